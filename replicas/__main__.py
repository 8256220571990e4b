"""``python -m replicas serve --port PORT [--host HOST]``: the coordinator (cli.py)."""
import sys

from replicas.cli import main

sys.exit(main())
