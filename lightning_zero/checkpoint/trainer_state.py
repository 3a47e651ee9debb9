"""Lightning's own part of a checkpoint (loops, callbacks, hyper-parameters) in a ZeRO tree: one
``torch.save`` blob read back with ``weights_only``, the few fields copied into the commit marker, and
the keys by which a tree tells the plugin its mode and marker fields."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from lightning_zero.checkpoint.store import storage
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError

TREE_TAG = "lightning_zero"
"""Key of the mode in a tree built by :func:`build_tree` (the plugin checks it)."""
PLAIN = "plain"
"""The tag (under :data:`TREE_TAG`) of a save that holds no optimizer state: one plain file whatever the mode
([Note: model-only saves] in lightning/lightning_tree.py)."""
MARKER_FIELDS = "marker_fields"
"""Key of the Lightning fields a tree carries to the commit marker (see [Note: marker format])."""
LIGHTNING_FIELDS = ("epoch", "global_step", "pytorch-lightning_version", "hyper_parameters", "hparams_name",
                    "hparams_type", "datamodule_hyper_parameters", "datamodule_hparams_name")


def marker_fields(trainer_state: dict[str, Any]) -> dict[str, Any]:
    """Lightning's small top-level fields, where they load with ``weights_only=True`` (hyper-parameters
    holding classes stay in the trainer blob only: the marker must always be readable)."""
    fields = {k: trainer_state[k] for k in LIGHTNING_FIELDS if k in trainer_state}
    try:
        buffer = io.BytesIO()
        torch.save(fields, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception:
        fields = {k: v for k, v in fields.items() if "hyper" not in k and "hparams" not in k}
    return fields


def trainer_state_blob(trainer_state: dict[str, Any]) -> bytes:
    """Lightning's loop/callback state as one blob, so tensors in it stay out of the sharded tree."""
    buffer = io.BytesIO()
    torch.save(trainer_state, buffer)
    return buffer.getvalue()


def read_trainer_state(blob: bytes, url: str, weights_only: bool = True) -> dict[str, Any]:
    """Lightning's loop/callback state, on CPU.

    Lightning's own rule for ``weights_only`` loads: tensors, containers and plain values only.
    Hyper-parameters or callback state that hold a class (an ``nn.Module``, a dataclass) are refused with
    its name and the fix, never retried with ``weights_only=False`` (a crafted checkpoint would run code).
    ``weights_only=False`` is the caller saying it trusts the file (``trainer.fit(..., weights_only=False)``,
    as Lightning's own loads take it): then any object is unpickled."""
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        name = storage.refused_global(exc)
        raise CheckpointCorruptError(
            f"The trainer state of checkpoint {url!r} holds {name}, which is not loaded: checkpoints are read"
            " with weights_only=True, so that a crafted file cannot run code. If you saved it yourself and trust"
            f" it, allow the class with torch.serialization.add_safe_globals([{name.rsplit('.', 1)[-1]}]) before"
            " loading, or load it with weights_only=False (trainer.fit/validate/test/predict(...,"
            " weights_only=False), fabric.load(..., weights_only=False), lightning-zero convert"
            " --no-weights-only); better, keep only plain values in checkpoints."
        ) from None
    except Exception as exc:
        raise CheckpointCorruptError(
            f"The trainer state of checkpoint {url!r} is damaged ({type(exc).__name__}: {exc}); resume from"
            " another checkpoint."
        ) from exc
