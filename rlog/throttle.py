"""A log that says a repeated line at most once per interval per reason, with how many it left out.

What a sender or an overload controls (a protocol violation, a refused request, a dropped frame, a
failed checkpoint retried at every commit) must not become a log line per event. ``ThrottledLog``
bounds each reason to a line per interval and says the rest as a count, and its ``flush``, which the
node's loop calls every turn (``rlog.server.NodeServer.turn``), says a burst's last lines once the
interval is over even if no line of that reason ever comes again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


def monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


class ThrottledLog:
    """At most one line per ``interval_ms`` per reason, saying how many lines of that reason it left
    out since the last one: what a sender controls (a frame per message, without ``[security]`` from
    anyone who reaches the endpoint) must not become a line per message. ``reason`` is a fixed name
    from the code, never the sender's: the reasons, and so this, stay bounded whatever arrives.

    Lines left out are reported with the next line of their reason, or by ``flush`` (the node's loop
    calls it every turn) once ``interval_ms`` has passed without one: a burst's last lines are said
    even if no line of that reason ever comes again. ``flush`` logs the last line left out, with the
    count of the others, and forgets a reason that has nothing left to say.

    A line goes to ``logger``, or to the one ``log`` names (a node's one log says the lines of its
    parts, each under its own module's logger: ``mnesite.replicant`` for a replicant's pushes)."""

    def __init__(
        self, logger: logging.Logger, interval_ms: int = 1000, clock: Callable[[], int] = monotonic_ms
    ) -> None:
        self.logger = logger
        self.interval_ms = interval_ms
        self.clock = clock
        # reason -> (when its last line was logged, lines left out since, the last of them as
        # (logger, level, text, args) or None): one entry per reason, whatever arrives.
        self._reasons: dict[str, tuple[int, int, tuple[logging.Logger, int, str, tuple[Any, ...]] | None]] = {}
        # When ``flush`` has something to do, at the earliest (None: nothing left out, no reason kept).
        self._flush_at_ms: int | None = None

    def log(self, reason: str, level: int, text: str, *args: Any, logger: logging.Logger | None = None) -> None:
        logger = logger or self.logger
        now_ms = self.clock()
        logged_ms, suppressed, _ = self._reasons.get(reason, (None, 0, None))
        if logged_ms is not None and now_ms - logged_ms < self.interval_ms:
            self._reasons[reason] = (logged_ms, suppressed + 1, (logger, level, text, args))
            self._flush_by(logged_ms + self.interval_ms)
            return
        self._reasons[reason] = (now_ms, 0, None)
        self._flush_by(now_ms + self.interval_ms)  # then forgotten by flush
        if suppressed:
            text += " (and %d more like it in the last %d ms)"
            args = (*args, suppressed, now_ms - logged_ms)
        logger.log(level, text, *args)

    def flush(self, final: bool = False) -> None:
        """Log, per reason whose ``interval_ms`` has passed, the last line left out (with the count of
        the others left out since its last line), and forget the reasons with nothing left out. Cheap
        when there is nothing to do: a clock read and a comparison. ``final``: every reason's, whether
        its interval passed or not (the node stops: no later turn would say them)."""
        if self._flush_at_ms is None:
            return
        now_ms = self.clock()
        if now_ms < self._flush_at_ms and not final:
            return
        self._flush_at_ms = None
        for reason, (logged_ms, suppressed, last) in list(self._reasons.items()):
            due_ms = logged_ms + self.interval_ms
            if now_ms < due_ms and not final:
                self._flush_by(due_ms)
                continue
            if last is None:
                del self._reasons[reason]  # quiet for an interval: its next line is logged anyway
                continue
            logger, level, text, args = last
            if suppressed > 1:
                text += " (and %d more like it in the last %d ms)"
                args = (*args, suppressed - 1, now_ms - logged_ms)
            logger.log(level, text, *args)
            self._reasons[reason] = (now_ms, 0, None)  # a line logged now: the next within the interval waits
            self._flush_by(now_ms + self.interval_ms)

    def _flush_by(self, due_ms: int) -> None:
        self._flush_at_ms = due_ms if self._flush_at_ms is None else min(self._flush_at_ms, due_ms)
