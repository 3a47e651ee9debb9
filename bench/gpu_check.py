"""One prepared script for what CPU runs cannot show about the engine; run it on one GPU.

    .venv/bin/python bench/gpu_check.py          # < 5 minutes on one GPU; exit status 1 on any FAIL

Every check prints one line, ``PASS``, ``FAIL`` or ``SKIP`` with the reason. On a machine without
CUDA the CPU-able checks run (gloo instead of NCCL, RSS instead of CUDA memory statistics) and the
CUDA-only ones print ``SKIP``; ``tests/bench/test_gpu_check.py`` runs it that way. Checks:

1. ZeRO-2 at world size 1 equals plain PyTorch, bit for bit, in fp32 (AdamW on the parameters)
   and bf16-true (against a plain fp32-master loop: bf16 model, fp32 copies, AdamW on the copies),
   over NCCL on a GPU (gloo on CPU), with the parameter gather overlapped.
2. (CUDA) no host synchronisation in forward (the overlapped gather's waits), backward and
   ``ensure_flushed`` (``torch.cuda.set_sync_debug_mode("error")``), and exactly one in the step:
   the once-per-step presence read ([Note: presence on the device] in engine/grad_bucket.py).
3. Step memory at world size 8 (fake process group, one process): the step's peak above its start
   is at most 0.3x the parameters' bytes (CUDA: ``max_memory_allocated``; CPU: peak RSS).
4. (CUDA) memory between steps at world size 8 (fake process group): ``memory_allocated`` after
   the gathers and ``zero_grad`` at most 1.1x the ZeRO formula (4 + 16/N bytes an element) with no
   pool slot held; ``memory_reserved`` between steps and a step's ``max_memory_allocated`` printed.
5. (CUDA) every bucket buffer and shard lives on the GPU, and the reductions use NCCL's native
   reduce-scatter for both stages.

6. (CUDA) checkpoint staging: an async save copies into pinned host buffers, reused by the next
   save, on a stream other than the training stream ([Note: staging on GPUs] in checkpoint/runtime/staging.py).
7. (CUDA) a training step with an async save in flight is at most 1.15x a step without.
8. (CUDA) a plain ``TorchCheckpointIO`` under ZeroLowLevelStrategy on NCCL: the gather to rank 0
   runs on the training group with CUDA tensors and one ordinary file comes out.
9. (torchft installed) fault tolerance, one replica group of one rank with a lighthouse started here: the
   cross-group hop runs on torchft's NCCL process group on a GPU (its gloo group on CPU), with the buckets'
   tensors on the device, and 3 committed AdamW steps equal the same steps without fault tolerance, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PeakRSS, free_port, release_free_memory  # noqa: E402
from scale import NarrowLlama, batch, filled_collectives  # noqa: E402

from lightning_zero.engine import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zero.engine.comm_pool import MAX_IN_FLIGHT  # noqa: E402

MAX_STEP_PEAK_VS_PARAMS = 0.3


class CheckFailed(Exception):
    pass


def cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda", 0) if cuda() else torch.device("cpu")


def init_one_rank(backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    kwargs = {"device_id": device()} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=0, world_size=1, **kwargs)


def small_model(dtype: torch.dtype) -> NarrowLlama:
    return NarrowLlama(blocks=2).to(device=device(), dtype=dtype)


def tokens(step: int) -> tuple[Tensor, Tensor]:
    x, y = batch(step)
    return x.to(device()), y.to(device())


def zero_run(dtype: torch.dtype, steps: int) -> dict[str, Tensor]:
    model = small_model(dtype)
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], ZeroConfig(stage=2, bucket_size_mb=0.05))
    opt = engine.optimizers[0]
    for step in range(steps):
        model(*tokens(step)).float().backward()
        engine.ensure_flushed()
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}  # finishes the gathers
    engine.close()
    return params


def plain_run(dtype: torch.dtype, steps: int) -> dict[str, Tensor]:
    """Plain PyTorch; below fp32 with fp32 master copies, the semantics ZeRO's masters give."""
    model = small_model(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters if dtype != torch.float32 else list(model.parameters()), lr=1e-2)
    for step in range(steps):
        model(*tokens(step)).float().backward()
        if dtype != torch.float32:
            for master, p in zip(masters, model.parameters(), strict=True):
                master.grad = p.grad.float() if p.grad is not None else None
        opt.step()
        if dtype != torch.float32:
            with torch.no_grad():
                for master, p in zip(masters, model.parameters(), strict=True):
                    p.copy_(master)
        opt.zero_grad()
        model.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_equivalence() -> str:
    backend = "nccl" if cuda() else "gloo"
    init_one_rank(backend)
    # Bit equality needs the same kernels on both sides: the math attention (flash/efficient
    # backward accumulates with atomics) and deterministic algorithms elsewhere.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        details = []
        for dtype in (torch.float32, torch.bfloat16):
            with sdpa_kernel([SDPBackend.MATH]):
                zero, plain = zero_run(dtype, steps=3), plain_run(dtype, steps=3)
            differ = [n for n in plain if not torch.equal(zero[n], plain[n])]
            if differ:
                worst = max((zero[n].float() - plain[n].float()).abs().max().item() for n in differ)
                raise CheckFailed(f"{dtype}: {len(differ)}/{len(plain)} tensors differ (max {worst:.3g}), e.g. {differ[:3]}")
            details.append(f"{str(dtype).removeprefix('torch.')} bit-identical over {len(plain)} tensors")
        return f"{backend}, world size 1, 3 AdamW steps: " + "; ".join(details)
    finally:
        torch.use_deterministic_algorithms(False)
        dist.destroy_process_group()


def check_no_host_sync() -> str:
    init_one_rank("nccl")
    try:
        model = small_model(torch.bfloat16)
        engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)],
                            ZeroConfig(stage=2, bucket_size_mb=0.05, reduce_dtype="float32"))
        opt = engine.optimizers[0]
        step_syncs = []
        for step in range(3):
            x, y = tokens(step)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = model(x, y).float()  # waits on the overlapped gathers of the previous step
                loss.backward()
                engine.ensure_flushed()
            except RuntimeError as exc:
                raise CheckFailed(f"step {step}: host sync in forward/backward: {exc}") from exc
            finally:
                torch.cuda.set_sync_debug_mode("default")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    opt.step()
                    opt.zero_grad()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            step_syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        engine.close()
        if any(n > 1 for n in step_syncs):
            raise CheckFailed(f"host syncs per step {step_syncs}: more than the one presence read")
        return f"forward+backward: none in 3 steps; step: {step_syncs} (the presence read)"
    finally:
        dist.destroy_process_group()


def check_step_memory() -> str:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = 8
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = NarrowLlama(blocks=8, d=256, ff=688, heads=4).to(device())
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with filled_collectives(0, world_size):
            engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)],
                                ZeroConfig(stage=2, bucket_size_mb=4.0))
            opt = engine.optimizers[0]
            growth = 0
            for step in range(3):  # the first step grows the pool's slots; the last is measured
                model(*tokens(step)).backward()
                engine.ensure_flushed()
                if cuda():
                    torch.cuda.synchronize()
                    start = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    opt.step()
                    engine.finish_param_gather()
                    torch.cuda.synchronize()
                    growth = torch.cuda.max_memory_allocated() - start
                else:
                    release_free_memory()
                    with PeakRSS() as peak:
                        opt.step()
                        engine.finish_param_gather()
                    growth = peak.growth
                opt.zero_grad()
            pool = engine.pool.high_water_bytes
            buckets = len(engine.buckets)
            engine.close()
    finally:
        dist.destroy_process_group()
    ratio = growth / param_bytes
    what = "CUDA max_memory_allocated" if cuda() else "peak RSS"
    detail = (f"{what} growth {growth / 2**20:.1f} MiB = {ratio:.3f}x of {param_bytes / 2**20:.1f} MiB parameters"
              f" (fake group, world size {world_size}, {buckets} buckets; pool {pool / 2**20:.1f} MiB ="
              f" {MAX_IN_FLIGHT} slots)")
    if ratio > MAX_STEP_PEAK_VS_PARAMS:
        raise CheckFailed(detail)
    return detail


MAX_BETWEEN_STEPS_VS_FORMULA = 1.1


def check_memory_between_steps() -> str:
    """CUDA allocator statistics around zero2 steps at world size 8 (fake group): between steps
    (after the gathers and ``zero_grad``) the allocated bytes against the ZeRO paper's model states
    (4 bytes of parameter + 16/N of gradient shard, master and AdamW moments per element, fp32),
    the pool empty ([Note: pool between steps] in engine/comm_pool.py), what the caching allocator keeps
    reserved, and the peak of a whole step above the memory between steps."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = 8
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        model = NarrowLlama(blocks=8, d=256, ff=688, heads=4).to(device())
        numel = sum(p.numel() for p in model.parameters())
        with filled_collectives(0, world_size):
            engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)],
                                ZeroConfig(stage=2, bucket_size_mb=4.0))
            opt = engine.optimizers[0]
            between, reserved, peak = [], [], []
            for step in range(4):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                model(*tokens(step)).backward()
                engine.ensure_flushed()
                opt.step()
                engine.finish_param_gather()
                opt.zero_grad()
                torch.cuda.synchronize()
                peak.append(torch.cuda.max_memory_allocated() - start)
                between.append(torch.cuda.memory_allocated() - base)
                reserved.append(torch.cuda.memory_reserved())
            pool_between, pool_during = engine.pool.nbytes, engine.pool.high_water_bytes
            engine.close()
    finally:
        dist.destroy_process_group()
    formula = 4 * numel + 16 * numel / world_size
    ratio = between[-1] / formula
    detail = (f"allocated between steps {between[-1] / 2**20:.1f} MiB = {ratio:.3f}x the formula"
              f" {formula / 2**20:.1f} MiB (limit {MAX_BETWEEN_STEPS_VS_FORMULA}x); pool between steps"
              f" {pool_between} B, during a step {pool_during / 2**20:.1f} MiB; memory_reserved between steps"
              f" {reserved[-1] / 2**20:.1f} MiB (steps: {', '.join(f'{r / 2**20:.0f}' for r in reserved)});"
              f" a step's max_memory_allocated above its start {peak[-1] / 2**20:.1f} MiB")
    if ratio > MAX_BETWEEN_STEPS_VS_FORMULA or pool_between:
        raise CheckFailed(detail)
    return detail


def check_device_placement() -> str:
    init_one_rank("nccl")
    try:
        for stage in (1, 2):
            model = small_model(torch.float32)
            engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters())], ZeroConfig(stage=stage))
            model(*tokens(0)).backward()
            engine.ensure_flushed()
            slots = list(engine.pool._storage.values())  # held from backward until the step's gathers end
            engine.optimizers[0].step()
            engine.finish_param_gather()
            tensors = [t for b in engine.buckets for t in (b.master_shard, b.grad_shard, b.present_count)] + slots
            off = [str(t.device) for t in tensors if t.device.type != "cuda"]
            if off or not engine.reducer.reduce_scatter:
                raise CheckFailed(f"stage {stage}: tensors on {off}; reduce_scatter={engine.reducer.reduce_scatter}")
            engine.close()
        return "stage 1 and 2: shards, flags and pool slots on cuda; native reduce-scatter on both stages"
    finally:
        dist.destroy_process_group()


def _trained_engine(steps: int = 2) -> tuple[NarrowLlama, ZeroEngine]:
    model = small_model(torch.float32)
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], ZeroConfig(stage=2, bucket_size_mb=4.0))
    for step in range(steps):
        _train_step(model, engine, step)
    return model, engine


def _train_step(model: NarrowLlama, engine: ZeroEngine, step: int) -> None:
    opt = engine.optimizers[0]
    model(*tokens(step)).float().backward()
    engine.ensure_flushed()
    opt.step()  # runs the pre-update hooks (the staging fence) after the closure, before the update
    opt.zero_grad()


def check_staging_pinned() -> str:
    """Async save on CUDA: staged into reused pinned host buffers, on a stream other than training's."""
    import tempfile

    from lightning_zero.checkpoint import maybe_finalize_async_calls, saver, wait_for_staging, zero_state_dict
    from lightning_zero.checkpoint.runtime.scheduler import checkpointer

    init_one_rank("nccl")
    try:
        model, engine = _trained_engine()
        with tempfile.TemporaryDirectory() as root:
            for index in range(2):
                saver.async_save(zero_state_dict(engine, model), f"{root}/s{index}.ckpt", mode="local")
                wait_for_staging()
                maybe_finalize_async_calls(blocking=True)
                buffers = checkpointer().stager.host_buffers()
                if index == 0:
                    first = {id(b) for b in buffers}
        if not buffers or not all(b.is_pinned() for b in buffers):
            raise CheckFailed(f"{sum(not b.is_pinned() for b in buffers)}/{len(buffers)} staging buffers not pinned")
        if {id(b) for b in buffers} != first:
            raise CheckFailed("the second save allocated new host buffers instead of reusing the first save's")
        streams = list(checkpointer().stager._streams.values())
        if not streams or any(s == torch.cuda.default_stream(device()) for s in streams):
            raise CheckFailed("staging ran on the training (default) stream")
        engine.close()
        return f"{len(buffers)} pinned buffers reused across 2 saves, copies on a side stream"
    finally:
        dist.destroy_process_group()


def check_step_with_save_in_flight() -> str:
    """A training step with an async save in flight is at most 1.15x a step without."""
    import statistics
    import tempfile

    from lightning_zero.checkpoint import maybe_finalize_async_calls, saver, zero_state_dict
    from lightning_zero.checkpoint.engine_tree import module_meta

    init_one_rank("nccl")
    try:
        model, engine = _trained_engine()
        engine.optimizers[0].register_pre_update_hook(saver.wait_for_staging)
        meta = module_meta(model)  # once, as the strategy does at setup

        def timed(step: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            _train_step(model, engine, step)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        plain = [timed(step) for step in range(10)]
        with tempfile.TemporaryDirectory() as root:
            with_save = []
            for step in range(10):
                saver.async_save(zero_state_dict(engine, model, meta=meta), f"{root}/last.ckpt", mode="local")
                with_save.append(timed(step))
                maybe_finalize_async_calls(blocking=True)
        ratio = statistics.median(with_save) / statistics.median(plain)
        engine.close()
        if ratio > 1.15:
            raise CheckFailed(f"step with a save in flight {ratio:.2f}x a step without (limit 1.15x)")
        return f"{ratio:.2f}x ({statistics.median(with_save) * 1e3:.1f} ms vs {statistics.median(plain) * 1e3:.1f} ms)"
    finally:
        dist.destroy_process_group()


def check_nccl_plain_checkpoint_io() -> str:
    """ZeroLowLevelStrategy with Lightning's TorchCheckpointIO on NCCL: the gather to rank 0 runs on
    the training group with CUDA tensors and one ordinary file comes out."""
    import tempfile

    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_zero import ZeroLowLevelStrategy

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(33, 17)

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(accelerator="gpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                          enable_checkpointing=False, default_root_dir=root,
                          strategy=ZeroLowLevelStrategy(stage=2, checkpoint_io=TorchCheckpointIO(),
                                                        process_group_backend="nccl"))
        trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(8, 33), batch_size=4))
        trainer.save_checkpoint(f"{root}/plain.ckpt")
        content = torch.load(f"{root}/plain.ckpt", weights_only=True)
        if not content.get("optimizer_states") or "layer.weight" not in content["state_dict"]:
            raise CheckFailed(f"the plain file lacks weights or optimizer state: {sorted(content)}")
    return "TorchCheckpointIO wrote one full file (weights and per-parameter optimizer state)"


def check_fault_tolerance() -> str:
    import subprocess

    from lightning_zero.engine.fault_tolerance import FaultTolerance, ReplicaGroups

    lighthouse = Path(sys.executable).with_name("torchft_lighthouse")
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "skipped: torchft is not installed (pip install \"lightning-zero[ft]\")"
    if not lighthouse.exists():
        return f"skipped: no {lighthouse.name} beside {sys.executable}"
    backend = "nccl" if cuda() else "gloo"
    init_one_rank(backend)
    port = free_port()
    server = subprocess.Popen([str(lighthouse), "--min_replicas", "1", "--bind", f"[::]:{port}", "--quorum_tick_ms", "100",
                               "--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "100"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hops: list[str] = []
    try:
        torch.manual_seed(0)
        model = small_model(torch.float32)
        groups = ReplicaGroups(FaultTolerance(0, lighthouse=f"http://127.0.0.1:{port}", timeout_s=30), 0, 1, device())
        original = groups.all_reduce

        def all_reduce(tensor: Tensor) -> object:
            hops.append(f"{tensor.device.type}/{groups.manager._pg.getBackendName()}")
            return original(tensor)

        groups.all_reduce = all_reduce  # type: ignore[method-assign]
        engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)],
                            ZeroConfig(stage=2, bucket_size_mb=0.05), replica_groups=groups)
        opt = engine.optimizers[0]
        opt.register_pre_update_hook(lambda: groups.decide(opt))
        groups.join()
        committed = 0
        for step in range(3):
            model(*tokens(step)).float().backward()
            engine.ensure_flushed()
            opt.step()
            opt.zero_grad()
            committed += groups.config.committed
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine.close()
        groups.close()
        torch.manual_seed(0)
        plain = zero_run(torch.float32, steps=3)
    finally:
        server.kill()
        dist.destroy_process_group()
    if committed != 3:
        raise CheckFailed(f"{committed} of 3 steps committed")
    expected = f"{device().type}/torchft-{backend}"
    if not hops or set(hops) != {expected}:
        raise CheckFailed(f"cross-group hops ran as {sorted(set(hops))}, expected {expected}")
    differ = [n for n in plain if not torch.equal(params[n], plain[n])]
    if differ:
        raise CheckFailed(f"{len(differ)}/{len(plain)} tensors differ from the run without fault tolerance")
    return f"{len(hops)} hops on {expected}, 3 steps committed, bit-identical to the run without fault tolerance"


CHECKS: list[tuple[str, bool, Callable[[], str]]] = [
    ("zero2 equals plain PyTorch at world size 1 (fp32, bf16-true)", False, check_equivalence),
    ("no host sync in forward/backward, one in the step", True, check_no_host_sync),
    ("step peak memory <= 0.3x parameter bytes at world size 8 (fake group)", False, check_step_memory),
    ("memory between steps <= 1.1x the ZeRO formula, no pool held (CUDA allocator)", True,
     check_memory_between_steps),
    ("buffers on the GPU, native reduce-scatter on NCCL", True, check_device_placement),
    ("checkpoint staging: pinned, reused host buffers on a side stream", True, check_staging_pinned),
    ("a training step with an async save in flight <= 1.15x a step without", True, check_step_with_save_in_flight),
    ("plain TorchCheckpointIO under ZeroLowLevelStrategy on NCCL", True, check_nccl_plain_checkpoint_io),
    ("fault tolerance: the cross-group hop on torchft's NCCL group, equal to no fault tolerance", False,
     check_fault_tolerance),
]
TODO: list[str] = []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    start = time.perf_counter()
    where = f"CUDA {torch.cuda.get_device_name()}" if cuda() else "CPU only (no CUDA)"
    print(f"gpu_check: torch {torch.__version__}, {where}")
    failures = 0
    for name, needs_cuda, check in CHECKS:
        if needs_cuda and not cuda():
            print(f"SKIP {name}: needs a CUDA GPU")
            continue
        try:
            print(f"PASS {name}: {check()}", flush=True)
        except CheckFailed as exc:
            failures += 1
            print(f"FAIL {name}: {exc}", flush=True)
    for item in TODO:
        print(f"TODO {item}: not in this script yet (checkpoint code)")
    print(f"gpu_check: {failures} failed, {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
    sys.exit(main())
