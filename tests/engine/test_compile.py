"""``trainer.fit(torch.compile(module))`` under zero1 and zero2 against ddp, 2 CPU processes: the same number
of graphs as ddp (one), none compiled after the first step although the parameter gathers of each step
overlap into the next ([Note: compiled reads] in engine/param_gather.py), the weights of ddp bit for bit (with the
"eager" backend, which counts graphs cheaply, and once with inductor), and a resume from a compiled run's
checkpoint that continues it exactly. The optimizer's own step compiled (``optimizer.step =
torch.compile(optimizer.step)``) steps the master shards in one graph, as it steps DDP's parameters;
compiling the engine's ``ZeroOptimizer.step`` is refused ([Note: compiled optimizer step] in engine/optimizer.py).

Bit for bit, not within a tolerance: with 2 ranks every reduction adds the same two numbers (gloo's
all-reduce under ddp, the reduce-scatter or all-reduce of the engine), and AdamW updates each element on
its own, so the shards step exactly as the whole tensors do. A graph compiled from a stale parameter, or
a forward reading one before its gather finished, would show up as a difference.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from compile_cases import compile_zero_optimizer_step, fabric_loop, fit, loop, two_engines_in_turn

pytestmark = pytest.mark.slow  # each fit compiles in two processes on shared cores: ~15 s

STEPS = 4


@functools.cache
def fitted(strategy: str, backend: str = "eager") -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root:
        return run_distributed(fit, 2, strategy, root, STEPS, backend, start_method="forkserver")


def _assert_same_params(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs by {(got[name] - value).abs().max()}"


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_compiled_module_has_as_many_graphs_as_ddp_and_no_recompiles(strategy: str) -> None:
    for rank, (zero, ddp) in enumerate(zip(fitted(strategy), fitted("ddp"), strict=True)):
        assert ddp["graphs_after_step"] == [1] * STEPS, f"rank {rank}: ddp compiled {ddp['graphs_after_step']}"
        assert zero["graphs_after_step"] == ddp["graphs_after_step"], f"rank {rank}"


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_compiled_module_reaches_ddps_weights_bit_for_bit(strategy: str) -> None:
    for rank, (zero, ddp) in enumerate(zip(fitted(strategy), fitted("ddp"), strict=True)):
        _assert_same_params(zero["params"], ddp["params"], f"{strategy} rank {rank}")


def test_inductor_compiled_module_reaches_ddps_weights_bit_for_bit() -> None:
    zero, ddp = fitted("zero2", "inductor"), fitted("ddp", "inductor")
    for rank in range(2):
        assert zero[rank]["graphs_after_step"] == ddp[rank]["graphs_after_step"] == [1] * STEPS
        _assert_same_params(zero[rank]["params"], ddp[rank]["params"], f"inductor rank {rank}")


def test_compiled_module_equals_the_eager_run() -> None:
    with tempfile.TemporaryDirectory() as root:
        eager = run_distributed(fit, 2, "zero2", root, STEPS, None, start_method="forkserver")
    _assert_same_params(fitted("zero2")[0]["params"], eager[0]["params"], "compiled against eager")


def test_resume_from_a_compiled_runs_checkpoint_continues_it_exactly(tmp_path: Path) -> None:
    first = run_distributed(fit, 2, "zero2", str(tmp_path), STEPS, "eager", None, True, start_method="forkserver")
    resumed = run_distributed(fit, 2, "zero2", str(tmp_path / "resume"), STEPS, "eager", None, False,
                              str(tmp_path / "ckpts" / "epoch=0-step=2.ckpt"), start_method="forkserver")
    for rank in range(2):
        _assert_same_params(resumed[rank]["params"], first[rank]["params"], f"resumed rank {rank}")
        assert resumed[rank]["graphs_after_step"] == [1] * (STEPS - 2), f"rank {rank}"


@pytest.mark.parametrize(("compile_model", "compile_step"), [(True, False), (False, True)],
                         ids=["model", "optimizer_step"])
def test_a_plain_loop_compiles_as_under_ddp(compile_model: bool, compile_step: bool) -> None:
    """The engine without Lightning: ``torch.compile(model)``, or the optimizer's own step compiled (the
    engine steps its master shards through it)."""
    zero = run_distributed(loop, 2, "zero2", STEPS, compile_model, compile_step, start_method="forkserver")
    ddp = run_distributed(loop, 2, "ddp", STEPS, compile_model, compile_step, start_method="forkserver")
    for rank in range(2):
        assert zero[rank]["graphs_after_step"] == ddp[rank]["graphs_after_step"] == [1] * STEPS, f"rank {rank}"
        _assert_same_params(zero[rank]["params"], ddp[rank]["params"], f"rank {rank}")
        # A compiled model's gathers end in the step; an eager one's still overlap the next forward.
        assert zero[rank]["pending_after_step"] == [not compile_model] * STEPS, f"rank {rank}"


def test_an_engine_built_again_on_a_compiled_module_ends_its_gathers_in_the_step() -> None:
    """The graph compiled for the first engine runs again without a trace: the second engine's gathers
    must end in the step all the same, or the graph would read parameters still being gathered."""
    compiled = run_distributed(two_engines_in_turn, 2, True, STEPS, start_method="forkserver")
    eager = run_distributed(two_engines_in_turn, 2, False, STEPS, start_method="forkserver")
    for rank in range(2):
        assert compiled[rank]["graphs_after_step"] == [1] * 2 * STEPS, f"rank {rank}"
        assert compiled[rank]["pending_after_step"] == [False] * 2 * STEPS, f"rank {rank}"
        assert eager[rank]["pending_after_step"] == [True] * 2 * STEPS, f"rank {rank}"
        _assert_same_params(compiled[rank]["params"], eager[rank]["params"], f"rank {rank}")


def test_an_optimizer_step_compiled_in_configure_optimizers_equals_ddps() -> None:
    """Under ddp Lightning calls ``step(closure)``, so the compiled step traces the closure too (forward
    and backward: several graphs, none after the first step); the engine runs the closure itself and
    calls the compiled step without it: one graph."""
    with tempfile.TemporaryDirectory() as root:
        zero = run_distributed(fit, 2, "zero2", root, STEPS, None, None, False, None, True, start_method="forkserver")
        ddp = run_distributed(fit, 2, "ddp", root, STEPS, None, None, False, None, True, start_method="forkserver")
    for rank in range(2):
        assert zero[rank]["graphs_after_step"] == [1] * STEPS, f"rank {rank}"
        first = ddp[rank]["graphs_after_step"][0]
        assert ddp[rank]["graphs_after_step"] == [first] * STEPS, f"rank {rank}"
        _assert_same_params(zero[rank]["params"], ddp[rank]["params"], f"rank {rank}")


def test_compiling_the_engines_optimizer_step_is_refused_with_the_way_out() -> None:
    for message in run_distributed(compile_zero_optimizer_step, 2, start_method="forkserver"):
        assert "torch.compile of ZeroOptimizer.step" in message
        assert "optimizer.step = torch.compile(optimizer.step)" in message


def test_a_shape_aware_optimizer_with_a_compiled_step_is_refused_at_setup(single_rank_group: None) -> None:
    from lightning_zero import ZeroConfig, ZeroEngine

    model = torch.nn.Linear(4, 4)
    muon = torch.optim.Muon([model.weight], lr=0.02)
    muon.step = torch.compile(muon.step, backend="eager")  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"Optimizer 0 \(Muon\) has a compiled step, and it is shape-aware"):
        ZeroEngine(model, [muon, torch.optim.AdamW([model.bias])], ZeroConfig(stage=2))


def test_fabric_setup_of_a_compiled_module_has_ddps_graphs_and_weights() -> None:
    zero = run_distributed(fabric_loop, 2, "zero2", STEPS, start_method="forkserver")
    ddp = run_distributed(fabric_loop, 2, "ddp", STEPS, start_method="forkserver")
    for rank in range(2):
        assert ddp[rank]["graphs_after_step"] == [1] * STEPS, ddp[rank]["graphs_after_step"]
        assert zero[rank]["graphs_after_step"] == ddp[rank]["graphs_after_step"], f"rank {rank}"
        _assert_same_params(zero[rank]["params"], ddp[rank]["params"], f"fabric rank {rank}")
