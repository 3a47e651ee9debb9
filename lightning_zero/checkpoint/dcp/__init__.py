"""torch.distributed.checkpoint for the ``sharded`` mode: the planners that read and write our tree
(``adapter``), the CRCs DCP's files carry (``integrity``), the data file of a rank of many small items
(``items``) and DCP's writer and reader of a location, the store's own wrapped with both (``storage``).

May import: ``store``, ``formats``, ``runtime`` (the process's gc pause).
"""
