"""`python -m training.report`: the stable entry point of training/tools/report.py (outside tools call this name)."""

from training.tools.report import main

if __name__ == "__main__":
    raise SystemExit(main())
