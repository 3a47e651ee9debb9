"""ReplicaGroups' commit decisions across groups, over a simulated torchft: a lighthouse that forms each quorum when
every live group has asked for it, heals a group behind the newest step from one at it (the source's registered state
read when the quorum forms, loaded inside the healer's ``should_commit``), and Managers that answer ``should_commit``
for their own group only, as torchft's do. One thread per group (one rank each), so the quorums, the heals and the
decisions interleave as they do between processes. What is checked is the groups' agreement, step after step."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from lightning_zero.engine.fault_tolerance import FaultTolerance, ReplicaGroups

WAIT_S = 5


class Lighthouse:
    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.lock = threading.Lock()
        self.asking: list[SimManager] = []
        self.served: list[tuple[int, int, dict]] = []
        """At each quorum, what each group would serve a heal: (group, the quorum's participants, its state)."""

    def ask(self, manager: SimManager) -> None:
        with self.lock:
            self.asking.append(manager)
            self._form_when_all_asked()

    def leave(self) -> None:
        """A group that ran its steps leaves (the other may still ask for the quorum after its last step)."""
        with self.lock:
            self.groups -= 1
            self._form_when_all_asked()

    def _form_when_all_asked(self) -> None:
        if self.asking and len(self.asking) == self.groups:
            self._form(sorted(self.asking, key=lambda m: m.group))
            self.asking = []

    def _form(self, members: list[SimManager]) -> None:
        """torchft's quorum with asynchronous heals: the groups at the newest step take part, the others heal."""
        newest = max(m.step for m in members)
        current = [m for m in members if m.step == newest]
        for m in members:
            m._participating_replica_rank = current.index(m) if m in current else None
            m._participating_replica_world_size, m.healing = len(current), m not in current
        for m in members:  # as a source's quorum thread reads it, before its training thread goes on
            self.served.append((m.group, len(current), m.fns["replica_groups"][1]()))
        for i, m in enumerate(m for m in members if m.healing):
            source = current[i % len(current)]  # its state as of now, as torchft's quorum thread sends it
            m.pending = {key: save() for key, (_, save) in source.fns.items()}
            m.step = newest
        for m in members:
            m.formed.set()


class SimManager:
    """torchft's Manager as ReplicaGroups calls it, one rank per group; ``fail_at``: manager steps at which this group
    alone sees its cross-group sum fail (a hop that a lost peer broke for one group and not the other)."""

    def __init__(self, lighthouse: Lighthouse, group: int, fail_at: set[int]) -> None:
        self.lighthouse, self.group, self.fail_at = lighthouse, group, fail_at
        self.step, self.healing = 0, False
        self._participating_replica_rank: int | None = None  # torchft's names: a state function reads them
        self._participating_replica_world_size = 0
        self.error: Exception | None = None
        self.fns: dict[str, tuple[Any, Any]] = {}
        self.pending: dict[str, Any] | None = None
        self.formed = threading.Event()

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def start_quorum(self) -> None:
        self.error, self.healing = None, False
        self.formed.clear()
        self.lighthouse.ask(self)

    def wait_quorum(self) -> None:
        assert self.formed.wait(WAIT_S), "no quorum: a group stopped asking"

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        self.wait_quorum()
        return self._participating_replica_world_size

    def participating_rank(self) -> int | None:
        self.wait_quorum()
        return self._participating_replica_rank

    def is_participating(self) -> bool:
        return self._participating_replica_rank is not None and not self.healing

    def errored(self) -> Exception | None:
        return self.error

    def report_error(self, exc: Exception) -> None:
        self.error = self.error or exc

    def should_commit(self) -> bool:
        if self.healing:
            assert self.pending is not None
            for key, (load, _) in self.fns.items():
                load(self.pending[key])
        if self.step in self.fail_at:  # once: the step taken again after it is another step's sum
            self.fail_at.discard(self.step)
            self.report_error(RuntimeError("Connection closed by peer"))
        if self.error is None:
            self.step += 1
        return self.error is None

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]

    def batches_committed(self) -> int:
        return 0


class SimGroups(ReplicaGroups):
    def __init__(self, manager: SimManager) -> None:
        self._sim = manager
        super().__init__(FaultTolerance(manager.group, lighthouse="http://sim", timeout_s=1), 0, 1, torch.device("cpu"))

    def _connect(self, device: torch.device) -> tuple[Any, Any]:
        return _SumOfTwo(), self._sim


class _SumOfTwo:
    def allreduce(self, tensors: list[torch.Tensor], options: object) -> Any:
        tensors[0].mul_(2)
        return _Done()


class _Done:
    def wait(self, timeout: object = None) -> bool:
        return True


def run_steps(groups: ReplicaGroups, steps: int | list[tuple[float, bool]], out: list[tuple[bool, int, int]],
              errors: list[BaseException], leave: bool = True) -> None:
    """The cross-group half of ``steps`` optimizer steps, as the engine calls it: each step's (committed,
    participants, the job's steps after it). ``steps`` as a list: each step's (seconds slept first, backward or not:
    a step with no backward, a ``training_step`` that returned None, goes to the decision without a reduction).
    ``leave``: the group leaves the lighthouse after them."""
    plan = steps if isinstance(steps, list) else [(0.0, True)] * steps
    try:
        for delay, backward in plan:
            time.sleep(delay)
            groups.start_step()
            if backward:
                groups.before_reduction()
                groups.wait_hop(groups.all_reduce(torch.ones(4)).work)
            committed = groups.commit()
            out.append((committed, groups.config.participants, groups.config.steps))
    except BaseException as exc:  # noqa: BLE001  (reported by the test's thread)
        errors.append(exc)
    finally:
        if leave:
            groups.manager.lighthouse.leave()


def decisions(fail_at: dict[int, set[int]], steps: int | list = 16, lighthouse: Lighthouse | None = None,
              start_at: tuple[int, int] = (0, 0)) -> list[list[tuple[bool, int, int]]]:
    """Two groups' (committed, participants, job steps) at each of their ``steps`` (a number, or one per group: a
    number or a plan, as :func:`run_steps` takes), from the job steps ``start_at``."""
    lighthouse = lighthouse or Lighthouse(2)
    managers = [SimManager(lighthouse, g, fail_at.get(g, set())) for g in range(2)]
    for manager, step in zip(managers, start_at):
        manager.step = step
    groups = [SimGroups(manager) for manager in managers]
    out: list[list[tuple[bool, int, int]]] = [[], []]
    errors: list[BaseException] = []
    runs = steps if isinstance(steps, list) else [steps, steps]
    threads = [threading.Thread(target=run_steps, args=(g, n, o, errors)) for g, n, o in zip(groups, runs, out)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 20)
    assert not errors, errors
    return out


def test_with_no_failure_both_groups_commit_every_step_together() -> None:
    a, b = decisions({})
    assert a == b == [(True, 2, step) for step in range(1, 17)]


def test_a_step_one_group_alone_discards_costs_one_more_step_then_both_commit_together() -> None:
    """Group 0's sum fails at step 5 and group 1's does not: group 1 commits it, group 0 is a step behind and heals
    from group 1 in the next quorum, where group 1 alone takes part. Group 1's batches of that step were split for two
    groups, so group 1 discards it, and group 0 with it ([Note: a healer decides as its source]): both are then at the
    same step, and from the next quorum on both commit every step together. Judged by its own split, the healer
    committed the steps its source discarded and the two took turns healing each other, never again committing a step
    together (what a fault-tolerance test once saw for two minutes)."""
    a, b = decisions({0: {4}})
    assert a[:4] == b[:4] == [(True, 2, step) for step in range(1, 5)]
    assert (a[4], b[4]) == ((False, 2, 4), (True, 2, 5))  # the failure: group 1 is one step ahead
    assert a[5] == b[5] == (False, 1, 5)  # group 0 healed to group 1's step, and both discarded the step
    assert a[6:] == b[6:] == [(True, 2, step) for step in range(6, 16)]


def test_after_a_discarded_step_a_source_serves_the_split_of_the_quorum_its_batches_wait_for() -> None:
    """Group 1 leaves after 3 steps: group 0's 4th step, split for two groups, is discarded, and its next batches are
    split by the next quorum, of one group. Asked for inside the decision, that quorum forms before group 0's training
    thread has read it; a heal it serves then must carry that split (a healer counts the samples of the step by it)
    and say that the split holds. Served as ``data_quorum`` said then, it carried the split of two groups, and a group
    healed there moved its data position by half the step's samples: samples seen twice."""
    lighthouse = Lighthouse(2)
    a, b = decisions({}, [6, 3], lighthouse)
    assert b == [(True, 2, step) for step in (1, 2, 3)]
    assert a == [(True, 2, 1), (True, 2, 2), (True, 2, 3), (False, 1, 3), (True, 1, 4), (True, 1, 5)]
    served = [(participants, state["data_quorum"], state["splits"]) for group, participants, state in lighthouse.served
              if group == 0]
    assert served[3:] == [(1, (0, 2), False),  # the 4th step: fetched for two groups, one takes part
                          (1, (0, 1), True),  # asked for by the discarded step: the batches wait for it
                          (1, (0, 1), True)]


def test_a_step_with_no_backward_decides_by_its_own_quorum_not_the_last_one() -> None:
    """Group 0 is behind (relaunched) and heals from group 1 in the first step, which both commit. Group 0's next step
    has no backward, so nothing has waited for that step's quorum when it decides, and group 1 asks for it late. The
    decision waits for it: read from the last quorum, group 0 still looked like a healer, skipped its own split
    check and committed a step, split for one group, that group 1 discarded (split for two)."""
    a, b = decisions({}, [[(0, True), (0, False), (0, True), (0, True)], [(0, True), (0.5, True), (0, True), (0, True)]],
                     start_at=(0, 3))
    assert a[0] == b[0] == (True, 1, 4)  # group 0 healed to group 1's step 3, both committed step 4
    assert a[1] == b[1] == (False, 2, 4)  # both take part now: split for one group, the step is discarded by both
    assert a[2:] == b[2:] == [(True, 2, 5), (True, 2, 6)]


def test_a_group_lost_and_another_joining_in_the_same_quorum() -> None:
    """Three groups; group 2 dies inside its 6th step (after asking for its quorum: the other two see their sums fail
    and discard it) and a new group 3 asks for the next quorum in its place, at step 0. That quorum keeps the two
    survivors' split (group 3 heals, contributing nothing): they commit it, and group 3 with them. In the next, three
    take part: every group's split changes and every group discards; from then on the three commit together."""
    lighthouse = Lighthouse(3)
    managers = [SimManager(lighthouse, g, {5} if g < 2 else set()) for g in range(3)]
    groups = [SimGroups(m) for m in managers]
    out: list[list[tuple[bool, int, int]]] = [[], [], [], []]
    errors: list[BaseException] = []
    threads = [threading.Thread(target=run_steps, args=(groups[g], 12, out[g], errors)) for g in range(2)]

    def dies_and_is_replaced() -> None:
        run_steps(groups[2], 5, out[2], errors, leave=False)
        try:
            groups[2].start_step()
            managers[2].wait_quorum()  # in the 6th step's quorum, then gone; group 3 takes its place (3 groups live)
            newcomer = SimGroups(SimManager(lighthouse, 3, set()))
            joined = threading.Thread(target=run_steps, args=(newcomer, 6, out[3], errors))
            joined.start()
            joined.join(WAIT_S * 20)
        except BaseException as exc:  # noqa: BLE001  (reported by the test's thread)
            errors.append(exc)

    threads.append(threading.Thread(target=dies_and_is_replaced))
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 20)
    assert not errors, errors
    three = [(True, 3, step) for step in range(1, 6)]
    assert out[0] == out[1] and out[2] == three
    assert out[0] == [*three, (False, 3, 5), (True, 2, 6), (False, 3, 6), *[(True, 3, step) for step in range(7, 11)]]
    assert out[3] == out[0][6:]  # healed inside its first step, then as the survivors
