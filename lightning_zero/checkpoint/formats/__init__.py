"""What the bytes mean: the ZeRO tree of a checkpoint and its flat shards (``tree``), the CRC32 of every
tensor and its check on load (``integrity``), and DeepSpeed's ZeRO-1/2 files read without DeepSpeed
(``deepspeed_files``, ``deepspeed_in``).

May import: ``store``.
"""
