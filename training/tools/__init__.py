"""Command-line tools around training: plan (memory/speed before a run), report (plots of a run), export
(checkpoint -> HF layout), generate (sample from a checkpoint). `python -m training.<tool>` and the console
scripts `k3-<tool>` run them; every tool takes `key=value` arguments (leading positionals for the required ones)."""
