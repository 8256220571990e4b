"""``python -m replicas serve --port PORT [--host HOST]``: the coordinator (coordinator.py)."""
import sys

from replicas.coordinator import main

sys.exit(main())
