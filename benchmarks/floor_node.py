"""The floor: the least a replicated, durable write costs with mnesite's stack on this machine.

    .venv/bin/python benchmarks/floor_node.py --role single|leader|follower --port P --db FILE
        [--peers PORT,PORT] [--leader PORT]

``bench_peers.py --systems floor-1,floor-3,...`` starts these processes; they are not a database.
They do only what any replicated write must do, with the same parts mnesite uses (CPython, pyzmq,
apsw with a WAL and an fsync per commit, one process per node, 127.0.0.1):

* ``single`` (floor-1): a loop turn reads every request waiting on its ROUTER socket, inserts them
  into one table in one transaction, commits it (``synchronous=FULL``: the WAL is fsynced), and
  answers each.
* ``leader`` (floor-3, with two followers): the same turn, but it sends the turn's requests to its
  first follower *before* its own commit (so that follower's fsync overlaps its own, as mnesite's
  sequencer does) and answers a request once its own commit is done and a follower has
  acknowledged it: two of three nodes have it on disk. The second follower is fed lazily, as
  mnesite's sequencer feeds the follower no commit waits for (``[cluster] lazy_feed_interval_ms``,
  ``core.consensus``): what accumulated since its last append, every ``--lazy-feed-ms`` (20, the
  product's default; sooner once a feed would pass ``FRAME_BYTES_MAX``); ``--lazy-feed-ms 0`` sends
  every turn to both followers, as the floor did until 2026-12-03.
* ``follower``: a turn inserts every append waiting on its socket in one transaction, commits it
  (fsync) and acknowledges the last one to the leader.

With ``--log`` (``floor-1-log``, ``floor-3-log`` in ``bench_peers``) every node also keeps what a
replica of mnesite's design keeps beside the table, in the same transaction: a log row per write
(its position, its request id, under an index on the request id as ``_mnesite_rlog``'s, and the
write) and a BLAKE2b digest chain over the writes (each digest over the previous one and the
write: the hashing a follower's chain check costs). Still no checks, no decoding, no consensus state.

No checks, no consensus state, no log beside the table, no apply, no metrics: whatever mnesite's
cores spend above these processes is theirs; what these processes spend is the floor that a
mnesite of this design (Python processes talking zmq, SQLite's commit) cannot go below on this
machine. Its WAL is checkpointed by a thread with its own connection, off the loop, as mnesite's
is (``rlog.checkpoint``), so that the WAL is overwritten rather than grown.

Frames (all from 127.0.0.1 peers of one benchmark run; the sizes are bounded all the same):
a client sends ``[key, value]``; a leader sends a follower ``[b"append", seq, key, value, ...]`` (a
lazy feed: every pair since the last one, ``seq`` the last turn's); a follower answers
``[b"ack", seq]``; every answer to a client is ``[b"ok"]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import os
import signal
import sys
import threading
import time

import apsw
import zmq

TURN_MESSAGES_MAX = 4096  # messages read in one turn: bounded, and one transaction carries them
FRAME_BYTES_MAX = 1 << 20  # a frame larger than this is refused by zmq (MAXMSGSIZE)
WAITING_MAX = 1 << 16  # requests committed here and waiting for a follower's acknowledgement
CHECKPOINT_EVERY_S = 0.5


def open_table(path: str) -> apsw.Connection:
    connection = apsw.Connection(path)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("PRAGMA wal_autocheckpoint=0")
    connection.execute("CREATE TABLE IF NOT EXISTS kv(key BLOB PRIMARY KEY, value BLOB NOT NULL)")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS log(position INTEGER PRIMARY KEY, request_id BLOB, digest BLOB NOT NULL, "
        "value BLOB NOT NULL)"
    )
    connection.execute("CREATE INDEX IF NOT EXISTS log_request ON log(request_id)")
    return connection


class Log:
    """``--log``: a node's log rows and digest chain (the module's docstring), continued from its disk."""

    def __init__(self, connection: apsw.Connection) -> None:
        last = connection.execute("SELECT position, digest FROM log ORDER BY position DESC LIMIT 1").fetchone()
        self.position, self.digest = last if last is not None else (0, bytes(32))

    def rows(self, pairs: list[tuple[bytes, bytes]]) -> list[tuple[int, bytes, bytes, bytes]]:
        rows = []
        for key, value in pairs:
            self.position += 1
            self.digest = hashlib.blake2b(self.digest + key + value, digest_size=32).digest()
            rows.append((self.position, key, self.digest, value))
        return rows


def checkpoint_forever(path: str, stop: threading.Event) -> None:
    connection = apsw.Connection(path)
    connection.set_busy_timeout(1000)
    while not stop.wait(CHECKPOINT_EVERY_S):
        with contextlib.suppress(apsw.BusyError):  # the writer holds the lock: the next round
            connection.execute("PRAGMA wal_checkpoint(PASSIVE)")


def insert(connection: apsw.Connection, pairs: list[tuple[bytes, bytes]], log: Log | None = None) -> None:
    connection.execute("BEGIN")
    if log is not None:
        connection.executemany(
            "INSERT INTO log(position, request_id, digest, value) VALUES (?, ?, ?, ?)", log.rows(pairs)
        )
    connection.executemany("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", pairs)
    connection.execute("COMMIT")  # synchronous=FULL in WAL mode: the WAL is fsynced here


def well_formed(role: str, frames: list[bytes]) -> bool:
    """Whether a ROUTER message has the parts its role reads (see the module's frames)."""
    if role == "follower":
        return len(frames) >= 3 and len(frames) % 2 == 1 and frames[1] == b"append" and frames[2].isdigit()
    if len(frames) == 3 and frames[1] == b"ack":
        return role == "leader" and frames[2].isdigit()
    return len(frames) == 3


def serve(role: str, port: int, db: str, peers: list[int], leader: int | None, lazy_feed_ms: int, logged: bool) -> None:
    connection = open_table(db)
    log = Log(connection) if logged else None
    stop = threading.Event()
    threading.Thread(target=checkpoint_forever, args=(db, stop), daemon=True).start()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.MAXMSGSIZE, FRAME_BYTES_MAX)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    dealers = []
    for peer in peers if role == "leader" else [leader] if role == "follower" else []:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{peer}")
        dealers.append(dealer)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    # leader: (seq, client identity) committed here, answered once a follower acknowledged seq
    waiting: collections.deque[tuple[int, bytes]] = collections.deque()
    seq = acked = 0
    # leader with a lazy second follower: the pairs it has not been sent, their bytes, the next feed's time
    lazy: list[bytes] = []
    lazy_bytes = 0
    feed_at = time.monotonic() + lazy_feed_ms / 1000
    try:
        while True:
            timeout_ms = 1000
            if lazy:
                timeout_ms = max(0, min(timeout_ms, round((feed_at - time.monotonic()) * 1000)))
            poller.poll(timeout_ms)
            clients: list[bytes] = []
            pairs: list[tuple[bytes, bytes]] = []
            appended = 0
            for _ in range(TURN_MESSAGES_MAX):
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if not well_formed(role, frames):
                    continue  # not a frame of this benchmark: dropped, never a crash
                if role == "follower":  # [identity, b"append", seq, key, value, ...]
                    appended = int(frames[2])
                    pairs.extend(zip(frames[3::2], frames[4::2], strict=True))
                elif frames[1] == b"ack":  # leader: [identity, b"ack", seq]
                    acked = max(acked, int(frames[2]))
                else:  # [identity, key, value]
                    clients.append(frames[0])
                    pairs.append((frames[1], frames[2]))
            if role == "leader" and pairs:
                seq += 1
                items = [item for pair in pairs for item in pair]
                eager = dealers if not lazy_feed_ms else dealers[:1]
                for dealer in eager:
                    dealer.send_multipart([b"append", b"%d" % seq, *items])  # before our own fsync: overlapped
                if lazy_feed_ms:
                    lazy.extend(items)
                    lazy_bytes += sum(len(item) for item in items)
            if lazy and (time.monotonic() >= feed_at or lazy_bytes >= FRAME_BYTES_MAX // 2):
                dealers[1].send_multipart([b"append", b"%d" % seq, *lazy])
                lazy, lazy_bytes = [], 0
                feed_at = time.monotonic() + lazy_feed_ms / 1000
            if pairs:
                insert(connection, pairs, log)
            if role == "follower" and appended:
                dealers[0].send_multipart([b"ack", b"%d" % appended])
            elif role == "single":
                for client in clients:
                    router.send_multipart([client, b"ok"])
            elif role == "leader":
                if len(waiting) + len(clients) > WAITING_MAX:
                    raise SystemExit("more requests wait for an acknowledgement than WAITING_MAX")
                waiting.extend((seq, client) for client in clients)
                while waiting and waiting[0][0] <= acked:
                    router.send_multipart([waiting.popleft()[1], b"ok"])
    finally:
        stop.set()
        context.destroy(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("single", "leader", "follower"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--peers", default="", help="leader: the followers' ports, comma-separated")
    parser.add_argument("--leader", type=int, help="follower: the leader's port")
    parser.add_argument(
        "--lazy-feed-ms",
        type=int,
        default=20,
        help="leader: feed the second follower what accumulated this often (0: every turn, as the first)",
    )
    parser.add_argument("--log", action="store_true", help="also keep a log row and a digest chain per write")
    args = parser.parse_args()
    if args.lazy_feed_ms < 0:
        parser.error("--lazy-feed-ms must be at least 0")
    peers = [int(p) for p in args.peers.split(",") if p]
    if args.role == "leader" and len(peers) != 2:
        parser.error("a leader has two followers (--peers PORT,PORT)")
    if args.role == "follower" and args.leader is None:
        parser.error("a follower needs --leader PORT")
    os.makedirs(os.path.dirname(os.path.abspath(args.db)), exist_ok=True)
    serve(args.role, args.port, args.db, peers, args.leader, args.lazy_feed_ms, args.log)


if __name__ == "__main__":
    main()
