"""How long the operator waits before asking an unavailable API server again.

kopf retries each API request along `settings.networking.error_backoffs` and gives up when they run out
(kopf's own default: 8 tries, about a minute). A watch stream whose request gave up on a 5xx is not started
again: the operator would sit deaf, seeing no new or changed resources, long after the API server is back. The
operator's backoffs never run out instead: capped, doubling delays for as long as the outage lasts.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

MAX_BACKOFF_SECONDS = 60  # also the longest delay before a failed reconcile pass is tried again


def backoff_seconds(retry: int) -> float:
    """A failed reconcile pass's delay before its next try: 1, 2, 4, ... 60."""
    return float(min(MAX_BACKOFF_SECONDS, 2 ** retry))


@dataclass(frozen=True)
class EndlessBackoffs:
    """first, 2 x first, 4 x first, ... up to `cap`, forever; iterated afresh for every request (no length: kopf
    then counts no "last attempt")."""
    first: float = 1.0
    cap: float = 30.0

    def __iter__(self) -> Iterator[float]:
        delay = self.first
        while True:
            yield delay
            delay = min(self.cap, delay * 2)
