"""Lost disks under the simulator's faults (``core.recovery``: generations, the vote floor, how many
cores must answer).

Theory of operation
-------------------
``LostDiskSimulation`` is the core simulation (``cluster.py``) where, now and then, a core's disk is
replaced by an empty one (``Simulation.lose_disk``): the core crashes and restarts on an empty
database, recovering first as production's ``CoreNode.recover_generations`` does, with the same
pure rules (``recovery_shortfall``: it starts only once every other member answered, declared
``initial_cluster_state = "existing"`` by the operator as the docs say; ``recovered_generations``;
``recovered_vote_floors``: it votes only for a log at or past the highest key they hold until its
own log does). While too few answer it asks again later.

One lost disk is one fault: a disk is lost only while no rebuilt core is still below its vote floor
(it holds again everything it held before its loss once its log passed the floor). Two disks lost
before the first caught up are two faults at once, which a majority protocol does not survive.

The checkers are the base simulation's (one sequencer per generation, committed prefixes agree,
every acknowledged write is in the final history). Its random draws come after the base
simulation's in every step, from the same seeded generator, so a seed replays exactly; the base
simulation's seeds are not disturbed (it is another class).
"""

from __future__ import annotations

from tests.sim.cluster import Simulation, SimulationResult, replay_command


class LostDiskSimulation(Simulation):
    def __init__(self, seed: int, core_count: int, faulty_ms: int = 3000, loss_probability: float = 0.004) -> None:
        super().__init__(seed, core_count, faulty_ms)
        self.loss_probability = loss_probability
        self.result: SimulationResult | None = None

    def _replay_command(self) -> str:
        return replay_command(self.seed, "tests/test_lost_disk_simulation.py")

    def _inject_faults(self) -> None:
        super()._inject_faults()
        if self.rng.random() < self.loss_probability and self._no_core_below_its_floor():
            names = [name for name in sorted(self.nodes) if name not in self.lost_for_good]
            self.lose_disk(self.rng.choice(names))

    def _no_core_below_its_floor(self) -> bool:
        """Whether every rebuilt core holds again what it held before its disk was lost."""
        return all(not node.disk_lost and node.log.last_key() >= node.state.vote_floor for node in self.nodes.values())


def run_lost_disk_seed(seed: int, core_count: int | None = None, faulty_ms: int = 3000) -> LostDiskSimulation:
    """Run one seed with lost disks; 3 cores for even seeds and 5 for odd ones unless given."""
    if core_count is None:
        core_count = 3 if seed % 2 == 0 else 5
    simulation = LostDiskSimulation(seed, core_count, faulty_ms)
    simulation.result = simulation.run()
    return simulation
