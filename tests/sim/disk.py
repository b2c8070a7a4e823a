"""Full disks under the simulator's faults (``rlog.disk``, issue 24).

Theory of operation
-------------------
``DiskFullSimulation`` is the core simulation (``cluster.py``) where, now and then, a core's disk
fills for a while (sometimes every core's at once: cores hold the same data, so their disks fill
together). It models what production's driver does (``rlog.server.NodeServer.turn`` and
``core.node.CoreNode.disk_filled``):

* The first step of a full core whose effects would write (``PersistEntries``, ``PersistState``,
  ``TruncateLog``, ``Commit``) fails as the driver's commit does: none of its effects is executed
  except the appends a sequencer sends before its own commit (``Send.before_persisted``, already
  out in production), and whatever the driver's open transaction held is lost (as in a crash).
* Then the old machine steps ``DiskFull`` (a sequencer steps down, its proposals fail, their clients
  hear "outcome unknown"), the remaining waiters are told "outcome unknown", and the machine is
  rebuilt from what is persisted and told ``DiskFull`` too: it takes no part until ``DiskFreed``,
  stepped when the disk's episode ends (production: a probe that writes).

The production rules under test are ``ShardConsensus``'s (no vote, no campaign, no acknowledgement,
a sequencer steps down); the checkers are the base simulation's (one sequencer per generation,
committed prefixes agree, every acknowledged write is in the final history).

Its random draws come after the base simulation's in every step, from the same seeded generator,
so a seed replays exactly; the base simulation's seeds are not disturbed (it is another class).
"""

from __future__ import annotations

from typing import Any

from mnesite.core.consensus import (
    Commit,
    ConsensusInvariantError,
    Effect,
    PersistEntries,
    PersistState,
    Send,
    TruncateLog,
)
from mnesite.rlog.config import Limits
from mnesite.rlog.disk import DiskFreed, DiskFull

from tests.sim.cluster import SimNode, Simulation, SimulationResult, replay_command

WRITING_EFFECTS = (PersistEntries, PersistState, TruncateLog, Commit)


class DiskFullSimulation(Simulation):
    def __init__(
        self,
        seed: int,
        core_count: int,
        faulty_ms: int = 3000,
        fill_probability: float = 0.01,
        all_fill_probability: float = 0.002,
    ) -> None:
        super().__init__(seed, core_count, faulty_ms)
        self.fill_probability = fill_probability
        self.all_fill_probability = all_fill_probability
        # core -> when its disk has room again (absent: it has room)
        self.full_until_ms: dict[str, int] = {}
        self.fills = 0  # episodes begun
        self.failed_steps = 0  # steps whose writes met a full disk
        self.result: SimulationResult | None = None

    def _replay_command(self) -> str:
        return replay_command(self.seed, "tests/test_disk_simulation.py")

    def fill(self, name: str, duration_ms: int) -> None:
        """``name``'s disk is full for ``duration_ms`` (its next writing step fails)."""
        self.full_until_ms[name] = self.now_ms + duration_ms
        self.fills += 1
        self.trace.append((self.now_ms, name, "disk full until", self.full_until_ms[name]))

    def _inject_faults(self) -> None:
        super()._inject_faults()
        if self.rng.random() < self.all_fill_probability:
            for name in self.nodes:
                self.fill(name, self.rng.randint(50, 600))
        elif self.rng.random() < self.fill_probability:
            self.fill(self.rng.choice(list(self.nodes)), self.rng.randint(50, 900))

    def _restart_due(self) -> None:
        super()._restart_due()
        for name, until_ms in list(self.full_until_ms.items()):
            if until_ms > self.now_ms:
                continue
            del self.full_until_ms[name]
            node = self.nodes[name]
            if node.machine is not None and node.machine.disk_full:
                self.trace.append((self.now_ms, name, "disk freed"))
                self._step(node, DiskFreed())

    def _heal(self) -> None:
        super()._heal()
        for name in self.full_until_ms:
            self.full_until_ms[name] = self.now_ms  # freed at the next _restart_due

    def _step(self, node: SimNode, event: Any) -> list[Effect]:
        if node.machine is not None and not self._propose_held_first(node, event):
            return []  # it crashed in that step
        machine = node.machine
        if machine is None or node.name not in self.full_until_ms or node.crash_in_next_step:
            return super()._step(node, event)
        try:
            effects = machine.step(event, self.now_ms)
        except ConsensusInvariantError as error:
            raise self.fail(f"{node.name} raised ConsensusInvariantError: {error}") from error
        if not any(isinstance(effect, WRITING_EFFECTS) for effect in effects):
            for effect in effects:
                self._execute(node, effect)
            self._check_node(node)
            return effects
        # The driver's commit fails for want of space: only what production sent before it is out.
        self.failed_steps += 1
        sent = [effect for effect in effects if isinstance(effect, Send) and effect.before_persisted]
        for effect in sent:
            self._execute(node, effect)
        self._disk_filled(node)
        return sent

    def _disk_filled(self, node: SimNode) -> None:
        """Production's ``CoreNode.disk_filled``: the old machine steps DiskFull, then a new one is built."""
        old = node.machine
        if old is None:
            return
        self.trace.append((self.now_ms, node.name, "a write found the disk full", old.role.value))
        node.apply.take()  # production: the commits gathered are forgotten, as a restart forgets them
        for effect in old.step(DiskFull("simulated"), self.now_ms):
            if isinstance(effect, WRITING_EFFECTS):
                raise self.fail(f"{node.name} wrote {effect} after DiskFull")
            self._execute(node, effect)
        self._lose_undurable(node)
        for client, outcome in node.waiters.abandoned("disk_full"):
            self._tell(node, outcome, client)
        node.tail.abandoned()  # production tells these failed guards to retry (nothing to check here)
        self._start(node)
        assert node.machine is not None
        for effect in node.machine.step(DiskFull("simulated"), self.now_ms):
            self._execute(node, effect)
        self._check_node(node)


def run_disk_seed(seed: int, core_count: int | None = None, faulty_ms: int = 3000) -> DiskFullSimulation:
    """Run one seed with full disks; 3 cores for even seeds and 5 for odd ones unless given."""
    if core_count is None:
        core_count = 3 if seed % 2 == 0 else 5
    simulation = DiskFullSimulation(seed, core_count, faulty_ms)
    simulation.result = simulation.run()
    return simulation


class GatheringDiskFullSimulation(DiskFullSimulation):
    """Full disks with followers gathering commits (``core.rules.FollowerApply`` at production's delay):
    what a full core gathered is forgotten with its turn, as production's ``disk_filled`` forgets it."""

    follower_apply_delay_ms = Limits().follower_apply_delay_ms_max
