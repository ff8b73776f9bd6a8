"""A counting phase clock for tests: phase durations in ticks, whatever the machine's load.

moetrace's host phase clock (:class:`moetrace.timing.HostClock`) takes ``time.perf_counter_ns``
when it is built. A clock built inside :func:`counting_clock` reads a counter instead, which
moves :data:`TICK_NS` at every reading (and keeps counting after the block ends), and by as much
as an injected delay would sleep when the block's ``sleep`` is called. So an entered phase lasts
a whole number of ticks, one more than the readings taken inside it, plus the delays injected in
it, and a phase never entered lasts none: figures a test can assert exactly, where a measured
duration can read zero on a coarse clock and two measured durations can swap on a loaded machine.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator

__all__ = ["TICK_NS", "TICK_S", "counting_clock"]

TICK_NS = 1_000
"""How far the counter moves per reading, in nanoseconds."""
TICK_S = TICK_NS * 1e-9


@contextlib.contextmanager
def counting_clock() -> Iterator[Callable[[float], None]]:
    """Host phase clocks built inside the block count ticks instead of reading the machine's time.

    Yields ``sleep(seconds)``: moves their counter as far as a sleep that long, at once (an injected
    delay that the clocks see, without waiting for it)."""
    from moetrace.timing import HostClock

    home = sys.modules[HostClock.__module__]  # the module whose ``time`` the clock reads
    now = [0]

    def read() -> int:
        now[0] += TICK_NS
        return now[0]

    def sleep(seconds: float) -> None:
        now[0] += round(seconds * 1e9)

    real = home.time
    home.time = types.SimpleNamespace(perf_counter_ns=read, time=real.time)
    try:
        yield sleep
    finally:
        home.time = real
