"""`GET /metrics` of `speckernel serve`, in the Prometheus text format (prometheus_client).

Two sources: what the server sees per request (outcomes, token counts, time to first token and
time per output token histograms), kept in prometheus_client metrics of a registry per app, and
the engine's own counters (`AsyncEngine.stats()`: KV blocks, queue, speculation), read once per
scrape and exposed as they are, so the figures cannot drift from the engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# (stats key under "spec", metric name, help, counter?)
SPEC_FIELDS = (
    ("num_drafts", "spec_drafts", "verification steps that checked drafts, summed over requests", True),
    ("num_draft_tokens", "spec_draft_tokens", "draft tokens proposed", True),
    ("num_accepted_tokens", "spec_accepted_tokens", "draft tokens accepted", True),
    ("num_k0_steps", "spec_k0_steps", "K=0 steps (speculator ran its sync pass only)", True),
    ("num_host_draft_copies", "spec_host_draft_copies", "steps that copied draft ids to the host", True),
    ("acceptance_rate", "spec_acceptance_rate", "accepted / proposed draft tokens", False),
    ("mean_acceptance_length", "spec_mean_acceptance_length", "tokens per verification step", False),
    ("num_speculator_failures", "spec_speculator_failures", "steps whose speculator pass raised (no drafts)", True),
    ("speculator_off", "spec_speculator_off", "1 once the engine switched a failing speculator off", False),
)
ENGINE_COUNTERS = (
    ("num_steps", "engine_steps", "engine steps run"),
    ("num_preemptions", "engine_preemptions", "requests preempted (recomputed later)"),
    ("num_prompt_tokens", "engine_prompt_tokens", "prompt tokens the engine prefilled (recompute included)"),
    ("num_generated_tokens", "engine_generated_tokens", "tokens the engine generated"),
)
ENGINE_GAUGES = (
    ("num_running", "num_requests_running", "requests holding a slot"),
    ("num_waiting", "num_requests_waiting", "requests waiting for a slot"),
    ("kv_blocks_total", "kv_blocks_total", "KV cache blocks"),
)


class EngineCollector(Collector):
    """Exposes the last `stats()` snapshot (set by the /metrics handler right before a scrape)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.stats: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{self.prefix}_engine_up", "1 while the engine core answers, 0 once it is dead")
        up.add_metric([], 0.0 if self.stats is None else 1.0)
        yield up
        stats = self.stats
        if stats is None:
            return
        in_use = GaugeMetricFamily(f"{self.prefix}_kv_blocks_in_use", "KV cache blocks held by requests")
        in_use.add_metric([], stats["kv_blocks_total"] - stats["kv_blocks_free"])
        yield in_use
        for key, name, text in ENGINE_GAUGES:
            gauge = GaugeMetricFamily(f"{self.prefix}_{name}", text)
            gauge.add_metric([], stats[key])
            yield gauge
        for key, name, text in ENGINE_COUNTERS:
            counter = CounterMetricFamily(f"{self.prefix}_{name}", text)
            counter.add_metric([], stats[key])
            yield counter
        spec = stats["spec"]
        for key, name, text, is_counter in SPEC_FIELDS:
            family = CounterMetricFamily if is_counter else GaugeMetricFamily
            metric = family(f"{self.prefix}_{name}", text)
            metric.add_metric([], float(spec.get(key) or 0.0))
            yield metric
        for key, value in sorted((spec.get("plugin") or {}).items()):  # the speculator's own counters
            plugin = GaugeMetricFamily(f"{self.prefix}_spec_plugin_{key}",
                                       f"the {spec.get('speculator')} speculator's {key} (stats: spec.plugin)")
            plugin.add_metric([], float(value))
            yield plugin


class ServeMetrics:
    """One registry per app, so several servers (or test apps) in one process never collide."""

    def __init__(self, prefix: str = "speckernel") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{prefix}_requests", "HTTP generation requests by outcome "
                                "(stop, length, abort: the client left, invalid: 400, error: 5xx)",
                                ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter(f"{prefix}_prompt_tokens", "prompt tokens of served requests",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{prefix}_generation_tokens", "tokens sent to clients",
                                         registry=self.registry)
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds", "arrival to first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(f"{prefix}_time_per_output_token_seconds",
                              "(last token - first token) / (tokens - 1), per request",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.restarts = Counter(f"{prefix}_engine_restarts", "engine cores replaced after their core died",
                                registry=self.registry)
        self.engine = EngineCollector(prefix)
        self.registry.register(self.engine)

    def finished(self, outcome: str, prompt_tokens: int, out: RequestOutput | None) -> None:
        """Records one request that is over (out: its last output, None if it never started)."""
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if out is None:
            return
        self.generation_tokens.inc(len(out.token_ids))
        t = out.timing
        if t is None or t.first_token is None:
            return
        self.ttft.observe(t.first_token - t.arrival)
        if t.finished is not None and len(out.token_ids) > 1:
            self.tpot.observe((t.finished - t.first_token) / (len(out.token_ids) - 1))

    def render(self, stats: dict[str, Any] | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
