"""Prometheus metrics: latencies measured in the server, engine counters from SchedulerStats.

Names are vLLM's after the prefix (`splitserve:` for `vllm:`), each with vLLM's
`model_name` and `engine` labels (the data-parallel engine, "0" with one), so a vLLM
dashboard works once the prefix is swapped. Each app has its own registry, so several
apps (tests) can live in one process.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from ipc.messages import ITERATION_TOKEN_BUCKETS, RequestStats, SchedulerStats
from server.args import METRICS_FOLDER_ENV

PREFIX = "splitserve:"
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
# fmt: on
LABEL = "model_name"
ENGINE = "engine"


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class FinishedRequest:
    """What the server saw of one finished request (its choices' token counts)."""

    seconds: float
    num_prompt_tokens: int
    num_cached_tokens: int
    choice_tokens: list[int]
    n: int
    max_tokens: int | None


class EngineStatsCollector:
    """Exposes each engine's latest SchedulerStats, labelled with its index; nothing for
    an engine that has not answered."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: list[SchedulerStats | None] = []

    def collect(self):
        answered = [(str(i), s) for i, s in enumerate(self.stats) if s is not None]
        if not answered:
            return
        families: dict[str, Any] = {}
        for engine, s in answered:
            for metric in self._engine_metrics(engine, s):
                if metric.name in families:
                    families[metric.name].samples.extend(metric.samples)
                else:
                    families[metric.name] = metric
        yield from families.values()

    def _engine_metrics(self, engine: str, s: SchedulerStats):
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
             s.kv_cache_usage),
            ("prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens.", hit_rate),
        ]  # fmt: skip
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted by the scheduler.", s.num_preemptions),
            ("prompt_tokens", "Prompt tokens of requests that started generating.",
             s.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.num_generation_tokens),
            ("kv_offload_swapped_out_blocks", "KV blocks copied to the host tier by swap "
             "preemption.", s.num_swapped_out_blocks),
            ("kv_offload_swapped_in_blocks", "KV blocks copied back from the host tier (swap "
             "resumes and host-tier prefix hits).", s.num_swapped_in_blocks),
            ("kv_offload_spilled_blocks", "KV blocks spilled to the host tier when evicted "
             "from the device prefix cache.", s.num_spilled_blocks),
            ("kv_offload_prefix_cache_hits", "Prompt tokens found in the host tier (also in "
             "prefix_cache_hits).", s.host_cache_hits),
            ("kv_transfer_pulls", "Prompts whose KV a consumer pulled from a producer.",
             s.kv_transfer_pulls),
            ("kv_transfer_failed_pulls", "Pulls that failed (their prompts were computed).",
             s.kv_transfer_failed_pulls),
            ("kv_transfer_pulled_bytes", "Bytes of KV pages pulled, every rank's.",
             s.kv_transfer_pulled_bytes),
            ("kv_transfer_pull_seconds", "Seconds the landed pulls took (rank 0's, summed).",
             s.kv_transfer_pull_seconds),
            ("kv_transfer_sends", "Requests whose KV a producer served (or stopped keeping "
             "after send_timeout_s).", s.kv_transfer_sends),
        ]  # fmt: skip
        for kinds, family in ((gauges, GaugeMetricFamily), (counters, CounterMetricFamily)):
            for name, doc, value in kinds:
                metric = family(PREFIX + name, doc, labels=[LABEL, ENGINE])
                metric.add_metric([self.model_name, engine], value)
                yield metric
        yield self._iteration_tokens(engine, s)
        if s.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding is configured
            yield from self._spec_decode(engine, s)
        if s.cache_config_info:
            labels = {LABEL: self.model_name, ENGINE: engine, **s.cache_config_info}
            info = GaugeMetricFamily(
                PREFIX + "cache_config_info", "Information of the KV cache's configuration.",
                labels=list(labels),
            )  # fmt: skip
            info.add_metric(list(labels.values()), 1)
            yield info

    def _spec_decode(self, engine: str, s: SchedulerStats):
        counters = [
            ("spec_decode_num_drafts", "Verifications: one request's drafts in one step.",
             s.spec_decode_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.",
             s.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             s.spec_decode_num_accepted_tokens),
        ]  # fmt: skip
        for name, doc, value in counters:
            metric = CounterMetricFamily(PREFIX + name, doc, labels=[LABEL, ENGINE])
            metric.add_metric([self.model_name, engine], value)
            yield metric
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a request's drafts (0: first).",
            labels=[LABEL, ENGINE, "position"],
        )
        for position, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, engine, str(position)], value)
        yield per_pos

    def _iteration_tokens(self, engine: str, s: SchedulerStats) -> HistogramMetricFamily:
        """Tokens per engine step, from the EngineCore's counts per bucket."""
        metric = HistogramMetricFamily(
            PREFIX + "iteration_tokens_total",
            "Tokens scheduled per engine step.",
            labels=[LABEL, ENGINE],
        )
        counts = s.iteration_tokens or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        buckets = list(zip(bounds, itertools.accumulate(counts), strict=True))
        metric.add_metric([self.model_name, engine], buckets, s.iteration_tokens_sum)
        return metric


class ServerMetrics:
    """The server's own metrics, labelled with the model's name and the engine (the
    data-parallel rank) that ran each request."""

    def __init__(self, model_name: str, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector(model_name)
        self.registry.register(self.engine)
        self.model_name = model_name
        tokens = token_buckets(max_model_len or 1_000_000)
        histograms = {
            "time_to_first_token_seconds": ("Time from arrival to first token.", TTFT_BUCKETS),
            "inter_token_latency_seconds": ("Time between token deliveries.", ITL_BUCKETS),
            "time_per_output_token_seconds": (
                "Time between token deliveries (vLLM's older name).",
                ITL_BUCKETS,
            ),
            "e2e_request_latency_seconds": ("Time from arrival to the request's end.", E2E_BUCKETS),
            "request_prompt_tokens": ("Prompt tokens of each finished request.", tokens),
            "request_generation_tokens": ("Tokens generated for each finished request.", tokens),
            "request_max_num_generation_tokens": (
                "Tokens generated for the longest choice of each finished request.",
                tokens,
            ),
            "request_prefill_kv_computed_tokens": (
                "Prompt tokens each finished request computed (not found in the prefix cache).",
                tokens,
            ),
            "request_params_n": ("The n of each finished request.", token_buckets(128)),
            "request_params_max_tokens": ("The max_tokens of each finished request.", tokens),
            "request_time_per_output_token_seconds": (
                "Each finished request's mean time between tokens (after the first), in the "
                "EngineCore.",
                ITL_BUCKETS,
            ),
            "request_decode_time_seconds": (
                "Time from each finished request's first token to its last, in the EngineCore.",
                E2E_BUCKETS,
            ),
            "request_queue_time_seconds": (
                "Time each finished request waited in the EngineCore to be first scheduled.",
                E2E_BUCKETS,
            ),
            "request_prefill_time_seconds": (
                "Time from each finished request's first scheduling to its first token, in "
                "the EngineCore.",
                E2E_BUCKETS,
            ),
            "request_num_preemptions": (
                "Times each finished request was preempted.",
                (0, 1, 2, 5, 10, 20, 50, 100),
            ),
            "request_inference_time_seconds": (
                "Time from each finished request's first scheduling to its last token, in "
                "the EngineCore.",
                E2E_BUCKETS,
            ),
        }
        self._histograms = {
            name: Histogram(
                PREFIX + name, doc, [LABEL, ENGINE], buckets=buckets, registry=self.registry
            )
            for name, (doc, buckets) in histograms.items()
        }
        self._engine_histograms: dict[int, dict[str, Any]] = {}
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            [LABEL, ENGINE, "finished_reason"],
            registry=self.registry,
        )
        self._cached_tokens = Counter(
            PREFIX + "prompt_tokens_cached",
            "Prompt tokens of finished requests found in the prefix cache.",
            [LABEL, ENGINE],
            registry=self.registry,
        )

    def _h(self, engine: int) -> dict[str, Any]:
        """The histograms of one engine's requests, by name."""
        if engine not in self._engine_histograms:
            self._engine_histograms[engine] = {
                n: h.labels(self.model_name, str(engine)) for n, h in self._histograms.items()
            }
        return self._engine_histograms[engine]

    def observe_first_token(self, seconds: float, engine: int = 0) -> None:
        self._h(engine)["time_to_first_token_seconds"].observe(seconds)

    def observe_inter_token(self, seconds: float, engine: int = 0) -> None:
        h = self._h(engine)
        h["inter_token_latency_seconds"].observe(seconds)
        h["time_per_output_token_seconds"].observe(seconds)

    def observe_finished(
        self, finish_reason: str, request: FinishedRequest, engine: int = 0
    ) -> None:
        h = self._h(engine)
        h["e2e_request_latency_seconds"].observe(request.seconds)
        h["request_prompt_tokens"].observe(request.num_prompt_tokens)
        h["request_generation_tokens"].observe(sum(request.choice_tokens))
        h["request_max_num_generation_tokens"].observe(max(request.choice_tokens, default=0))
        computed = request.num_prompt_tokens - request.num_cached_tokens
        h["request_prefill_kv_computed_tokens"].observe(computed)
        h["request_params_n"].observe(request.n)
        if request.max_tokens is not None:
            h["request_params_max_tokens"].observe(request.max_tokens)
        self._cached_tokens.labels(self.model_name, str(engine)).inc(request.num_cached_tokens)
        self._success.labels(self.model_name, str(engine), finish_reason).inc()

    def observe_request_stats(self, stats: RequestStats, num_tokens: int, engine: int = 0) -> None:
        """One engine request's phases, preemptions and `num_tokens` (each choice's, with
        n > 1, as vLLM counts them)."""
        h = self._h(engine)
        h["request_queue_time_seconds"].observe(stats.queued)
        h["request_prefill_time_seconds"].observe(stats.prefill)
        h["request_decode_time_seconds"].observe(stats.decode)
        h["request_inference_time_seconds"].observe(stats.prefill + stats.decode)
        h["request_num_preemptions"].observe(stats.num_preemptions)
        if num_tokens > 1:
            h["request_time_per_output_token_seconds"].observe(stats.decode / (num_tokens - 1))

    def render(self, stats: list[SchedulerStats | None]) -> bytes:
        """The metrics, with each engine's stats (None: that engine did not answer). Under
        prometheus_client's multiprocess mode (several API servers: $PROMETHEUS_MULTIPROC_DIR)
        the server's own are those of every API server process, summed."""
        self.engine.stats = stats
        folder = os.environ.get(METRICS_FOLDER_ENV)
        if folder is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, folder)
        registry.register(self.engine)
        return generate_latest(registry)
