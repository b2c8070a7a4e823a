"""A core process with its hops timed: ``mnesite.cli`` with a few driver methods wrapped (``trace_write.py``).

    python benchmarks/trace_hook.py start --config CORE.toml   (MNESITE_TRACE_OUT=FILE)

Records ``(event, start_ns, end_ns, tag)`` with ``time.monotonic_ns`` (one clock for every process of
the machine) for: the loop's poll, each dispatched message (tag: its kind), the turn's commit (tag:
durable), each fdatasync, each frame sent (tag: its bytes), the batch's proposal and append, the
apply, and each step of the consensus machine (tag: the event). At most ``EVENTS_MAX`` events are
kept (the newest); they are written to ``MNESITE_TRACE_OUT`` as JSON lines when the node stops.
A benchmark aid, never imported by the product: the wrappers cost about a microsecond each.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import runpy
import sys
import time
from typing import Any

EVENTS_MAX = 2_000_000

events: collections.deque[tuple[str, int, int, Any]] = collections.deque(maxlen=EVENTS_MAX)
now_ns = time.monotonic_ns


def timed(owner: Any, name: str, tag: Any = None) -> None:
    """Replace ``owner.name`` by a wrapper that records each call (``tag(args)``: what to note)."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = now_ns()
        try:
            return original(*args, **kwargs)
        finally:
            events.append((name, start, now_ns(), tag(args, kwargs) if tag else None))

    setattr(owner, name, wrapper)


def install() -> None:
    from mnesite.core import consensus, node
    from mnesite.rlog import server, store

    timed(server.NodeServer, "poll")
    timed(node.CoreNode, "_dispatch", lambda args, _: args[2].kind)
    timed(store.Store, "commit", lambda args, kwargs: kwargs.get("durable", args[1] if len(args) > 1 else True))
    timed(node.CoreNode, "_propose_batch")
    timed(node.CoreNode, "_end_batches")
    timed(store.Store, "append_entries")
    timed(store.Store, "apply_committed")
    timed(consensus.ShardConsensus, "step", lambda args, _: type(args[1]).__name__)
    # Module functions, looked up by name at each call: wrapped where they are looked up.
    timed(server, "send_frames", lambda args, _: len(args[1][-1]))
    timed(store.os, "fdatasync")


def dump(path: str) -> None:
    with open(path, "w") as out:
        for event in events:
            out.write(json.dumps(event) + "\n")


if __name__ == "__main__":
    install()
    atexit.register(dump, os.environ["MNESITE_TRACE_OUT"])
    sys.argv = ["mnesite", *sys.argv[1:]]
    runpy.run_module("mnesite.cli", run_name="__main__")
