"""Self-speculative decoding with the MTP block as draft (model/speculative.py) is plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

from model.generate import generate
from model.k3 import K3ForCausalLM
from model.speculative import generate_speculative
from tests.model.micro import exercise_every_path, micro_config


def test_speculative_output_equals_plain_greedy_token_for_token():
    torch.manual_seed(0)  # this seed's drafts are both accepted and rejected: both paths run
    model = exercise_every_path(K3ForCausalLM(micro_config(mtp_depth=1))).double()
    prompt = torch.randint(0, 61, (1, 7))
    got, stats = generate_speculative(model, prompt, 24)
    assert 0 < stats.accepted < stats.drafted
    assert torch.equal(got, generate(model, prompt, 24))


def test_speculative_decoding_needs_an_mtp_block():
    with pytest.raises(ValueError, match="mtp_depth >= 1"):
        generate_speculative(K3ForCausalLM(micro_config()), torch.tensor([[1, 2]]), 4)
