"""Kimi Delta Attention: the fla-compatible kernels (`chunk_kda`, `recurrent_kda`), their per-token reference
(`naive_recurrent_kda`) and the `KDA` layer."""

from model.kda.layer import KDA, KDACache
from model.kda.naive import naive_recurrent_kda
from model.kda.ops import chunk_kda, recurrent_kda

__all__ = ["KDA", "KDACache", "chunk_kda", "naive_recurrent_kda", "recurrent_kda"]
