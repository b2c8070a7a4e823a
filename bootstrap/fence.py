"""The read fence: when a bootstrap is complete enough to serve reads again (a pure rule).

Theory of operation
-------------------
A bootstrap copies dirty reads (``bootstrap.copy``): rows that may be ahead of K0, the key the copy
started at. Applying the entries after K0 heals them, but until the applied key reaches a key
committed *after* the copy ended, a read could see a mix no committed prefix ever held. So the
one bootstrap completion rule, for a replicant (``replicant.replica``) and for a core that
installs a snapshot (``core.snapshot``):

1. The copy is done (``TableCopy.done``): the owner fences reads (``ReadFence(fenced=True)``,
   persisted, so a restart stays fenced) and asks the sequencer's quorum-confirmed committed key
   (``FetchCommitted`` whenever ``should_ask`` says so: at once, then once per ``ask_interval_ms``
   while no answer came; a lost answer or a "no quorum" answer is asked again).
2. The first committed key answered becomes the fence key (later answers do not move it); an answer
   without one keeps why (``error``, for the owner's status) until a key comes or a copy begins. Each
   question has a number (``question``, never reused); only an answer to the question asked last
   counts. An answer to an earlier one, late, may carry a committed key from before the current
   copy ended (a copy began again meanwhile): taken as the fence key, it would serve reads while
   that copy's dirty rows are not healed yet.
3. Reads are served again once the applied key reaches the fence key (``reached``): checked at the
   answer and after every apply.

The owner decides which answers count (the replica only its upstream's; a core any core's: the
answer is quorum-confirmed either way) and when asking makes sense (the replica: in NORMAL mode
with an upstream).
"""

from __future__ import annotations

from mnesite.rlog.types import TxKey


class ReadFence:
    """The read fence of one shard after a bootstrap."""

    def __init__(self, fenced: bool, ask_interval_ms: int) -> None:
        self.fenced = fenced
        self.ask_interval_ms = ask_interval_ms
        self.fence_key: TxKey | None = None
        self.asked_ms: int | None = None
        # The number of the question asked last (0: none yet); grows by one at every question, across
        # copies, so that no answer of an earlier copy's question is taken for this copy's.
        self.question = 0
        # Why the last question counted was answered without a committed key (None: not so, or not known).
        self.error: str | None = None

    def fence(self) -> None:
        """Rule 1: a new copy begins; no read until its fence is reached."""
        self.fenced, self.fence_key, self.asked_ms, self.error = True, None, None, None

    def forget_question(self) -> None:
        """An answer to the question asked so far will be ignored (the owner changed upstream)."""
        self.asked_ms = None

    def waits_for_answer(self) -> bool:
        return self.fenced and self.fence_key is None

    def next_ask_ms(self, now_ms: int) -> int | None:
        """When ``should_ask`` becomes true (None: never, the fence key is known or there is no fence)."""
        if not self.waits_for_answer():
            return None
        return now_ms if self.asked_ms is None else self.asked_ms + self.ask_interval_ms

    def should_ask(self, now_ms: int) -> bool:
        """Rule 1: ask for the committed key now (and remember that it was asked, as ``question``, the
        number the owner sends with the question and hands back with its answer)."""
        due = self.next_ask_ms(now_ms)
        if due is None or now_ms < due:
            return False
        self.asked_ms = now_ms
        self.question += 1
        return True

    def committed_received(
        self, committed_key: TxKey | None, applied_key: TxKey, question: int, error: str | None = None
    ) -> bool:
        """Rule 2: the answer to ``question`` (None: the core could not tell, ``error`` says why). True if
        the fence was just reached."""
        if not self.fenced or self.asked_ms is None or question != self.question:
            return False  # not asked, no longer asked, or the answer to an earlier question: stale
        self.asked_ms = None
        if committed_key is None:
            self.error = error
            return False  # asked again when ``should_ask`` says so
        self.error = None
        if self.fence_key is None:
            self.fence_key = committed_key
        return self.reached(applied_key)

    def unsent(self, question: int, error: str) -> None:
        """Rule 2, for a question the owner could not send: no answer will come, and ``error`` says why
        (for the owner's status). It is asked again when ``should_ask`` says so: after
        ``ask_interval_ms``, as a lost answer, not at once (what kept it may keep the next one)."""
        if self.fenced and self.asked_ms is not None and question == self.question:
            self.error = error

    def reached(self, applied_key: TxKey) -> bool:
        """Rule 3: True if the applied key just reached the fence (reads are served again)."""
        if self.fenced and self.fence_key is not None and applied_key >= self.fence_key:
            self.fenced, self.fence_key = False, None
            return True
        return False
