"""torch.distributed.checkpoint for the ``sharded`` mode: the planners that read and write our tree
(``dcp_adapter``), the CRCs DCP's files carry (``dcp_integrity``) and DCP's writer and reader of a location,
the store's own wrapped with both (``dcp_storage``).

May import: ``store``, ``formats``, ``runtime`` (the process's gc pause).
"""
