"""Generation (issue 3 §5): cached incremental decode == full forward, sampling controls, seeds, the CLI."""

from __future__ import annotations

import pytest
import torch

from model.generate import generate, sample_next
from model.k3 import K3Cache, K3ForCausalLM
from tests.model.micro import exercise_every_path, micro_config


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    """fp32 random weights with larger-than-init scales so logits are far from uniform and decoding is sensitive."""
    torch.manual_seed(0)
    m = exercise_every_path(K3ForCausalLM(micro_config()).eval())
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return m


@torch.no_grad()
def test_incremental_decode_equals_full_forward(model):
    ids = torch.randint(0, 61, (2, 24))
    full = model(ids).logits
    cache = K3Cache.empty(model.config)
    steps = [model(ids[:, :9], cache=cache).logits, model(ids[:, 9:13], cache=cache).logits]  # prefill + chunk
    steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(13, 24)]  # one token at a time
    assert cache.seen_tokens == 24
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-4)


@torch.no_grad()
def test_greedy_generation_follows_the_argmax_of_the_full_forward(model):
    prompt = torch.randint(0, 61, (2, 6))
    out = generate(model, prompt, max_new_tokens=8)
    assert out.shape == (2, 14) and torch.equal(out[:, :6], prompt)
    logits = model(out[:, :-1]).logits
    assert torch.equal(out[:, 6:], logits[:, 5:].argmax(-1))


def test_sampling_is_reproducible_with_a_seed(model):
    prompt = torch.randint(0, 61, (1, 5))
    a = generate(model, prompt, 12, temperature=1.0, seed=7)
    b = generate(model, prompt, 12, temperature=1.0, seed=7)
    c = generate(model, prompt, 12, temperature=1.0, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])).expand(2000, 5)
    g = torch.Generator().manual_seed(0)
    k2 = sample_next(logits, temperature=1.0, top_k=2, generator=g)
    assert set(k2.tolist()) == {0, 1}
    p = sample_next(logits, temperature=1.0, top_p=0.85, generator=g)  # 0.5 + 0.3 < 0.85 -> keep three
    assert set(p.tolist()) == {0, 1, 2}
    assert set(sample_next(logits, temperature=1.0, top_p=0.01, generator=g).tolist()) == {0}
    assert torch.equal(sample_next(logits[:3], temperature=0.0), torch.zeros(3, dtype=torch.long))


def test_streaming_callback_and_eos_stop(model):
    prompt = torch.randint(0, 61, (1, 4))
    greedy = generate(model, prompt, 6)
    eos = int(greedy[0, 6])  # the third generated token
    seen = []
    out = generate(model, prompt, 6, eos_token_id=eos, callback=lambda t: seen.append(int(t[0])))
    assert out[0, 4:].tolist() == greedy[0, 4:7].tolist() == seen
