"""The local tier: checkpoints on each node's own disk (``tiers``), their replicas on a peer node
(``replication``), the spare files later saves write over (``spares``), the choice of a tier on
``ckpt_path="last"`` (``recovery``) and the reshard of a local-tier checkpoint to a new world size
(``reshard``).

May import: ``store``, ``formats``, ``runtime``, ``modes``.
"""
