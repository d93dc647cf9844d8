"""Long-sequence memory on CPU: what tiling saves per rank (issue 24).

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.long_context                      # parts at 16k and 32k tokens
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.long_context --seqs --steps 16384  # whole train steps (minutes)
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.long_context --seqs --sp-steps 16384 32768 --budget 1.0  # + SP, budget

Each case runs in a fresh child process with glibc's mmap threshold fixed (so freed tensors leave the heap at once)
and reports the peak heap growth over forward + backward (training/metrics/heap.py, the CPU analogue of
`torch.cuda.max_memory_allocated`), the inputs and weights excluded, untiled vs tiled, measured in the same run:
  * loss: lm_head + cross-entropy of T hidden states of the `tiny` preset (d 256, vocab 4096): the full [T, V]
    logits + the chunked CE (`train.loss_tile_tokens=0`) vs `TiledLinearCrossEntropy` with tiles of 1024 tokens;
  * ffn: one dense SiTU-GLU (d 256, intermediate 1024): untiled vs `train.ffn_tile_tokens=1024`;
  * step (`--steps`): one `tiny` train step (forward + backward, activation checkpointing on) of one sequence,
    without and with both tilings: the per-rank peak at SP=1;
  * sp_step (`--sp-steps`): the same step through the trainer's build and DeepSpeed engine (ZeRO-0, fp32) under the
    real launcher, 1 rank SP=1 and 2 ranks `parallel.sp_size=2` (each rank its half of the sequence, the
    sequence-parallel mpu), checkpointing on, without and with both tilings: the per-rank peak, rank 0's loss;
  * budget (`--budget GB`): the longest sequence one process trains (`step` as above) inside GB of peak growth,
    for the plain step (no checkpointing, no tiling), checkpointing alone and checkpointing + both tilings: the
    peak is measured at 2k and 4k tokens, the longest length inside the budget read off the line through them (a
    multiple of 1024) and then run, stepping down 1024 tokens until it fits.
Losses and gradients are compared in the same run (max relative difference, tiled vs untiled).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
TILE = 1024
MIXER_TILE = 1024  # train.mixer_tile_tokens of the budget's tiled mode (model/kda/tiled.py)


def _peak(fn) -> tuple[float, Any]:
    from training.metrics.heap import HeapPeak

    heap = HeapPeak()
    with heap:
        out = fn()
    return heap.peak / GB, out


def child(part: str, seq: int, tiled: bool) -> dict[str, Any]:
    import torch

    from model import K3Config, K3ForCausalLM
    from model.ffn import SiTUGLU
    from model.k3 import causal_lm_loss
    from model.loss import LMHead

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    g = torch.Generator().manual_seed(1)
    if part == "loss":
        head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        head.tile_rows = TILE if tiled else 0
        h = torch.randn(1, seq, cfg.hidden_size, generator=g).requires_grad_()
        t = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)

        def run():
            if tiled:
                loss = head(h, t) / seq
            else:
                loss, _ = causal_lm_loss(head(h), None, None, t)
            loss.backward()
            return float(loss.detach())

        peak, loss = _peak(run)
        grads = [h.grad, head.weight.grad]
    elif part == "ffn":
        ffn = SiTUGLU(cfg.hidden_size, cfg.intermediate_size, cfg).train()
        ffn.tile_rows = TILE if tiled else 0
        x = torch.randn(1, seq, cfg.hidden_size, generator=g).requires_grad_()

        def run():
            y = ffn(x)
            y.backward(torch.ones_like(y))
            return float(y.detach().double().sum())

        peak, loss = _peak(run)
        grads = [x.grad, *(p.grad for p in ffn.parameters())]
    else:  # step; "plain" (budget): neither checkpointing nor tiling
        model = K3ForCausalLM(cfg).train()
        model.set_gradient_checkpointing(part != "plain")
        model.set_loss_tiling(TILE if tiled else 0)
        model.set_ffn_tiling(TILE if tiled else 0)
        model.set_mixer_tiling(MIXER_TILE if tiled and os.environ.get("K3_LONG_CONTEXT_MIXER", "1") == "1" else 0)
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)

        def run():
            out = model(ids, labels=ids)
            out.loss.backward()
            return float(out.loss.detach())

        peak, loss = _peak(run)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
    path = os.environ["K3_LONG_CONTEXT_GRADS"]
    torch.save([gr.detach() for gr in grads], f"{path}.{int(tiled)}.pt")
    return {"peak_GB": peak, "loss": loss}


def _case(part: str, seq: int, env: dict[str, str], tmp: str) -> dict[str, Any]:
    import torch

    env = dict(env, K3_LONG_CONTEXT_GRADS=f"{tmp}/{part}{seq}")
    res = []
    for tiled in (False, True):
        cmd = [sys.executable, "-m", "bench.long_context", "--child", part, str(seq), str(int(tiled))]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        res.append(json.loads(p.stdout.strip().splitlines()[-1]))
    g0, g1 = (torch.load(f"{tmp}/{part}{seq}.{i}.pt") for i in (0, 1))
    grad_diff = max(float((a - b).abs().max()) / max(float(a.abs().max()), 1e-30) for a, b in zip(g0, g1))
    return {
        "part": part,
        "seq_len": seq,
        "untiled_GB": res[0]["peak_GB"],
        "tiled_GB": res[1]["peak_GB"],
        "ratio": res[1]["peak_GB"] / res[0]["peak_GB"],
        "loss_rel_diff": abs(res[1]["loss"] - res[0]["loss"]) / abs(res[0]["loss"]),
        "grad_rel_diff": grad_diff,
    }


def sp_child(seq: int, tiled: bool, out: str) -> None:
    """One rank of an sp_step case under the launcher: the trainer's build and engine, one forward + backward."""
    sys.path.insert(0, str(ROOT))  # run as a script by the launcher: bench/ is sys.path[0]
    import torch

    from training.config import build_model_config, compose
    from training.distributed import init_distributed
    from training.engine import build_ds_config, initialize, param_groups
    from training.metrics.heap import HeapPeak
    from training.parallel.construct import build_model
    from training.step import pack_microbatch

    torch.set_num_threads(1)
    info = init_distributed()
    sp = info.world_size
    over = ["model=tiny", "deepspeed=zero0", f"parallel.sp_size={sp}", f"train.seq_len={seq}", "logging=disabled"]
    cfg = compose([*over, "train.micro_batch_size=1", "train.precision=fp32"])
    mcfg = build_model_config(cfg)
    ds = build_ds_config(cfg, info.world_size)
    ids = torch.randint(0, mcfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    mb = pack_microbatch({"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, seq])}, sp, info.rank)
    model, par = build_model(mcfg, 0, 1, 0, ds, sp_size=sp)
    model.set_gradient_checkpointing(True)
    model.set_loss_tiling(TILE if tiled else 0)
    model.set_ffn_tiling(TILE if tiled else 0)
    engine, _, _ = initialize(cfg, model, ds, param_groups(model, 0.0), mpu=par.mpu)
    with HeapPeak() as heap:
        res = engine(**mb.model_inputs(engine.device))
        engine.backward(res.loss)
    rec = {"peak_GB": heap.peak / GB, "loss": float(res.loss.detach())}
    Path(f"{out}.rank{info.rank}.json").write_text(json.dumps(rec))


def _sp_case(seq: int, sp: int, env: dict[str, str], tmp: str) -> list[dict[str, Any]]:
    """Per-rank rows of one sp_step case: untiled vs tiled, `sp` ranks through the launcher."""
    from training.launch import launch_command

    res = []
    for tiled in (False, True):
        out = f"{tmp}/sp{sp}_{seq}_{int(tiled)}"
        cmd = launch_command(["--sp-child", str(seq), str(int(tiled)), out], sp, __file__)
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"sp_step {seq} SP={sp} failed: {p.stderr.strip().splitlines()[-1:]}")
        res.append([json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(sp)])
    return [
        {
            "part": "sp_step",
            "seq_len": seq,
            "sp_size": sp,
            "rank": r,
            "untiled_GB": res[0][r]["peak_GB"],
            "tiled_GB": res[1][r]["peak_GB"],
            "ratio": res[1][r]["peak_GB"] / res[0][r]["peak_GB"],
            "loss_rel_diff": abs(res[1][r]["loss"] - res[0][r]["loss"]) / abs(res[0][r]["loss"]),
        }
        for r in range(sp)
    ]


def _step_peak(part: str, seq: int, tiled: bool, env: dict[str, str], tmp: str, mixer: bool = True) -> float:
    env = dict(env, K3_LONG_CONTEXT_GRADS=f"{tmp}/budget", K3_LONG_CONTEXT_MIXER=str(int(mixer)))
    cmd = [sys.executable, "-m", "bench.long_context", "--child", part, str(seq), str(int(tiled))]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return float(json.loads(p.stdout.strip().splitlines()[-1])["peak_GB"])


BUDGET_MODES = {  # name: (child part, loss + FFN tiling, mixer tiling)
    "plain": ("plain", False, False),
    "checkpointing": ("step", False, False),
    "checkpointing+tiling": ("step", True, False),
    "checkpointing+tiling+mixer": ("step", True, True),
}


def _budget(budget: float, env: dict[str, str], tmp: str, names: list[str], old: dict | None) -> dict[str, Any]:
    """The longest sequence (multiple of 1024) whose step peak stays inside `budget` GB, per memory mode in
    `names` (the other modes keep their numbers from `old`, the last results at the same budget)."""
    keep = old["modes"] if old and old.get("budget_GB") == budget else {}
    out: dict[str, Any] = {"budget_GB": budget, "modes": {}}
    for name, (part, tiled, mixer) in BUDGET_MODES.items():
        if name not in names:
            if name in keep:
                out["modes"][name] = keep[name]
            continue
        p2, p4 = (_step_peak(part, t, tiled, env, tmp, mixer) for t in (2048, 4096))
        per_token = (p4 - p2) / 2048
        seq = max(1024, int((budget - (p2 - per_token * 2048)) / per_token) // 1024 * 1024)
        while (peak := _step_peak(part, seq, tiled, env, tmp, mixer)) > budget and seq > 1024:
            seq -= 1024
        out["modes"][name] = {"peak_2k_GB": p2, "peak_4k_GB": p4, "longest_seq": seq, "peak_GB": peak}
        print(name, out["modes"][name], flush=True)
    base = out["modes"]["plain"]["longest_seq"]
    for m in out["modes"].values():
        m["vs_plain"] = m["longest_seq"] / base
    best = max(m["longest_seq"] for m in out["modes"].values())
    out["tiling_vs_checkpointing"] = best / out["modes"]["checkpointing"]["longest_seq"]
    return out


def _old_results() -> dict[str, Any]:
    from bench.common import RESULTS_DIR

    path = RESULTS_DIR / "long_context.json"
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", nargs="*", type=int, default=[16384, 32768], help="tokens of the loss/ffn parts")
    ap.add_argument("--steps", nargs="*", type=int, default=[], help="tokens of whole train steps (slow)")
    ap.add_argument("--sp-steps", nargs="*", type=int, default=[], help="tokens of SP=1 / SP=2 engine steps (slow)")
    ap.add_argument("--sp", nargs="*", type=int, default=[1, 2], help="SP sizes of --sp-steps (ranks)")
    ap.add_argument("--budget", type=float, default=0.0, help="GB: the longest sequence inside it, per mode")
    ap.add_argument("--budget-modes", nargs="*", default=list(BUDGET_MODES), choices=list(BUDGET_MODES))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--sp-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.sp_child:
        seq, tiled, out = args.sp_child
        sp_child(int(seq), bool(int(tiled)), out)
        return {}
    if args.child:
        part, seq, tiled = args.child
        print(json.dumps(child(part, int(seq), bool(int(tiled)))))
        return {}
    import tempfile

    from bench.common import print_table, write_json

    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(p, s) for s in args.seqs for p in ("loss", "ffn")] + [("step", s) for s in args.steps]
        for part, seq in cases:
            rows.append(_case(part, seq, env, tmp))
            print(rows[-1], flush=True)
        for seq in args.sp_steps:
            for sp in args.sp:
                rows += _sp_case(seq, sp, env, tmp)
                print(rows[-1], flush=True)
        old_budget = _old_results().get("budget")
        budget = _budget(args.budget, env, tmp, args.budget_modes, old_budget) if args.budget > 0 else None
    print_table(
        f"peak memory over forward + backward, untiled vs tiled ({TILE}-token tiles), tiny, per rank, fp32",
        rows,
        ["part", "seq_len", "sp_size", "rank", "untiled_GB", "tiled_GB", "ratio", "loss_rel_diff", "grad_rel_diff"],
    )
    # rows (and a budget) of cases not run now keep their last numbers in the results file
    old = _old_results()
    key = lambda r: (r["part"], r["seq_len"], r.get("sp_size", 1), r.get("rank", 0))  # noqa: E731
    new = {key(r) for r in rows}
    rows = [r for r in old.get("rows", []) if key(r) not in new] + rows
    payload = {"tile_tokens": TILE, "rows": rows, "budget": budget or old.get("budget")}
    payload["step_machine"] = old.get("step_machine")  # where the older rows ran
    if budget:
        print(json.dumps(budget, indent=1))
    print(f"wrote {write_json('long_context', payload)}")
    return payload


if __name__ == "__main__":
    main()
    from training.distributed import leave

    sys.exit(leave(0))  # a rank ends without interpreter teardown (training/distributed.py)
