"""ZeroOptimizer.register_pre_update_hook: where in ``step(closure)`` the hooks run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from engine_cases import global_batch, initial_model

from lightning_zero import ZeroConfig, ZeroEngine


def test_pre_update_hook_runs_after_the_closure_and_before_the_parameters_change(single_rank_group: None) -> None:
    model = initial_model()
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=2))
    opt = engine.optimizers[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    events: list[str] = []
    seen_at_hook: dict[str, torch.Tensor] = {}

    def closure() -> torch.Tensor:
        events.append("closure")
        x, y = global_batch(0, 0, 1)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        engine.ensure_flushed()
        return loss

    def hook() -> None:
        events.append("hook")
        seen_at_hook.update({n: p.detach().clone() for n, p in model.named_parameters()})
        seen_at_hook.update({f"master:{sp.fqn}": sp.master.detach().clone() for sp in engine.sharded_params.values()})

    handle = opt.register_pre_update_hook(hook)
    opt.step(closure)
    assert events == ["closure", "hook"]
    for sp in engine.sharded_params.values():
        assert torch.equal(seen_at_hook[sp.fqn], before[sp.fqn]), sp.fqn
        assert torch.equal(seen_at_hook[f"master:{sp.fqn}"], sp.own_elements(before[sp.fqn])), sp.fqn
    assert not torch.equal(model.hidden.weight.detach(), before["hidden.weight"]), "the step must update"

    handle.remove()
    opt.step(closure)
    assert events == ["closure", "hook", "closure"], "a removed hook must not run"
    engine.close()
