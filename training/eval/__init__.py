"""Evaluation: held-out loss sets and tasks (multiple choice, passkey), the same code in the training loop
(`eval.every`, training/eval/callback.py) and on a saved checkpoint (`python -m training.evaluate`)."""
