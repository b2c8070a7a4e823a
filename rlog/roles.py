"""Who may send what: the role table of every message kind a node accepts (pure; no sockets).

Theory of operation
-------------------
A peer's identity is the principal name its CurveZMQ key maps to (``rlog.security``: the ZAP
handler turns the authenticated public key into the name of its ``authorized_keys`` file), never
a field of the message. The ``[security.roles]`` config gives each principal its roles; this
module says which roles may send each message kind, so one lookup decides whether a decoded
message may reach the code that acts on it. A kind missing from the table is refused for every
role but ``admin``: a new kind is closed until someone decides who may send it.

The roles:

* ``core``: consensus (``peer``, which also carries exclusion notices), replication to replicants (``push``), and what a
  core asks of another core on behalf of its own clients (forwarded writes, journals, reads), snapshot offers
  (``snapshot_offer``), a follower's request for one (``snapshot_request``) and the ``bootstrap_batch``
  reads of a snapshot install.
* ``replicant``: ``watch`` and ``push_ack``, forwarding its clients' writes, and the reads it needs
  to find an upstream, bootstrap (``bootstrap_batch``) and serve linearizable reads.
* ``admin``: everything, including ``create_table``, ``drop_table``, ``create_index``, ``drop_index``,
  ``add_column``, ``force_start``, ``membership_change``,
  ``stop``, ``backup`` and ``backup_read``.
* ``writer``: reads and ``transact``.
* ``reader``: reads.

Forwarded requests keep the forwarder's principal: a replicant or core checks its own client's
roles before forwarding, so a ``writer`` cannot create a table by asking a replicant to forward it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

ROLES = ("core", "replicant", "admin", "writer", "reader")

READ_KINDS = frozenset(
    {
        "get",
        "scan",
        "count",
        "status",
        "list_tables",
        "rlog_tail",
        "rlog_entries",
        "journal",
        "members",
        "read_index",
        "range_digest",
        "key_boundaries",
        "row_digests",
        "query",
        "query_page",
        "query_close",
        "changes",
    }
)

# Writes: ordered by the sequencer of their shard (forwarded there by any other node).
WRITE_KINDS = frozenset({"transact", "create_table", "drop_table", "create_index", "drop_index", "add_column"})

# kind -> the roles that may send it (admin may send every kind and is left out of the table).
KIND_ROLES: dict[str, frozenset[str]] = {
    **{kind: frozenset({"core", "replicant", "writer", "reader"}) for kind in READ_KINDS},
    "transact": frozenset({"core", "replicant", "writer"}),
    "create_table": frozenset({"core", "replicant"}),
    # schema changes are forwarded by cores and replicants; only admin may originate them
    "drop_table": frozenset({"core", "replicant"}),
    "create_index": frozenset({"core", "replicant"}),
    "drop_index": frozenset({"core", "replicant"}),
    "add_column": frozenset({"core", "replicant"}),
    "peer": frozenset({"core"}),
    "push": frozenset({"core"}),
    # a sequencer offers a snapshot to a follower behind its trimmed log (core.snapshot)
    "snapshot_offer": frozenset({"core"}),
    # a follower whose rows an abandoned install deleted asks its sequencer for an offer (core.snapshot)
    "snapshot_request": frozenset({"core"}),
    # key-ordered dirty-read batches of a whole table, for bootstraps (bootstrap.serve)
    "bootstrap_batch": frozenset({"core", "replicant"}),
    "watch": frozenset({"replicant"}),
    "push_ack": frozenset({"replicant"}),
    "force_start": frozenset(),
    # adding or removing a core changes who counts in every quorum: operators only (a core
    # forwards an admin's request to the sequencer, keeping the admin's principal)
    "membership_change": frozenset({"core"}),
    # shutting a node down is an operator's decision, never a client's or a peer's
    "stop": frozenset(),
    # writes a copy of the whole database to a path on the node's host (rlog.backup)
    "backup": frozenset(),
    # sends that copy down, a chunk at a time: the node's own finished backup only (rlog.backup.read_chunk)
    "backup_read": frozenset(),
}

# Kinds whose body names its sender: the name must be the authenticated principal.
SENDER_FIELDS: dict[str, str] = {
    "peer": "sender",
    "push": "core",
    "watch": "replicant",
    "snapshot_offer": "sender",
    "snapshot_request": "sender",
    # a learner core names itself so that the sequencer counts its snapshot copy (core.snapshot.CopiesServed)
    "bootstrap_batch": "sender",
}
# Of those, the kinds whose sender field is optional: absent, it claims nobody (a replicant's bootstrap
# batch, or a learner's of a release before the field), and nothing is checked.
OPTIONAL_SENDER_KINDS = frozenset({"bootstrap_batch"})


class RoleTable:
    """Principal name -> roles, built from ``[security.roles]`` (``role -> [principal, ...]``)."""

    def __init__(self, roles: Mapping[str, Iterable[str]]) -> None:
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)} (known: {', '.join(ROLES)})")
        principals: dict[str, set[str]] = {}
        for role, names in roles.items():
            for name in names:
                principals.setdefault(name, set()).add(role)
        self.principals = {name: frozenset(found) for name, found in principals.items()}

    def without_keys(self, keyed: Iterable[str]) -> list[str]:
        """``principal (roles)`` for each principal given a role but not among ``keyed`` (the names
        of authorized_keys): no one can hold that role; usually a typo of a name that has a key."""
        known = set(keyed)
        return [
            f"{name} ({', '.join(sorted(roles))})"
            for name, roles in sorted(self.principals.items())
            if name not in known
        ]

    def roles_of(self, principal: str) -> frozenset[str]:
        return self.principals.get(principal, frozenset())

    def refusal(self, principal: str, kind: str) -> str | None:
        """None if ``principal`` may send ``kind``; otherwise the reason, worded for the sender."""
        roles = self.roles_of(principal)
        if "admin" in roles:
            return None
        allowed = KIND_ROLES.get(kind, frozenset())
        if roles & allowed:
            return None
        needed = ", ".join(sorted(allowed | {"admin"}))
        held = ", ".join(sorted(roles)) or "no role"
        return f"{principal} ({held}) may not send {kind}; it needs one of: {needed}"


# The roles of the nodes that forward their clients' requests: their connections are not clients'.
PEER_ROLES = frozenset({"core", "replicant"})


# The requests a peer's connection may have waiting, at least: a core forwards all its clients'
# requests to a sequencer over one connection, up to this many at once (``core.node.FORWARDED_MAX``
# is this), and ``requests_outstanding_max`` is a client connection's bound (``NodeServer.hold``).
PEER_REQUESTS_OUTSTANDING_MIN = 10_000


def peer_connection(secured: bool, roles: frozenset[str], forwarded: bool) -> bool:
    """Whether a request comes over a peer's connection (a core or replicant forwarding for its
    clients), which ``connections_waiting_max`` does not stop and ``requests_outstanding_max`` bounds
    at no less than ``PEER_REQUESTS_OUTSTANDING_MIN`` (``NodeServer.hold``): with [security],
    its principal has the ``core`` or ``replicant`` role; without, another core marked it forwarded.
    A replicant forwards its client's request unmarked (a core forwards it on), so without [security]
    it cannot be told from a client's; nor can a client that marks its own, which only gets it into
    the bounded room kept for peers."""
    if secured:
        return not PEER_ROLES.isdisjoint(roles)
    return forwarded


def sender_mismatch(principal: str, kind: str, body: object) -> str | None:
    """None if the body's sender field (if the kind has one) names ``principal``; else the reason."""
    field_name = SENDER_FIELDS.get(kind)
    claimed = getattr(body, field_name, None) if field_name is not None else None
    if field_name is None or claimed == principal or (claimed is None and kind in OPTIONAL_SENDER_KINDS):
        return None
    return f"{kind} claims {field_name} {claimed!r} but comes from {principal}"
