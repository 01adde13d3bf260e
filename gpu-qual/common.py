"""What every rung module shares: how a rung says SKIP or FAIL (with what it
measured all the same, where it measured anything)."""

from __future__ import annotations


class Skip(Exception):
    """The machine lacks what the rung needs (the reason is the message)."""

    def __init__(self, reason: str, details: dict | None = None):
        super().__init__(reason)
        self.details = details or {}


class Fail(Exception):
    """pdstor got something wrong (the reason is the message)."""

    def __init__(self, reason: str, details: dict | None = None):
        super().__init__(reason)
        self.details = details or {}
