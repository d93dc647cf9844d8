"""`python -m training.export`: the stable entry point of training/tools/export.py (outside tools call this name)."""

from training.distributed import leave
from training.tools.export import main

if __name__ == "__main__":
    raise SystemExit(leave(main()))  # a launched rank ends without interpreter teardown (training/distributed.py)
