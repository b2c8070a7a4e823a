"""The core node driver: a zmq ROUTER in front of the apsw store, with group commit.

Theory of operation
-------------------
One thread owns the socket and the database, so nothing here needs a lock. Each turn of
the loop drains up to ``group_commit_max`` frames that are already waiting:

* malformed frames get an error reply at once (the node keeps serving);
* reads (``get``, ``scan``, ``status``, ...) are answered at once from the database;
* writes (``transact``, ``create_table``) are collected into one batch.

The batch runs in ONE SQLite write transaction (one fsync). Each client transaction in
it runs in its own savepoint: guards are evaluated against the state left by the
transactions before it in the batch, its result ops are logged as an rlog entry with the
next tx key, applied, and the shard's applied key and digest move with it (invariant 4).
A failure rolls back that savepoint only. Replies are sent after COMMIT returns, so an
acknowledged write is durable at the configured ``synchronous`` level.

A single core is its own sequencer: at start-up it opens a new generation per shard
(persisted before use), so tx keys never repeat across restarts.

Retried requests are idempotent: a transaction whose request id is in the retained rlog is
answered with its original tx key and not applied again.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import apsw
import msgpack
import zmq

from core.transaction import GuardFailed, evaluate, parse_transaction
from rlog import codec
from rlog.codec import CodecError, Message
from rlog.config import Config, ConfigError
from rlog.schema import DEFAULT_SHARD, SchemaError, TableSchema, check_key, define_table
from rlog.store import ShardPosition, Store, StoreError
from rlog.types import ZERO_KEY, OpDecodeError, TxKey, entry_to_json, make_entry, tx_key_from_wire

log = logging.getLogger("mnesite.core")

READ_KINDS = frozenset({"get", "scan", "status", "list_tables", "rlog_tail", "rlog_entries"})
WRITE_KINDS = frozenset({"transact", "create_table"})
CONSISTENCY_LEVELS = ("local", "read-your-writes", "linearizable")
RLOG_TAIL_COUNT_MAX = 1000
RETENTION_INTERVAL_MS = 1000
POLL_INTERVAL_MS = 100
# zmq drops (disconnects) peers whose message exceeds this; frames between frame_bytes_max and
# this bound still get a clear frame_too_large reply.
SOCKET_MESSAGE_FACTOR = 4


class RequestError(Exception):
    def __init__(self, code: str, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


def now_ms() -> int:
    return int(time.time() * 1000)


class CoreNode:
    def __init__(self, config: Config, clock_ms: Callable[[], int] = now_ms) -> None:
        if config.role != "core":
            raise ConfigError(f"[node].role is {config.role!r}; this version runs core nodes only")
        others = sorted(set(config.core_nodes) - {config.name})
        if others:
            raise ConfigError(
                f"[cluster].core_nodes lists other cores ({', '.join(others)}); "
                "this version runs a single core: list only this node"
            )
        self.config = config
        self.clock_ms = clock_ms
        os.makedirs(config.data_dir, exist_ok=True)
        self.store = Store(config.database_path, synchronous=config.synchronous)
        self.last_key: dict[str, TxKey] = {}
        with self.store.write_transaction():
            for shard, position in self.store.shards().items():
                # A single core elects itself: a new generation per start, persisted before use.
                self.store.set_generation(shard, position.generation + 1)
                self.last_key[shard] = self.store.last_entry_key(shard)
        self.context: zmq.Context | None = None
        self.socket: zmq.Socket | None = None
        self.stopping = threading.Event()
        self.commits = 0
        self.transactions = 0
        self._next_retention_ms = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 10_000)
        self.socket.setsockopt(zmq.SNDHWM, 10_000)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.config.limits.frame_bytes_max * SOCKET_MESSAGE_FACTOR)
        self.socket.bind(self.config.listen)

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stopping.set())

    def serve_forever(self) -> None:
        if self.socket is None:
            self.bind()
        if self.socket is None:
            raise RuntimeError("socket not bound")
        log.info("core %s serving on %s, data in %s", self.config.name, self.config.listen, self.config.data_dir)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                if poller.poll(POLL_INTERVAL_MS):
                    self._serve_waiting()
                self._maybe_trim()
        finally:
            self.close()

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(0)
            self.socket = None
        if self.context is not None:
            self.context.term()
            self.context = None
        self.store.close()

    # -- the loop ----------------------------------------------------------------------------

    def _serve_waiting(self) -> None:
        if self.socket is None:
            return
        writes: list[tuple[list[bytes], Message]] = []
        for _ in range(self.config.limits.group_commit_max):
            try:
                parts = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(parts) < 2:
                continue  # not from a ROUTER peer we can answer
            envelope, frame = parts[:-1], parts[-1]
            try:
                message = codec.decode(frame, self.config.limits.frame_bytes_max)
            except CodecError as error:
                self._send(envelope, codec.error(_request_id_of(frame), error.code, str(error)))
                continue
            if message.kind in WRITE_KINDS:
                writes.append((envelope, message))
            elif message.kind in READ_KINDS:
                self._send(envelope, self._answer(message, self._read))
            else:
                self._send(envelope, codec.error(message.request_id, "bad_request", f"{message.kind} is a reply kind"))
        if writes:
            for envelope, answer in self.commit_batch(writes):
                self._send(envelope, answer)

    def _send(self, envelope: list[bytes], message: Message) -> None:
        if self.socket is None:
            return
        try:
            frame = codec.encode(message)
        except CodecError as error:
            frame = codec.encode(codec.error(message.request_id, "internal", f"reply not encodable: {error}"))
        try:
            self.socket.send_multipart([*envelope, frame], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("reply to a slow client dropped (send queue full)")

    def _answer(self, message: Message, handler: Callable[[Message], Any]) -> Message:
        try:
            return codec.reply(message.request_id, handler(message))
        except RequestError as error:
            return codec.error(message.request_id, error.code, str(error), error.detail)
        except SchemaError as error:
            return codec.error(message.request_id, error.code, str(error))
        except (StoreError, apsw.Error) as error:
            log.exception("request %s failed", message.kind)
            return codec.error(message.request_id, "internal", f"{type(error).__name__}: {error}")

    # -- writes ------------------------------------------------------------------------------

    def commit_batch(self, writes: list[tuple[Any, Message]]) -> list[tuple[Any, Message]]:
        """Run a batch of write requests in one SQLite transaction; return the replies."""
        answers: list[tuple[Any, Message]] = []
        last_key = dict(self.last_key)
        try:
            with self.store.write_transaction():
                for envelope, message in writes:
                    answers.append((envelope, self._answer(message, lambda m: self._write(m, last_key))))
        except apsw.Error as error:
            log.exception("group commit of %d requests failed", len(writes))
            return [
                (envelope, codec.error(message.request_id, "internal", f"commit failed: {error}"))
                for envelope, message in writes
            ]
        self.last_key = last_key
        self.commits += 1
        self.transactions += len(writes)
        return answers

    def _write(self, message: Message, last_key: dict[str, TxKey]) -> Any:
        previous = self.store.find_request(message.request_id)
        if previous is not None:
            return {"tx_key": list(previous[1]), "duplicate": True}
        if message.kind == "create_table":
            body = message.body
            table = define_table(body["table"], body["key"], body["columns"], body.get("shard", DEFAULT_SHARD))
            existing = self.store.catalog().get(table.name)
            if existing is not None:
                raise RequestError("table_exists", f"table {table.name!r} already exists in shard {existing.shard!r}")
            return self._log(table.shard, (table.to_op(),), message.request_id, last_key)
        catalog = self.store.catalog()
        transaction = parse_transaction(
            message.body.get("guards"), message.body["ops"], catalog, self.config.limits.transaction_ops_max
        )
        outcome = evaluate(transaction, catalog, self.store.read_row)
        if isinstance(outcome, GuardFailed):
            raise RequestError(
                "guard_failed",
                outcome.describe(),
                {"index": outcome.index, "actual": outcome.actual},
            )
        return self._log(transaction.shard, outcome, message.request_id, last_key)

    def _log(self, shard: str, ops: tuple, request_id: str, last_key: dict[str, TxKey]) -> dict[str, Any]:
        position = self.store.shard(shard)
        if position is None:
            position = self.store.ensure_shard(shard, 1)
            last_key[shard] = ZERO_KEY
        previous = last_key.get(shard, ZERO_KEY)
        if previous != position.applied:
            raise StoreError(f"shard {shard}: last logged {previous} but applied {position.applied}")
        if previous.generation == position.generation:
            tx_key = TxKey(position.generation, previous.counter + 1)
        else:
            tx_key = TxKey(position.generation, 1)
        entry = make_entry(shard, tx_key, previous, position.digest, ops, request_id)
        with self.store.savepoint():
            self.store.append_entry(entry, self.clock_ms())
            self.store.apply_entry(entry)
        last_key[shard] = tx_key
        return {"tx_key": list(tx_key)}

    def _maybe_trim(self) -> None:
        now = self.clock_ms()
        if now < self._next_retention_ms:
            return
        self._next_retention_ms = now + RETENTION_INTERVAL_MS
        retention = self.config.retention
        before_ms = now - retention.retention_age_ms_max if retention.retention_age_ms_max else None
        try:
            with self.store.write_transaction():
                for shard in self.store.shards():
                    self.store.trim(shard, retention.retention_entries_max, before_ms)
        except apsw.Error:
            log.exception("rlog retention failed; will retry")

    # -- reads -------------------------------------------------------------------------------

    def _table(self, name: str) -> TableSchema:
        table = self.store.catalog().get(name)
        if table is None:
            raise RequestError("unknown_table", f"unknown table {name!r}")
        return table

    def _check_consistency(self, message: Message) -> None:
        # A single core is the sequencer and applies before it acknowledges, so every
        # local read here is also read-your-writes and linearizable.
        level = message.body.get("consistency", "local")
        if level not in CONSISTENCY_LEVELS:
            raise RequestError("bad_request", f"consistency must be one of {', '.join(CONSISTENCY_LEVELS)}")

    def _read(self, message: Message) -> Any:
        body = message.body
        if message.kind == "get":
            self._check_consistency(message)
            table = self._table(body["table"])
            return self.store.read_row(table, check_key(table, body["key"]))
        if message.kind == "scan":
            self._check_consistency(message)
            table = self._table(body["table"])
            limit = body.get("limit", self.config.limits.scan_rows_max)
            if not 0 < limit <= self.config.limits.scan_rows_max:
                raise RequestError("bad_request", f"limit must be 1..{self.config.limits.scan_rows_max}")
            after = body.get("after")
            if after is not None:
                after = check_key(table, after)
            return self.store.scan(table, after, limit)
        if message.kind == "list_tables":
            return [table.to_json() for table in self.store.catalog().values()]
        if message.kind == "status":
            return self.status()
        if message.kind == "rlog_tail":
            count = body.get("count", 10)
            if not 0 < count <= RLOG_TAIL_COUNT_MAX:
                raise RequestError("bad_request", f"count must be 1..{RLOG_TAIL_COUNT_MAX}")
            self._shard(body["shard"])
            return [entry_to_json(entry) for entry in self.store.tail(body["shard"], count)]
        if message.kind == "rlog_entries":
            limit = body.get("limit", RLOG_TAIL_COUNT_MAX)
            if not 0 < limit <= RLOG_TAIL_COUNT_MAX:
                raise RequestError("bad_request", f"limit must be 1..{RLOG_TAIL_COUNT_MAX}")
            self._shard(body["shard"])
            try:
                after = tx_key_from_wire(body.get("after", [0, 0]))
            except OpDecodeError as error:
                raise RequestError("bad_request", str(error)) from None
            return [entry_to_json(entry) for entry in self.store.entries_after(body["shard"], after, limit)]
        raise RequestError("bad_request", f"unknown request {message.kind}")

    def _shard(self, shard: str) -> ShardPosition:
        position = self.store.shard(shard)
        if position is None:
            raise RequestError("unknown_shard", f"unknown shard {shard!r}")
        return position

    def status(self) -> dict[str, Any]:
        shards = {}
        for shard, position in self.store.shards().items():
            shards[shard] = {
                "applied": list(position.applied),
                "digest": position.digest.hex(),
                "generation": position.generation,
                "sequencer": self.config.name,
                "committed": list(position.applied),
                "rlog": self.store.rlog_statistics(shard),
            }
        return {
            "node": self.config.name,
            "role": self.config.role,
            "listen": self.config.listen,
            "data_dir": self.config.data_dir,
            "commits": self.commits,
            "transactions": self.transactions,
            "shards": shards,
        }


def _request_id_of(frame: bytes) -> str:
    """Best effort: echo the request id of a frame we could not decode, so the client can match it."""
    try:
        value = msgpack.unpackb(frame, raw=False, ext_hook=lambda code, data: None)
        if isinstance(value, list) and len(value) == 4 and isinstance(value[2], str) and 0 < len(value[2]) <= 64:
            return value[2]
    except Exception:  # garbage: there is no request id to echo
        pass
    return "?"
