"""Prometheus metrics (prometheus-client), one registry per app.

Engine-side numbers (queue lengths, KV usage, token counters, prefix-cache counters,
compilations, host and device time per step, device-idle fraction) are read from the
engine when Prometheus scrapes, so they cannot drift from the engine's own state; request
latencies are observed by the handlers as requests finish.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from ksana_jax.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(
        self,
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        snap = self.engine.snapshot()
        gauges = {
            "ksana_num_requests_running": ("Requests in the running batch.", snap.running),
            "ksana_num_requests_waiting": ("Requests waiting to start.", snap.waiting),
            "ksana_kv_cache_usage_ratio": (
                "Fraction of KV pages held by requests (1 = full).",
                snap.kv_cache_usage,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "ksana_prompt_tokens": ("Prompt tokens of requests that started.", snap.prompt_tokens),
            "ksana_generation_tokens": ("Tokens generated.", snap.generation_tokens),
            "ksana_prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                snap.prefix_cache_queries,
            ),
            "ksana_prefix_cache_hits": (
                "Prompt tokens found in the prefix cache.",
                snap.prefix_cache_hits,
            ),
            "ksana_num_preemptions": ("Requests preempted for KV pages.", snap.preemptions),
            "ksana_compilations": ("Compiled step shapes (flat after warm-up).", snap.compilations),
            "ksana_spec_decode_num_draft_tokens": (
                "Speculative tokens proposed and verified.",
                snap.spec_draft_tokens,
            ),
            "ksana_spec_decode_num_accepted_tokens": (
                "Speculative tokens the target accepted.",
                snap.spec_accepted_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        per_position = {
            "ksana_spec_decode_num_draft_tokens_per_pos": (
                "Speculative tokens verified at each position j (0 = right after the last token).",
                snap.spec_drafted_per_position,
            ),
            "ksana_spec_decode_num_accepted_tokens_per_pos": (
                "Speculative tokens accepted at each position j; acceptance at j = accepted / "
                "draft tokens per pos.",
                snap.spec_accepted_per_position,
            ),
        }
        for name, (doc, values) in per_position.items():
            family = CounterMetricFamily(name, doc, labels=["position"])
            for j, value in enumerate(values):
                family.add_metric([str(j)], value)
            yield family
        timer = snap.step_timer
        histograms = {
            "ksana_step_host_milliseconds": (
                "Host time of an engine step (schedule, prepare, dispatch, update, emit).",
                timer.host_ms,
            ),
            "ksana_step_device_milliseconds": (
                "Device time of an engine step (an upper bound; see step_metrics.py).",
                timer.device_ms,
            ),
        }
        for name, (doc, hist) in histograms.items():
            yield HistogramMetricFamily(name, doc, buckets=hist.cumulative(), sum_value=hist.total)
        yield GaugeMetricFamily(
            "ksana_device_idle_ratio",
            "Fraction of time the device sat idle between steps while there was work.",
            value=timer.idle_fraction,
        )


class Metrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.request_success = Counter(
            "ksana_request_success",
            "Finished completions (choices), by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "ksana_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "ksana_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "ksana_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
