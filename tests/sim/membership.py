"""Membership changes under the simulator's faults (``core.membership``, issue 14).

Theory of operation
-------------------
``MembershipSimulation`` is the core simulation (``cluster.py``: drops, duplicates, delays,
partitions, crashes mid-step, pauses, trimming and snapshot installs) with spare cores that start
outside the membership, and an operator who, now and then, asks the node it believes is the
sequencer to add a spare (it catches up as a learner first) or remove a member (possibly the
sequencer itself). The changes go through the production rule (``ShardConsensus`` and
``core.membership``); their entries are checked like any write (committed prefix agreement, at most
one sequencer per generation, no acknowledged change lost) and the final check covers every member
of the final membership, so a core removed and re-added must have converged.

Its random draws come after the base simulation's in every step, from the same seeded generator, so
a seed replays exactly; the base simulation's seeds are not disturbed (it is another class).
"""

from __future__ import annotations

from mnesite.core.consensus import (
    Effect,
    MembershipChangeRequested,
    PersistedState,
    ProposalCommitted,
    ProposalRejected,
)

from tests.sim.cluster import SimNode, Simulation, SimulationResult

SPARE_CORES = 2
CHANGES_MAX = 40
MEMBERS_MIN = 2  # the operator never removes below this (a single member is legal but dull)


class MembershipSimulation(Simulation):
    def __init__(self, seed: int, core_count: int, faulty_ms: int = 3000, change_probability: float = 0.02) -> None:
        super().__init__(seed, core_count, faulty_ms)
        self.change_probability = change_probability
        self.changes_requested = 0
        self.changes_committed = 0
        self.result: SimulationResult | None = None
        self.changes_refused: dict[str, int] = {}
        seed_members = tuple(self.nodes)
        for index in range(SPARE_CORES):
            name = f"spare{index}"
            # A spare knows the cluster's seed membership (as a new core learns it from its peers).
            node = SimNode(name, PersistedState(0, None, seed_members))
            self.nodes[name] = node
            self._start(node)

    def _replay_command(self) -> str:
        return f"MNESITE_SIM_SEED={self.seed} .venv/bin/pytest tests/test_membership.py -k 'seed_{self.seed}'"

    def _inject_faults(self) -> None:
        super()._inject_faults()
        if self.faults.write_probability > 0 and self.rng.random() < self.change_probability:
            self.request_random_change()

    def request_random_change(self) -> None:
        if self.changes_requested >= CHANGES_MAX:
            return
        target = self.client_belief or self.rng.choice(list(self.nodes))
        node = self.nodes[target]
        if not self._is_up(node) or node.machine is None:
            return
        members = node.machine.members
        outsiders = [name for name in self.nodes if name not in members and name not in self.lost_for_good]
        add = bool(outsiders) and (len(members) <= MEMBERS_MIN or self.rng.random() < 0.5)
        name = self.rng.choice(outsiders) if add else self.rng.choice(members)
        self.change(target, name, add)

    def change(self, target: str, name: str, add: bool) -> None:
        """The operator asks ``target`` to add or remove ``name`` (answered through the effects)."""
        node = self.nodes[target]
        if node.machine is None:
            return
        self.changes_requested += 1
        request_id = f"m{self.changes_requested}"
        self.trace.append((self.now_ms, target, "membership change", "add" if add else "remove", name, request_id))
        self._step(node, MembershipChangeRequested(name, add, f"tcp://127.0.0.1:{9000 + len(name)}", request_id))

    def _execute(self, node: SimNode, effect: Effect) -> None:
        super()._execute(node, effect)
        request_id = getattr(effect, "request_id", None)
        if not isinstance(request_id, str) or not request_id.startswith("m"):
            return
        if isinstance(effect, ProposalCommitted):
            self.changes_committed += 1
            self.trace.append((self.now_ms, node.name, "membership change committed", request_id, effect.tx_key))
        elif isinstance(effect, ProposalRejected):
            self.changes_refused[effect.reason] = self.changes_refused.get(effect.reason, 0) + 1


def run_membership_seed(seed: int, core_count: int = 3, faulty_ms: int = 3000) -> MembershipSimulation:
    """Run one seed with membership changes; returns the finished simulation (its counters)."""
    simulation = MembershipSimulation(seed, core_count, faulty_ms)
    simulation.result = simulation.run()
    return simulation
