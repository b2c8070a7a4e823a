"""Content-level fuzzing of running nodes: send hostile messages with pyzmq, then check every node.

A run sends batches of messages drawn from ``tests.fuzz.strategies`` (plus hand-built frames nested
about 1,010 levels deep, which msgpack-python itself refuses to pack) to every node of a running
cluster, round robin, from one DEALER per node, reading answers as they come. After each batch:

* every node process is alive and answers ``status`` within 1 s;
* no write got lost in silence: every ``transact`` / ``create_table`` sent got an answer in time;
* the state changed only by legitimate writes: every rlog entry appended since the run began is the
  new generation's no-op or carries the request id of a write that was answered with success, and
  every node's tables are the model's (the tables before the run plus those created with success);
* all nodes converge on one applied key and digest per shard (the replicant included);
* each node's RSS is recorded; ``FuzzReport.rss_ratio_max`` is the largest RSS over the first one.

And as answers come: a ``backup_read`` is answered with bytes only for a path a ``backup`` asked the node
to write (never another file of the node's host).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq
from mnesite.rlog import messages
from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.roles import WRITE_KINDS  # every kind that may log an entry (schema changes too)
from mnesite.rlog.versions import CLUSTER_VERSION_HIGHEST

from tests.conftest import Cluster, wait_until

DEEP_LEVELS = 1010
STATUS_TIMEOUT_MS = 1000
WRITE_ANSWER_TIMEOUT_S = 30.0
CONVERGE_TIMEOUT_S = 60.0


class FuzzFailure(AssertionError):
    pass


INTERNAL_MESSAGES_KEPT = 20


@dataclass
class FuzzReport:
    messages_sent: int = 0
    deep_frames_sent: int = 0
    not_packable: int = 0
    answers: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    # The messages of ``internal`` answers (an unexpected exception a node caught): each is a bug to
    # look at, so the first few are kept for the report (bounded, truncated).
    internal_messages: list[str] = field(default_factory=list)
    writes_succeeded: int = 0
    batches: int = 0
    rss_start_kb: dict[str, int] = field(default_factory=dict)
    rss_max_kb: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def rss_ratio_max(self) -> float:
        return max((self.rss_max_kb[n] / self.rss_start_kb[n] for n in self.rss_start_kb), default=0.0)

    def summary(self) -> str:
        rss = ", ".join(
            f"{name} {start // 1024}->{self.rss_max_kb[name] // 1024} MB" for name, start in self.rss_start_kb.items()
        )
        codes = ", ".join(f"{code} {count}" for code, count in sorted(self.errors_by_code.items()))
        return (
            f"{self.messages_sent} messages ({self.deep_frames_sent} {DEEP_LEVELS}-level frames) in {self.batches} "
            f"batches, {self.seconds:.0f} s; answers {self.answers}; writes succeeded {self.writes_succeeded}; "
            f"not packable (skipped) {self.not_packable}; error codes: {codes}; RSS {rss}; "
            f"max ratio {self.rss_ratio_max:.2f}"
            + "".join(f"\n  internal: {message}" for message in self.internal_messages)
        )


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise FuzzFailure(f"no VmRSS for pid {pid}")


def deep_frame(kind: str, body: dict[str, Any], field_name: str, request_id: str) -> bytes:
    """``body`` with ``field_name`` replaced by [[[...]]] of DEEP_LEVELS levels, spliced in as raw bytes."""
    marker = f"@deep-{uuid.uuid4().hex}@"
    frame = msgpack.packb(
        [messages.PROTOCOL_VERSION, kind, request_id, {**body, field_name: marker}], use_bin_type=True
    )
    return frame.replace(msgpack.packb(marker), b"\x91" * DEEP_LEVELS + b"\x90")


class Fuzzer:
    def __init__(self, cluster: Cluster, names: list[str], cores: list[str]) -> None:
        self.cluster = cluster
        self.names = names
        self.cores = cores
        self.context = zmq.Context.instance()
        self.sockets: dict[str, zmq.Socket] = {}
        for name in names:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 100_000)
            socket.connect(cluster.endpoints[name])
            self.sockets[name] = socket
        self.report = FuzzReport()
        self.writes_pending: dict[str, str] = {}  # request id -> kind
        self.sent_to: dict[str, str] = {}
        self.writes_ok: set[str] = set()
        self.writes_refused: set[str] = set()
        self.tables: dict[str, Any] = {}
        self.shards: set[str] = set()
        self.shards_allowed: set[str] = set()
        self.create_shards: dict[str, str] = {}
        self.start_keys: dict[str, list[int]] = {}
        # backup_read request id -> its path; the paths a backup asked for (the only ones a node may send).
        self.backup_reads: dict[str, Any] = {}
        self.backup_paths: set[str] = set()
        self._next = 0
        self._started = time.monotonic()

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close(0)

    # -- before the run ----------------------------------------------------------------------

    def baseline(self) -> None:
        with self.cluster.client(self.cores[0]) as client:
            self.tables = {t["table"]: t for t in client.list_tables()}
            status = client.status()
        self.start_keys = {shard: info["applied"] for shard, info in status["shards"].items()}
        self.shards = set(status["shards"])
        for name in self.names:
            pid = self.cluster.nodes[name].process.pid
            self.report.rss_start_kb[name] = self.report.rss_max_kb[name] = rss_kb(pid)

    # -- sending -----------------------------------------------------------------------------

    def send(self, kind: str, body: dict[str, Any]) -> None:
        request_id = f"fz{self.report.messages_sent}-{uuid.uuid4().hex[:8]}"
        try:
            frame = msgpack.packb([messages.PROTOCOL_VERSION, kind, request_id, body], use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            self.report.not_packable += 1  # e.g. an integer below -2**63: msgpack has no encoding for it
            return
        path = body.get("path") if isinstance(body, dict) else None
        if kind == "backup" and isinstance(path, str):  # a path of another type is refused unread
            self.backup_paths.add(path)
        elif kind == "backup_read":  # any answer with bytes to a path of another type is a failure too
            self.backup_reads[request_id] = path if isinstance(path, str) else repr(path)
        self._send_frame(kind, frame, request_id)
        if request_id in self.writes_pending:
            self.writes_pending[request_id] = f"{kind} to {self.sent_to[request_id]}: {str(body)[:300]}"
            if kind == "create_table" and isinstance(body.get("shard"), str):
                self.create_shards[request_id] = body["shard"]

    def send_deep(self, kind: str, body: dict[str, Any]) -> None:
        if not body:
            return
        request_id = f"fzd{self.report.messages_sent}-{uuid.uuid4().hex[:8]}"
        field_name = sorted(body)[self.report.messages_sent % len(body)]
        try:
            frame = deep_frame(kind, body, field_name, request_id)
        except (OverflowError, ValueError, TypeError):
            self.report.not_packable += 1
            return
        self.report.deep_frames_sent += 1
        # Not tracked as a write: a node cannot even read the request id of a frame this deep, so the
        # refusal comes back under the id "?" (and nothing this deep can be applied).
        self._send_frame("deep", frame, request_id)

    def _send_frame(self, kind: str, frame: bytes, request_id: str) -> None:
        name = self.names[self._next % len(self.names)]
        self._next += 1
        self.sent_to[request_id] = name
        if kind in WRITE_KINDS:
            self.writes_pending[request_id] = kind
        self.sockets[name].send(frame)
        self.report.messages_sent += 1
        self.drain(0)

    def drain(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        for socket in self.sockets.values():
            poller.register(socket, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(timeout_ms))
            if not ready:
                return
            for socket in ready:
                while True:
                    try:
                        frame = socket.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_answer(frame)
            timeout_ms = 0

    def _on_answer(self, frame: bytes) -> None:
        self.report.answers += 1
        try:
            answer = messages.decode(frame, 64 * 1024 * 1024)
        except messages.MessageError as error:
            raise FuzzFailure(f"a node sent an undecodable answer: {error}") from None
        if answer.kind == "error":
            code = answer.body.code
            self.report.errors_by_code[code] = self.report.errors_by_code.get(code, 0) + 1
            if code == "internal" and len(self.report.internal_messages) < INTERNAL_MESSAGES_KEPT:
                self.report.internal_messages.append(str(answer.body.message)[:300])
        read_path = self.backup_reads.pop(answer.request_id, None)
        if answer.kind == "reply" and read_path is not None and read_path not in self.backup_paths:
            raise FuzzFailure(f"a node sent {read_path!r:.80} to a backup_read, a file no backup was asked to write")
        kind = self.writes_pending.pop(answer.request_id, None)
        if kind is None:
            return
        if kind.startswith("create_table") and (
            answer.kind == "reply" or answer.body.code in ("no_sequencer", "outcome_unknown", "overloaded")
        ):
            # A valid create_table opens its shard before the sequencer answers (it may campaign there).
            self.shards_allowed.add(self.create_shards.get(answer.request_id, "default"))
        if answer.kind == "reply":
            self.writes_ok.add(answer.request_id)
            self.report.writes_succeeded += 1
        elif answer.body.code == "outcome_unknown":
            self.writes_ok.add(answer.request_id)  # it may have committed: a legitimate write either way
        else:
            self.writes_refused.add(answer.request_id)

    # -- checking ----------------------------------------------------------------------------

    def check(self) -> None:
        """The after-batch checks (see the module docstring); raises ``FuzzFailure``."""
        self.report.batches += 1
        for name in self.names:
            process = self.cluster.nodes[name].process
            if process is None or process.poll() is not None:
                raise FuzzFailure(f"{name} died: {self.cluster.nodes[name].log_path.read_text()[-3000:]}")
            started = time.monotonic()
            try:
                with Client(self.cluster.endpoints[name], timeout_ms=STATUS_TIMEOUT_MS, retries=0) as client:
                    client.status()
            except MnesiteError as error:
                raise FuzzFailure(f"{name} did not answer status within {STATUS_TIMEOUT_MS} ms: {error}") from None
            if time.monotonic() - started > STATUS_TIMEOUT_MS / 1000:
                raise FuzzFailure(f"{name} took {time.monotonic() - started:.2f} s to answer status")
            kb = rss_kb(process.pid)
            self.report.rss_max_kb[name] = max(self.report.rss_max_kb[name], kb)
        deadline = time.monotonic() + WRITE_ANSWER_TIMEOUT_S
        while self.writes_pending and time.monotonic() < deadline:
            self.drain(100)
        if self.writes_pending:
            unanswered = list(self.writes_pending.values())[:5]
            raise FuzzFailure(f"{len(self.writes_pending)} writes were never answered (a hang): {unanswered}")
        # Converged first: the tables are compared node by node, and a core one entry behind (a drop
        # or a create applied by core2, not yet by core1) is not a divergence (100k run, 2026-11-23).
        self._check_converged()
        self._refresh_model_tables()
        self._check_entries_are_legitimate()
        self.report.seconds = time.monotonic() - self._started
        progress = os.environ.get("MNESITE_FUZZ_PROGRESS")
        if progress:  # long runs: one line per batch, so that a stopped run still has its figures
            with open(progress, "a") as handle:
                handle.write(f"{time.strftime('%H:%M:%S')} {self.report.summary()}\n")

    def _refresh_model_tables(self) -> None:
        # Tables created by a write answered with success are legitimate; read their definitions once.
        with self.cluster.client(self.cores[0]) as client:
            for table in client.list_tables():
                self.tables.setdefault(table["table"], None)

    def _check_entries_are_legitimate(self) -> None:
        with self.cluster.client(self.cores[0], timeout_ms=5000) as client:
            status = client.status()
            for shard, info in status["shards"].items():
                after = self.start_keys.get(shard, [0, 0])
                while True:
                    entries = client.rlog_entries(shard, after, 1000)
                    for entry in entries:
                        request_id = entry["request_id"]
                        if request_id is None and not entry["ops"]:
                            continue  # a new generation's no-op
                        if _cores_own_cluster_version_entry(entry, shard):
                            continue  # issue 23: the cores agree on the cluster version through the log
                        if request_id not in self.writes_ok:
                            raise FuzzFailure(
                                f"entry {entry['tx_key']} of shard {shard} (request {request_id!r}) was not "
                                f"answered with success: an unintended state change; ops {str(entry['ops'])[:300]}"
                            )
                        for op in entry["ops"]:
                            if op["op"] == "create_table":
                                self.tables[op["table"]] = op
                                self.shards.add(op["shard"])
                            elif op["op"] == "drop_table":
                                self.tables.pop(op["table"], None)
                    if len(entries) < 1000:
                        break
                    after = entries[-1]["tx_key"]
                self.start_keys[shard] = info["applied"] if not entries else entries[-1]["tx_key"]
        for name in self.cores:
            with self.cluster.client(name, timeout_ms=5000) as client:
                tables = {t["table"] for t in client.list_tables()}
                shards = set(client.status()["shards"])
            if tables != set(self.tables):
                raise FuzzFailure(f"{name} has tables {sorted(tables)}, the model {sorted(self.tables)}")
            if not self.shards <= shards <= self.shards | self.shards_allowed:
                raise FuzzFailure(
                    f"{name} has shards {sorted(shards)}, the model {sorted(self.shards)} "
                    f"(and maybe {sorted(self.shards_allowed)})"
                )

    def _check_converged(self) -> None:
        def positions() -> dict[str, Any]:
            result = {}
            for name in self.names:
                status = self.cluster.status(name, timeout_ms=2000)
                if status is None:
                    return {}
                result[name] = {s: (tuple(i["applied"]), i["digest"]) for s, i in status["shards"].items()}
            return result

        def converged() -> bool:
            found = positions()
            return bool(found) and len({tuple(sorted(p.items())) for p in found.values()}) == 1

        try:
            wait_until(converged, CONVERGE_TIMEOUT_S, "every node to converge", interval_s=0.2)
        except AssertionError:
            raise FuzzFailure(f"nodes did not converge: {positions()}") from None


def _cores_own_cluster_version_entry(entry: dict, shard: str) -> bool:
    """An entry the cores append themselves (rlog.versions): only cluster-version ops of this shard,
    at the highest version this release speaks. No client request can log such an op (a transaction
    holds writes and deletes only), so a fuzzed message cannot have made it."""
    ops = entry["ops"]
    return bool(ops) and all(
        op.get("op") == "cluster_version"
        and op.get("shard") == shard
        and op.get("cluster_version") == CLUSTER_VERSION_HIGHEST
        for op in ops
    )
