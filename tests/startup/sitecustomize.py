"""Run by every Python interpreter the suite starts (conftest.py puts this folder first on their PYTHONPATH): torchrun's
agents and workers, the scripts launched as processes of their own, the fault scenarios' runs, the notebook's kernel.
Not a test file, and nothing else lives in this folder (all of it is importable by those interpreters).

Each of them imports torch (and a worker, torch._dynamo with its first optimizer): some 400,000 new objects that
garbage collection's young generation, collected every 700 new containers, traverses over and over, with a full
collection of everything alive each time the old generations fill: about a tenth of the import's CPU time. Collected
every 10,000, as the session's workers are (harness.py), the same import costs less (`python3 -c "import gc;
gc.set_threshold(N); import torch, torch._dynamo"`, the median of 8 runs each on the 2-core VM: 3.36 CPU-s at 700,
3.08 at 10,000), and the suite starts about a hundred of them. Garbage without cycles is freed as before, at once."""
import gc

gc.set_threshold(10_000, *gc.get_threshold()[1:])
