"""The planner's export estimate (issue 37): time and memory of `training.export` for a model, both layouts.

Per process the streamed export holds one tensor (read fp32 + its converted copy) plus at most 256 MB of mapped
checkpoint pages (training/tools/export_safetensors.py `Unmapper`) above the interpreter's baseline, whatever the
model's size. The time is the larger of the I/O (fp32 master weights read, shards written; for a ZeRO-3 checkpoint
also DeepSpeed's universal conversion, which reads the ranks' fp32 weights and Adam moments and writes them per
parameter) over the nodes' disk bandwidth, and the MXFP4 quantisation of the routed experts (release layout) over
the processes: shards are disjoint, so N nodes x P processes divide both. `QUANT_ELEMENTS_PER_S` is the CPU time
of one thread quantising a K3-sized expert, `BASELINE_GB` the post-import RSS bench/export.py measures.
"""

from __future__ import annotations

from typing import Any

from training.tools.export_layout import HF_SHARD_BYTES, RELEASE_SHARD_BYTES

GB = 1e9
BASELINE_GB = 0.3  # RSS of a process after importing torch + the exporter (bench/export.py)
UNMAP_GB = 64 * 1024**2 / GB  # mapped checkpoint pages kept before the export unmaps them
QUANT_ELEMENTS_PER_S = 19.5e6  # pack_mxfp4 of a K3 expert [3072, 3584], CPU time of one thread (AMD EPYC, 2026-12-06)


def export_plan(
    config: Any,
    breakdown: dict[str, int],
    nodes: int,
    procs_per_node: int,
    disk_gbps: float,
    zero_stage: int,
) -> dict[str, Any]:
    """Export estimate for both layouts (GB, seconds). disk_gbps: GB/s of read + write per node."""
    total, experts = breakdown["total"], breakdown["moe_routed_experts"]
    dense = total - experts
    largest = max(config.vocab_size * config.hidden_size, breakdown.get("per_routed_expert", 0) // 3)
    procs = nodes * procs_per_node
    convert = 24 * total if zero_stage == 3 else 0  # ds_to_universal: read 12 B/param (fp32 + 2 moments), write 12
    out: dict[str, Any] = {
        "nodes": nodes,
        "procs_per_node": procs_per_node,
        "disk_gbps_per_node": disk_gbps,
        "memory_per_process_gb": BASELINE_GB + UNMAP_GB + 2 * 4 * largest / GB,
        "universal_conversion_gb_io": convert / GB,
    }
    for fmt, written, quant in (
        ("hf", 4 * total, 0),
        ("release", experts * (0.5 + 1 / 32) + 2 * dense, experts),
    ):
        io_s = (4 * total + written + convert) / GB / (nodes * disk_gbps)
        cpu_s = quant / QUANT_ELEMENTS_PER_S / procs
        out[fmt] = {
            "written_gb": written / GB,
            "shards": int(-(-written // (RELEASE_SHARD_BYTES if fmt == "release" else HF_SHARD_BYTES))),
            "io_s": io_s,
            "quantise_s": cpu_s,
            "time_s": max(io_s, cpu_s),
        }
    return out


def export_rows(e: dict[str, Any]) -> list[tuple[str, str]]:
    """Lines of the planner's table."""
    rows = []
    for fmt in ("hf", "release"):
        f = e[fmt]
        rows.append(
            (
                f"export --format {fmt}",
                f"{f['time_s'] / 60:.1f} min on {e['nodes']} nodes x {e['procs_per_node']} processes "
                f"(I/O {f['io_s'] / 60:.1f} min at {e['disk_gbps_per_node']:.1f} GB/s/node, MXFP4 "
                f"{f['quantise_s'] / 60:.1f} min), {f['written_gb']:.0f} GB in {f['shards']} shards",
            )
        )
    conv = e["universal_conversion_gb_io"]
    rows.append(
        (
            "export memory",
            f"{e['memory_per_process_gb']:.1f} GB per process (one tensor + 64 MiB mapped)"
            + (f"; ZeRO-3: +{conv:.0f} GB I/O for DeepSpeed's universal conversion" if conv else ""),
        )
    )
    return rows
