"""Hardware facts for MFU and memory logging: the peak FLOP/s (measured once on CPU, cached) and memory in use.

Why measured on CPU: there is no datasheet number for "2 shared cores"; the best large fp32 matmul this machine
sustains is the honest ceiling. On GPUs the dense bf16 datasheet peak is the convention for MFU.
"""

from __future__ import annotations

import json
import os
import platform
import time

import psutil
import torch

from data.config import cache_dir
from data.files import atomic_write

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from vendor datasheets (SXM parts unless noted).
GPU_PEAK_BF16: dict[str, float] = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
}


def gpu_peak_flops(name: str) -> float | None:
    """Datasheet bf16 dense peak for a device name such as 'NVIDIA H200' (longest matching key wins)."""
    for key in sorted(GPU_PEAK_BF16, key=len, reverse=True):
        if all(part.lower() in name.lower() for part in key.split()):
            return GPU_PEAK_BF16[key]
    return None


def measure_matmul_flops(
    n: int = 1024, reps: int = 5, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """Best-of-reps FLOP/s of an n x n x n matmul (2n^3 FLOPs each); best because noise only ever slows it."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)  # warm-up (thread pool, caches)
    best = float("inf")
    for _ in range(reps):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def _cpu_key() -> str:
    return f"cpu|{platform.machine()}|{platform.processor() or platform.node()}|threads={torch.get_num_threads()}"


def peak_flops(device: str | torch.device | None = None, refresh: bool = False) -> float:
    """Peak FLOP/s for MFU. Env K3_PEAK_FLOPS overrides. CUDA: datasheet bf16 table (measured bf16 matmul if the
    GPU is unknown). CPU: measured large fp32 matmul, cached in <cache_dir>/peak_flops.json per machine/threads."""
    env = os.environ.get("K3_PEAK_FLOPS")
    if env:
        return float(env)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        table = gpu_peak_flops(name)
        if table is not None:
            return table
        key = f"cuda|{name}"
        measure = lambda: measure_matmul_flops(8192, 5, torch.bfloat16, str(dev))  # noqa: E731
    else:
        key = _cpu_key()
        measure = lambda: measure_matmul_flops(1024, 7)  # noqa: E731
    path = cache_dir() / "peak_flops.json"
    cache: dict[str, float] = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    if not refresh and key in cache:
        return float(cache[key])
    value = measure()
    cache[key] = value
    try:
        atomic_write(path, json.dumps(cache, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home must not stop training; the value is still returned
    return value


def memory_stats(device: str | torch.device | None = None) -> dict[str, float]:
    """Memory in GiB: process RSS (CPU) and, on CUDA, allocated / peak allocated / reserved."""
    out: dict[str, float] = {}
    out["memory/rss_gib"] = psutil.Process().memory_info().rss / 2**30
    dev = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        out["memory/gpu_alloc_gib"] = torch.cuda.memory_allocated(dev) / 2**30
        out["memory/gpu_peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        out["memory/gpu_reserved_gib"] = torch.cuda.memory_reserved(dev) / 2**30
    return out
