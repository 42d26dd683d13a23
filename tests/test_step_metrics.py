"""Step timing (host side): histograms, device time and idle time from a step's instants,
and their Prometheus exposition."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from ksana_jax.async_engine import EngineSnapshot
from ksana_jax.step_metrics import Histogram, StepTimer
from server.metrics import Metrics


def test_histogram_buckets_are_cumulative():
    h = Histogram((1, 5))
    for v in (0.5, 1, 3, 7, 9):
        h.observe(v)
    assert h.cumulative() == [("1.0", 2), ("5.0", 3), ("+Inf", 5)]
    assert h.total == 20.5 and h.count == 5 and h.mean == 4.1


def test_sequential_steps_leave_the_device_idle_during_host_work():
    t = StepTimer()
    # step 1: dispatched at 1, result waited for from 1.5 to 3; call from 0 to 3.5
    t.record(0.0, 3.5, 1.0, 1.5, 3.0, False)
    # step 2: dispatched at 4.5 (the device idled 3 -> 4.5), done at 6
    t.record(4.0, 6.5, 4.5, 5.0, 6.0, False)
    assert t.busy_s == pytest.approx(2.0 + 1.5)
    assert t.idle_s == pytest.approx(1.5)
    assert t.idle_fraction == pytest.approx(1.5 / 5.0)
    assert t.host_ms.mean == pytest.approx(((3.5 - 1.5) + (2.5 - 1.0)) / 2 * 1e3)
    assert t.device_ms.count == 2


def test_overlapped_steps_keep_the_device_busy():
    t = StepTimer()
    t.record(0.0, 1.0, 0.1, 0.5, 0.9, False)  # ends at 0.9
    t.record(1.0, 2.0, 0.6, 1.2, 1.8, False)  # dispatched before the first ended
    assert t.idle_s == 0.0 and t.busy_s == pytest.approx(0.8 + 0.9)
    t.pause()  # no work: the wait until the next request is not idle time
    t.record(5.0, 5.5, 5.1, 5.2, 5.4, False)
    assert t.idle_s == 0.0
    t.record(6.0, 6.5, 6.1, 6.2, 6.3, True)  # already done when fetched: dated at the fetch
    assert t.idle_s == pytest.approx(0.7)


class _FakeEngine:
    def __init__(self, timer: StepTimer):
        self.timer = timer

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            running=1,
            waiting=0,
            kv_cache_usage=0.5,
            prompt_tokens=10,
            generation_tokens=20,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            preemptions=0,
            compilations=3,
            spec_draft_tokens=0,
            spec_accepted_tokens=0,
            spec_drafted_per_position=(),
            spec_accepted_per_position=(),
            step_timer=self.timer.copy(),
        )


def test_metrics_expose_step_times_and_idle_ratio():
    timer = StepTimer()
    timer.record(0.0, 0.010, 0.001, 0.002, 0.008, False)
    text = generate_latest(Metrics(_FakeEngine(timer)).registry).decode()
    assert 'ksana_step_host_milliseconds_bucket{le="5.0"} 1.0' in text
    assert "ksana_step_host_milliseconds_count 1.0" in text
    assert "ksana_step_device_milliseconds_sum 7.0" in text
    assert "ksana_device_idle_ratio 0.0" in text
