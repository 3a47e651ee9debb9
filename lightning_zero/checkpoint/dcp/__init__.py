"""torch.distributed.checkpoint for the ``sharded`` mode: the planners that read and write our tree
(``dcp_adapter``), the CRCs DCP's files carry (``dcp_integrity``) and DCP's storage over fsspec with the
package's own atomic publish (``dcp_storage``).

May import: ``store``, ``formats``, ``runtime`` (the process's gc pause).
"""
