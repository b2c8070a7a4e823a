"""A core a forced start left out of the shard, read locally (``core.rules.not_serving_reason``).

Theory of operation
-------------------
``ExcludedMemberSimulation`` is the core simulation without random faults. The scenario
(``excluded_member_reading_locally``) makes one fault by hand: a follower C is cut off from the
others, a second follower B is lost for good, and the operator force-starts the last core A, which
reaches no one (forced set {A}). Once the cut heals, C campaigns at A and hears that it was left out
(``ExclusionNotice``); from then on A alone commits a write every ``STUCK_WRITE_GAP_MS`` and clients
read every key locally at A and at C, in turn. From the moment C knows it was left out, the
simulator holds local reads to the lag bound of a run without faults (``_lag_ms_without_faults``):
A meets it; C, whose state no longer moves, breaks it once a write commits after it stopped, unless
the serving rule refuses its reads (``not_ready``), as production's and the simulator's gate do.
Then C crashes and restarts, and the reads go on as before: its machine is rebuilt from what it
persisted, which holds the exclusion (``PersistedState.excluded_generation``), so it refuses local
reads from its first step; a machine that ignored it would serve them, stale, until A (at most once
per ``EXCLUSION_NOTICE_INTERVAL_MS``) told it again.
"""

from __future__ import annotations

from tests.sim.cluster import READ_KEYS, Simulation
from tests.sim.versions import STUCK_RUN_MS, STUCK_WRITE_GAP_MS


class ExcludedMemberSimulation(Simulation):
    def __init__(self, seed: int, core_count: int) -> None:
        self.lag_checked = False  # set once the left-out core knows it: the bound holds from then on
        super().__init__(seed, core_count, faulty_ms=0)
        self._heal()

    def _replay_command(self) -> str:
        return f".venv/bin/pytest tests/test_simulation.py -k left_out (seed {self.seed})"

    def _local_read_lag_ms_max(self) -> int | None:
        return self._lag_ms_without_faults() if self.lag_checked else None

    def restart(self, name: str) -> None:
        """``name`` crashes and starts again at once, from what it persisted."""
        node = self.nodes[name]
        self._crash(node)
        node.down_until_ms = self.now_ms
        self._restart_due()
        if node.machine is None:
            raise self.fail(f"{name} did not restart")


def excluded_member_reading_locally(seed: int) -> tuple[ExcludedMemberSimulation, str, str, int]:
    """The scenario of the module's theory (3 cores). Returns the simulation, the forced core A, the
    left-out core C, and how many local reads C had answered when it heard it was left out."""
    sim, forced, left_out = _left_out_core_told(seed)
    answered = sim.local_reads_answered[left_out]
    sim.lag_checked = True
    _read_at_both(sim, forced, left_out)
    sim.restart(left_out)
    _read_at_both(sim, forced, left_out)
    return sim, forced, left_out, answered


def _left_out_core_told(seed: int) -> tuple[ExcludedMemberSimulation, str, str]:
    """Up to where the left-out core C hears that the force start at A left it out: (sim, A, C)."""
    sim = ExcludedMemberSimulation(seed, 3)
    sequencer = sim.run_until_quiet()
    for _ in range(3):
        sim.write(sequencer.name)
    sequencer = sim.run_until_quiet()
    forced, lost, left_out = sequencer.name, *sorted(name for name in sim.nodes if name != sequencer.name)
    sim.cut = {(left_out, other) for other in (forced, lost)} | {(other, left_out) for other in (forced, lost)}
    sim.lose_for_good([lost])
    sim.force_start(forced)
    machine = sim.nodes[forced].machine
    if machine is None or machine.members != (forced,):
        raise sim.fail(f"the force start at {forced} did not make the forced set ({forced},)")
    for _ in range(1000):
        if machine.committed_key.generation == machine.generation:
            break
        sim.advance()
    else:
        raise sim.fail(f"{forced} did not commit its forced generation's first entry")
    sim.cut = set()
    node = sim.nodes[left_out]
    for _ in range(1000):
        if node.machine is not None and node.machine.excluded:
            break
        sim.advance()
    else:
        raise sim.fail(f"{left_out} never heard that the force start at {forced} left it out")
    return sim, forced, left_out


def _read_at_both(sim: ExcludedMemberSimulation, forced: str, left_out: str) -> None:
    """``STUCK_RUN_MS`` of a write at A every ``STUCK_WRITE_GAP_MS`` and local reads at A and C in turn."""
    readers = (forced, left_out)
    for tick in range(STUCK_RUN_MS // sim.tick_ms):
        if tick * sim.tick_ms % STUCK_WRITE_GAP_MS == 0:
            sim.write(forced)
        sim.read(readers[tick % 2], tick // 2 % READ_KEYS, kind="local")
        sim.advance()
