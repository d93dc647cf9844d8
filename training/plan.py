"""`python -m training.plan`: the stable entry point of training/tools/plan.py (outside tools call this name)."""

from training.tools.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
