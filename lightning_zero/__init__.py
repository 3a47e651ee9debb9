"""ZeRO stage 1/2 with evenly sharded optimizer state, and async sharded checkpoints, for Lightning.

The engine (``lightning_zero.engine``) needs torch only: where Lightning cannot be imported, importing it
still works, and the Lightning front ends' names say what is missing when asked for.
"""

import sys

try:
    import lightning  # noqa: F401
except ImportError:  # the engine alone
    from lightning_zero.engine import (
        EvenShard,
        FaultTolerance,
        ZeroConfig,
        ZeroEngine,
        ZeroOptimizer,
        register_optimizer,
    )

    _FRONT_ENDS = ("DataPosition", "ElasticDistributedSampler", "LocalTier", "ZeroCheckpointIO", "ZeroLowLevelStrategy")

    def __getattr__(name: str) -> object:
        if name in _FRONT_ENDS:
            raise ImportError(f"lightning_zero.{name} needs Lightning, which cannot be imported here: install it"
                              " (pip install lightning); lightning_zero.engine works without it")
        raise AttributeError(f"module 'lightning_zero' has no attribute {name!r}")
else:
    from lightning_zero import _compat  # noqa: F401, I001  (first: refuses a torch or Lightning this package cannot use)
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zero.engine import EvenShard, FaultTolerance, ZeroConfig, ZeroEngine, ZeroOptimizer, register_optimizer

    from lightning_zero._lightning_fixes import install_checkpoint_reader
    from lightning_zero.checkpoint import LocalTier, ZeroCheckpointIO
    from lightning_zero.data import DataPosition, ElasticDistributedSampler
    from lightning_zero.fabric import register_fabric_strategies
    from lightning_zero.strategy import ZeroLowLevelStrategy

    ZeroLowLevelStrategy.register_strategies(StrategyRegistry)
    register_fabric_strategies()  # Fabric(strategy="zero2")
    install_checkpoint_reader()  # LightningModule.load_from_checkpoint reads local/sharded checkpoints

# The engine's modules sat at the top of the package before it had a package of its own: their old import
# paths (``from lightning_zero.sharding import EvenShard``) name the same modules.
for _name in ("fault_tolerance", "optimizer", "optimizer_kinds", "sharding"):
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"lightning_zero.engine.{_name}"]

__all__ = ["DataPosition", "ElasticDistributedSampler", "EvenShard", "FaultTolerance", "LocalTier", "ZeroCheckpointIO", "ZeroConfig", "ZeroEngine", "ZeroLowLevelStrategy", "ZeroOptimizer",
           "register_optimizer"]
__version__ = "0.1.0"
