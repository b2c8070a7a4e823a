"""Rolling upgrades under the simulator's faults: the cluster version rule of ``core.versions``.

Theory of operation
-------------------
``VersionsSimulation`` is the core simulation (``cluster.py``: drops, duplicates, delays, partitions,
crashes mid-step, pauses, trimming and snapshot installs) whose cores start on release 0.1.0 and are
restarted, one at a time and in a random order, on this release; now and then one upgraded core is
rolled back to 0.1.0 before the last core is upgraded (the procedure of docs/operations/upgrades.md:
while another core still runs the older release, and the next step only once the probes saw it).

Every ``VERSIONS_PROBE_INTERVAL_MS`` each core of this release hears the announcement of every peer
it can reach (``PeerVersions.heard``; a 0.1.0 peer answers without one); the sequencer asks
``cluster_version_to_propose`` and proposes the ``ClusterVersionOp`` it names, as ``core.node`` does.
The checks: no core of a release that cannot read a cluster version entry ever persists one (it would
have been sent something it cannot read), every member speaks the version when its entry commits,
committed cluster versions never go down, and after the last upgrade the version does move.

``rolled_back_while_down`` is the freshness of announcements (``ANNOUNCEMENT_FRESH_MS``): an upgraded
member rolled back while the last core still runs 0.1.0 stays down while that core is upgraded; the
sequencer heard it announce this release before, and must not count that answer once it is stale
(the checks count a member that is down with the release it comes back on).

``StuckMemberSimulation`` is the other side of that rule: a member rolled back after the probes saw
it, so that the sequencer appends a cluster version it does not speak. It refuses the entry (its own
check) and is stuck there (``ShardConsensus.stuck_reason``) while the others go on; clients keep
reading locally everywhere, and the simulator's lag bound for local reads (``_local_read_lag_ms_max``)
catches a stuck core that answers them. The sequencer trims past it and offers it snapshots at the
cluster version it applied (production's offer): the stuck member refuses them too, and a member that
took one (a copy at a cluster version its release cannot read) fails the run. When a write and the
entry travel in one append (``stuck_member_behind_one_append``), the member takes the write and its
commit, and stops at it. While it is stuck, the sequencer resends it the refused entry at most once a
heartbeat interval, however fast writes come (``stuck_member_under_writes``, ``refused_sent_ms``).
"""

from __future__ import annotations

import dataclasses

from mnesite.core.consensus import AppendRequest, Effect, PeerMessage, PersistEntries, ProtocolViolation, Role
from mnesite.core.versions import (
    ANNOUNCEMENT_FRESH_MS,
    UNSPOKEN_CLUSTER_VERSION,
    VERSIONS_PROBE_INTERVAL_MS,
    ClusterVersionProposals,
    PeerVersions,
    cluster_version_of,
)
from mnesite.rlog.types import ClusterVersionOp, Entry, TxKey
from mnesite.rlog.versions import RELEASE_0_1_0, THIS_RELEASE, Announcement

from tests.sim.cluster import READ_KEYS, SHARD, SimNode, Simulation, SimulationResult

# Steps of the procedure are this far apart: a probe round has seen the previous step.
STEP_GAP_MS = ANNOUNCEMENT_FRESH_MS + VERSIONS_PROBE_INTERVAL_MS
ROLL_BACK_PROBABILITY = 0.5


class VersionsSimulation(Simulation):
    def __init__(self, seed: int, core_count: int = 3) -> None:
        names = [f"core{index}" for index in range(core_count)]
        # Enough time for every step of the procedure, and a roll back, to run under faults.
        super().__init__(seed, core_count, faulty_ms=STEP_GAP_MS * (core_count + 3))
        self.release: dict[str, Announcement] = dict.fromkeys(names, RELEASE_0_1_0)
        self.views: dict[str, PeerVersions] = {}
        # Production's proposal bookkeeping, one per core (in memory: a restart forgets it).
        self.proposals: dict[str, ClusterVersionProposals] = {}
        self.committed_versions: list[tuple[TxKey, int]] = []
        self.moves_committed = 0
        self.restarting: dict[str, Announcement] = {}
        order = list(names)
        self.rng.shuffle(order)
        plan: list[tuple[str, Announcement]] = [(name, THIS_RELEASE) for name in order]
        if self.rng.random() < ROLL_BACK_PROBABILITY:
            # Roll back the first upgraded core while another still runs 0.1.0, then upgrade it again.
            plan[1:1] = [(order[0], RELEASE_0_1_0), (order[0], THIS_RELEASE)]
        self.plan = [(STEP_GAP_MS * (index + 1), name, release) for index, (name, release) in enumerate(plan)]
        self.last_upgrade_ms = self.plan[-1][0]
        self.next_probe_ms = 0

    def _replay_command(self) -> str:
        return f".venv/bin/pytest tests/test_versions.py -k 'simulated and {self.seed}-{self.core_count}]'"

    # -- the procedure ---------------------------------------------------------------------------

    def _inject_faults(self) -> None:
        super()._inject_faults()
        while self.plan and self.plan[0][0] <= self.now_ms:
            _, name, release = self.plan.pop(0)
            node = self.nodes[name]
            if node.machine is not None:
                self._crash(node)
            self.restarting[name] = release
            self.trace.append((self.now_ms, name, "restarting on", release.software))
        self._probe_due()
        self._propose_due()

    def _speaks(self, node: SimNode) -> Announcement:
        # The node's release runs the follower's own check (core.versions.unspoken_cluster_version).
        return self.release[node.name] if hasattr(self, "release") else RELEASE_0_1_0

    def _start(self, node: SimNode) -> None:
        if hasattr(self, "restarting") and node.name in self.restarting:
            self.release[node.name] = self.restarting.pop(node.name)
        super()._start(node)
        release = self.release[node.name] if hasattr(self, "release") else RELEASE_0_1_0
        if hasattr(self, "views"):
            # In memory: a restart forgets what the peers said. Release 0.1.0 runs no such rule.
            self.views.pop(node.name, None)
            self.proposals.pop(node.name, None)
            if release.announced:
                self.views[node.name] = PeerVersions(release)

    def _probe_due(self) -> None:
        if self.now_ms < self.next_probe_ms:
            return
        self.next_probe_ms = self.now_ms + VERSIONS_PROBE_INTERVAL_MS
        for name, view in self.views.items():
            if not self._is_up(self.nodes[name]):
                continue
            for peer, node in self.nodes.items():
                if peer == name or not self._is_up(node) or (name, peer) in self.cut or (peer, name) in self.cut:
                    continue
                if self.rng.random() < self.faults.drop_probability:
                    continue
                release = self.release[peer]
                view.heard(peer, {"versions": release.to_wire()} if release.announced else {}, self.now_ms)

    def _propose_due(self) -> None:
        for name, view in self.views.items():
            node = self.nodes[name]
            machine = node.machine
            if not self._is_up(node) or machine is None or machine.role is not Role.SEQUENCER:
                continue
            status = machine.status()
            target = self.proposals.setdefault(name, ClusterVersionProposals()).due(
                SHARD,
                node.cluster_version,
                status.members,
                status.committed_members,
                status.learner,
                view,
                name,
                self.now_ms,
            )
            if target is not None:
                self.trace.append((self.now_ms, name, "proposes cluster version", target))
                self._propose(node, (ClusterVersionOp(SHARD, target),), f"v{target}-{self.now_ms}")

    # -- the checks ------------------------------------------------------------------------------

    def _execute(self, node: SimNode, effect: Effect) -> None:
        if isinstance(effect, PersistEntries):
            for entry in effect.entries:
                version = cluster_version_of(entry)
                if version is not None and not self.release[node.name].speaks(version):
                    raise self.fail(
                        f"{node.name} of release {self.release[node.name].software} was sent the cluster version "
                        f"{version} entry {entry.tx_key}, which it cannot read"
                    )
        super()._execute(node, effect)

    def _apply(self, node: SimNode, up_to: TxKey) -> list[Entry]:
        applied = super()._apply(node, up_to)
        for entry in applied:
            version = cluster_version_of(entry)
            if version is None:
                continue
            if (entry.tx_key, version) in self.committed_versions:
                continue
            if self.committed_versions and version < self.committed_versions[-1][1]:
                raise self.fail(f"cluster version went down to {version} at {entry.tx_key}")
            members = node.machine.members if node.machine is not None else tuple(self.nodes)
            # A member that is down counts with the release it comes back on.
            cannot = [
                member for member in members if not self.restarting.get(member, self.release[member]).speaks(version)
            ]
            if cannot:
                raise self.fail(f"cluster version {version} committed at {entry.tx_key} while {cannot} cannot speak it")
            if self.now_ms < self.last_upgrade_ms:
                raise self.fail(f"cluster version {version} committed before the last core was upgraded")
            self.committed_versions.append((entry.tx_key, version))
            self.moves_committed += 1
        return applied

    def run(self) -> SimulationResult:
        result = super().run()
        # Healed and quiet: every core runs this release, so the version must have moved everywhere.
        for _ in range(3):
            self._probe_due()
            self._propose_due()
            self._run_until_quiet(20_000)
            self.next_probe_ms = 0
        up = [name for name, node in self.nodes.items() if node.machine is not None]
        if {self.nodes[name].cluster_version for name in up} != {THIS_RELEASE.cluster_versions[1]}:
            raise self.fail(f"the cluster version did not move after the last upgrade: {self.cluster_versions()}")
        return result

    def cluster_versions(self) -> dict[str, int]:
        return {name: node.cluster_version for name, node in self.nodes.items()}

    def summary(self) -> str:
        return f"seed {self.seed}: versions {self.cluster_versions()}, moves {self.committed_versions}"


def run_versions_seed(seed: int, core_count: int = 3) -> VersionsSimulation:
    """Run one seed of a rolling upgrade; returns the finished simulation (its counters)."""
    simulation = VersionsSimulation(seed, core_count)
    simulation.run()
    return simulation


# The rolled-back member of ``rolled_back_while_down`` stays down this long: the last core is upgraded
# a step after it went down, and probe rounds follow, before it comes back.
DOWN_MS = 3 * STEP_GAP_MS
SEQUENCER_TRIES = 5


def _run_for(sim: VersionsSimulation, ms: int) -> None:
    """Time passes with the probes, the sequencer's proposals and the checks (no faults)."""
    end = sim.now_ms + ms
    while sim.now_ms < end:
        sim._inject_faults()
        sim._restart_due()
        sim.advance()


def _restart_on(sim: VersionsSimulation, name: str, release: Announcement, down_ms: int | None = None) -> None:
    """``name`` restarts on ``release`` (an operator's step), after ``down_ms`` if given."""
    node = sim.nodes[name]
    sim._crash(node)
    if down_ms is not None:
        node.down_until_ms = sim.now_ms + down_ms
        sim.trace.append((sim.now_ms, name, "down until", node.down_until_ms))
    sim.restarting[name] = release
    sim.trace.append((sim.now_ms, name, "restarting on", release.software))


def _sequencer_upgraded(sim: VersionsSimulation) -> SimNode:
    """Once quiet, the sequencer, which runs this release: one of 0.1.0 is restarted (on the same
    release) until another is elected, at most ``SEQUENCER_TRIES`` times."""
    for _ in range(SEQUENCER_TRIES):
        sequencer = sim.run_until_quiet()
        if sim.release[sequencer.name] == THIS_RELEASE:
            return sequencer
        sim._crash(sequencer)
    raise sim.fail(f"no core of this release was elected in {SEQUENCER_TRIES} tries")


def rolled_back_while_down(seed: int) -> VersionsSimulation:
    """3 cores of release 0.1.0, no faults. Two are upgraded, a step apart, and one of them that is
    not the sequencer is rolled back (the procedure allows it while the third still runs 0.1.0) and
    stays down for ``DOWN_MS``: the sequencer heard it announce this release before it went down.
    A step later the third core is upgraded: every member's last announcement speaks this release's
    cluster version, but the rolled-back one's is stale (``ANNOUNCEMENT_FRESH_MS``), so nothing is
    proposed; a rule that counted it would commit the version while that member comes back on a
    release that cannot read it (the checks of ``VersionsSimulation`` fail the run). It comes back,
    is heard on 0.1.0, then is upgraded again: the version moves (the rule did not merely block).
    Returns the finished simulation."""
    sim = VersionsSimulation(seed)
    sim.plan = []
    sim.last_upgrade_ms = 10**12  # nothing may move before the last step below
    sim._heal()
    names = sorted(sim.nodes)
    for name in names[:2]:
        _restart_on(sim, name, THIS_RELEASE)
        _run_for(sim, STEP_GAP_MS)
    sequencer = _sequencer_upgraded(sim)
    _run_for(sim, VERSIONS_PROBE_INTERVAL_MS)  # a probe round: heard just before it goes down
    rolled_back = next(name for name in names[:2] if name != sequencer.name)
    view = sim.views[sequencer.name]
    if view.announcement(rolled_back) != THIS_RELEASE:
        raise sim.fail(f"{sequencer.name} did not hear {rolled_back} announce this release")
    _restart_on(sim, rolled_back, RELEASE_0_1_0, down_ms=DOWN_MS)
    _run_for(sim, STEP_GAP_MS)
    # Back at once: with the rolled-back member down, a longer outage would depose the sequencer (it
    # hears no majority), and the next one would be this core, which heard no stale announcement.
    _restart_on(sim, names[2], THIS_RELEASE, down_ms=sim.tick_ms)
    _run_for(sim, DOWN_MS - STEP_GAP_MS)
    machine = sim.nodes[sequencer.name].machine
    if sim.release[names[2]] != THIS_RELEASE or machine is None or machine.role is not Role.SEQUENCER:
        raise sim.fail(f"{names[2]} was not upgraded under the sequencer {sequencer.name}")
    if view.announcement(names[2]) != THIS_RELEASE or view.announcement(rolled_back) != THIS_RELEASE:
        raise sim.fail(f"{sequencer.name} did not hold every member's announcement of this release")
    _run_for(sim, STEP_GAP_MS)  # back on 0.1.0, and heard
    if view.announcement(rolled_back) != RELEASE_0_1_0:
        raise sim.fail(f"{rolled_back} was not heard on release 0.1.0")
    sim.last_upgrade_ms = sim.now_ms
    _restart_on(sim, rolled_back, THIS_RELEASE)
    _run_for(sim, 2 * STEP_GAP_MS)
    sim.run_until_quiet()
    return sim


# The stuck scenario: how long clients go on after the member is stuck, how often one writes at the
# sequencer (more than two round trips at the longest delay: no write waits behind another).
STUCK_RUN_MS = 2000
STUCK_WRITE_GAP_MS = 300


class StuckMemberSimulation(Simulation):
    """Cores without faults (no drops, partitions, pauses or crashes; the healed run's trimming)
    whose member ``rolled_back`` restarts on release 0.1.0 (cluster version 1 only) after the probes
    saw it speak this release, and whose sequencer then appends this release's highest cluster
    version. The sequencer trims past the stuck member's position and offers it snapshots, at the
    cluster version it applied (production's offer): the member refuses each (``offers_refused``)."""

    def __init__(self, seed: int, core_count: int) -> None:
        self.rolled_back: str | None = None
        self.offers_refused = 0
        # When an append carrying a cluster version entry was sent to the rolled-back member, and
        # how many entries it carried.
        self.refused_sent_ms: list[int] = []
        self.refused_sent_entries: list[int] = []
        super().__init__(seed, core_count)
        self._heal()

    def _replay_command(self) -> str:
        return f".venv/bin/pytest tests/test_simulation.py -k stuck_consensus (seed {self.seed})"

    def _local_read_lag_ms_max(self) -> int | None:
        """No faults, and writes ``STUCK_WRITE_GAP_MS`` apart (none waits behind another)."""
        return self._lag_ms_without_faults()

    def _speaks(self, node: SimNode) -> Announcement:
        return RELEASE_0_1_0 if node.name == self.rolled_back else THIS_RELEASE

    def roll_back(self, name: str) -> None:
        """``name`` restarts on release 0.1.0 (a crash now; ``run_until_quiet`` restarts it)."""
        self.rolled_back = name
        self._crash(self.nodes[name])

    def _execute(self, node: SimNode, effect: Effect) -> None:
        # The rolled-back member refusing the entry is the scenario (and the only protocol
        # violation it has): its own check holds it at the entry before, loudly.
        if (
            isinstance(effect, ProtocolViolation)
            and node.name == self.rolled_back
            and UNSPOKEN_CLUSTER_VERSION in effect.reason
        ):
            self.trace.append((self.now_ms, node.name, "refused", effect.reason))
            return
        super()._execute(node, effect)

    def _send(self, sender: str, to: str, message: PeerMessage | str) -> None:
        if (
            to == self.rolled_back
            and isinstance(message, AppendRequest)
            and any(cluster_version_of(entry) is not None for entry in message.entries)
        ):
            self.refused_sent_ms.append(self.now_ms)
            self.refused_sent_entries.append(len(message.entries))
        super()._send(sender, to, message)

    def _offer_unspoken(self, follower: SimNode, sequencer: SimNode, refused: str) -> None:
        # So are the snapshot offers at that version: the stuck member refuses them (core.snapshot),
        # as production does (a protocol violation counted), and stays where it is.
        if follower.name != self.rolled_back:
            super()._offer_unspoken(follower, sequencer, refused)
        self.offers_refused += 1
        self.trace.append((self.now_ms, follower.name, "refused an offer", refused))


def _propose_unspoken_version(sim: StuckMemberSimulation) -> tuple[SimNode, str, int]:
    """Once quiet, roll a follower back to release 0.1.0 and have the sequencer propose the next
    cluster version; returns the sequencer, that follower and the version."""
    sequencer = sim.run_until_quiet()
    stuck = next(name for name in sorted(sim.nodes) if name != sequencer.name)
    sim.roll_back(stuck)
    sequencer = sim.run_until_quiet()
    version = THIS_RELEASE.cluster_versions[1]
    if sequencer.name == stuck or RELEASE_0_1_0.speaks(version):
        raise sim.fail(f"the scenario needs a follower {stuck} that does not speak cluster version {version}")
    sim._propose(sequencer, (ClusterVersionOp(SHARD, version),), f"v{version}")
    return sequencer, stuck, version


def stuck_member_reading_locally(seed: int) -> tuple[StuckMemberSimulation, str, int]:
    """3 cores (even seeds) or 5: once quiet, a follower is rolled back to release 0.1.0 and the
    sequencer appends the next cluster version, which that follower refuses: it is stuck while the
    others commit a write every ``STUCK_WRITE_GAP_MS``, and clients read every key locally, in turn
    at every core, for ``STUCK_RUN_MS``. Returns the simulation, the stuck core, and how many local
    reads it had answered when it got stuck."""
    sim = StuckMemberSimulation(seed, 3 if seed % 2 == 0 else 5)
    sequencer, stuck, version = _propose_unspoken_version(sim)
    node = sim.nodes[stuck]
    for _ in range(100):
        if node.machine is not None and node.machine.stuck_reason is not None:
            break
        sim.advance()
    else:
        raise sim.fail(f"{stuck} did not refuse the cluster version {version} entry")
    answered = sim.local_reads_answered[stuck]
    names = sorted(sim.nodes)
    for tick in range(STUCK_RUN_MS // sim.tick_ms):
        if tick * sim.tick_ms % STUCK_WRITE_GAP_MS == 0:
            sim.write(sequencer.name)
        sim.read(names[tick % len(names)], tick // len(names) % READ_KEYS, kind="local")
        sim.advance()
    return sim, stuck, answered


def stuck_member_behind_one_append(seed: int) -> tuple[StuckMemberSimulation, str, TxKey]:
    """As ``stuck_member_reading_locally``, but the sequencer proposes a write and the cluster version
    entry in one turn, so that they travel to the rolled-back member in one append: the write first.
    Runs ``STUCK_RUN_MS`` more; returns the simulation, the stuck core and the write's
    key, the last entry that member can read."""
    sim = StuckMemberSimulation(seed, 3 if seed % 2 == 0 else 5)
    if sim.config.entries_per_append_max < 2:
        raise sim.fail("the scenario needs a seed whose appends carry more than one entry")
    sequencer = sim.run_until_quiet()
    stuck = next(name for name in sorted(sim.nodes) if name != sequencer.name)
    sim.roll_back(stuck)
    sequencer = sim.run_until_quiet()
    version = THIS_RELEASE.cluster_versions[1]
    if sequencer.name == stuck or sequencer.machine is None or RELEASE_0_1_0.speaks(version):
        raise sim.fail(f"the scenario needs a follower {stuck} that does not speak cluster version {version}")
    written = TxKey(sequencer.machine.last_key.generation, sequencer.machine.last_key.counter + 1)
    # Held, as the writes of one turn are, then proposed in one batch (production's _propose_batch).
    sim._propose(sequencer, sim._write_ops(0), "before-the-version", held=True)
    sim._propose(sequencer, (ClusterVersionOp(SHARD, version),), f"v{version}", held=True)
    sim._propose_held(sequencer)
    if sequencer.machine.last_key <= written:
        raise sim.fail(f"the sequencer appended no cluster version {version} entry after {written}")
    for _ in range(STUCK_RUN_MS // sim.tick_ms):
        sim.advance()
    return sim, stuck, written


def stuck_member_under_writes(seed: int) -> tuple[StuckMemberSimulation, str]:
    """As ``stuck_member_reading_locally``, but once the member is stuck a client writes at the
    sequencer every tick for ``STUCK_RUN_MS``: each batch goes to every follower that was sent the
    log's end, the stuck one too. Returns the simulation (``refused_sent_ms``) and the stuck core."""
    sim = StuckMemberSimulation(seed, 3 if seed % 2 == 0 else 5)
    # Retention keeps the log: the sequencer goes on replicating to the stuck member, not offering
    # it snapshots.
    sim.faults = dataclasses.replace(sim.faults, retention_entries_max=10**9, retention_age_ms_max=0)
    sequencer, stuck, _ = _propose_unspoken_version(sim)
    for _ in range(STUCK_RUN_MS // sim.tick_ms):
        sim.write(sequencer.name)
        sim.advance()
    return sim, stuck
