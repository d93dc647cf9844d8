"""The no-network default: embedded stdlib corpus + its cached 4096-piece tokenizer -> real-text batches."""

from __future__ import annotations

import json

from data import DataConfig, GlobalBatchLoader, default_corpus_path, prepare_tokenizer


def test_default_config_yields_real_text_batches_with_the_tiny_vocab():
    cfg = DataConfig(num_workers=1)
    tok = prepare_tokenizer(cfg)  # trained once per machine, cached under $K3_CACHE_DIR or ~/.cache/k3-train
    assert tok.vocab_size == 4096 and tok.path.endswith(".model")
    loader = GlobalBatchLoader(cfg, tok, seq_len=128, global_batch_size=4, micro_batch_size=2)
    batch = loader.next_microbatch()
    loader.close()
    assert batch["input_ids"].shape == (2, 128) and int(batch["input_ids"].max()) < 4096
    text = tok.decode(batch["input_ids"][0, 1:64])  # a slice of one (or two) stdlib modules
    with open(default_corpus_path(), encoding="utf-8") as f:
        corpus_text = "".join(json.loads(line)["text"] for line in f)
    assert any(piece in corpus_text for piece in text.split("\n") if len(piece) > 20)
