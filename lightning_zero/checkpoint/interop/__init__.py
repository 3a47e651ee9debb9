"""Other systems' layouts written from any checkpoint: one ``full`` file, a Hugging Face folder
(``convert``), a torch DCP folder FSDP2 loads (``dcp_out``), a DeepSpeed ZeRO-1/2 folder
(``deepspeed_out``), and the whole checkpoint read by parameter name that they share (``named_state``).

May import: ``store``, ``formats`` and the verbs at the package's top (``reader``, ``opening``,
``engine_tree``).
"""
