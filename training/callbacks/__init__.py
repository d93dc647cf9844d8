"""Callbacks around the trainer loop (training/callbacks/base.py documents the hook order)."""

from training.callbacks.base import Callback, CallbackList, load_callback
from training.callbacks.progress import DataStats, LossWindow, Throughput
from training.callbacks.router_health import RouterHealth


def default_callbacks() -> list[Callback]:
    """What every run logs: loss windows, throughput/MFU/memory, data counters, router health."""
    return [LossWindow(), Throughput(), DataStats(), RouterHealth()]


__all__ = [
    "Callback",
    "CallbackList",
    "DataStats",
    "LossWindow",
    "RouterHealth",
    "Throughput",
    "default_callbacks",
    "load_callback",
]
