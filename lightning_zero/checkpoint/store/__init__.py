"""Where bytes go: a checkpoint's location on a filesystem or an fsspec store (``storage``: paths, URLs,
markers, atomic publishes), removal, links and clean-up (``cleanup``), the files written and read there (``file_io``), the page-cache
write-back of a large write (``writeback``) and the tuning of both (``tuning``).

The bottom layer: imports nothing else of ``lightning_zero.checkpoint``.
"""
