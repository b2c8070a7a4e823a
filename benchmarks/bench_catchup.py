"""Replicant catch-up, bootstrap, lag and failover against three real cores, with same-run baselines.

    .venv/bin/python benchmarks/bench_catchup.py [--rows 100000] [--rows-per-transaction 1000]
        [--loaders 1] [--writers 3] [--phases catchup,lag,failover,bootstrap,apply,many] [--json]
        [--baseline TREE]   (the servers run from another commit's source tree, for a same-run A/B)

Phases (each starts three fresh core processes on 127.0.0.1, ``synchronous = "NORMAL"``):

* ``catchup``: ``--loaders`` clients load ``--rows`` rows of about 100 bytes in transactions of
  ``--rows-per-transaction`` rows (elections during the load are reported); then an empty replicant
  starts while ``--writers`` clients keep writing one row per transaction, and resumes from (0, 0)
  through the rlog (default retention). Reported: seconds until it is ``normal`` at (or past) the
  cores' committed key of the moment it started,
  entries/s and MB/s (entry bytes estimated by ``Entry.size_bytes``), elections during the catch-up.
* ``lag``: the writers' maximum rate is measured for ``--seconds``, then they write at half of it;
  after each acknowledgement the writer reads its row at the replicant with ``after_tx_key`` (held
  there until applied): lag of a write = acknowledgement to that answer (p50, p99), which includes
  one read round trip (reported alone as ``read_rtt_p50_ms``) and names the replicant's upstream.
* ``failover``: the replicant's upstream core is killed with SIGKILL; reported: seconds until the
  replicant is ``normal`` on another core, and rows re-copied (target 0: it resumes from its applied key).
* ``bootstrap``: retention of 50 entries forces a dirty-read bootstrap of the ``--rows`` rows; the
  baseline is a raw apsw copy of the same rows (read from a core's database file in key order,
  inserted into a new WAL database in one transaction), measured in the same run.
* ``apply``: the replicant's apply path without sockets (``ReplicantApply``: push frames
  decoded and checked by the typed layer, the real ``ShardReplica``, the store's set-based apply,
  one transaction per push of ``--push-entries`` entries) against raw apsw's batched upsert of the
  same rows (one ``executemany`` and one transaction per push), alternated push by push and each
  timed alone (``apply_round``), ``--repeat`` rounds.
* ``many``: the clients' write latency (``--writers`` clients, one row per transaction, p50/p99)
  with no replicant, then with ``--replicants`` replicants attached and normal, then with none
  again (they are killed); the ratio is against the mean of the two rounds without. Also the CPU
  per acknowledged write from ``/proc``: the cores summed without and with the replicants, and each
  replicant's.

Not a test: it asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mnesite.rlog.client import Client, MnesiteError  # noqa: E402

from benchmarks.bench_commit import cpu_seconds, free_endpoint, machine, percentile, wait_listening  # noqa: E402

ROW_VALUE = "v" * 90  # with the id and the encoding, about 100 bytes a row
ENTRY_OVERHEAD_BYTES_ESTIMATE = 128
ROW_BYTES_ESTIMATE = 100


# Where the servers import mnesite from: this repository, or a --baseline tree's package layout.
SERVER_PYTHONPATH = str(REPO)


class Cluster:
    """Three core processes and optionally one replicant; every process is killed at ``close``."""

    def __init__(self, directory: Path, core_toml: str = "") -> None:
        self.directory = directory
        self.endpoints = {f"core{i}": free_endpoint() for i in range(1, 4)}
        self.processes: dict[str, subprocess.Popen] = {}
        core_nodes = ", ".join(f'{name} = "{endpoint}"' for name, endpoint in self.endpoints.items())
        self.core_nodes = core_nodes
        for name, endpoint in self.endpoints.items():
            config = directory / f"{name}.toml"
            config.write_text(
                f'[node]\nname = "{name}"\ndata_dir = "{directory / name}"\nlisten = "{endpoint}"\n'
                f'[cluster]\ncore_nodes = {{ {core_nodes} }}\n[storage]\nsynchronous = "NORMAL"\n' + core_toml
            )
            self._start(name, config)

    def _start(self, name: str, config: Path) -> None:
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "mnesite.cli", "start", "--config", str(config), "--log-level", "INFO"],
            # Not the repository as working directory: ``python -m`` would import its own package
            # first, whatever PYTHONPATH says (a --baseline tree's servers).
            cwd=self.directory,
            env=dict(os.environ, PYTHONPATH=SERVER_PYTHONPATH),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=(self.directory / f"{name}.log").open("w"),
        )

    def start_replicant(self, name: str = "replicant1") -> None:
        self.endpoints[name] = free_endpoint()
        config = self.directory / f"{name}.toml"
        config.write_text(
            f'[node]\nname = "{name}"\nrole = "replicant"\ndata_dir = "{self.directory / name}"\n'
            f'listen = "{self.endpoints[name]}"\n[cluster]\ncore_nodes = {{ {self.core_nodes} }}\n'
            '[storage]\nsynchronous = "NORMAL"\n'
        )
        self._start(name, config)

    def kill(self, name: str) -> None:
        os.killpg(self.processes[name].pid, signal.SIGKILL)
        self.processes[name].wait(30)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)

    def status(self, name: str, timeout_ms: int = 2000) -> dict | None:
        try:
            with Client(self.endpoints[name], timeout_ms=timeout_ms, retries=0) as client:
                return client.status()
        except MnesiteError:
            return None

    def shard(self, name: str) -> dict:
        status = self.status(name)
        return (status or {}).get("shards", {}).get("default") or {}

    def generations(self) -> dict[str, tuple[int, int]]:
        result = {}
        for name in ("core1", "core2", "core3"):
            info = self.shard(name)
            if info and name in self.processes and self.processes[name].poll() is None:
                result[name] = (info["generation"], info.get("elections", 0))
        return result

    def wait(self, condition, timeout_s: float, what: str, interval_s: float = 0.05) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if condition():
                return time.monotonic() - started
            time.sleep(interval_s)
        raise SystemExit(f"timed out after {timeout_s} s waiting for {what}; logs in {self.directory}")


def load(cluster: Cluster, rows: int, rows_per_transaction: int, loaders: int) -> float:
    """Load ``rows`` rows in batched transactions from ``loaders`` concurrent clients; seconds taken."""
    starts = list(range(0, rows, rows_per_transaction))
    lock = threading.Lock()
    errors: list[str] = []

    def run(loader: int) -> None:
        with Client(cluster.endpoints[f"core{loader % 3 + 1}"], timeout_ms=60_000, retries=5) as client:
            while True:
                with lock:
                    if not starts:
                        return
                    start = starts.pop()
                ops = [
                    {"op": "write", "table": "kv", "row": {"id": i, "value": ROW_VALUE}}
                    for i in range(start, min(rows, start + rows_per_transaction))
                ]
                try:
                    client.transact(ops)
                except MnesiteError as error:
                    errors.append(str(error))
                    return

    began = time.monotonic()
    threads = [threading.Thread(target=run, args=(n,)) for n in range(loaders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise SystemExit(f"load failed: {errors[:3]}")
    return time.monotonic() - began


class Writers:
    """``count`` threads putting one row per transaction; optionally paced to ``rate_per_s`` in total.

    ``probe``: a replicant's endpoint; after each acknowledgement the writer reads its row there with
    ``after_tx_key`` (the replicant answers once it has applied the write) and records the lag."""

    def __init__(self, cluster: Cluster, count: int, rate_per_s: float | None = None, probe: str | None = None) -> None:
        self.cluster = cluster
        self.stop_event = threading.Event()
        self.acknowledged: list[tuple[float, tuple[int, int]]] = []
        self.lags_ms: list[float] = []
        self.probe_errors = 0
        self.probe = probe
        self.lock = threading.Lock()
        self.rate_per_s = rate_per_s
        self.count = count
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(count)]

    def _run(self, worker: int) -> None:
        interval = self.count / self.rate_per_s if self.rate_per_s else 0.0
        next_at = time.monotonic()
        row_id = 10**9 + worker * 10**7
        while not self.stop_event.is_set():
            try:
                with contextlib.ExitStack() as stack:
                    endpoint = self.cluster.endpoints[f"core{worker % 3 + 1}"]
                    client = stack.enter_context(Client(endpoint, timeout_ms=5000, retries=2))
                    probe = stack.enter_context(Client(self.probe, timeout_ms=5000, retries=0)) if self.probe else None
                    while not self.stop_event.is_set():
                        if interval:
                            next_at += interval
                            time.sleep(max(0.0, next_at - time.monotonic()))
                        row_id += 1
                        key = client.put("kv", {"id": row_id, "value": ROW_VALUE})
                        acked_at = time.monotonic()
                        with self.lock:
                            self.acknowledged.append((acked_at, tuple(key)))
                        if probe is not None:
                            try:
                                probe.get("kv", row_id, after_tx_key=key)
                            except MnesiteError:
                                with self.lock:
                                    self.probe_errors += 1
                                continue
                            with self.lock:
                                self.lags_ms.append((time.monotonic() - acked_at) * 1000)
            except MnesiteError:
                time.sleep(0.05)

    def start(self) -> Writers:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> list[tuple[float, tuple[int, int]]]:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(30)
        return list(self.acknowledged)


def start_cluster(directory: Path, core_toml: str = "") -> Cluster:
    cluster = Cluster(directory, core_toml)
    wait_listening(list(cluster.endpoints.values()))
    with Client(cluster.endpoints["core1"], timeout_ms=3000, retries=20) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    return cluster


def committed(cluster: Cluster) -> tuple[int, int]:
    return max(tuple(cluster.shard(name).get("committed", (0, 0))) for name in ("core1", "core2", "core3"))


def normal_at(cluster: Cluster, target: tuple[int, int]) -> bool:
    """The replicant serves reads at (or past) ``target``."""
    info = cluster.shard("replicant1")
    return info.get("serving") is True and tuple(info.get("applied", (0, 0))) >= target


def phase_catchup(directory: Path, args: argparse.Namespace, report: dict) -> None:
    cluster = start_cluster(directory)
    try:
        load_s = load(cluster, args.rows, args.rows_per_transaction, args.loaders)
        before = cluster.generations()
        report["load"] = {
            "rows": args.rows,
            "rows_per_transaction": args.rows_per_transaction,
            "loaders": args.loaders,
            "seconds": round(load_s, 2),
            "rows_per_s": round(args.rows / load_s),
            "generations_after_load": before,
        }
        writers = Writers(cluster, args.writers).start()
        time.sleep(1.0)  # the writers are under way before the replicant starts
        target = committed(cluster)
        cluster.start_replicant()

        caught_s = cluster.wait(lambda: normal_at(cluster, target), args.timeout_s, "the replicant's catch-up")
        after = cluster.generations()
        writers.stop()
        applied = cluster.shard("replicant1")["applied"]
        loaded_entries = args.rows // args.rows_per_transaction + 2  # the loaded entries, the no-op, the table
        # Every entry the replicant applied came through the rlog (generation 1: counters are entries).
        entries = applied[1] if applied[0] == 1 else loaded_entries
        total_bytes = args.rows * ROW_BYTES_ESTIMATE + entries * ENTRY_OVERHEAD_BYTES_ESTIMATE
        total_bytes += (entries - loaded_entries) * ROW_BYTES_ESTIMATE
        report["catchup"] = {
            "seconds": round(caught_s, 2),
            "applied": applied,
            "entries": entries,
            "megabytes": round(total_bytes / 1e6, 1),
            "entries_per_s": round(entries / caught_s, 1),
            "mb_per_s": round(total_bytes / caught_s / 1e6, 2),
            "generations_before": before,
            "generations_after": after,
            "new_generation": any(after[n][0] != before[n][0] for n in after if n in before),
        }
        if "lag" in args.phases:
            phase_lag(cluster, args, report)
        if "failover" in args.phases:
            phase_failover(cluster, args, report)
    finally:
        cluster.close()


def phase_lag(cluster: Cluster, args: argparse.Namespace, report: dict) -> None:
    """Lag of a write: from its acknowledgement until a read at the replicant that must see it returns.

    The writers measure their maximum rate, then write at half of it; after each acknowledgement the
    writer asks the replicant for the row with ``after_tx_key`` = the write's key: the replicant holds
    the read until it has applied that key (a server-side wait, no polling interval), so the figure is
    the lag plus one read round trip to the replicant (``read_rtt_p50_ms``, measured alone, for scale)."""
    writers = Writers(cluster, args.writers).start()
    time.sleep(args.seconds)
    full = writers.stop()
    window = [t for t, _ in full if t >= full[0][0] + 0.5] if full else []
    max_rate = len(window) / (window[-1] - window[0]) if len(window) > 1 else 0.0
    upstream = cluster.shard("replicant1").get("upstream")
    upstream_role = cluster.shard(upstream).get("role") if upstream else None
    with Client(cluster.endpoints["replicant1"], timeout_ms=2000, retries=0) as client:
        rtts = []
        for _ in range(200):
            began = time.monotonic()
            client.get("kv", -1)
            rtts.append((time.monotonic() - began) * 1000)
    half = Writers(cluster, args.writers, rate_per_s=max_rate / 2, probe=cluster.endpoints["replicant1"]).start()
    time.sleep(args.seconds)
    acknowledged = half.stop()
    lags_ms = sorted(half.lags_ms)
    rtts.sort()
    report["lag"] = {
        "max_writes_per_s": round(max_rate, 1),
        "paced_writes_per_s": round(len(acknowledged) / args.seconds, 1),
        "replicant_upstream": f"{upstream} ({upstream_role})",
        "samples": len(lags_ms),
        "probe_errors": half.probe_errors,
        "p50_ms": round(percentile(lags_ms, 0.5), 2),
        "p99_ms": round(percentile(lags_ms, 0.99), 2),
        "read_rtt_p50_ms": round(percentile(rtts, 0.5), 2),
    }


def phase_failover(cluster: Cluster, args: argparse.Namespace, report: dict) -> None:
    before = cluster.shard("replicant1")
    upstream = before["upstream"]
    writers = Writers(cluster, args.writers).start()
    time.sleep(0.5)
    cluster.kill(upstream)

    def moved() -> bool:
        info = cluster.shard("replicant1")
        return info.get("mode") == "normal" and info.get("upstream") not in (None, upstream)

    resumed_s = cluster.wait(moved, args.timeout_s, "the replicant's failover", interval_s=0.02)
    writers.stop()
    after = cluster.shard("replicant1")
    report["failover"] = {
        "killed": upstream,
        "new_upstream": after["upstream"],
        "seconds_to_normal": round(resumed_s, 2),
        "rows_recopied": after["rows_copied"] - before["rows_copied"],
        "bootstraps": after["bootstraps"] - before["bootstraps"],
        "resumes": after["resumes"] - before["resumes"],
    }


class ReplicantApply:
    """The replicant's apply path without sockets, one push at a time (``apply_round`` times each).

    What a replicant does with pushes of ``push_entries`` entries of ``rows_per_transaction`` rows:
    decode the frame (``messages.decode``: the wire schema's checks, then ``push_received``'s
    ``decode_entry`` per entry), step the real ``ShardReplica`` (which checks the digest chain), and
    execute its ``ApplyEntries`` on a real ``Store`` the way ``replicant.node`` does, with the cyclic
    collector paused as the driver pauses it, one SQLite transaction per push.
    """

    def __init__(self, directory: Path, rows: int, rows_per_transaction: int, push_entries: int) -> None:
        import random

        from mnesite.replicant.replica import ReplicaConfig, ShardReplica
        from mnesite.rlog import messages
        from mnesite.rlog import replication as p

        try:  # a --baseline tree with its frames in their own module
            from mnesite.rlog import codec
        except ImportError:
            codec = messages
        try:  # what the replicant's driver runs around a push (replicant.node._dispatch)
            from mnesite.rlog.server import collector_paused
        except ImportError:  # a --baseline tree: the collector stays on
            collector_paused = contextlib.nullcontext
        try:  # the typed wire: the driver's own decode of a push (replicant.replica.push_received)
            from mnesite.replicant.replica import push_received

            def received(body: object) -> p.PushReceived:
                return push_received(self.replica, body)  # type: ignore[arg-type]

        except ImportError:  # a --baseline tree before the typed wire (dict bodies, decode_entry per entry)

            def received(body: object) -> p.PushReceived:
                decoded = tuple(messages.decode_entry(value, "push.entries") for value in body["entries"])  # type: ignore[index]
                return p.PushReceived("c", "a", decoded, self.committed, True)

        from mnesite.rlog.schema import TableSchema
        from mnesite.rlog.store import Store
        from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, TxKey, WriteOp, make_entry

        self.codec, self.received, self.collector_paused = codec, received, collector_paused
        self.rows, self.schema = rows, TableSchema("kv", "default", "id", (("id", "INTEGER"), ("value", "TEXT")))
        entries = [make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (self.schema.to_op(),))]
        try:  # as a cluster at cluster version 2 packs a bulk write: one run of rows (rlog.types.WriteRows)
            from mnesite.rlog.versions import packs_runs

            runs = {"runs": packs_runs(2)}
        except ImportError:  # a --baseline tree: one op per row
            runs = {}
        for start in range(0, rows, rows_per_transaction):
            keys = range(start, min(rows, start + rows_per_transaction))
            ops = tuple(WriteOp("kv", {"id": i, "value": ROW_VALUE}) for i in keys)
            last = entries[-1]
            key = TxKey(1, last.tx_key.counter + 1)
            entries.append(make_entry("default", key, last.tx_key, last.digest, ops, **runs))
        self.committed = committed = entries[-1].tx_key
        self.pushes = []
        for i in range(0, len(entries), push_entries):
            body = {
                "shard": "default",
                "agent": "a",
                "core": "c",
                "entries": [e.to_wire() for e in entries[i : i + push_entries]],
                "committed": list(committed),
                "hears_sequencer": True,
            }
            self.pushes.append(codec.encode(codec.Message("push", "a", body)))
        # The replicant holds only what it receives: the loaded entries would make every garbage
        # collection of the timed loop walk them.
        self.entries = len(entries)
        del entries, body
        gc.collect()
        self.store = Store(str(directory / "apply.db"), synchronous="NORMAL")
        with self.store.write_transaction():
            self.store.ensure_shard("default", 0)
        self.replica = ShardReplica(
            "default", "r", ("c",), ZERO_KEY, GENESIS_DIGEST, ReplicaConfig(), random.Random(0), 0
        )
        self.replica.step(p.Ticked(), 0)
        self.replica.step(p.JournalsReceived((("c", p.JournalAnswer(committed, True, 0)),)), 0)
        self.replica.step(p.WatchAccepted("c", "a", "resume", ZERO_KEY, GENESIS_DIGEST, self.replica.watch_id), 0)

    def apply(self, index: int) -> None:
        """Push ``index``: decoded, stepped and applied in one transaction, as the driver does it."""
        body = self.codec.decode(self.pushes[index], 64 * 1024 * 1024).body
        self.store.connection.execute("BEGIN IMMEDIATE")
        with self.collector_paused():  # as the driver: left once the push's decoded rows are freed
            apply_push(self.store, self.replica, self.received(body))
        self.store.connection.execute("COMMIT")

    def close(self, check: bool = True) -> None:
        """``check``: that every row arrived (a benchmark of a broken apply would measure nothing)."""
        import apsw

        applied, rows = self.replica.applied_key, 0
        if check:
            with contextlib.suppress(apsw.SQLError):  # no table: nothing was applied
                rows = self.store.count_rows(self.schema)
        self.store.close()
        if check and (applied != self.committed or rows != self.rows):
            raise SystemExit(f"the apply benchmark applied up to {applied} ({rows} rows), not {self.committed}")


def apply_push(store: object, replica: object, push: object) -> None:
    """Step the replica with a decoded push and apply its ``ApplyEntries`` (the driver's ``_step``); a
    function of its own so that its locals, the decoded rows, are freed when it returns."""
    from mnesite.replicant.node import ReplicantNode
    from mnesite.rlog import replication as p

    for effect in replica.step(push, 0):  # type: ignore[attr-defined]
        if isinstance(effect, p.ApplyEntries):
            ReplicantNode.apply_entries(store, effect.entries)  # type: ignore[arg-type]


class RawUpsert:
    """Raw apsw batched upsert of the same rows: one prepared executemany and one transaction per push."""

    def __init__(self, directory: Path, rows: int, rows_per_transaction: int, push_entries: int) -> None:
        import apsw

        self.connection = apsw.Connection(str(directory / "raw-upsert.db"))
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute("PRAGMA synchronous=NORMAL")
        self.connection.execute("CREATE TABLE kv(id INTEGER PRIMARY KEY NOT NULL, value TEXT) STRICT")
        batch_rows = rows_per_transaction * push_entries
        self.batches = [range(start, min(rows, start + batch_rows)) for start in range(0, rows, batch_rows)]

    def apply(self, index: int) -> None:
        with self.connection:
            self.connection.executemany(
                'INSERT OR REPLACE INTO kv ("id", "value") VALUES (?, ?)', ((i, ROW_VALUE) for i in self.batches[index])
            )

    def close(self) -> None:
        self.connection.close()


def apply_round(directory: Path, rows: int, rows_per_transaction: int, push_entries: int) -> tuple[float, float, int]:
    """One round of the apply phase: (replicant seconds, raw apsw seconds, entries).

    The two alternate push by push (a raw batch, then a replicant push, ...), each timed alone: this
    machine's speed swings within seconds (the same code measured 0.39-0.83x in rounds that ran the
    two sides one after the other, 2026-11-27), and a ratio of sums of turns taken milliseconds apart
    swings much less (0.41-0.48x over 15 rounds the same evening).
    """
    replicant = ReplicantApply(directory, rows, rows_per_transaction, push_entries)
    raw = RawUpsert(directory, rows, rows_per_transaction, push_entries)
    replicant_s = raw_s = 0.0
    finished = False
    try:
        for index in range(max(len(replicant.pushes), len(raw.batches))):
            began = time.perf_counter()
            if index < len(raw.batches):
                raw.apply(index)
            middle = time.perf_counter()
            if index < len(replicant.pushes):
                replicant.apply(index)
            raw_s, replicant_s = raw_s + middle - began, replicant_s + time.perf_counter() - middle
        finished = True
    finally:
        raw.close()
        replicant.close(check=finished)  # after a failure: its own error, not the check's
    return replicant_s, raw_s, replicant.entries


def phase_apply(directory: Path, args: argparse.Namespace, report: dict) -> None:
    """Replicant apply rate against raw apsw's batched upsert, push by push (``apply_round``), ``--repeat`` rounds."""
    rows = min(args.rows, args.apply_rows_max)
    rounds = []
    for round_index in range(args.repeat):
        round_directory = directory / f"round{round_index}"
        round_directory.mkdir()
        rounds.append(apply_round(round_directory, rows, args.rows_per_transaction, args.push_entries))
        shutil.rmtree(round_directory, ignore_errors=True)
    ratios = sorted(raw_s / apply_s for apply_s, raw_s, _ in rounds)
    report["apply"] = {
        "rows": rows,
        "entries": rounds[0][2],
        "entries_per_push": args.push_entries,
        "replicant_rows_per_s": [round(rows / apply_s) for apply_s, _, _ in rounds],
        "raw_apsw_rows_per_s": [round(rows / raw_s) for _, raw_s, _ in rounds],
        "x_raw_apsw_per_round": [round(raw_s / apply_s, 3) for apply_s, raw_s, _ in rounds],
        "x_raw_apsw_median": round(ratios[len(ratios) // 2], 2),
    }


def write_latencies(cluster: Cluster, writers: int, seconds: float) -> list[float]:
    """``writers`` clients (spread over the cores) putting one row per transaction for ``seconds``;
    the latency of every acknowledged write, in ms."""
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def run(worker: int) -> None:
        row_id = 2 * 10**9 + worker * 10**7 + int(time.monotonic() * 1000) % 10**6 * 10
        with Client(cluster.endpoints[f"core{worker % 3 + 1}"], timeout_ms=5000, retries=2) as client:
            while time.monotonic() < deadline:
                row_id += 1
                began = time.monotonic()
                try:
                    client.put("kv", {"id": row_id, "value": ROW_VALUE})
                except MnesiteError:
                    continue
                with lock:
                    latencies.append((time.monotonic() - began) * 1000)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(latencies)


def phase_many(directory: Path, args: argparse.Namespace, report: dict) -> None:
    """Clients' write latency with 0 replicants, with ``--replicants`` attached, and with 0 again."""
    cluster = start_cluster(directory)
    try:
        load(cluster, min(args.rows, 10_000), args.rows_per_transaction, 1)
        rounds: dict[str, list[float]] = {}
        cores = [cluster.processes[f"core{n}"] for n in range(1, 4)]
        before = cpu_seconds(cores)
        rounds["none_before"] = write_latencies(cluster, args.writers, args.seconds)
        cores_none_s = sum(cpu_seconds(cores)) - sum(before)
        names = [f"replicant{n}" for n in range(1, args.replicants + 1)]
        for name in names:
            cluster.start_replicant(name)
        target = committed(cluster)

        def all_normal() -> bool:
            for name in names:
                info = cluster.shard(name)
                if info.get("serving") is not True or tuple(info.get("applied", (0, 0))) < target:
                    return False
            return True

        attach_s = cluster.wait(all_normal, args.timeout_s, f"{len(names)} replicants to be normal")
        replicants = [cluster.processes[name] for name in names]
        commits_before = [(cluster.status(name) or {}).get("commits") for name in names]
        before = cpu_seconds(cores + replicants)
        rounds["attached"] = write_latencies(cluster, args.writers, args.seconds)
        used = [after - start for start, after in zip(before, cpu_seconds(cores + replicants), strict=True)]
        commits = [
            after - start if isinstance(start, int) and isinstance(after, int) else None
            for start, after in zip(
                commits_before, [(cluster.status(name) or {}).get("commits") for name in names], strict=True
            )
        ]
        lag = [cluster.shard(name).get("lag_entries") for name in names]
        for name in names:
            cluster.kill(name)
        rounds["none_after"] = write_latencies(cluster, args.writers, args.seconds)
        figures = {
            name: {
                "writes": len(values),
                "p50_ms": round(percentile(values, 0.5), 2),
                "p99_ms": round(percentile(values, 0.99), 2),
            }
            for name, values in rounds.items()
        }
        baseline = (figures["none_before"]["p50_ms"] + figures["none_after"]["p50_ms"]) / 2
        report["many"] = {
            "replicants": len(names),
            "writers": args.writers,
            "seconds_per_round": args.seconds,
            "attach_s": round(attach_s, 2),
            "lag_entries_after": lag,
            "rounds": figures,
            "x_p50_attached_vs_none": round(figures["attached"]["p50_ms"] / baseline, 2) if baseline else None,
            # CPU from /proc over a round, divided by the writes acknowledged in it (every replicant
            # applies each of them): the cores summed, and each replicant.
            "cores_cpu_ms_per_write_none": _per_write(cores_none_s, len(rounds["none_before"])),
            "cores_cpu_ms_per_write_attached": _per_write(sum(used[:3]), len(rounds["attached"])),
            "replicant_cpu_ms_per_write": [_per_write(value, len(rounds["attached"])) for value in used[3:]],
            # The replicants' SQLite commits (about one per loop turn that applied pushes) per write:
            # 1.0 is a push per write, lower is batching (a tree without the ``commits`` status: None).
            "replicant_commits_per_write": [
                round(value / len(rounds["attached"]), 2) if value is not None and rounds["attached"] else None
                for value in commits
            ],
        }
    finally:
        cluster.close()


def _per_write(cpu_s: float, writes: int) -> float | None:
    return round(cpu_s / writes * 1000, 3) if writes else None


def raw_apsw_copy(source: Path, target: Path) -> tuple[int, float]:
    """Copy table kv from ``source`` to a new WAL database in key order, one transaction; (rows, seconds)."""
    import apsw

    began = time.monotonic()
    reader = apsw.Connection(str(source), flags=apsw.SQLITE_OPEN_READONLY)
    writer = apsw.Connection(str(target))
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA synchronous=NORMAL")
    writer.execute("CREATE TABLE kv(id INTEGER PRIMARY KEY, value TEXT) STRICT")
    rows = 0
    with writer:
        for row in reader.execute('SELECT id, value FROM "kv" ORDER BY id'):
            writer.execute("INSERT INTO kv VALUES (?, ?)", row)
            rows += 1
    elapsed = time.monotonic() - began
    reader.close()
    writer.close()
    return rows, elapsed


def phase_bootstrap(directory: Path, args: argparse.Namespace, report: dict) -> None:
    cluster = start_cluster(directory, "[rlog]\nretention_entries_max = 50\n")
    try:
        load(cluster, args.rows, args.rows_per_transaction, args.loaders)
        cluster.wait(lambda: committed(cluster) == tuple(cluster.shard("core1")["applied"]), 60, "core1 to apply")
        rows, raw_s = raw_apsw_copy(directory / "core1" / "mnesite.db", directory / "raw-copy.db")
        before = cluster.generations()
        target = committed(cluster)
        cluster.start_replicant()
        copy_began: list[float] = []

        def done() -> bool:
            info = cluster.shard("replicant1")
            if not copy_began and info.get("mode") == "bootstrap":
                copy_began.append(time.monotonic())
            return normal_at(cluster, target)

        bootstrap_s = cluster.wait(done, args.timeout_s, "the bootstrap", interval_s=0.02)
        # From the watch answer (mode bootstrap) to normal at the committed key: the copy and the
        # replay, without the replicant's process start and shard discovery.
        copy_s = time.monotonic() - copy_began[0] if copy_began else bootstrap_s
        info = cluster.shard("replicant1")
        report["bootstrap"] = {
            "rows": rows,
            "raw_apsw_copy_s": round(raw_s, 2),
            "bootstrap_s": round(bootstrap_s, 2),
            "copy_and_replay_s": round(copy_s, 2),
            "x_raw_apsw": round(copy_s / raw_s, 2),
            "x_raw_apsw_with_start": round(bootstrap_s / raw_s, 2),
            "rows_copied": info["rows_copied"],
            "bootstraps": info["bootstraps"],
            "generations_before": before,
            "generations_after": cluster.generations(),
        }
    finally:
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rows-per-transaction", type=int, default=1000)
    parser.add_argument("--loaders", type=int, default=1)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each lag measurement")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--phases", default="catchup,lag,failover,bootstrap")
    parser.add_argument("--replicants", type=int, default=10, help="replicants attached in the many phase")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the apply phase (median reported)")
    parser.add_argument("--push-entries", type=int, default=10, help="entries per push in the apply phase")
    parser.add_argument("--apply-rows-max", type=int, default=200_000, help="rows of the apply phase at most")
    parser.add_argument("--keep", action="store_true", help="keep the data directories and logs")
    parser.add_argument(
        "--baseline",
        type=lambda text: Path(text).resolve(),
        help="run the servers (cores, replicants) from another commit's source tree (git archive REV | tar -x -C TREE)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.phases = set(args.phases.split(","))
    root = Path(tempfile.mkdtemp(prefix="mnesite-bench-catchup-"))
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "directory": str(root)}
    if args.baseline is not None:
        from bench_peers import package_layout

        global SERVER_PYTHONPATH
        SERVER_PYTHONPATH = package_layout(args.baseline, root)
        report["servers_from"] = str(args.baseline)
    try:
        if args.phases & {"catchup", "lag", "failover"}:
            (root / "catchup").mkdir()
            phase_catchup(root / "catchup", args, report)
        if "many" in args.phases:
            (root / "many").mkdir()
            phase_many(root / "many", args, report)
        if "apply" in args.phases:
            (root / "apply").mkdir()
            phase_apply(root / "apply", args, report)
        if "bootstrap" in args.phases:
            (root / "bootstrap").mkdir()
            phase_bootstrap(root / "bootstrap", args, report)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
