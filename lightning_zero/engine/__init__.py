"""The ZeRO engine: torch only, usable without Lightning (Fabric, a plain loop) and without the checkpoint
package; the Lightning and Fabric front ends (``lightning_zero/strategy.py``, ``fabric.py``) are glue over it.

Layers, each importing only those above it: ``sharding`` (the even-split arithmetic, no
``torch.distributed``), ``_compat`` (the torch internals used) and ``comm_pool`` (reused buffers);
``collectives`` (stateless functions over lists of buckets); ``grad_bucket`` (one group of parameters that
communicates together), ``grad_reducer`` (backward's hooks and reductions) and ``param_gather`` (the
all-gathers after the step); ``whole_step`` and ``optimizer_kinds`` (optimizers that update whole
parameters); ``optimizer`` (the sharded optimizer); ``zero_engine`` (the object that wires them to a module)
and ``fault_tolerance`` (replica groups on torchft, imported only when turned on).
"""

from lightning_zero.engine.fault_tolerance import FaultTolerance
from lightning_zero.engine.optimizer import ZeroOptimizer
from lightning_zero.engine.optimizer_kinds import register_optimizer
from lightning_zero.engine.sharding import EvenShard
from lightning_zero.engine.zero_engine import (
           DEFAULT_BUCKET_MB,
           MIN_CHUNK_NUMEL,
           ZeroConfig,
           ZeroEngine,
           dtype_from_name,
)

__all__ = ["DEFAULT_BUCKET_MB", "MIN_CHUNK_NUMEL", "EvenShard", "FaultTolerance", "ZeroConfig", "ZeroEngine", "ZeroOptimizer",
           "dtype_from_name", "register_optimizer"]
