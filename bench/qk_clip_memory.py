"""QK-Clip's memory over a long packed row (issue 35): what `optim.qk_clip_tau` adds to an MLA layer's step.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.qk_clip_memory                 # 32k tokens, ~1 min
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.qk_clip_memory --seq 2048      # a quick look

One `GatedMLA` layer of the `small` preset (d 768, 6 heads, qk head dim 192, v 128, fp32) runs forward + backward
over one packed row of `--seq` tokens (documents of mixed, odd lengths, the longest a quarter of the row) with
max-logit tracking (what `optim.qk_clip_tau` or a logged step turns on, training/optim/qk_clip.py) off, on, and on
with the tracking as it was before issue 35 (`dense_mask`: a dense [T, T] block-diagonal mask, 1 byte per pair,
1.07 GB at 32k plus its temporaries, and every query scored against every key). Each case runs in a fresh child
process with glibc's mmap threshold fixed and reports the peak heap growth (training/metrics/heap.py), inputs and
weights excluded, and the wall time of the forward + backward; `tracking_GB` is the peak above tracking off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def doc_lengths(seq: int) -> list[int]:
    """Mixed odd lengths summing to `seq`: a quarter-row document, then halving ones, the rest in 1001-token ones."""
    out, left, n = [], seq, max(1, seq // 4)
    while left > 0 and n > 1000:
        n = min(n | 1, left)
        out.append(n)
        left -= n
        n //= 2
    while left > 0:
        out.append(min(1001, left))
        left -= out[-1]
    return out


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), printed beside every number."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def dense_mask_max_logits(q_BTHE, c_kv_BSR, k_r_BSD, w_kvb, nope_dim, scale, cu_seqlens=None, *_, chunk=128):
    """The tracking before issue 35, kept as this bench's peer: the dense [T, S] block-diagonal mask of
    `attention_mask`, every query chunk scored against all S keys."""
    import torch
    import torch.nn.functional as F

    from model.mla import attention_mask

    B, T, H, _ = q_BTHE.shape
    S = c_kv_BSR.shape[1]
    mask_TS, is_causal = attention_mask(T, S, cu_seqlens, q_BTHE.device)
    k_nope_BSHN = F.linear(c_kv_BSR, w_kvb).view(B, S, H, -1)[..., :nope_dim]
    k_BHSE = torch.cat([k_nope_BSHN, k_r_BSD[:, :, None, :].expand(B, S, H, k_r_BSD.shape[-1])], -1).transpose(1, 2)
    if is_causal and mask_TS is None:
        mask_TS = torch.ones(T, S, dtype=torch.bool, device=q_BTHE.device).tril(diagonal=S - T)
    out_H = torch.full((H,), float("-inf"), dtype=torch.float32, device=q_BTHE.device)
    with torch.no_grad():
        for t0 in range(0, T, chunk):
            s_BHtS = torch.einsum("bthe,bhse->bhts", q_BTHE[:, t0 : t0 + chunk].float(), k_BHSE.float()) * scale
            if mask_TS is not None:
                s_BHtS = s_BHtS.masked_fill(~mask_TS[t0 : t0 + chunk], float("-inf"))
            out_H = torch.maximum(out_H, s_BHtS.amax(dim=(0, 2, 3)))
    return out_H


MODES = ("off", "per_document", "dense_mask")  # tracking off; on (this code); on with the pre-issue-35 dense mask


def child(seq: int, mode: str) -> dict[str, Any]:
    import torch

    import model.mla
    from model import K3Config
    from model.mla import GatedMLA
    from training.metrics.heap import HeapPeak

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    cfg = K3Config.preset("small")
    m = GatedMLA(cfg, layer_idx=3)
    m.track_max_logit = mode != "off"
    if mode == "dense_mask":
        model.mla.mla_max_logits = dense_mask_max_logits
    lens = doc_lengths(seq)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = torch.randn(1, seq, cfg.hidden_size, requires_grad=True)
    heap = HeapPeak()
    t0 = time.perf_counter()
    with heap:
        m(x, cu_seqlens=cu, cu_seqlens_host=cu.tolist()).sum().backward()
    seconds = time.perf_counter() - t0
    top = None if m.max_logit_H is None else float(m.max_logit_H.max())
    return {"peak_GB": heap.peak / GB, "docs": len(lens), "max_logit": top, "seconds": seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--child", nargs=2, metavar=("SEQ", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1])))
        return {}
    from bench.common import print_table, write_json

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), MALLOC_MMAP_THRESHOLD_="131072")
    env["PYTHONPATH"] = str(ROOT)
    res = {}
    for mode in MODES:
        cmd = [sys.executable, "-m", "bench.qk_clip_memory", "--child", str(args.seq), mode]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        res[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    off = res["off"]["peak_GB"]
    rows = [
        {
            "tracking": mode,
            "seq_len": args.seq,
            "docs": res[mode]["docs"],
            "peak_GB": res[mode]["peak_GB"],
            "tracking_GB": res[mode]["peak_GB"] - off,
            "step_s": res[mode]["seconds"],
            "max_logit": res[mode]["max_logit"],
        }
        for mode in MODES
    ]
    cpu = cpu_model()
    print_table(f"QK-Clip tracking memory, one small-preset MLA layer, packed row, fp32, fwd+bwd ({cpu})", rows)
    out = {"cpu_model": cpu, "rows": rows}
    write_json("qk_clip_memory", out)
    return out


if __name__ == "__main__":
    main()
