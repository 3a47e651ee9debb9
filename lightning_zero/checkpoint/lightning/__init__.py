"""The front ends: Lightning's ``CheckpointIO`` plugin and its front-end side (``plugin``: ``ZeroCheckpointIO``,
``StrategyLink``), the mapping between Lightning's checkpoint dict and the ZeRO tree (``lightning_tree``), the resume
that reads it back (``resume``: which load fills what, the Trainer's ``load_checkpoint`` as
:class:`~lightning_zero.checkpoint.lightning.resume.TrainerResume`; ``hook_weights``: the weights that wait for
``on_load_checkpoint`` and the ``strict_loading`` key checks), the same mapping for ``fabric.save``
(``fabric_tree``), the logged metrics of each save (``metrics``), and ``entry``: the one module the strategies
import beside the package's public names.

May import every other group of the package but ``interop``.
"""
