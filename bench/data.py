"""Data pipeline throughput (read -> tokenize -> pack, one core) vs what the tiny model consumes in training.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.data                 # writes bench/results/data.json
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.data --reps 3 --fresh-tokens 1000000

Peers, all in this process with the default DataConfig (embedded stdlib corpus, cached 4096-piece BPE):
- pipeline steady: GlobalBatchLoader inline (no thread), 1 tokenizer thread, [8, 256] micro-batches, timed in
  chunks of `--chunk` micro-batches after warm-up;
- pipeline fresh: a new loader producing `--fresh-tokens` tokens, start-up and the first shuffle window
  (1024 documents read and parsed) included: the pessimistic rate, what a restart costs;
- resume latency: load_state_dict at a mid-window position + the first micro-batch;
- tiny model: K3ForCausalLM(K3Config.preset("tiny")) fwd + bwd + AdamW step on one [8, 256] micro-batch
  (flattened to [1, 2048] with its cu_seqlens), all torch threads: the training consumption rate.
Steady pipeline and model steps are timed round-robin so machine load hits both alike. Goal: >= 20x.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import print_table, time_interleaved, write_json
from data import DataConfig, GlobalBatchLoader, prepare_tokenizer

SEQ, MICRO = 256, 8


def make_loader(tok, cfg: DataConfig) -> GlobalBatchLoader:
    return GlobalBatchLoader(cfg, tok, SEQ, MICRO, MICRO, 0, 1, 0)


def fresh_rate(tok, cfg: DataConfig, tokens: int) -> float:
    t0 = time.perf_counter()
    loader = make_loader(tok, cfg)
    n = 0
    while n < tokens:
        n += loader.next_microbatch()["num_tokens"]
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--model-reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=128, help="micro-batches per steady pipeline timing")
    p.add_argument("--fresh-tokens", type=int, default=2_000_000)
    p.add_argument("--fresh-reps", type=int, default=3)
    a = p.parse_args()

    cfg = DataConfig(num_workers=0)
    t0 = time.perf_counter()
    tok = prepare_tokenizer(cfg)  # builds the corpus and trains the tokenizer on first use (cached)
    prepare_s = time.perf_counter() - t0
    from data.corpus import default_corpus_path

    corpus = default_corpus_path()
    n_docs = sum(1 for _ in open(corpus, encoding="utf-8"))

    steady = make_loader(tok, cfg)
    mb = steady.next_microbatch()
    ids_1N, labels_1N, cu = mb["input_ids"].reshape(1, -1), mb["labels"].reshape(1, -1), mb["cu_seqlens"]

    def pipeline_chunk() -> None:
        for _ in range(a.chunk):
            steady.next_microbatch()

    peers = {"pipeline": pipeline_chunk}
    try:
        from model import K3Config, K3ForCausalLM

        torch.manual_seed(0)
        model = K3ForCausalLM(K3Config.preset("tiny"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def model_step() -> None:
            opt.zero_grad(set_to_none=True)
            model(ids_1N, labels=labels_1N, cu_seqlens=cu).loss.backward()
            opt.step()

        peers["model"] = model_step
    except ImportError as e:  # the model package is built in parallel: measure the pipeline alone
        print(f"tiny model unavailable ({e}); pipeline only")
    times = time_interleaved(peers, reps={"pipeline": a.reps, "model": a.model_reps}, warmup=1)
    pipe_tps = a.chunk * SEQ * MICRO / times["pipeline"].median
    model_tps = SEQ * MICRO / times["model"].median if "model" in times else float("nan")
    fresh = [fresh_rate(tok, cfg, a.fresh_tokens) for _ in range(a.fresh_reps)]
    fresh_tps = statistics.median(fresh)

    state = steady.state_dict()
    t0 = time.perf_counter()
    resumed = make_loader(tok, cfg)
    resumed.load_state_dict(state)
    resumed.next_microbatch()
    resume_s = time.perf_counter() - t0
    stats = steady.stats()

    rows = [
        {
            "peer": "pipeline steady (1 core)",
            "tokens_per_s": pipe_tps,
            "x_model": pipe_tps / model_tps,
            "spread": times["pipeline"].spread,
        },
        {
            "peer": f"pipeline fresh ({a.fresh_tokens / 1e6:.1f}M tok, incl. start)",
            "tokens_per_s": fresh_tps,
            "x_model": fresh_tps / model_tps,
            "spread": (max(fresh) - min(fresh)) / fresh_tps,
        },
    ]
    if "model" in times:
        rows.append(
            {
                "peer": "tiny model fwd+bwd+AdamW [8x256]",
                "tokens_per_s": model_tps,
                "x_model": 1.0,
                "spread": times["model"].spread,
            }
        )
    print_table("data pipeline vs tiny-model training consumption", rows)
    print(
        f"corpus: {corpus.name}, {n_docs} documents, {corpus.stat().st_size / 1e6:.2f} MB; prepare "
        f"(corpus+tokenizer, cached after first use) {prepare_s:.2f} s; resume latency {resume_s:.2f} s"
    )
    path = write_json(
        "data",
        {
            "seq_len": SEQ,
            "micro_batch": MICRO,
            "rows": rows,
            "pipeline_timing": times["pipeline"].as_dict(),
            "model_timing": times["model"].as_dict() if "model" in times else None,
            "fresh_rates": fresh,
            "resume_latency_s": resume_s,
            "prepare_s": prepare_s,
            "corpus": {"file": corpus.name, "documents": n_docs, "bytes": corpus.stat().st_size},
            "tokenizer": {"vocab_size": tok.vocab_size, "sha256_16": tok.fingerprint},
            "goal_x": 20.0,
            "steady_x": pipe_tps / model_tps,
            "fresh_x": fresh_tps / model_tps,
            "loader_stats_at_end": stats,
            "torch_threads": torch.get_num_threads(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
