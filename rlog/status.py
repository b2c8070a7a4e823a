"""The typed sections of a node's ``status`` answer that clients check (``Client.status``).

``status`` answers a free map (``rlog.messages.Reply``): most of it is read by operators, not code.
A section a client reads fields of is declared here as a ``messages.Answer`` (unknown fields allowed:
an older client reads what it knows of a newer node's answer), built by the node from the same type.
"""

from __future__ import annotations

from typing import Annotated, Literal

from mnesite.rlog.messages import Answer, NonNegative, Text
from mnesite.rlog.types import Name
from msgspec import Meta

# A core keeps at most this many core endpoints (``core.node.MEMBERS_LEARNED_MAX``): it asks each.
Names = Annotated[list[Name], Meta(max_length=64)]


class RecoveryAnswer(Answer, frozen=True, kw_only=True):
    """``status``'s ``recovery`` section while a core recovers at start-up (``core.recovery``)."""

    # "asking": a round's journal requests are out; "waiting": the round came up short, the next one
    # starts once its time is up.
    phase: Literal["asking", "waiting"]
    round: NonNegative
    rounds_max: NonNegative
    elapsed_ms: NonNegative
    round_timeout_ms: NonNegative
    asked: Names  # the members asked in this round
    answered: Names  # those whose answer this round holds
    waiting_for: Names  # the members whose answers it still needs
    needed: NonNegative | None = None  # how many; None until an answer shows whether the cluster has history
    existing: bool  # [cluster] initial_cluster_state = "existing"
    reason: Text
