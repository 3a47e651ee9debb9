"""What one checkpoint save cost, as the rank that made it saw it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

METRIC_PREFIX = "checkpoint/"
"""Where :meth:`SaveStats.as_metrics` puts its figures among a logger's metrics."""


@dataclass
class SaveStats:
    """One save as this rank saw it. Times in seconds, measured with ``time.perf_counter``.

    ``blocked_s`` and ``staging_wait_s`` are what the training thread paid; the other times run on
    the background thread while training goes on."""

    url: str
    mode: str
    step: int | None = None
    """``global_step`` of the Lightning checkpoint (None for the functional API)."""
    blocked_s: float = 0.0
    """The training thread inside the save call (``ZeroLowLevelStrategy.save_checkpoint`` when it made the
    call: building the tree included, and waiting for the previous save to finalize when it had not)."""
    staging_wait_s: float = 0.0
    """How long the next optimizer update waited for this save's tensors to be copied."""
    staging_s: float = 0.0
    """Copying the tensors off the live state (background)."""
    write_s: float = 0.0
    """Serializing and writing this rank's files (background)."""
    commit_s: float = 0.0
    """From the end of this rank's writes until the commit marker is written and every rank knows it."""
    committed_after_s: float = 0.0
    """From the save call until committed."""
    bytes_written: int = 0
    """Tensor bytes this rank wrote, file overhead excluded (``local``: every tensor of its file;
    ``sharded``: its shards, and on rank 0 the replicated tensors, which DCP writes once; ``full``: rank 0
    the whole state, the others 0)."""

    tier: str | None = None
    """With a local tier: the furthest tier this save reached (``"local"``: committed and replicated on
    node-local storage; ``"durable"``: also on the checkpoint path). None without a local tier."""
    local_committed_after_s: float | None = None
    """With a local tier: from the save call until every node's own files were committed locally."""
    replicated_after_s: float | None = None
    """With a local tier: from the save call until the replicas on other nodes were committed (recoverable
    after losing any one node's storage)."""
    durable_after_s: float | None = None
    """With a local tier: from the save call until committed on the durable path (None: not persisted)."""
    durable_error: str | None = None
    """With a local tier: why persisting this save failed (None: it did not fail, or was not persisted)."""

    @property
    def blocked_total_s(self) -> float:
        """Everything the training loop waited for this save."""
        return self.blocked_s + self.staging_wait_s

    @property
    def throughput_mb_s(self) -> float:
        """This rank's write rate, MB (10^6 bytes) per second of ``write_s``."""
        return self.bytes_written / self.write_s / 1e6 if self.write_s > 0 else 0.0

    def as_metrics(self, prefix: str = METRIC_PREFIX) -> dict[str, float]:
        """The figures as logger metrics (milliseconds for times)."""
        metrics = {
            "blocked_ms": self.blocked_s * 1e3,
            "staging_wait_ms": self.staging_wait_s * 1e3,
            "staging_ms": self.staging_s * 1e3,
            "write_ms": self.write_s * 1e3,
            "commit_ms": self.commit_s * 1e3,
            "committed_after_ms": self.committed_after_s * 1e3,
            "bytes": float(self.bytes_written),
            "throughput_mb_s": self.throughput_mb_s,
        }
        if self.step is not None:
            metrics["step"] = float(self.step)
        for name in ("local_committed_after_s", "replicated_after_s", "durable_after_s"):
            value = getattr(self, name)
            if value is not None:
                metrics[name.replace("_after_s", "_after_ms")] = value * 1e3
        return {f"{prefix}{name}": value for name, value in metrics.items()}


def process_started_at() -> float | None:
    """Wall-clock time (``time.time()``) this process started, from Linux's ``/proc`` (None elsewhere)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        # starttime counts from the host's boot, as CLOCK_BOOTTIME does (a container's /proc/uptime may not).
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


# [Note: a recovery's timeline]
# A resume with a local tier is timed from the failure to the first completed step after it, in parts:
#   restart   the newest local-tier save (the last moment the previous run is known to have been training,
#             the coordinator's wall clock in its marker) -> this worker process's start: detecting the
#             failure, torch elastic's re-rendezvous (or the scheduler's requeue) and the spawn. It includes
#             the training done after that save started and lost, about one save interval; 0 when this process was
#             already running at that save (a resume in the same process).
#   startup   process start -> the resume begins: imports, the process group, the model's setup.
#   choose, reshard, load   as measured by the resume itself (monotonic clock).
#   first step   the resume's end -> the first optimizer step completed after it (logged then).
# Wall-clock differences between machines assume synchronised clocks (NTP); on one machine they are exact
# to the clock's resolution. ``process_started_at`` has a resolution of one clock tick (10 ms).


@dataclass(frozen=True)
class TierLoad:
    """One resume with a local tier: the tier it read (``"local"`` or ``"durable"``), the path (this
    rank's), how long choosing and loading took, and why that tier; its timeline ([Note: a recovery's
    timeline]) once the first step after it has completed."""

    tier: str
    path: str
    seconds: float
    reason: str
    step: int | None = None
    """The global step resumed."""
    choose_s: float = 0.0
    """Listing every node's checkpoints and choosing (one exchange over the coordination group)."""
    reshard_s: float = 0.0
    """Making the local-tier checkpoint readable here: a lost rank's file fetched, or the reshard to this
    world size (pieces read, received, the new files written)."""
    load_s: float = 0.0
    """The load itself, into the engine (and, after a failed local load, the durable one)."""
    steps_lost: int = 0
    """Checkpointed steps not recovered: the newest step any tier holds (complete or not) minus ``step``."""
    resharded_from: int | None = None
    """The world size the local-tier checkpoint was saved at, when it was resharded to this one."""
    moved: dict[str, int] = field(default_factory=dict)
    """A reshard's bytes on this rank: ``read_bytes`` (its node's copies), ``received_bytes``, ``sent_bytes``."""
    restart_s: float | None = None
    """The newest local-tier save -> this process's start (failure detection, rendezvous, spawn)."""
    startup_s: float | None = None
    """This process's start -> the resume's start (imports, process group, setup)."""
    first_step_s: float | None = None
    """The resume's end -> the first optimizer step completed after it (None until then)."""
    restarts: int | None = None
    """torch elastic's restart count of this worker group (``TORCHELASTIC_RESTART_COUNT``), when under it."""
    ended_at: float = field(default_factory=time.time)
    """Wall-clock time the resume ended (the first step is timed from it)."""

    @property
    def failure_to_step_s(self) -> float | None:
        """From the failure (the newest local-tier save) to the first step after the resume, when known."""
        if self.restart_s is None or self.startup_s is None or self.first_step_s is None:
            return None
        return self.restart_s + self.startup_s + self.seconds + self.first_step_s

    def as_metrics(self, prefix: str = METRIC_PREFIX) -> dict[str, float]:
        """The figures as logger metrics (milliseconds for times; ``recovery/tier`` 0 local, 1 durable;
        ``recovery/total_ms`` the resume itself, ``recovery/failure_to_step_ms`` the whole timeline)."""
        metrics = {"tier": 0.0 if self.tier == "local" else 1.0, "total_ms": self.seconds * 1e3,
                   "choose_ms": self.choose_s * 1e3, "reshard_ms": self.reshard_s * 1e3, "load_ms": self.load_s * 1e3,
                   "steps_lost": float(self.steps_lost)}
        if self.step is not None:
            metrics["step"] = float(self.step)
        if self.resharded_from is not None:
            metrics["resharded_from"] = float(self.resharded_from)
        for name in ("restart_s", "startup_s", "first_step_s", "failure_to_step_s"):
            value = getattr(self, name)
            if value is not None:
                metrics[name.removesuffix("_s") + "_ms"] = value * 1e3
        if self.restarts is not None:
            metrics["restarts"] = float(self.restarts)
        return {f"{prefix}recovery/{name}": value for name, value in metrics.items()}
