"""The operator's API backoffs never run out (kopf gives a request up when they do, and a watch given up on a 5xx
is not started again) and grow to a cap; each request iterates them afresh."""
from __future__ import annotations

import collections.abc
import itertools

from disagg.operator.backoff import EndlessBackoffs, backoff_seconds


def test_backoffs_double_to_the_cap_and_never_end():
    b = EndlessBackoffs(first=1, cap=30)
    assert list(itertools.islice(b, 8)) == [1, 2, 4, 8, 16, 30, 30, 30]
    assert len(list(itertools.islice(b, 10_000))) == 10_000
    assert list(itertools.islice(b, 3)) == [1, 2, 4], "every request starts from the first delay"
    assert not isinstance(b, collections.abc.Sized), "kopf counts a last attempt only for a sized sequence"


def test_reconcile_retry_delays_are_capped():
    assert [backoff_seconds(r) for r in (0, 1, 5, 6, 20)] == [1, 2, 32, 60, 60]
