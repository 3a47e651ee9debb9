"""ZeRO stage 1/2 with evenly sharded optimizer state, and async sharded checkpoints, for Lightning."""

from lightning_zero import _compat  # noqa: F401, I001  (first: refuses a torch or Lightning this package cannot use)
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero._lightning_fixes import install_checkpoint_reader
from lightning_zero.checkpoint import LocalTier, ZeroCheckpointIO
from lightning_zero.data import DataPosition, ElasticDistributedSampler
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.fabric import register_fabric_strategies
from lightning_zero.fault_tolerance import FaultTolerance
from lightning_zero.optimizer import ZeroOptimizer
from lightning_zero.optimizer_kinds import register_optimizer
from lightning_zero.sharding import EvenShard
from lightning_zero.strategy import ZeroLowLevelStrategy

ZeroLowLevelStrategy.register_strategies(StrategyRegistry)
register_fabric_strategies()  # Fabric(strategy="zero2")
install_checkpoint_reader()  # LightningModule.load_from_checkpoint reads local/sharded checkpoints

__all__ = ["DataPosition", "ElasticDistributedSampler", "EvenShard", "FaultTolerance", "LocalTier", "ZeroCheckpointIO", "ZeroConfig", "ZeroEngine", "ZeroLowLevelStrategy", "ZeroOptimizer",
           "register_optimizer"]
__version__ = "0.1.0"
