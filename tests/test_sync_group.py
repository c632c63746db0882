"""Each parameter group's own schedule (`SyncGroup`) is the closed form of `schedule`."""

import jax
import optax
import pytest
from custom_model import StackedMLP, loss_fn

from eqx_diloco import DiLoCo, schedule


def _abstract(**overrides) -> DiLoCo:
    kwargs = {"loss_fn": loss_fn, "layers": lambda m: m.blocks, "num_replicas": 2, "sync_period": 6,
              "inner_optimizer": optax.sgd(1e-2), "num_fragments": 3}
    diloco = DiLoCo(**{**kwargs, **overrides})
    diloco.abstract(StackedMLP(key=jax.random.key(0)))
    return diloco


@pytest.mark.parametrize("H,P,K", [(6, 3, 0), (6, 1, 0), (10, 5, 0), (6, 3, 2), (6, 2, 3)])
def test_each_group_syncs_when_the_closed_form_says(H, P, K):
    # With K > 0 the head's bias stands in for the MoE routers: it syncs on its own period.
    routers = (lambda p: jax.tree.map(lambda x: x is p.head.bias, p)) if K else None
    diloco = _abstract(sync_period=H, num_fragments=P, router_sync_period=K, routers=routers)
    groups = diloco._sync_groups
    assert [g.index for g in groups] == list(range(P + (K > 0)))
    for t in range(4 * H + 1):
        synced, _ = diloco.events(t)
        assert [g.index for g in groups[:P] if g.syncs_after(t)] == ([] if synced is None else [synced])
        assert diloco.router_due(t) == schedule.router_synced(t, K)
        for g in groups[:P]:
            assert g.last_sync(t) == max(schedule.sync_steps(g.index, H, P, t), default=0)
        if K:
            assert groups[P].last_sync(t) == t - t % K
        expected = sum(diloco.group_bytes[g] for g in ([synced] if synced is not None else []))
        expected += diloco.group_bytes[P] if diloco.router_due(t) else 0
        assert diloco.sent_bytes_at(t) == expected


def test_byte_counts_exist_once_a_model_is_bound():
    diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, sync_period=6,
                    inner_optimizer=optax.sgd(1e-2))
    with pytest.raises(AttributeError, match="exists once a model is bound"):
        _ = diloco.group_bytes
    diloco.abstract(StackedMLP(key=jax.random.key(0)))
    assert diloco.group_bytes == [diloco.sent_bytes_at(6)] and diloco.settled
