"""`python -m training.evaluate`: the stable entry point of training/eval/tool.py (also a launcher script:
`deepspeed --num_gpus 2 training/evaluate.py checkpoint=... parallel=ep2`)."""

import os
import sys

if __package__ in (None, ""):  # run as a script by the deepspeed launcher: the repo root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.distributed import leave  # noqa: E402
from training.eval.tool import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(leave(main()))  # a launched rank ends without interpreter teardown (training/distributed.py)
