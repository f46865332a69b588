"""Bounds on when a lease (or a retention) the store starts ends, measured around the call
that starts it.

A store stamps a lease with its own clock (the same system clock as the test's: SQLite
keeps float seconds, Redis milliseconds), somewhere between the call being sent and
its return. A test sleeps just past the latest end (no fixed sleep longer than it
needs) and asserts "still leased" only when asked well before the earliest end, so a
slow machine skips that assertion instead of failing it. The retention tests
(`tests/contract/test_contract_retention.py`) bound their entries' expiry the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

MARGIN_S = 0.1  # what a measured time must clear a lease's end by before a test relies on it

T = TypeVar("T")


@dataclass(frozen=True)
class LeaseWindow:
    """Bounds on when a lease ends, measured around the call that took it."""

    earliest: float  # the call was sent, plus the lease
    latest: float  # the call had returned, plus the lease

    def still_held(self) -> bool:
        """Whether something that returned before now surely ran within the lease."""
        return time.time() < self.earliest - MARGIN_S

    def sleep_past(self) -> None:
        """Sleep until the lease has ended in the store's view."""
        time.sleep(max(0.0, self.latest + MARGIN_S - time.time()))


def leasing(call: Callable[[], T], lease_s: float) -> tuple[T, LeaseWindow]:
    """Run `call` (one that takes leases of `lease_s`); its result and the leases' end."""
    sent = time.time()
    result = call()
    return result, LeaseWindow(sent + lease_s, time.time() + lease_s)
