"""Deterministic simulator for the core consensus state machine (see ``cluster.py``)."""

from tests.sim.cluster import MemoryLog, Simulation, SimulationFailure, SimulationResult, run_seed

__all__ = ["MemoryLog", "Simulation", "SimulationFailure", "SimulationResult", "run_seed"]
