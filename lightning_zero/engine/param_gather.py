"""The parameter all-gathers after a step: :class:`ParamGatherer`, in forward order, overlapped with
the next forward.

[Note: gather overlap] After the step, :class:`ParamGatherer` gathers the buckets in *forward*
order (the reverse of the reduction order: the first layers' parameters come first), at most
``MAX_IN_FLIGHT`` at a time: bucket ``i + MAX_IN_FLIGHT`` is launched once bucket ``i`` is copied
into the parameters and its slot is free. That program runs by itself, never waiting for the
training thread: on CUDA it is all enqueued at the step on a side stream (slot reuse is ordered on
the device, each bucket records an event); on CPU a thread of the gatherer runs it (gloo's wait
blocks the caller). Reading a parameter through its module waits only for that parameter's bucket
([Note: guarded parameter reads] in zero_engine.py): Megatron's ``overlap_param_gather``, where a forward
pre-hook waits for a module's buckets. Iterating parameters (``state_dict``, ``parameters()``),
the first gradient hook of the next backward (the reductions reuse the slots), the next step,
clipping, :meth:`ZeroEngine.finish_param_gather` and ``close`` wait for all of them.

Why not launch the next gather from the read that waits, as Megatron's pre-hook does: the gathers
a rank has launched would then depend on how far its forward got. A rank that skips the last layers
(layer drop) would stop launching, and if it then enters another collective (a ``sync_dist`` log
between forward and backward) while a rank with the full forward waits for a gather the first one
never launched, both hang (``test_param_gather`` has this case). Launching independently of the
forward, in the same order on every rank, on a process group of the gathers' own
(:func:`lightning_zero.engine.zero_engine._gather_group`), makes the gathers complete whatever else the ranks do.

[Note: compiled reads] A ``torch.compile``d forward reads the parameters as graph inputs, fetched at
each call straight from the module's dicts: the guarded read (zero_engine.py) runs only while dynamo traces,
never when the graph runs, so a read cannot wait for its bucket there. Tracing the wait instead would
guard the graph on the gatherer's progress, which differs at every step: a recompilation per step
until torch's ``recompile_limit``, then an eager forward. So while dynamo traces a guarded read, the
read touches no gatherer state (nothing to guard on) and :func:`compiled_read_traced` runs once, at
trace time (``_compat.run_at_trace_time``): it finishes what is pending (the graph about to run reads
the parameters) and from then on every gatherer of the process ends its round inside ``start``, that
is in the optimizer step, as with ``overlap_param_gather=False``; also the gatherers built later,
since an engine built again on the same module (the next ``fit``) runs the cached graph without a new
trace. On CUDA that end is the current stream waiting on the gather stream's events, no host sync.
The gathers then overlap nothing of the forward (bench/compile_gather.py measures the cost); a rank's
gathers and their order stay those of the eager program. Not done here: a wait inside the graph per
bucket, which needs an operator the compiler keeps before each parameter's first use; one without a
data dependency on the parameter is not ordered by that, and one that declares it mutates the
parameter is functionalized by AOTAutograd, which may run it on a copy.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_zero.engine import collectives as comm
from lightning_zero.engine.comm_pool import BufferPool
from lightning_zero.engine.grad_bucket import GradBucket, PendingGather


class ParamGatherer:
    """The all-gathers after the step, in forward order, at most ``MAX_IN_FLIGHT`` at a time.

    See [Note: gather overlap]. ``start`` queues the buckets and starts the gather program;
    ``wait_for(position)`` returns once every queued bucket up to that forward position is in the
    parameters (a parameter read); ``finish`` waits for all. All are no-ops when nothing is
    queued, so callers can call them freely. Call order, on the training thread only:
    ``start`` (the step) -> ``wait_for``* (reads) -> ``finish`` (backward, step, close).
    """

    compiled_reads_traced: ClassVar[bool] = False
    """A compiled graph in this process reads guarded parameters: every round ends in ``start``
    ([Note: compiled reads]). Set once, never cleared."""

    def __init__(self, buckets: Sequence[GradBucket], group: dist.ProcessGroup | None,
                 pool: BufferPool, async_op: bool, background: bool) -> None:
        # Forward order: buckets were built in backward (reverse registration) order.
        self.order = list(reversed(buckets))
        self.positions = {bucket: position for position, bucket in enumerate(self.order)}
        """Each bucket's place in the forward-order queue (what a parameter read waits up to)."""
        self.group = group
        self.pool = pool
        self.async_op = async_op
        self.background = background  # False: the program runs to its end inside ``start``
        # Fixed here, not read at each launch: every rank must gather every bucket the same way.
        self.broadcast_sources = comm.broadcast_sources(group)  # [Note: gloo all-gather] in collectives.py
        self._queue: list[GradBucket] = []
        self._consumed = 0  # queue entries the training thread has waited for
        self._done: list[threading.Event] = []  # CPU: set by the gather thread per entry
        self._cuda_done: list[Any] = []  # CUDA: an event on the gather stream per entry
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._side_stream: Any = None
        self.in_flight = 0
        """Gathers launched and not yet copied into the parameters (bounded by the pool's slots)."""
        self.launch_hook: Callable[[ParamGatherer], None] | None = None
        """Called after every launch (tests and benchmarks watch the in-flight bound with it)."""
        _LIVE_GATHERERS.add(self)
        _guard_group_teardown()

    @property
    def pending(self) -> bool:
        return self._consumed < len(self._queue)

    def start(self, buckets: Iterable[GradBucket]) -> None:
        """Queue ``buckets`` (in forward order, the same on every rank) and start gathering them."""
        self.finish()  # an older round first: its buffers and its order come before ours
        wanted = set(buckets)
        queue = [b for b in self.order if b in wanted]
        if not queue:
            return
        self._queue, self._consumed, self._error = queue, 0, None
        device = queue[0].device
        if not self.background:
            self._run(queue, lambda _: None)
            self._queue = []
            self.pool.release()
        elif device.type == "cuda":
            # Everything is enqueued now, on a side stream ordered after the step; nothing here
            # blocks the host, and a read waits on the device for its bucket's event only.
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device)
            side = self._side_stream
            side.wait_stream(torch.cuda.current_stream(device))
            self._cuda_done = [torch.cuda.Event() for _ in queue]
            with torch.cuda.stream(side):
                self._run(queue, lambda i: self._cuda_done[i].record(side))
        else:
            # gloo's wait blocks the calling thread: a thread of our own runs the program, so the
            # gathers proceed whatever the training thread does ([Note: gather overlap]).
            self._done = [threading.Event() for _ in queue]
            self._thread = threading.Thread(target=self._run_in_thread, args=(queue,), daemon=True,
                                            name="lightning_zero-param-gather")
            self._thread.start()
        if ParamGatherer.compiled_reads_traced:
            self.finish()  # [Note: compiled reads]

    def _run(self, queue: Sequence[GradBucket], done: Callable[[int], None]) -> None:
        """Launch in order, keeping at most the pool's slots in flight; ``done(i)`` per copy-out."""
        in_flight: deque[tuple[int, PendingGather]] = deque()
        for index, bucket in enumerate(queue):
            if len(in_flight) == self.pool.slots:
                finished, gather = in_flight.popleft()
                gather.finish(self.pool)
                done(finished)
            in_flight.append((index, bucket.launch_all_gather(self.pool, index, self.group, self.async_op,
                                                              self.broadcast_sources)))
            self.in_flight = len(in_flight)
            if self.launch_hook is not None:
                self.launch_hook(self)
        while in_flight:
            finished, gather = in_flight.popleft()
            gather.finish(self.pool)
            self.in_flight = len(in_flight)
            done(finished)

    def _run_in_thread(self, queue: Sequence[GradBucket]) -> None:
        try:
            with torch.no_grad():
                self._run(queue, lambda i: self._done[i].set())
        except BaseException as exc:  # raised on the training thread at its next wait
            self._error = exc
            for event in self._done:
                event.set()

    def wait_for(self, position: int) -> None:
        """Return once every queued bucket at forward ``position`` or before is in the parameters."""
        while self._consumed < len(self._queue) and self.positions[self._queue[self._consumed]] <= position:
            if self._cuda_done:
                torch.cuda.current_stream(self._queue[0].device).wait_event(self._cuda_done[self._consumed])
            else:
                self._done[self._consumed].wait()
                if self._error is not None:
                    error, self._error = self._error, None
                    self._end_round()
                    # The cause's own words first: a lost or frozen peer is named there.
                    raise RuntimeError(f"The parameter all-gather failed in its thread: {error}") from error
            self._consumed += 1
        if self._queue and self._consumed == len(self._queue):
            self._end_round()

    def _end_round(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._queue, self._consumed, self._done, self._cuda_done = [], 0, [], []
        self.pool.release()  # every gather is waited for: [Note: pool between steps] in comm_pool.py

    def finish(self) -> None:
        if self.pending:
            self.wait_for(len(self.order))

    def drain(self) -> None:
        """:meth:`finish`, then on CUDA wait on the host until the gathers have run on the device: the
        process group may be destroyed next ([Note: gathers outlive no group])."""
        events = list(self._cuda_done)
        self.finish()
        for event in events:
            event.synchronize()


_LIVE_GATHERERS: weakref.WeakSet[ParamGatherer] = weakref.WeakSet()

log = logging.getLogger(__name__)

_GUARDED = False  # destroy_process_group wrapped and the exit drain registered ([Note: gathers outlive no group])


def drain_all_gathers() -> None:
    """(this rank) Every gather this process launched has completed when this returns; a failed one is
    logged, not raised: this runs where a program ends ([Note: gathers outlive no group])."""
    for gatherer in list(_LIVE_GATHERERS):
        try:
            gatherer.drain()
        except Exception as exc:
            log.warning("The parameter all-gathers still in flight at the end failed: %s", exc)


def _guard_group_teardown() -> None:
    """[Note: gathers outlive no group] After ``opt.step()`` the parameter gathers run on by themselves
    ([Note: gather overlap]), and every rank's gathers need every other rank's to complete. A DDP program
    ends with ``dist.destroy_process_group()`` (or just exits) right after its last step, without
    ``engine.close()``: a rank whose gathers are still in flight would then take the group away from
    its peers, which fail at their next parameter read ("Connection closed by peer"), and an interpreter
    exiting with our gather thread inside gloo aborts ("terminate called without an active exception").
    So while gatherers live, ``torch.distributed.destroy_process_group`` first drains this rank's gathers
    (they complete once every rank has launched them, which every rank did in its step: no training-thread
    action of a peer is needed), and so does an ``atexit`` handler, which Python runs before it stops
    daemon threads. Nothing changes on the hot path: the overlap with the next forward stays whole, and a
    program that calls ``engine.close()`` finds nothing to drain. Installed once per process; a function
    imported by name before the first engine (``from torch.distributed import destroy_process_group``)
    is the original: the ``atexit`` drain still covers the exit."""
    global _GUARDED
    if _GUARDED:
        return
    _GUARDED = True
    original = dist.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        drain_all_gathers()
        original(group)

    destroy_process_group.__doc__ = original.__doc__
    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    atexit.register(drain_all_gathers)


def compiled_read_traced(_ctx: Any = None) -> None:
    """(trace time) Dynamo traced a guarded parameter read: every gatherer of the process finishes what
    is pending and ends its later rounds in the step, and so do those built later ([Note: compiled
    reads]). Module-level and without free variables, as ``torch._dynamo.comptime`` needs; which
    engine's module is traced is not known here, so all of them switch (a process rarely holds more
    than one)."""
    ParamGatherer.compiled_reads_traced = True
    for gatherer in list(_LIVE_GATHERERS):
        gatherer.finish()
