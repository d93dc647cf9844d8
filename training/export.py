"""`python -m training.export`: the stable entry point of training/tools/export.py (outside tools call this name)."""

from training.tools.export import main

if __name__ == "__main__":
    raise SystemExit(main())
