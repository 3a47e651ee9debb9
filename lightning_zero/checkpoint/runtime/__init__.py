"""The process's checkpoint machinery that outlives one save: the process-wide state, its accessor, fork
rule and reset (``process``: [Note: process-wide checkpoint state]), the worker thread and its queue
(``scheduler``), the staging copies a save reads while training goes on (``staging``), the coordination
group and the collectives over it (``team``), and the figures of each save and load (``stats``).

May import: ``store``, ``formats``.
"""
