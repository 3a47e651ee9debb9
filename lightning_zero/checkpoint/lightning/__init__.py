"""The front ends: Lightning's ``CheckpointIO`` plugin (``plugin``), the mapping between Lightning's
checkpoint dict and the ZeRO tree and the resume that uses it (``lightning_tree``), the same for
``fabric.save`` (``fabric_tree``), and the logged metrics of each save (``metrics``).

May import every other group of the package but ``interop``.
"""
