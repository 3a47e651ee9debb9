"""Where bytes go, and the only place that knows one kind of store from another ([Note: storage seam] in
``backend``): ``Store``, the object per kind of store (``backend``), the registry from a URL scheme and
``storage_options["client"]`` to one (``registry``), the stores themselves (``local``: disks and shared file
systems; ``fsspec_store``: fsspec and s3fs; ``s3torch``: AWS's s3torchconnector), a checkpoint's location,
markers and the errors a user reads (``storage``), removal, links and clean-up (``cleanup``), the files written
and read there (``file_io``), the page-cache write-back of a large local write (``writeback``) and the tuning of
both (``tuning``).

The bottom layer: imports nothing else of ``lightning_zero.checkpoint``.
"""
