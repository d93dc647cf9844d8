"""The planner's human-readable table: one row per memory term, communication volume and time (training/tools/plan.py
computes them)."""

from __future__ import annotations

from typing import Any

from training.tools.plan_export import export_rows


def _fmt_n(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def format_table(p: dict[str, Any]) -> str:
    m, lay, hw, g, t = p["model"], p["layout"], p["hardware"], p["gpu_memory_gb"], p["time"]
    offload = (" +opt offload" if lay["offload_optimizer"] else "") + (
        " +param offload" if lay["offload_param"] else ""
    )
    ppg = p["params_per_gpu"]
    rows = [
        (
            "model",
            f"{_fmt_n(m['total_params'])} total, {_fmt_n(m['active_params'])} active "
            f"({_fmt_n(m['expert_params'])} in routed experts)",
        ),
        (
            "layout",
            f"{hw['nodes']} nodes x {hw['gpus_per_node']} GPUs = {hw['world']}, ZeRO-{lay['zero_stage']}"
            f"{offload}, EP {lay['ep_size']}, SP {lay['sp_size']}, {lay['precision']}",
        ),
        (
            "batch",
            f"micro {lay['micro_batch_size']} x seq {lay['seq_len']} x GA {lay['grad_accum']} x DP "
            f"{hw['world'] // lay['sp_size']} = {t['tokens_per_step']:,} tokens/step; activation ckpt "
            f"{lay['activation_checkpointing']}",
        ),
        ("params / GPU", f"dense {_fmt_n(ppg['dense'])} + expert {_fmt_n(ppg['expert'])}"),
    ]
    for k, v in g.items():
        if k != "total":
            rows.append((f"  GPU {k}", f"{v:10.2f} GB"))
    rule = p["peak_rule"]
    backward, step = " + ".join(rule["backward"]), " + ".join(rule["step"])
    peak_rule = (
        (f"max({backward}, {step}) + the other terms: the step comes after backward" if step else "every term")
        if rule["grads_persist"]
        else f"max({backward}, grads) + the other terms: fp32 ZeRO-0 creates grads in backward"
    )
    rows.append(
        (
            "GPU total",
            f"{g['total']:10.2f} GB of {hw['gpu_memory_gb']:.0f} GB -> "
            f"{'FITS' if p['fits']['gpu'] else 'DOES NOT FIT'} "
            f"({p['fits']['gpu_headroom_gb']:+.1f} GB); peak = {peak_rule}",
        )
    )
    if p["cpu_memory_gb_per_node"]:
        rows.append(
            (
                "CPU offload / node",
                f"{p['cpu_memory_gb_per_node']:10.1f} GB of {hw['cpu_memory_gb']:.0f} "
                f"GB -> {'fits' if p['fits']['cpu'] else 'DOES NOT FIT'}",
            )
        )
    c = p["comm_per_step_per_gpu_gb"]
    rows += [
        ("FLOPs / token (train)", f"{m['flops_per_token_train']:.3e}"),
        (
            "MoE all-to-all / GPU",
            f"{c['moe_all_to_all']:.2f} GB/step ({c['moe_all_to_all_inter_node']:.2f} GB inter-node)",
        ),
        ("DP gradients / GPU", f"{c['dp_gradients']:.2f} GB/step"),
        *(
            [
                (
                    "SP all-to-all / GPU",
                    f"{c['sp_all_to_all']:.2f} GB/step ({c['sp_all_to_all_per_layer']:.3f} per layer)",
                )
            ]
            if lay["sp_size"] > 1
            else []
        ),
        (
            "step time",
            f"{t['step_s']:.2f} s = compute {t['compute_s']:.2f} + a2a {t['all_to_all_s']:.2f} "
            f"x{1 - hw['a2a_overlap']:.1f} + SP a2a {t['sp_all_to_all_s']:.2f} + DP {t['dp_comm_s']:.2f} "
            f"x{1 - hw['dp_overlap']:.1f} "
            f"(MFU {hw['mfu']:.0%} of {hw['peak_tflops']:.0f} TFLOP/s)",
        ),
        ("throughput", f"{t['tokens_per_s']:,.0f} tokens/s ({t['tokens_per_s_per_gpu']:,.0f} per GPU)"),
    ]
    rows += export_rows(p["export"]) if "export" in p else []
    rows += [("warning", w) for w in p.get("warnings", [])]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
