"""Modules built on the meta device (shapes only, no memory), without running their random initialisation.

On meta tensors `Tensor.normal_` (and meta maths such as `log`, `exp`) dispatches to Python references
(torch._refs), whose first call imports torch._dynamo and inductor: ~2 s of every process that counts parameters
or plans a sharded start, for values a meta tensor does not hold. Under `on_meta()` the in-place fills of meta
tensors (`nn.init.*`, `normal_`, `uniform_`) return their input; modules whose init does maths skip it on meta.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_}


def _is_fill(func) -> bool:
    return func in _FILLS or getattr(func, "__module__", None) == "torch.nn.init"  # nn.init.* fill in place


class _SkipMetaFills(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init.* pass `tensor=` by keyword
        if _is_fill(func) and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """`with torch.device("meta")`, minus the random fills (their values do not exist on meta)."""
    with torch.device("meta"), _SkipMetaFills():
        yield
