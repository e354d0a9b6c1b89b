"""Prometheus metrics: latencies measured in the server, engine counters from SchedulerStats.

Each app has its own registry, so several apps (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ipc.messages import SchedulerStats

PREFIX = "splitserve:"
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
# fmt: on


class EngineStatsCollector:
    """Exposes the latest SchedulerStats; nothing while the engine has not answered."""

    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None

    def collect(self):
        s = self.stats
        if s is None:
            return
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0 to 1).",
                s.kv_cache_usage,
            ),
            (
                "prefix_cache_hit_rate",
                "Prefix cache hits / queries, in tokens, since start.",
                s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            ),
        ]
        counters = [
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted by the scheduler.", s.num_preemptions),
            (
                "prompt_tokens",
                "Prompt tokens of requests that started generating.",
                s.num_prompt_tokens,
            ),
            ("generation_tokens", "Tokens generated.", s.num_generation_tokens),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector()
        self.registry.register(self.engine)
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Time from request arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between successive token deliveries.", ITL_BUCKETS
        )
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its end.", E2E_BUCKETS
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

    def render(self, stats: SchedulerStats | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
