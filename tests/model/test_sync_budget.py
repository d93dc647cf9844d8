"""Host syncs in one forward + backward of the tiny preset (docs/performance.md, "Sync budget"), counted with the
dispatch-level probe of bench/probes.py: on a GPU each one drains the launch queue, so the step makes none but
the documented ones. The CPU runs the same code a GPU runs without fla, so the counts hold there too."""

from __future__ import annotations

import pytest
import torch

from bench.probes import count_syncs
from model.config import K3Config
from model.k3 import K3ForCausalLM

T = 64


@pytest.fixture(scope="module")
def tiny() -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny")).train()


def _syncs(model: K3ForCausalLM, backend: str, packed: bool, host_copy: bool = False):
    model.set_expert_backend(backend)
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    kw = {}
    if packed:
        cu = torch.tensor([0, 17, 40, T])
        kw = {"cu_seqlens": cu, **({"cu_seqlens_cpu": cu.clone()} if host_copy else {})}
    with count_syncs() as counter:
        out = model(ids, labels=ids, **kw)
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    return counter


def test_unpacked_step_with_grouped_experts_makes_no_host_sync(tiny):
    counter = _syncs(tiny, "grouped_mm", packed=False)
    assert counter.total == 0, counter.report()


def test_loop_experts_read_their_counts_once_per_moe_layer(tiny):
    counter = _syncs(tiny, "loop", packed=False)
    moe_layers = sum(1 for i in range(tiny.config.num_hidden_layers) if tiny.config.is_moe_layer(i))
    assert dict(counter.counts) == {"tolist": moe_layers}, counter.report()


def test_packed_documents_read_cu_seqlens_once_per_micro_batch(tiny):
    counter = _syncs(tiny, "grouped_mm", packed=True)
    assert dict(counter.counts) == {"tolist": 1}, counter.report()


def test_balancing_reads_its_scalars_once_per_optimizer_step():
    """Quantile Balancing (exact estimator) updates every MoE layer's bias on the device; the trainer reads the
    layers' estimate errors for the metrics in one batched host read."""
    from training import balance

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny", num_hidden_layers=3, moe_balance_estimator="exact")).train()
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    out = model(ids, labels=ids)
    moes = model.moe_layers()
    with count_syncs() as counter:
        extra = balance.apply(moes, [s.balance for s in out.router_stats])
    assert dict(counter.counts) == {"tolist": 1}, counter.report()
    assert len(extra) == len(moes) and all(isinstance(d["qb_est_error"], float) for d in extra)
