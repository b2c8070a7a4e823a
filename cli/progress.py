"""Progress of a long command on stderr, paced: what ``restore`` and ``rlog verify`` show.

Theory of operation
-------------------
A command doing minutes of work calls ``ProgressLines.show`` after each step with a function that
describes it; a line is written to stderr only if ``interval_s`` passed since the last one (a step
is milliseconds: a line per step would flood the terminal), and always for the final one. A run
shorter than ``interval_s`` shows only its final line. Stdout is left to the result, which scripts read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import click
from mnesite.rlog.types import TxKey

PROGRESS_INTERVAL_S = 1.0  # a progress line at most this often (stderr, unless --quiet)


class ProgressLines:
    """Lines on stderr at most every ``interval_s``, and the final one."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._shown_s = time.monotonic()

    def show(self, describe: Callable[[], str], final: bool = False) -> None:
        """Write ``describe()`` if it is ``final`` or the last line is ``interval_s`` old (only then described)."""
        if final or time.monotonic() - self._shown_s >= self._interval_s:
            self._shown_s = time.monotonic()
            click.echo(describe(), err=True)


def key_text(key: TxKey) -> str:
    return f"({key.generation}, {key.counter})"


def describe_chain_batch(shard: str, entries_verified: int, tx_key: TxKey, applied: TxKey) -> str:
    """How far ``Store.verify_chains`` got (the figures of its ``on_batch``)."""
    return f"{entries_verified} entries verified (shard {shard} at {key_text(tx_key)}, applied {key_text(applied)})"
