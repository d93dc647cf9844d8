"""Kimi Delta Attention: the fla-compatible kernels (`chunk_kda`, `recurrent_kda`) and the `KDA` layer."""
from model.kda.layer import KDA, KDACache
from model.kda.ops import chunk_kda, recurrent_kda

__all__ = ["KDA", "KDACache", "chunk_kda", "recurrent_kda"]
