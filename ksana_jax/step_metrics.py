"""Step timing for /metrics and the benchmarks: host time per step, device time per step,
and the fraction of time the device sat idle between steps (host side, no jax).

The engine reports four instants per step (`StepTimer.record`): when its `step()` call began
and ended, when the step was dispatched, and when its result was fetched (with whether it was
already done when the fetch began). Host time is the call's own work -- schedule, prepare,
dispatch, update, emit -- without the wait for the device. A step's device time runs from
when it could start (its dispatch, or the previous step's end if later) to its end; the gap
between the previous step's end and this step's start is idle time, counted only while the
engine kept stepping. A result already done when fetched is dated at the fetch, so device
time is an upper bound and idle time a lower bound.
"""

from __future__ import annotations

import bisect
import dataclasses

HOST_BUCKETS_MS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000)
DEVICE_BUCKETS_MS = (0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000)


@dataclasses.dataclass
class Histogram:
    """Counts per upper bound (the last slot: above every bound), plus sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, observations <= it), ending with +Inf."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else str(float(bound)), running))
        return out

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclasses.dataclass
class StepTimer:
    host_ms: Histogram = dataclasses.field(default_factory=lambda: Histogram(HOST_BUCKETS_MS))
    device_ms: Histogram = dataclasses.field(default_factory=lambda: Histogram(DEVICE_BUCKETS_MS))
    busy_s: float = 0.0
    idle_s: float = 0.0
    _last_end: float | None = None  # when the device finished the last step fetched

    @property
    def idle_fraction(self) -> float:
        wall = self.busy_s + self.idle_s
        return self.idle_s / wall if wall else 0.0

    def record(
        self,
        begin: float,
        end: float,
        dispatched: float | None,
        fetch_begin: float,
        fetch_end: float,
        was_ready: bool,
    ) -> None:
        """One `step()` call that fetched a step (dispatched at `dispatched`, by this call or
        the one before); times in seconds from one monotonic clock."""
        self.host_ms.observe(((end - begin) - (fetch_end - fetch_begin)) * 1e3)
        if dispatched is None:
            return
        done = fetch_begin if was_ready else fetch_end
        start = dispatched if self._last_end is None else max(dispatched, self._last_end)
        if self._last_end is not None:
            self.idle_s += max(0.0, start - self._last_end)
        self.busy_s += done - start
        self.device_ms.observe((done - start) * 1e3)
        self._last_end = done

    def copy(self) -> StepTimer:
        """A snapshot for another thread (the metrics scrape)."""
        return dataclasses.replace(
            self,
            host_ms=dataclasses.replace(self.host_ms, counts=list(self.host_ms.counts)),
            device_ms=dataclasses.replace(self.device_ms, counts=list(self.device_ms.counts)),
        )

    def pause(self) -> None:
        """The engine ran out of work: the next step's wait is not idle time."""
        self._last_end = None
