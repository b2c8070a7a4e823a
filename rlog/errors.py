"""The refusals a node answers a request with (pure: the rule-books raise them, the drivers answer them)."""

from __future__ import annotations

from typing import Any

# Why a node refused a connection at its handshake (the ZAP status, ``rlog.security.REFUSAL_REASONS``):
# it held its [limits] connections_max, or the key is not in its authorized_keys. A node's own DEALERs
# (``rlog.connections.RefusedDealers``) and a client's call (``rlog.client.MnesiteError.refused``) say it so.
REFUSED_FULL = "connections_max"
REFUSED_KEY = "key"


class RequestError(Exception):
    """The request is refused with an error ``code`` (and optional ``detail``); a node answers it as an error."""

    def __init__(self, code: str, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


class OverloadedError(Exception):
    """A bound was reached; the request is refused with code ``overloaded`` and changes nothing."""
