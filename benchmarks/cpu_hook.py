"""A core process with the CPU of its loop's methods counted: ``mnesite.cli`` with ``WRAPPED`` wrapped.

    python benchmarks/cpu_hook.py start --config CORE.toml   (MNESITE_CPU_OUT=FILE)

Each wrapped call's thread CPU time (``time.thread_time_ns``) is added to its method's *inclusive*
time and, less the time of the wrapped calls made inside it, to its *exclusive* time; calls are
counted. SIGUSR1 has the loop's next turn write the counts to ``MNESITE_CPU_OUT`` as JSON and start
them again (a warm-up left out; ``Dumps``); the node's exit writes them too. A benchmark aid for
``cpu_by_function.py``, never imported by the product: a wrapper costs about a microsecond of CPU
per call (two clock reads), which the figures of methods called many times a write include.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import json
import os
import runpy
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

# (module, class or None for the module's own functions, names): the loop's turn and what it calls.
WRAPPED: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("mnesite.rlog.server", "NodeServer", ("poll", "receive", "begin", "flush", "reply", "_send_queued", "refusal")),
    (
        "mnesite.core.node",
        "CoreNode",
        (
            "run_turn",
            "_serve_waiting",
            "_dispatch",
            "_on_peer",
            "_write",
            "_propose_all",
            "_step",
            "_execute",
            "_tell_outcomes",
            "_end_batches",
            "_apply_due",
            "before_send",
            "after_commit",
            "serve_queries",
            "serve_changes",
            "build_indexes",
            "_versions_turn",
            "_expire_forwarded",
            "_expire_held_guard_failures",
            "_maybe_trim",
        ),
    ),
    ("mnesite.core.consensus", "ShardConsensus", ("step", "next_deadline_ms")),
    ("mnesite.rlog.store", "Store", ("append_entries", "apply_committed", "commit", "find_request")),
    ("mnesite.core.agent_server", "AgentServer", ("begin_turn", "tick", "next_deadline_ms")),
    # Module functions, looked up by name where they are called: wrapped there.
    ("mnesite.rlog.messages", None, ("decode",)),
    ("mnesite.core.node", None, ("message_from_wire", "is_peer_frame")),
    ("mnesite.rlog.server", None, ("send_frames",)),
    ("os", None, ("fdatasync",)),  # a durable commit's sync of the WAL (Store.commit): its own row
)


class Accounting:
    """Inclusive and exclusive CPU (``clock`` units) and calls per label, of nested wrapped calls."""

    def __init__(self, clock: Callable[[], int] = time.thread_time_ns) -> None:
        self.clock = clock
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.exclusive: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._children: list[int] = []  # per open call: the time of the wrapped calls made inside it

    def wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0)
            started = self.clock()
            try:
                return function(*args, **kwargs)
            finally:
                spent = self.clock() - started
                inside = self._children.pop()
                self.inclusive[label] += spent
                self.exclusive[label] += spent - inside
                self.calls[label] += 1
                if self._children:
                    self._children[-1] += spent

        return wrapper

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"inclusive": dict(self.inclusive), "exclusive": dict(self.exclusive), "calls": dict(self.calls)}

    def clear(self) -> None:
        self.inclusive.clear()
        self.exclusive.clear()
        self.calls.clear()


def install(accounting: Accounting) -> None:
    for module_name, owner_name, names in WRAPPED:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        for name in names:
            label = f"{owner_name}.{name}" if owner_name else name
            setattr(owner, name, accounting.wrap(getattr(owner, name), label))


class Dumps:
    """The counts written to ``path``: at the exit, and on SIGUSR1 at the start of the loop's next turn,
    which then starts them again.

    The handler only records the request (``request``). It used to write the file and clear the
    counts itself, on the main thread between two bytecodes of whatever the loop was doing: in the
    middle of a wrapped call (whose CPU then took in the handler's file I/O, counted after the
    clear) or holding a lock the I/O could need. At a turn's start no wrapped call is open. The
    node's loop wakes on any signal (``rlog.process_signals``' wakeup pipe): an idle core writes
    within a poll."""

    def __init__(self, accounting: Accounting, path: str) -> None:
        self.accounting = accounting
        self.path = path
        self.requested = False

    def request(self, _number: int, _frame: Any) -> None:
        self.requested = True  # a record, nothing else: the loop's turn writes (``before_turn``)

    def write(self) -> None:
        with open(self.path, "w") as out:
            json.dump(self.accounting.snapshot(), out)

    def before_turn(self, turn: Callable[..., Any]) -> Callable[..., Any]:
        """``turn`` that first writes the counts and starts them again if SIGUSR1 asked since."""

        def turn_after_dump(*args: Any, **kwargs: Any) -> Any:
            if self.requested:
                self.requested = False
                self.write()
                self.accounting.clear()
            return turn(*args, **kwargs)

        return turn_after_dump


def main() -> None:
    accounting = Accounting()
    install(accounting)
    dumps = Dumps(accounting, os.environ["MNESITE_CPU_OUT"])
    server = importlib.import_module("mnesite.rlog.server")
    server.NodeServer.turn = dumps.before_turn(server.NodeServer.turn)
    atexit.register(dumps.write)
    signal.signal(signal.SIGUSR1, dumps.request)
    sys.argv = ["mnesite", *sys.argv[1:]]
    runpy.run_module("mnesite.cli", run_name="__main__")


if __name__ == "__main__":
    main()
