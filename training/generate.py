"""`python -m training.generate`: the stable entry point of training/tools/generate.py (outside tools call it)."""

from training.tools.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
