"""The signals a node's process acts on: SIGTERM and SIGINT stop it, SIGHUP re-reads its keys.

Theory of operation
-------------------
A Python signal handler runs on the main thread between two bytecodes, wherever that thread is: in
the middle of the loop's turn, holding a lock (a ``threading.Lock`` is not reentrant: a handler that
takes it waits for its own thread for ever, and every later signal's handler after it), or inside
a write the handler would interleave with. So the handlers here only record the signal (attribute
writes of values made in advance), and ``signal.set_wakeup_fd`` has the interpreter's C-level handler
write a byte to a pipe, from whichever thread the kernel delivered the signal to: a poll that watches
``wakeup_fd`` returns at once (a signal delivered to another thread does not interrupt the main
thread's poll), and the loop acts on the record on its own time (``NodeServer.take_signals``).

``mnesite start`` installs them before it constructs the node, so a signal is never lost nor fatal:
a core's start-up recovery runs inside its constructor (``core.recovery``), for minutes if its peers
are away, and looks at ``stop_signal`` at every poll (``CoreNode._recovery_wait``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD_SIGNAL = signal.SIGHUP
# Made before any handler runs: a handler builds nothing (``signal.Signals(number)`` is an enum lookup).
_NAMES = {int(number): number.name for number in STOP_SIGNALS}


class ProcessSignals:
    """What the process's stop and reload signals asked, recorded by handlers that do nothing else."""

    def __init__(self) -> None:
        self.stop_signal: str | None = None  # the first stop signal's name ("SIGTERM"): the node stops
        self.reloads = 0  # SIGHUPs received; the loop reloads once per change it sees
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)  # a full pipe: a wake-up is pending already
        self._previous: tuple[int, dict[int, Any]] | None = None

    @property
    def wakeup_fd(self) -> int:
        """Readable once a signal arrived since the last ``drain``."""
        return self._read_fd

    def install(self) -> None:
        """Take SIGTERM, SIGINT and SIGHUP for this process (from its main thread: ``signal``'s rule)."""
        previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        handlers = {int(number): signal.getsignal(number) for number in (*STOP_SIGNALS, RELOAD_SIGNAL)}
        self._previous = (previous_fd, handlers)
        for number in STOP_SIGNALS:
            signal.signal(number, self._stop)
        signal.signal(RELOAD_SIGNAL, self._reload)

    def uninstall(self) -> None:
        """Give the signals back to the handlers (and wakeup fd) found at ``install``; close the pipe."""
        if self._previous is not None:
            previous_fd, handlers = self._previous
            for number, handler in handlers.items():
                signal.signal(number, handler)
            signal.set_wakeup_fd(previous_fd)
            self._previous = None
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def drain(self) -> None:
        """Empty the wakeup pipe (the loop's poll found it readable)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, 4096):
                pass

    # The handlers: a record, nothing else (see the module's opening).

    def _stop(self, number: int, _frame: Any) -> None:
        if self.stop_signal is None:
            self.stop_signal = _NAMES[number]

    def _reload(self, _number: int, _frame: Any) -> None:
        self.reloads += 1
