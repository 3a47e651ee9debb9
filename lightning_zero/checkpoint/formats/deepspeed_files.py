"""A DeepSpeed ZeRO-1/2 checkpoint's files: found, checked for a layout this package can carry over, and
read without importing DeepSpeed and without running its pickles.

The layouts it accepts (``loc`` is what the user passes):

* a tag folder: ``mp_rank_00_model_states.pt`` and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``
  per data-parallel rank (``engine.save_checkpoint(dir, tag)`` writes ``dir/<tag>/``);
* a save folder holding ``latest`` (the newest tag's name) and that tag's folder: ``engine.save_checkpoint``'s
  ``dir``, and the ``<file>.ckpt/`` folder Lightning's ``DeepSpeedStrategy`` writes (tag ``checkpoint``).

[Note: reading DeepSpeed's pickles] DeepSpeed's files are ``torch.save`` pickles of a few of its own classes
among tensors and plain containers: ``fragment_address`` (where a parameter's piece lies in a rank's flat
partition), the loss scaler, ``ZeroStageEnum``. Unpickled as they are, they would import DeepSpeed and run
whatever a crafted file names. They are read with ``torch.load(weights_only=True)`` instead, with those
names (:data:`STAND_INS`) mapped to inert stand-ins of this module that keep plain values only, for the
duration of the one call (``torch.serialization.safe_globals``); any other global is refused by torch's
restricted unpickler, and the error names it. The stand-ins admit no code and no reference to one.
"""

from __future__ import annotations

import pickle
import re
import types
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero.checkpoint.store import storage
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, CheckpointNotFoundError, Location

MODEL_STATES = "mp_rank_00_model_states.pt"
LATEST = "latest"
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")
_MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_PIPELINE_FILE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
_EXPERT_FILE = re.compile(r"^(expp_rank_\d+_mp_rank_\d+_optim_states|layer_\d+_expert_\d+_mp_rank_\d+_model_states)\.pt$")
PLAIN = (int, float, bool, str, type(None), torch.dtype)


def _plain_fields(kind: str, state: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """The pickled attributes of a stand-in, refused unless they are plain values of the expected names."""
    if not isinstance(state, dict):
        raise pickle.UnpicklingError(f"DeepSpeed {kind} with a state of type {type(state).__name__}, not a dict")
    for key, value in state.items():
        if key not in allowed or not isinstance(value, PLAIN):
            raise pickle.UnpicklingError(f"DeepSpeed {kind} with an unexpected field {key!r} ({type(value).__name__})")
    return dict(state)


class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``: a parameter's piece in one rank's
    flat partition of its param group starts at ``start`` and holds ``numel`` elements."""

    numel: int
    start: int

    def __init__(self, numel: int = 0, start: int = 0) -> None:
        self.numel, self.start = numel, start

    def __setstate__(self, state: Any) -> None:
        fields = _plain_fields("fragment_address", state, frozenset({"numel", "start"}))
        if set(fields) != {"numel", "start"} or not all(type(v) is int and v >= 0 for v in fields.values()):
            raise pickle.UnpicklingError(f"DeepSpeed fragment_address with fields {fields!r}")
        self.numel, self.start = fields["numel"], fields["start"]


_SCALER_FIELDS = frozenset({
    "cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
    "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale", "dtype",
})


class StaticLossScaler:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (a fixed scale; 1.0 outside fp16)."""

    fields: dict[str, Any]

    def __setstate__(self, state: Any) -> None:
        self.fields = _plain_fields("LossScaler", state, _SCALER_FIELDS)


class DynamicLossScaler(StaticLossScaler):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (fp16's dynamic scale)."""


class ZeroStage(int):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as the enum called with its value)."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (ZeroStage, (int(self),))


STAND_INS: list[tuple[Any, str]] = [
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (StaticLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]
"""The only DeepSpeed globals its ZeRO-1/2 files may name ([Note: reading DeepSpeed's pickles])."""


@dataclass(frozen=True)
class DeepSpeedFolder:
    """One tag folder of a DeepSpeed ZeRO-1/2 checkpoint, its files listed and checked for the layout."""

    url: str
    """What the user passed (for messages)."""
    tag: Location
    rank_files: dict[int, str]
    """Data-parallel rank -> path of its optimizer-state file (the count is checked against the model
    states once read: :func:`check_rank_files`)."""

    @property
    def model_states(self) -> str:
        return self.tag.join(self.tag.path, MODEL_STATES)


def _names(loc: Location) -> list[str]:
    return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in loc.store.ls(loc.path))


def _holds_deepspeed_files(names: list[str]) -> bool:
    return any(_MODEL_FILE.match(n) or _RANK_FILE.match(n) or _ZERO3_MODEL_FILE.match(n) for n in names)


def tag_folder(loc: Location) -> Location | None:
    """The tag folder of the DeepSpeed checkpoint at ``loc`` (itself, or the one its ``latest`` names), or
    None when ``loc`` is not a directory holding one. Lists one or two directories."""
    try:
        if not loc.store.isdir(loc.path):
            return None
        names = _names(loc)
        if _holds_deepspeed_files(names):
            return loc
        if LATEST not in names:
            return None
        with loc.store.open_read(loc.join(loc.path, LATEST)) as f:
            tag = f.read(4096).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise storage.storage_error(loc, "read", exc) from exc
    path = loc.join(loc.path, tag)
    if not tag or "/" in tag or tag in (".", "..") or not loc.store.isdir(path):
        raise CheckpointNotFoundError(
            f"{loc.url!r} has a DeepSpeed 'latest' file naming tag {tag!r}, but no folder {tag!r} beside it: the"
            " save did not finish or was moved. Pass the tag folder of a complete save."
        )
    return loc.at(path, loc.join(loc.url, tag))


def open_folder(loc: Location) -> DeepSpeedFolder:
    """The DeepSpeed ZeRO-1/2 checkpoint at ``loc``; raises for a layout this package cannot carry over exactly."""
    tag = tag_folder(loc)
    if tag is None:
        raise CheckpointNotFoundError(
            f"{loc.url!r} is not a DeepSpeed checkpoint folder: it holds neither {MODEL_STATES} and"
            " zero_pp_rank_*_optim_states.pt files nor a 'latest' file naming such a folder."
        )
    names = _names(tag)
    for name in names:
        if _ZERO3_MODEL_FILE.match(name):
            raise ValueError(
                f"{tag.url!r} is a DeepSpeed ZeRO stage 3 checkpoint ({name}): its parameters themselves are"
                " partitioned in a layout of their own, which lightning_zero (ZeRO-1/2) does not read. Convert it"
                " to weights with DeepSpeed's zero_to_fp32.py, or resume it under DeepSpeed."
            )
        if _PIPELINE_FILE.match(name) or (_MODEL_FILE.match(name) and name != MODEL_STATES):
            raise ValueError(
                f"{tag.url!r} was saved with pipeline or tensor (model) parallelism ({name}): each model-parallel"
                " rank holds other slices of the weights, which lightning_zero (data parallel only) cannot"
                " reassemble. Only checkpoints of a pure data-parallel ZeRO-1/2 run (mp_rank_00 files) are read."
            )
        if _EXPERT_FILE.match(name):
            raise ValueError(
                f"{tag.url!r} holds mixture-of-experts state ({name}), partitioned over expert-parallel ranks;"
                " lightning_zero does not read it."
            )
    rank_files: dict[int, str] = {}
    prefixes = set()
    for name in names:
        found = _RANK_FILE.match(name)
        if found is None:
            continue
        if found.group(3) != "00":
            raise ValueError(
                f"{tag.url!r} was saved with tensor (model) parallelism ({name}): lightning_zero reads only"
                " data-parallel ZeRO-1/2 checkpoints (mp_rank_00 files)."
            )
        prefixes.add(found.group(1) or "")
        rank_files[int(found.group(2))] = tag.join(tag.path, name)
    if MODEL_STATES not in names:
        raise CheckpointCorruptError(
            f"DeepSpeed checkpoint {tag.url!r} has no {MODEL_STATES}: the save did not finish or the file was"
            " removed. Resume from another checkpoint."
        )
    if len(prefixes) > 1:
        raise CheckpointCorruptError(
            f"DeepSpeed checkpoint {tag.url!r} mixes bf16_ and plain optimizer-state files: files of two saves"
            " were put into one folder."
        )
    return DeepSpeedFolder(loc.url, tag, rank_files)


def check_rank_files(folder: DeepSpeedFolder, world_size: int) -> None:
    """Every data-parallel rank's optimizer-state file is there, and no other."""
    missing = [r for r in range(world_size) if r not in folder.rank_files]
    if missing:
        names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in missing]
        raise CheckpointCorruptError(
            f"DeepSpeed checkpoint {folder.tag.url!r} was saved by {world_size} data-parallel ranks but lacks the"
            f" optimizer-state file of rank(s) {missing} ({', '.join(names)}, with a bf16_ prefix under bf16): each"
            " rank's file holds its own slice of the masters and moments. Copy the whole folder, or resume from"
            " another checkpoint."
        )
    extra = sorted(set(folder.rank_files) - set(range(world_size)))
    if extra:
        raise CheckpointCorruptError(
            f"DeepSpeed checkpoint {folder.tag.url!r} was saved by {world_size} data-parallel ranks but holds"
            f" optimizer-state files of ranks {extra} too: files of another save were put into this folder."
        )


def load_file(folder: DeepSpeedFolder, path: str) -> Any:
    """One of the checkpoint's files, unpickled with only :data:`STAND_INS` admitted ([Note: reading
    DeepSpeed's pickles]); tensors on CPU, a local file memory-mapped (its pages are read as they are copied)."""
    tag = folder.tag
    name = path.rsplit("/", 1)[-1]
    mapped: str | None = None
    try:
        with torch.serialization.safe_globals(STAND_INS):
            mapped = tag.store.mappable(path)
            if mapped is not None:
                return torch.load(mapped, map_location="cpu", weights_only=True, mmap=True)
            with tag.store.open_read(path) as f:
                return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{name} of DeepSpeed checkpoint {tag.url!r} is missing.") from exc
    except pickle.UnpicklingError as exc:
        raise CheckpointCorruptError(
            f"{name} of DeepSpeed checkpoint {tag.url!r} was not unpickled: {_refusal(exc)}. A ZeRO-1/2 checkpoint"
            f" holds tensors, plain values and {', '.join(n for _, n in STAND_INS)} only; a crafted file could run"
            " code through any other global, so lightning_zero reads none of this file."
        ) from None
    except MemoryError:
        raise
    except Exception as exc:
        if isinstance(exc, OSError) and mapped is None:  # a stream: the store, not the file, failed mid-read
            raise storage.storage_error(tag, "read", exc) from exc
        raise CheckpointCorruptError(
            f"Could not read {name} of DeepSpeed checkpoint {tag.url!r} ({type(exc).__name__}: {exc}): the file is"
            " truncated or damaged. Resume from another checkpoint."
        ) from exc


def _refusal(exc: BaseException) -> str:
    """What torch's restricted unpickler refused, without its advice to allow it."""
    text = str(exc)
    if re.search(r"GLOBAL ([\w.]+)", text):
        return f"it names the global {storage.refused_global(exc)}"
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    return f"its content is not what DeepSpeed writes ({(found.group(1) if found else text).strip()})"


class _DeepSpeedPickler(pickle._Pickler):
    """A pickler that names each stand-in by the DeepSpeed global it stands for ([Note: writing DeepSpeed's
    pickles]); every other object pickles as ``pickle`` pickles it."""

    _names = {cls: name.rsplit(".", 1) for cls, name in STAND_INS}

    def save_global(self, obj: Any, name: str | None = None) -> None:
        found = self._names.get(obj)
        if found is None:
            super().save_global(obj, name)
            return
        module, qualname = found
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


_PICKLE_MODULE = types.ModuleType("lightning_zero_deepspeed_pickle")
_PICKLE_MODULE.Pickler = _DeepSpeedPickler  # type: ignore[attr-defined]


def save_file(content: Any, path: str) -> None:
    """``torch.save`` of ``content`` as DeepSpeed writes its files: the stand-ins of :data:`STAND_INS` pickled
    under DeepSpeed's names, so DeepSpeed's own ``torch.load`` builds its classes and :func:`load_file` its
    stand-ins.

    [Note: writing DeepSpeed's pickles] DeepSpeed's loaders unpickle its classes (``fragment_address``,
    ``ZeroStageEnum``) by name. Writing those names without importing DeepSpeed takes a pickler whose
    ``save_global`` emits the name for the stand-in class; ``pickle``'s own would look the name up, find no
    DeepSpeed module, and refuse. The Python pickler is slower than the C one only for the pickled structure:
    the tensors' bytes are written by ``torch.save`` beside the pickle, not through it."""
    torch.save(content, path, pickle_module=_PICKLE_MODULE)
