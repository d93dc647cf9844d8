"""`python -m training.generate ... speculative=true` prints plain greedy decoding's tokens (drafted by the MTP
block) and the accepted-draft rate."""

from __future__ import annotations

import torch

from model.hf import save_hf_checkpoint
from model.k3 import K3ForCausalLM
from tests.model.micro import micro_config
from training.tools.generate import main


def test_speculative_cli_prints_the_greedy_tokens_and_the_acceptance(tmp_path, capsys):
    torch.manual_seed(0)
    save_hf_checkpoint(K3ForCausalLM(micro_config(mtp_depth=1)), tmp_path)
    args = [f"checkpoint={tmp_path}", "prompt_ids=1 2 3", "max_new_tokens=12"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "speculative=true"]) == 0
    got = capsys.readouterr()
    assert got.out == plain and "drafts accepted" in got.err
