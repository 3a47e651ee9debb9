"""Where ZeroLowLevelStrategy is in the Trainer's runs: one enum of phases and the one place it changes, as
FSDP2's ``TrainingState`` says where a module is in its step.

[Note: the strategy's phases] Lightning calls the strategy's hooks in an order that depends on the run:

* ``fit`` from scratch: ``setup`` (IDLE or FITTED -> FITTING) builds the engine; ``teardown`` (-> FITTED)
  closes it and keeps it, so that ``trainer.save_checkpoint`` after ``fit`` saves what the last step had;
* ``fit`` that resumes: ``load_checkpoint`` runs before ``setup`` (Lightning restores the module and the
  callbacks first: [Note: restore before on_fit_start] in strategy.py); it builds the engine (-> RESUMING),
  and ``setup`` (-> FITTING) builds nothing again;
* ``validate``/``test``/``predict``: ``setup`` (-> IDLE) releases a previous fit's engine; no engine is built.

A fit that fails before its setup is torn down from RESUMING (-> FITTED). The one move refused is a run's
setup while a fit of the same strategy instance is still RESUMING or FITTING: it would close that fit's
engine under it, and the failure would surface later, far from its cause. Only a user gets there (one
strategy instance given to two Trainers, or ``trainer.fit``/``validate`` called from inside a running fit),
so the error says how to fix it.
"""

from __future__ import annotations

from enum import Enum, auto


class Phase(Enum):
    IDLE = auto()
    """No fit set up: constructed, or set up for validate/test/predict (no engine)."""
    RESUMING = auto()
    """A resuming fit's ``load_checkpoint`` has set the module up and built the engine; ``setup`` comes next."""
    FITTING = auto()
    """From fit's ``setup`` to its ``teardown``: the engine (when an optimizer exists) has its hooks and steps."""
    FITTED = auto()
    """After fit's ``teardown``: the engine closed (hooks off) and kept for ``trainer.save_checkpoint``."""


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.IDLE, Phase.RESUMING, Phase.FITTING}),
    Phase.RESUMING: frozenset({Phase.FITTING, Phase.FITTED}),
    Phase.FITTING: frozenset({Phase.FITTED}),
    Phase.FITTED: frozenset({Phase.IDLE, Phase.RESUMING, Phase.FITTING, Phase.FITTED}),
}
"""Phase -> the phases it may move to ([Note: the strategy's phases])."""


class Lifecycle:
    """The strategy's phase; it changes only in :meth:`enter`."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def enter(self, phase: Phase, hook: str) -> None:
        """``hook`` moves the strategy to ``phase``; a move ``MOVES`` does not allow is a RuntimeError that
        names the hook, the phase and the fix."""
        if phase not in MOVES[self.phase]:
            raise RuntimeError(
                f"ZeroLowLevelStrategy.{hook} cannot run while this strategy instance is {self.phase.name.lower()} a"
                " model: it was given to another Trainer whose `fit` is still running, or `fit`/`validate`/`test`/"
                "`predict` was called from inside a running `fit`. Create one ZeroLowLevelStrategy per Trainer, and"
                " start a run once the previous one has returned."
            )
        self.phase = phase

    @property
    def fitting(self) -> bool:
        """Between a fit's first setup hook (``load_checkpoint`` when it resumes, else ``setup``) and its teardown."""
        return self.phase in (Phase.RESUMING, Phase.FITTING)
