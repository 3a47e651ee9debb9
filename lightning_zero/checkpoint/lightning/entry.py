"""The front ends' one entry into the checkpoint package beyond its public names (``lightning_zero.checkpoint``).

ZeroLowLevelStrategy (strategy.py), its Fabric twin (fabric.py) and Lightning's fixes (_lightning_fixes.py)
import what they need of the package from ``lightning_zero.checkpoint`` and from here, nowhere else
(tests/test_code_layout.py holds it), so this list is the whole seam between the front ends and the
checkpoint package:

* the plugin's front-end side: :class:`StrategyLink`, reached with :func:`link_of` ([Note: the plugin's two
  faces] in plugin.py);
* the mappings between a front end's state and the ZeRO tree: Lightning's checkpoint dict
  (``lightning_tree``), ``fabric.save``'s state (``fabric_tree``) and the module's metadata (``engine_tree``);
* the Trainer's resume (``resume``) and the weights that wait for ``on_load_checkpoint`` (``hook_weights``).
"""

from lightning_zero.checkpoint.engine_tree import module_meta
from lightning_zero.checkpoint.lightning.fabric_tree import fabric_tree, plain_fabric_tree
from lightning_zero.checkpoint.lightning.hook_weights import (
    PendingWeights,
    apply_pending_weights,
    keep_own_values,
)
from lightning_zero.checkpoint.lightning.lightning_tree import (
    build_tree,
    gather_full_checkpoint,
    holds_module_parameters,
    holds_optimizer_state,
    plain_tree,
)
from lightning_zero.checkpoint.lightning.plugin import StrategyLink, link_of
from lightning_zero.checkpoint.lightning.resume import TrainerResume, publish
from lightning_zero.checkpoint.reader import to_fabric_layout

__all__ = [
    "PendingWeights",
    "StrategyLink",
    "TrainerResume",
    "apply_pending_weights",
    "build_tree",
    "fabric_tree",
    "gather_full_checkpoint",
    "holds_module_parameters",
    "holds_optimizer_state",
    "keep_own_values",
    "link_of",
    "module_meta",
    "plain_fabric_tree",
    "plain_tree",
    "publish",
    "to_fabric_layout",
]
