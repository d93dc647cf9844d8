"""Self-speculative greedy decoding with the first MTP block (model/mtp.py) as the draft model.

Each round, with the main model's caches holding positions < P, `nxt` (token P, chosen but not yet fed) and the
main hidden state h[P-1]:
  1. draft: the MTP block on (h[P-1], emb(nxt)) predicts token P+1 = `draft` (its own MLA cache holds the
     committed pairs (h[t], emb(token t+1)) of earlier positions);
  2. verify: one main forward over [nxt, draft] gives the greedy tokens g0 (after nxt) and g1 (after draft);
  3. g0 == draft: both are accepted, g1 is the next `nxt` (two tokens for one main forward);
     otherwise g0 is the token plain greedy decoding picks: the main caches go back to the snapshot before the
     verify (KDA's recurrent state cannot drop a token) and take `nxt` alone.
The output is plain greedy decoding's whatever the drafts (every token is the main model's argmax given the same
prefix); only the work per token changes. Batch 1, greedy only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from model.k3 import K3Cache, K3ForCausalLM
from model.mtp import mtp_block


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens proposed (one per round)
    accepted: int = 0  # of which the main model agreed
    main_forwards: int = 0  # main-model forwards after the prefill (plain greedy: one per new token)

    @property
    def acceptance(self) -> float:
        return self.accepted / max(1, self.drafted)


def _snapshot(cache: K3Cache, n: int) -> list:
    """The first n layer caches as they are now: their tensors are rebound, never written in place, by forward."""
    out = []
    for c in cache.layers[:n]:
        s = copy.copy(c)
        if hasattr(s, "conv_state"):
            s.conv_state = dict(s.conv_state)
        out.append(s)
    return out


@torch.no_grad()
def generate_speculative(
    model: K3ForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
) -> tuple[torch.Tensor, SpecStats]:
    """Prompt [1, T] (or [T]) -> (prompt + greedy continuation [1, T + n], SpecStats); equals
    `generate(model, input_ids, max_new_tokens, eos_token_id=...)` token for token."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if not isinstance(model, K3ForCausalLM) or model.config.mtp_depth < 1:
        raise ValueError("self-speculative decoding drafts with MTP blocks: needs a K3ForCausalLM with mtp_depth >= 1")
    if input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"generate_speculative takes one non-empty prompt [1, T], got {tuple(input_ids.shape)}")
    L = model.config.num_hidden_layers
    block, embed = model.model.layers[L], model.model.embed_tokens
    was_training = model.training
    model.eval()
    try:
        cache, stats = K3Cache.empty(model.config), SpecStats()
        out = model(input_ids, cache=cache)
        h = out.hidden_states
        if input_ids.shape[1] > 1:  # the MTP cache: committed pairs (h[t], emb(token t+1)), t < T-1
            mtp_block(block, h[:, :-1], embed(input_ids[:, 1:]), cache=cache.layers[L])
        h_last, nxt = h[:, -1:], out.logits[:, -1].argmax(-1, keepdim=True)
        new = [nxt]
        while len(new) < max_new_tokens and not (eos_token_id is not None and int(new[-1]) == eos_token_id):
            m, _ = mtp_block(block, h_last, embed(nxt), cache=cache.layers[L])
            draft = model.lm_head(model.model.norm(m)).argmax(-1)
            snap, seen = _snapshot(cache, L), cache.seen_tokens
            out = model(torch.cat([nxt, draft], 1), cache=cache)
            g = out.logits.argmax(-1)  # [1, 2]
            stats.drafted += 1
            stats.main_forwards += 1
            if int(g[0, 0]) == int(draft):
                stats.accepted += 1
                new += [draft, g[:, 1:]]
                mtp_block(block, out.hidden_states[:, :1], embed(draft), cache=cache.layers[L])  # pair at nxt
                h_last, nxt = out.hidden_states[:, 1:], g[:, 1:]
            else:  # back to the snapshot; nxt alone (its logits are g0's: the same prefix)
                cache.layers[:L], cache.seen_tokens = snap, seen
                out = model(nxt, cache=cache)
                stats.main_forwards += 1
                h_last, nxt = out.hidden_states, out.logits[:, -1].argmax(-1, keepdim=True)
                new.append(nxt)
        tokens = torch.cat(new, 1)[:, :max_new_tokens]
        if eos_token_id is not None:  # plain generate stops at the first eos
            hits = (tokens[0] == eos_token_id).nonzero()
            if len(hits):
                tokens = tokens[:, : int(hits[0]) + 1]
        return torch.cat([input_ids, tokens], 1), stats
    finally:
        model.train(was_training)
