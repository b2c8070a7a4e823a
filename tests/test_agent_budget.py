"""core.agent_budget: the eviction rule, sentence by sentence of its theory of operation, and the
accounting of the bytes agents hold as ``core.agent_server`` keeps it (added on a push, freed on an
acknowledgement, an eviction, or the agent's end)."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest
from mnesite.core.agent import TOKEN_HASH_BYTES, TOKEN_KEY_BYTES, TOKEN_SEQUENCE_BYTES, Agent, AgentConfig
from mnesite.core.agent_budget import AgentBudgetError, AgentMemoryBudget, AgentUse, agents_to_evict
from mnesite.core.agent_server import AgentServer
from mnesite.rlog import messages
from mnesite.rlog.config import ConfigError, parse_config
from mnesite.rlog.messages import Message, typed_body
from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION, AgentMode, CommittedAdvanced, Ticked
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, TxKey, WriteOp, make_entry

from tests.sim import MemoryLog
from tests.test_agent import SHARD, build_large_log, build_log

pytestmark = pytest.mark.timeout(30)

SILENT_MS = 1000


def use(agent_id: str, held_bytes: int, last_heard_ms: int, acknowledged: bool = True) -> AgentUse:
    return AgentUse(agent_id, held_bytes, last_heard_ms, acknowledged)


def evict(agents: list[AgentUse], requester: AgentUse, bytes_max: int, now_ms: int = 10_000) -> list[str]:
    used = sum(agent.held_bytes for agent in agents)
    return agents_to_evict(agents, requester, used, bytes_max, now_ms, SILENT_MS)


# -- the rule -------------------------------------------------------------------------------------


def test_nothing_is_evicted_while_the_budget_has_room():
    dead = use("dead", 500, 0, acknowledged=False)
    live = use("live", 0, 9_990)
    assert evict([dead, live], live, bytes_max=501) == []
    assert evict([dead, live], live, bytes_max=500) == ["dead"]  # the use reached the bound: no room


def test_the_longest_silent_go_first_and_only_as_many_as_make_room():
    agents = [
        use("silent-since-3000", 400, 3_000),
        use("never-acked-since-1000", 400, 1_000, acknowledged=False),
        use("silent-since-2000", 400, 2_000),
    ]
    requester = use("live", 0, 9_999)
    assert evict([*agents, requester], requester, bytes_max=1_000) == ["never-acked-since-1000"]
    assert evict([*agents, requester], requester, bytes_max=500) == ["never-acked-since-1000", "silent-since-2000"]


def test_an_acknowledging_agent_is_never_evicted_whoever_asks():
    live = use("live", 10_000, 9_500)  # acknowledged 500 ms ago: live
    just_silent = use("just-silent", 100, 9_000)  # acknowledged exactly SILENT_MS ago: silent
    for requester in (use("other-live", 0, 9_999), use("new-watch", 0, 9_999, acknowledged=False)):
        agents = [live, just_silent, requester]
        # Evicting the silent one cannot make room: nobody is evicted, the requester waits.
        assert evict(agents, requester, bytes_max=5_000) == []
        assert evict(agents, requester, bytes_max=10_050) == ["just-silent"]


def test_a_silent_requester_evicts_only_agents_silent_for_longer_than_itself():
    older = use("older", 300, 4_000, acknowledged=False)
    newer = use("newer", 300, 6_000, acknowledged=False)
    requester = use("requester", 0, 5_000, acknowledged=False)
    agents = [older, newer, requester]
    assert evict(agents, requester, bytes_max=400) == ["older"]
    # Even with "newer" holding more, it is left alone; with "older" not enough, nobody is evicted.
    assert evict(agents, requester, bytes_max=100) == []
    # A live requester, though, may evict both.
    live = use("live", 0, 9_999)
    assert evict([older, newer, live], live, bytes_max=100) == ["older", "newer"]


def test_agents_that_hold_nothing_and_the_requester_itself_are_never_evicted():
    empty = use("empty", 0, 0, acknowledged=False)
    requester = use("requester", 1_000, 0, acknowledged=False)
    assert evict([empty, requester], requester, bytes_max=10) == []


def test_ties_are_broken_by_agent_id_so_the_rule_is_deterministic():
    agents = [use("b", 100, 1_000, acknowledged=False), use("a", 100, 1_000, acknowledged=False)]
    requester = use("live", 0, 9_999)
    assert evict([*agents, requester], requester, bytes_max=150) == ["a"]


def test_the_accounting_adds_frees_and_counts():
    budget = AgentMemoryBudget(1_000, SILENT_MS)
    budget.held("a", 600)
    budget.held("b", 300)
    assert (budget.used_bytes, budget.has_room()) == (900, True)
    budget.held("a", 800)  # pushed 200 more
    assert (budget.used_bytes, budget.has_room()) == (1_100, False)
    assert budget.release("b") == 300 and budget.release("b") == 0
    assert (budget.used_bytes, budget.has_room()) == (800, True)
    budget.held("a", 1_000)
    requester = use("c", 0, 9_999)
    evicted = budget.evict_for([use("a", 1_000, 0, acknowledged=False), requester], requester, 10_000)
    assert evicted == ["a"]
    assert budget.status() == {"used_bytes": 0, "bytes_max": 1_000, "evicted_agents": 1}
    with pytest.raises(AgentBudgetError):
        budget.held("a", -1)
    with pytest.raises(AgentBudgetError):
        AgentMemoryBudget(0, SILENT_MS)


# -- the accounting in the rlog server --------------------------------------------------------------


def config(**overrides) -> AgentConfig:
    values = {
        "push_bytes_max": 4096,
        "window_bytes_max": 32_768,
        "probation_bytes_max": 4096,
        "step_bytes_max": 4096,
        "heartbeat_interval_ms": 100,
        "ack_timeout_ms": 5_000,
    }
    return AgentConfig(**{**values, **overrides})


def server_of(agents_bytes_max: int, **overrides) -> AgentServer:
    return AgentServer("core1", config(**overrides), watches_max=100, agents_bytes_max=agents_bytes_max)


def watch(
    server: AgentServer,
    log,
    replicant: str,
    now_ms: int,
    shard: str = SHARD,
    protocol=REPLICATION_PROTOCOL_VERSION,
    from_key: tuple[int, int] = (0, 0),
) -> str:
    """A watch from the start of ``log`` (the agent resumes there and would push all of it)."""
    body = {
        "shard": shard,
        "replicant": replicant,
        "endpoint": f"tcp://{replicant}.test:1",
        "from": list(from_key),
        "from_digest": GENESIS_DIGEST,
        "protocol": protocol,
    }
    server.begin_turn()
    committed = log.last_key()
    return server.watch(
        typed_body("watch", body), log, committed, log.digest_at(committed), log.digest_at, True, now_ms
    )["agent"]


def held(server: AgentServer) -> int:
    """What the agents hold, from the agents themselves; the budget must say the same."""
    total = sum(watch.agent.unacknowledged_bytes for watch in server.watches.values())
    assert server.budget.used_bytes == total
    return total


def ack_all(server: AgentServer, agent_id: str, now_ms: int) -> None:
    """The replicant of ``agent_id`` reads everything it was pushed and acknowledges it, echoing the
    last push's token (as a live replica does)."""
    read = [m for _, m in server.outbox if m.body["agent"] == agent_id]
    server.outbox = [(e, m) for e, m in server.outbox if m.body["agent"] != agent_id]
    key = server.watches[agent_id].agent.status().sent_key
    body = {"shard": server.watches[agent_id].shard, "agent": agent_id, "applied": list(key)}
    if read:
        body["token"] = read[-1].body["token"]
        read_token[agent_id] = body["token"]
    elif agent_id in read_token:
        body["token"] = read_token[agent_id]
    server.begin_turn()
    server.acknowledged(typed_body("push_ack", body), now_ms)


# The token of the last push each agent's replicant read (it echoes it while nothing new arrives).
read_token: dict[str, bytes] = {}


def test_a_push_adds_its_bytes_and_an_acknowledgement_frees_them():
    log = build_large_log(20, 1000)
    server = server_of(1_000_000)
    agent_id = watch(server, log, "rep0", 0)
    first = held(server)
    assert 0 < first <= 4096 + 1100  # about one push (one entry crosses) until the first acknowledgement
    server.begin_turn()
    server.tick(1)
    assert held(server) == first, "before its first acknowledgement, a watch holds one push at most"
    now = 2
    while server.watches[agent_id].agent.status().acked_key < log.last_key():
        ack_all(server, agent_id, now)
        assert held(server) > 0 or server.watches[agent_id].agent.status().acked_key == log.last_key()
        server.begin_turn()
        server.tick(now)
        now += 1
    assert held(server) == 0


@pytest.mark.parametrize("end", ["ack_timeout", "superseded", "stop_shard", "rejected"])
def test_an_agent_that_ends_frees_its_bytes(end):
    log = build_large_log(20, 1000)
    server = server_of(1_000_000)
    agent_id = watch(server, log, "rep0", 0)
    other = watch(server, log, "rep1", 0)
    assert held(server) > 0
    before_other = server.budget.held_bytes(other)
    if end == "ack_timeout":
        server.tick(6_000)  # both stop: nothing acknowledged for ack_timeout_ms
        assert server.watches == {} and held(server) == 0
        return
    if end == "superseded":
        watch(server, log, "rep0", 1)  # the same replicant watches again: the old agent ends
    elif end == "stop_shard":
        server.stop_shard(SHARD)
        assert server.watches == {} and held(server) == 0
        return
    else:
        server.acknowledged(
            typed_body(
                "push_ack", {"shard": SHARD, "agent": agent_id, "rejected": "not the watched agent", "applied": [0, 0]}
            ),
            1,
        )
    assert agent_id not in server.watches
    assert server.budget.held_bytes(agent_id) == 0
    assert server.budget.held_bytes(other) == before_other
    held(server)


def test_silent_watches_are_evicted_for_a_live_replicant_which_keeps_pushing():
    log = build_large_log(100, 1000)
    server = server_of(20_000)
    live = watch(server, log, "live", 0)
    ack_all(server, live, 1)  # the live replicant has acknowledged: its window opens
    server.outbox.clear()
    dead = [watch(server, log, f"ghost{n}", 10 + n) for n in range(12)]
    assert held(server) <= 20_000 + 4096  # one push beyond the bound at most
    evicted_before = server.budget.evicted_agents
    assert evicted_before > 0, "new watches evict older silent ones once the budget is spent"
    assert all(d not in server.watches for d in dead[:evicted_before])  # the oldest went first
    # The live replicant acknowledges everything it gets, turn after turn: it reaches the end of the
    # log, evicting silent watches on its way whenever the budget is spent.
    for now in range(100, 400):
        ack_all(server, live, now)
        server.begin_turn()
        server.tick(now)
        assert live in server.watches
        assert held(server) <= 20_000 + 4096
    assert server.watches[live].agent.status().acked_key == log.last_key()
    assert server.budget.evicted_agents > evicted_before
    # What was evicted left no frame behind.
    assert all(message.body["agent"] in server.watches for _, message in server.outbox)


def test_an_evicted_agents_frames_not_yet_sent_are_dropped():
    log = build_large_log(100, 1000)
    server = server_of(3_000)
    dead = watch(server, log, "ghost", 0)
    assert any(message.body["agent"] == dead for _, message in server.outbox)
    assert not server.budget.has_room()
    live = watch(server, log, "live", 1)  # a newer watch evicts the older silent one to push
    assert dead not in server.watches and server.budget.evicted_agents == 1
    assert not any(message.body["agent"] == dead for _, message in server.outbox)
    assert any(message.body["agent"] == live and message.body["entries"] for _, message in server.outbox)


def test_an_agent_that_waits_for_the_budget_is_not_due_until_bytes_are_freed():
    log = build_large_log(100, 1000)
    server = server_of(5_000, heartbeat_interval_ms=100)
    first = watch(server, log, "rep0", 0)
    ack_all(server, first, 1)
    second = watch(server, log, "rep1", 2)
    ack_all(server, second, 3)  # both live: neither may evict the other
    server.outbox.clear()
    server.begin_turn()
    server.tick(4)
    assert not server.budget.has_room()
    waiting = [a for a, w in server.watches.items() if w.agent.wants_to_push]
    assert waiting, "the budget is spent and both want to push"
    # Not due at once (a loop that ticks it at once would spin): only at its next heartbeat.
    assert server.next_deadline_ms() > 4
    # One agent ends: its bytes are free, and whoever waited is due at once.
    ender = first if first in waiting else second
    server.acknowledged(
        typed_body(
            "push_ack", {"shard": SHARD, "agent": ender, "rejected": "not the watched agent", "applied": [0, 0]}
        ),
        5,
    )
    assert server.budget.has_room()
    assert server.next_deadline_ms() <= 5


def test_the_mode_is_counted_only_once_a_push_moved_the_position():
    """A new watch from another generation (here [0, 0]) that waits for the memory budget is stepped
    at every heartbeat without pushing: the log is not counted each time (a count reads the log)."""
    log = build_log(5)
    counted = []
    original = log.count_after

    def counting(key, up_to, limit):
        counted.append(key)
        return original(key, up_to, limit)

    log.count_after = counting
    machine = Agent("agent-1", SHARD, "rep0", TxKey(0, 0), log, config(), 0)
    machine.step(CommittedAdvanced(TxKey(1, 5), True), 0, push_bytes_max=0)
    for now in range(1, 50):
        machine.step(Ticked(), now, push_bytes_max=0)
    assert counted == [] and machine.mode is AgentMode.CATCHUP
    assert machine.step(Ticked(), 50)  # room again: it pushes, and sent_key is in generation 1 now
    assert machine.status().sent_key == TxKey(1, 5) and machine.mode is AgentMode.NORMAL


def test_the_config_key_is_bounded():
    base = {"node": {"name": "core1", "data_dir": "/tmp/x"}}
    assert parse_config(base).limits.agents_bytes_max == 16 * 1024 * 1024
    assert parse_config({**base, "limits": {"agents_bytes_max": 65536}}).limits.agents_bytes_max == 65536
    with pytest.raises(ConfigError, match="agents_bytes_max"):
        parse_config({**base, "limits": {"agents_bytes_max": 1000}})


def test_tiny_first_entries_do_not_make_the_next_read_take_the_whole_log():
    """A watch from [0, 0]: the log starts with a no-op and a table creation (tens of bytes), then
    100 KB transactions. Sizing the next read by the tiny ones read 256 large entries (25 MB) for a
    push of one; a read takes at most twice the entries of the last push."""
    log = MemoryLog()
    prev, digest = ZERO_KEY, GENESIS_DIGEST
    for counter in range(1, 301):
        ops = () if counter <= 2 else (WriteOp("t", {"k": counter, "v": "x" * 100_000}),)
        entry = make_entry(SHARD, TxKey(1, counter), prev, digest, ops)
        log.append((entry,))
        prev, digest = entry.tx_key, entry.digest
    read_counts = []
    original = log.entries_after

    def recording(key, limit):
        read = original(key, limit)
        read_counts.append(len(read))
        return read

    log.entries_after = recording
    machine = Agent("agent-1", SHARD, "rep0", ZERO_KEY, log, config(push_bytes_max=65_536, step_bytes_max=65_536), 0)
    machine.step(CommittedAdvanced(log.last_key(), True), 0)
    assert machine.status().sent_key == TxKey(1, 3)  # the two small ones, then one large one alone
    assert max(read_counts) <= 4, read_counts


def test_a_dead_endpoint_whose_agent_ends_has_its_socket_reset_a_live_one_keeps_it():
    """zmq may still hold an ended agent's frames: the socket of its endpoint is closed (and made
    again for a newer agent) unless an acknowledging agent still uses it. Otherwise one replicant
    name watched again and again naming a dead endpoint would pile pushes up in one open socket."""
    log = build_large_log(50, 1000)
    server = server_of(1_000_000)
    first = watch(server, log, "ghost", 0)
    assert server.endpoints_to_reset() == set()
    watch(server, log, "ghost", 1)  # supersedes the first: same endpoint, nobody acknowledged
    assert first not in server.watches
    assert server.endpoints_to_reset() == {"tcp://ghost.test:1"}
    assert not any(message.body["agent"] == first for _, message in server.outbox)
    # A live replicant watching two shards: one agent ending leaves the other's stream alone.
    body = {
        "shard": "other",
        "replicant": "live",
        "endpoint": "tcp://live.test:1",
        "from": [0, 0],
        "from_digest": GENESIS_DIGEST,
        "protocol": REPLICATION_PROTOCOL_VERSION,
    }
    other = server.watch(
        typed_body("watch", body), log, log.last_key(), log.digest_at(log.last_key()), log.digest_at, True, 2
    )["agent"]
    ack_all(server, other, 3)
    live = watch(server, log, "live", 4)
    server.endpoints_to_reset()
    server.acknowledged(
        typed_body("push_ack", {"shard": SHARD, "agent": live, "rejected": "not the watched agent", "applied": [0, 0]}),
        5,
    )
    assert live not in server.watches and other in server.watches
    assert server.endpoints_to_reset() == set()


def test_the_agents_left_on_a_reset_endpoint_resend_what_went_with_its_socket():
    """A reset endpoint's socket is closed with everything zmq still queues for it: the pushes that
    the other agents using it handed over in earlier turns go too. Those agents (none of their
    replicants acknowledged, or the socket would have been kept) resend from their acknowledged key:
    otherwise the next push would start after a gap, and the replicant resynchronise (a restarted
    replicant that follows two shards, its two watches in two loop turns)."""
    log = build_log(3)
    server = server_of(1_000_000)
    fresh = watch(server, log, "r", 0, shard="other")
    watch(server, log, "r", 0)
    assert server.watches[fresh].agent.status().sent_key == TxKey(1, 3)
    server.drain()  # handed to zmq in this turn
    watch(server, log, "r", 1)  # a watch again of the shard: its old agent ends, nobody acknowledged
    assert server.endpoints_to_reset() == {"tcp://r.test:1"}  # the node closes the socket, and its queue
    server.begin_turn()
    server.tick(2)
    resent = [m for _, m in server.drain() if m.body["agent"] == fresh and m.body["entries"] != []]
    assert len(resent) == 1
    assert server.watches[fresh].agent.status().sent_key == TxKey(1, 3)
    held(server)


def test_a_watch_never_acknowledged_stops_after_probation_timeout_ms_an_acknowledged_one_after_ack_timeout_ms():
    log = build_log(5)
    server = server_of(1_000_000, heartbeat_interval_ms=100, ack_timeout_ms=5_000, probation_timeout_ms=1_000)
    dead = watch(server, log, "ghost", 0)
    live = watch(server, log, "live", 0)
    ack_all(server, live, 10)
    server.tick(999)
    assert dead in server.watches
    server.tick(1_000)
    assert dead not in server.watches and live in server.watches  # acknowledged at 10: 5 s from there
    server.tick(5_009)
    assert live in server.watches
    server.tick(5_010)
    assert server.watches == {} and held(server) == 0


def test_agents_pushing_the_same_entries_share_one_encoding_and_send_the_bytes_of_the_plain_list():
    """Entries pushed by several agents in one turn are encoded once; each frame is byte for byte
    what encoding the entries as a list gives (the wire of v0.1.0), and decodes to those entries."""
    log = build_log(30)
    server = server_of(1_000_000, step_bytes_max=1_000_000)
    server.begin_turn()
    committed = log.last_key()
    for replicant in ("rep0", "rep1"):
        body = {
            "shard": SHARD,
            "replicant": replicant,
            "endpoint": f"tcp://{replicant}.test:1",
            "from": [0, 0],
            "from_digest": GENESIS_DIGEST,
            "protocol": REPLICATION_PROTOCOL_VERSION,
        }
        server.watch(typed_body("watch", body), log, committed, log.digest_at(committed), log.digest_at, True, 0)
    by_agent: dict[str, list[Message]] = {}
    for _, message in server.outbox:
        if message.body["entries"]:
            by_agent.setdefault(message.body["agent"], []).append(message)
    first, second = by_agent.values()
    assert len(first) == len(second) > 0
    for one, other in zip(first, second, strict=True):
        assert one.body["entries"] is other.body["entries"]  # encoded once, for both agents
    for pushes in (first, second):
        keys = []
        for message in pushes:
            frame = messages.encode(message)
            pushed = messages.decode(frame).body.entries
            keys += [entry.tx_key for entry in pushed]
            entries = log.entries_after(pushed[0].prev, len(pushed))
            wire_entries = [entry.to_wire() for entry in entries]
            plain = Message(message.kind, message.request_id, dict(message.body, entries=wire_entries))
            assert frame == messages.encode(plain)
        assert keys == [TxKey(1, n) for n in range(1, len(keys) + 1)]


def test_one_replicant_cannot_take_every_agent_slot():
    """At ``replicant_watches_max`` agents of one replicant (principal), its next watch of another shard
    is refused (``overloaded``), whatever room ``watches_max`` has: other replicants keep theirs."""
    from mnesite.core.watch import WatchRefusedError

    log = build_log(5)
    server = AgentServer("core1", config(), watches_max=10, replicant_watches_max=2)

    def watch_shard(replicant: str, shard: str) -> str:
        return watch(server, log, replicant, 0, shard)

    watch_shard("greedy", "s1")
    watch_shard("greedy", "s2")
    with pytest.raises(WatchRefusedError, match="replicant greedy holds 2 watches") as refused:
        watch_shard("greedy", "s3")
    assert refused.value.code == "overloaded"
    watch_shard("greedy", "s2")  # a watch again of a shard it holds supersedes its agent: served
    watch_shard("other", "s3")  # another replicant is served
    assert sorted(w.replicant for w in server.watches.values()) == ["greedy", "greedy", "other"]


def test_a_watch_refused_as_behind_evicts_no_silent_agent():
    """At ``watches_max`` a watch evicts the oldest agent whose replicant never acknowledged, to be
    served in its place; a watch this core refuses (its committed key is behind the replica) is not
    served, so it must change nothing: otherwise watches naming a key beyond the log would kill every
    connecting replicant's agent and hold no slot themselves."""
    from mnesite.core.watch import WatchRefusedError

    log = build_log(5)
    server = AgentServer("core1", config(), watches_max=2)
    connecting, other = watch(server, log, "connecting", 0), watch(server, log, "other", 0, "s2")
    with pytest.raises(WatchRefusedError, match="has committed only up to") as refused:
        watch(server, log, "ahead", 1, from_key=(1, 9))
    assert refused.value.code == "behind"
    assert set(server.watches) == {connecting, other} and server.endpoints_to_reset() == set()


def test_replicant_watches_max_is_a_bounded_config_key_at_most_watches_max():
    base = {"node": {"name": "core1", "data_dir": "/tmp/x"}}
    assert parse_config(base).limits.replicant_watches_max == 256
    assert parse_config({**base, "limits": {"replicant_watches_max": 5}}).limits.replicant_watches_max == 5
    with pytest.raises(ConfigError, match="replicant_watches_max"):
        parse_config({**base, "limits": {"replicant_watches_max": 0}})
    # Not given: watches_max, smaller or larger (no bound of its own: a cluster of 300 shards keeps its replicants).
    assert parse_config({**base, "limits": {"watches_max": 10}}).limits.replicant_watches_max == 10
    assert parse_config({**base, "limits": {"watches_max": 500}}).limits.replicant_watches_max == 500
    with pytest.raises(ConfigError, match=r"replicant_watches_max must be at most \[limits\].watches_max"):
        parse_config({**base, "limits": {"replicant_watches_max": 20, "watches_max": 10}})


def test_the_agent_server_gives_tokens_to_protocol_2_replicants_only():
    """A replicant of release 0.1.0 (protocol 1) refuses a push with a field it does not know: its
    pushes carry no token, and its acknowledgements are trusted as before."""
    log = build_log(3)
    server = server_of(1_000_000)
    old, new = watch(server, log, "old", 0, protocol=1), watch(server, log, "new", 0)
    frames = server.drain()
    assert {m.body["agent"] for _, m in frames} == {old, new}
    assert all(("token" in m.body) == (m.body["agent"] == new) for _, m in frames)
    for _, message in frames:  # what each replicant decodes
        typed_body("push", {**message.body, "entries": []})
    server.acknowledged(typed_body("push_ack", {"shard": SHARD, "agent": old, "applied": [1, 3]}), 1)
    server.acknowledged(typed_body("push_ack", {"shard": SHARD, "agent": new, "applied": [1, 3]}), 1)
    assert server.watches[old].acknowledged and server.watches[old].agent.status().acked_key == TxKey(1, 3)
    assert not server.watches[new].acknowledged and server.acks_refused == 1


def test_the_agent_server_counts_each_refused_acknowledgement_once():
    """``AgentServer.acks_refused`` adds what each acknowledgement made its agent refuse (an agent's own
    count grows over its life): one per refusal, over every agent, kept when the agents end."""
    log = build_log(3)
    server = server_of(1_000_000)
    first, second = watch(server, log, "r1", 0), watch(server, log, "r2", 0)
    tokens = {m.body["agent"]: m.body["token"] for _, m in server.drain()}

    def acknowledge(agent: str, token: bytes | None = None) -> None:
        body = {"shard": SHARD, "agent": agent, "applied": [1, 3], "token": token}
        server.acknowledged(typed_body("push_ack", body), 1)

    for _ in range(3):
        acknowledge(first)  # no token: proves no push read
    acknowledge(second, bytes(len(tokens[second])))  # a token no push carried
    assert server.acks_refused == 4  # adding the agents' running counts would give 1 + 2 + 3 + 1
    acknowledge(first, tokens[first])  # taken: counts nothing
    assert server.watches[first].acknowledged and server.acks_refused == 4
    acknowledge(second)
    assert server.acks_refused == 5
    server.stop_shard(SHARD)  # since the start: the ended agents' refusals stay counted
    acknowledge(second)  # an ended agent's acknowledgement is nobody's to refuse
    assert not server.watches and server.acks_refused == 5


def test_a_replicant_that_learns_a_random_source_s_state_cannot_forge_a_token():
    """Had agent ids and token keys come from a ``random.Random`` (a Mersenne Twister), about 624 of its
    outputs (some 300 agent ids, collected by watching again and again) would give its whole state and
    every later key, and a lying replicant could forge the tokens that prove what it read ("Proven
    acknowledgements"). Both come from the operating system's secure source: a key guessed from a
    seeded Mersenne Twister (the one agent ids came from before) proves nothing."""
    log = build_log(3)
    server = server_of(1_000_000)
    agent_id = watch(server, log, "liar", 0)
    clone = random.Random(7)  # the state a replicant recovered from a Mersenne Twister's outputs
    clone.getrandbits(64)  # the agent id it would have given
    guessed_key = clone.randbytes(TOKEN_KEY_BYTES)
    server.drain()  # pushed, never read
    forged = (1).to_bytes(TOKEN_SEQUENCE_BYTES, "big")
    forged += hashlib.blake2b(forged, key=guessed_key, digest_size=TOKEN_HASH_BYTES).digest()
    body = {"shard": SHARD, "agent": agent_id, "applied": [1, 3], "token": forged}
    server.acknowledged(typed_body("push_ack", body), 1)
    assert server.acks_refused == 1
    assert not server.watches[agent_id].acknowledged and held(server) > 0


def test_a_replicant_that_acknowledged_once_then_went_silent_cannot_pile_uncounted_frames_in_its_socket():
    """The socket of an endpoint is kept, when an agent using it ends, only for an agent that is live
    by the budget's rule (acknowledged within two heartbeats): its queue is being delivered. A
    replicant that acknowledged once and then stopped reading is silent; were its socket kept, its
    watches again of another shard would leave each superseded agent's frames in zmq (up to
    push_queue_max of them), which the budget no longer counts."""
    log = build_large_log(400, 1000)
    sizes = {entry.tx_key: entry.size_bytes for entry in log.entries}
    server = server_of(10_000_000)
    endpoint = "tcp://rep0.test:1"
    queued: list[Message] = []  # what zmq holds for the endpoint: its replicant reads nothing more

    def hand_to_zmq() -> None:  # the node's before_send: close the sockets to reset, then queue the turn's frames
        if endpoint in server.endpoints_to_reset():
            queued.clear()
        queued.extend(message for to, message in server.drain() if to == endpoint)

    def queued_bytes() -> int:
        entries = [entry for m in queued if m.body["entries"] != [] for entry in msgpack.unpackb(m.body["entries"])]
        return sum(sizes[TxKey(*entry[1])] for entry in entries)

    first = watch(server, log, "rep0", 0, shard="other")
    ack_all(server, first, 1)  # acknowledged once: its window opens; then the replicant reads nothing
    hand_to_zmq()
    for now in range(1_000, 4_000, 30):  # silent for longer than two heartbeats, within its ack timeout
        watch(server, log, "rep0", now)  # each watch of the shard supersedes the one before
        server.begin_turn()
        server.tick(now)
        hand_to_zmq()
        assert first in server.watches
        counted = sum(server.budget.held_bytes(a) for a, w in server.watches.items() if w.endpoint == endpoint)
        assert queued_bytes() <= counted, f"at {now} ms zmq holds frames the budget does not count"


# -- the twenty-sixth session: liveness judged by progress, and unguessable agent ids ---------------


def test_watches_max_evicts_an_agent_that_acknowledged_once_and_went_silent():
    """At ``watches_max`` a new watch evicted only an agent whose replicant never acknowledged: one
    that acknowledged once and then went silent (its replicant died) kept its slot until its ack
    timeout, and a live replicant's watch was refused ``overloaded`` meanwhile. The slot goes by the
    budget's liveness rule now: silent agents, the longest silent first; live ones never."""
    from mnesite.core.watch import WatchRefusedError

    log = build_log(3)
    server = AgentServer("core1", config(), watches_max=2)
    once, live = watch(server, log, "once", 0), watch(server, log, "live", 0, shard="s2")
    ack_all(server, once, 1)
    ack_all(server, live, 1)
    for now in range(100, 1_001, 100):  # "live" acknowledges every heartbeat (caught up: the same key)
        server.begin_turn()
        server.tick(now)
        ack_all(server, live, now)
    fresh = watch(server, log, "fresh", 1_000, shard="s3")
    assert set(server.watches) == {live, fresh}, "the agent silent since its one acknowledgement makes room"
    ack_all(server, fresh, 1_000)
    with pytest.raises(WatchRefusedError) as refused:
        watch(server, log, "late", 1_000, shard="s4")
    assert refused.value.code == "overloaded"  # both live: neither is evicted


def test_an_agent_whose_acknowledgements_arrive_but_never_advance_is_silent_for_the_budget():
    """A replicant stuck re-acknowledging an old key (it reads every push, echoes its token, applies
    nothing) counted as live for ever: its acknowledgements arrive, and liveness was their arrival.
    Its window held the node's memory budget and no other watch could evict it. Liveness is progress
    now (``Agent.last_progress_ms``): an acknowledgement that advances, or finds nothing unacknowledged."""
    log = build_large_log(40, 1000)
    server = server_of(6_000)
    stuck = watch(server, log, "stuck", 0)
    ack_all(server, stuck, 1)  # one real acknowledgement: its whole window opens
    start = server.watches[stuck].agent.status().acked_key
    for now in range(100, 1_001, 100):
        server.begin_turn()
        server.tick(now)
        read = [m for _, m in server.outbox if m.body["agent"] == stuck]
        server.outbox = [(e, m) for e, m in server.outbox if m.body["agent"] != stuck]
        body = {"shard": SHARD, "agent": stuck, "applied": list(start), "token": read[-1].body["token"]}
        server.acknowledged(typed_body("push_ack", body), now)
    assert stuck in server.watches and server.watches[stuck].agent.status().acked_key == start
    assert not server.budget.has_room() and held(server) == server.budget.held_bytes(stuck)
    fresh = watch(server, log, "fresh", 1_000)
    assert stuck not in server.watches, "acknowledging without progress is no sign of life"
    assert server.budget.evicted_agents == 1 and held(server) == server.budget.held_bytes(fresh) > 0


def _untemper(value: int) -> int:
    """The Mersenne Twister state word behind one of its 32-bit outputs."""
    value ^= value >> 18
    value ^= (value << 15) & 0xEFC60000
    result = value
    for _ in range(5):
        result = value ^ ((result << 7) & 0x9D2C5680 & 0xFFFFFFFF)
    value = result
    result = value
    for _ in range(3):
        result = value ^ (result >> 11)
    return result & 0xFFFFFFFF


def test_agent_ids_cannot_be_predicted_from_the_ones_a_replicant_was_told():
    """Agent ids came from a ``random.Random`` (a Mersenne Twister): the 312 ids told to one replicant
    that watched again and again gave its state, hence every later agent id, and without
    ``[security]`` anyone who knows an agent id can stop that agent (a push_ack naming it, rejected).
    They come from the operating system's secure source now (``secrets``)."""
    log = build_log(3)
    server = AgentServer("core1", config(), watches_max=10)
    outputs = []
    for _ in range(312):
        value = int(watch(server, log, "spy", 0).rsplit("-", 1)[1], 16)
        outputs += [value & 0xFFFFFFFF, value >> 32]  # getrandbits(64) fills its low word first
    clone = random.Random()
    clone.setstate((3, (*(_untemper(word) for word in outputs), 624), None))
    predicted = f"core1-{clone.getrandbits(64):016x}"
    assert watch(server, log, "victim", 0, shard="s2") != predicted


def test_an_agent_id_is_a_wire_name_whatever_the_core_s_name():
    """A core named with 64 characters (``[node] name`` allows it) gave agent ids of 81: every push and
    acknowledgement naming one is refused by the wire's name type (at most 64 characters)."""
    log = build_log(3)
    name = "c" * 64
    server = AgentServer(name, config(), watches_max=10)
    agent_id = watch(server, log, "rep0", 0)
    assert len(agent_id) <= 64 and agent_id.startswith("c" * 40)
    ack = typed_body("push_ack", {"shard": SHARD, "agent": agent_id, "applied": [0, 0]})
    assert ack.agent == agent_id
    assert len({watch(server, log, "rep0", 0) for _ in range(50)}) == 50  # still unique
