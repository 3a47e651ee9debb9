"""A training job that is SIGKILLed, all of its processes at once, in the middle of a save.

``python killed_job.py MODE DIRPATH``: 2 CPU ranks fit the Lightning cases' module through
``checkpoint_cases.make_trainer`` (a checkpoint every epoch and ``last.ckpt``). The writer of the
first ``last.ckpt`` is slowed the way a busy disk is: it writes half of the first data file of that
save, then the whole process group (the launcher and both ranks) gets SIGKILL, which is what a
scheduler's hard kill or a lost node does. The test then looks at what is left on disk.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from typing import Any


def main(mode: str, dirpath: str) -> None:
    import torch
    from checkpoint_cases import fit, make_trainer

    from lightning_zero import _compat

    target = "/last.ckpt"
    if mode == "weights":
        # ``python killed_job.py weights DIRPATH``: a weights-only ModelCheckpoint writing one name
        # (weights.ckpt) every epoch through a `sharded` plugin; the second write of it is the one killed.
        from lightning.pytorch.callbacks import ModelCheckpoint

        target = "/weights.ckpt"
        trainer = make_trainer("sharded", dirpath, 2, start_method="fork", callbacks=[
            ModelCheckpoint(dirpath=dirpath, filename="weights", save_weights_only=True)])
    else:
        trainer = make_trainer(mode, dirpath, 2, start_method="fork")
    seen: list[str] = []

    def saving(frame: Any) -> str:
        """The checkpoint the background save job calling us writes ("" outside one)."""
        while frame is not None:
            job = frame.f_locals.get("self")
            if type(job).__name__ == "_SaveJob":
                return job.loc.url
            frame = frame.f_back
        return ""

    def half_then_kill(real_save: Any) -> Any:
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            url = "" if isinstance(f, io.BytesIO) else saving(sys._getframe(1))
            if url.endswith(target) and mode == "weights" and url not in seen:
                seen.append(url)  # the first write of the name commits
            elif url.endswith(target):
                buffer = io.BytesIO()
                real_save(obj, buffer, *args, **kwargs)
                data = buffer.getvalue()
                f.write(data[: len(data) // 2])
                f.flush()
                os.killpg(os.getpgrp(), signal.SIGKILL)
            real_save(obj, f, *args, **kwargs)

        return save

    # The sharded objects file and the full file are torch.save streams, and DCP's data files of sharded mode
    # too, through DCP's writer; the local rank files are written without record CRCs ([Note: one checksum pass]).
    torch.save = half_then_kill(torch.save)  # type: ignore[assignment]
    _compat.torch_save_without_record_crcs = half_then_kill(_compat.torch_save_without_record_crcs)
    fit(trainer)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
