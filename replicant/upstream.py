"""Which core a replica watches: a pure choice over the journal ages the cores reported.

Theory of operation
-------------------
A replica probes every core for its ``JournalAnswer`` of the shard (committed key, whether it hears
the sequencer, how many agents it runs) and calls ``choose_upstream``. The rules, in order:

1. No time travel (invariant 5). A core whose committed key is behind the replica's applied key
   never qualifies: watching it could move the replica's data backwards. A core that did not answer
   (``None``) or that the caller excludes never qualifies either.
2. Prefer cores that hear the sequencer. A core cut off from the majority stops learning commits,
   so its replicas would go stale; it is chosen only when no qualifying core hears the sequencer
   (stale data that is a consistent prefix beats no data, and the replica's failure detector moves
   on once a better core answers).
3. Spread by load. Among the preferred cores, those with the fewest agents win; cores within
   ``near_tie_agents(fewest)`` agents of the fewest are near ties, and the winner among them is
   drawn with the caller's ``random.Random``. Replicas probe at jittered times and agent counts
   grow as they attach, so a core that just restarted (zero agents) does not take every replicant
   at once: it qualifies only once its committed key has caught up and it hears the sequencer
   again, and the replicas that come later see its new agent count.

The function is pure: the same arguments and the same random state give the same answer.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from mnesite.rlog.replication import JournalAnswer
from mnesite.rlog.types import TxKey

# Cores whose agent counts differ by at most max(NEAR_TIE_AGENTS_MIN, fewest // NEAR_TIE_DIVISOR)
# are treated as equally loaded: exact counts are stale by the time the watch arrives anyway.
NEAR_TIE_AGENTS_MIN = 1
NEAR_TIE_DIVISOR = 10


def near_tie_agents(fewest: int) -> int:
    """How many more agents than ``fewest`` still count as a tie."""
    return max(NEAR_TIE_AGENTS_MIN, fewest // NEAR_TIE_DIVISOR)


def qualifying_cores(
    ages: Mapping[str, JournalAnswer | None], applied_key: TxKey, exclude: frozenset[str] = frozenset()
) -> list[str]:
    """Cores that answered, are not excluded and whose committed key is at least ``applied_key``."""
    return sorted(
        core
        for core, age in ages.items()
        if age is not None and core not in exclude and age.committed_key >= applied_key
    )


def choose_upstream(
    ages: Mapping[str, JournalAnswer | None],
    applied_key: TxKey,
    rng: random.Random,
    exclude: frozenset[str] = frozenset(),
) -> str | None:
    """The core to watch, or None when no core qualifies (see the module docstring for the rules)."""
    qualified = qualifying_cores(ages, applied_key, exclude)
    known = {core: age for core, age in ages.items() if age is not None}
    hearing = [core for core in qualified if known[core].hears_sequencer]
    pool = hearing or qualified
    if not pool:
        return None
    fewest = min(known[core].agents for core in pool)
    near = [core for core in pool if known[core].agents <= fewest + near_tie_agents(fewest)]
    # ``pool`` is sorted, so the draw does not depend on the mapping's order.
    return near[rng.randrange(len(near))]


def write_target(
    upstreams: list[str | None], cores: tuple[str, ...], rng: random.Random, unavailable: frozenset[str] = frozenset()
) -> str:
    """The core a replicant forwards a write (or a linearizable read's ``read_index``) to.

    A core this replicant watches (the first replica's upstream): it answered recently and hears
    the sequencer, or it would not have been chosen; with none, any core (it forwards once to the
    sequencer, or answers ``no_sequencer`` and the client retries). A core in ``unavailable`` (the
    driver cannot send to it now: its queue holds ``core_queue_bytes_max``, or a send to it failed
    just now) is skipped for another, watched first, else any; only when every core is unavailable
    is the choice made as if none were (the driver's send then refuses the request with why).
    """
    if not cores:
        raise ValueError("a replicant needs at least one core")
    watched = [core for core in upstreams if core is not None]
    watched_available = [core for core in watched if core not in unavailable]
    if watched_available:
        return watched_available[0]
    available = [core for core in cores if core not in unavailable]
    if available:
        return available[rng.randrange(len(available))]
    if watched:  # every core is unavailable: chosen as if none were
        return watched[0]
    return cores[rng.randrange(len(cores))]
