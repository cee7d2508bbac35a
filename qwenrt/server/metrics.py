"""/metrics in Prometheus text: vLLM's metric names with a `qwenrt:` prefix, and under vLLM's own `vllm:` names the
gauges fleet routers and autoscalers read (llm-d's endpoint picker, the vLLM and SGLang routers, KEDA): waiting and
running requests, cache usage, the cache's prefix granularity and the LoRA adapters in use. One registry per app, so
several servers (or tests) in one process do not share counters."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qwenrt.engine import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                  80.0)


class ServerMetrics:
    def __init__(self, state):
        """state: the app's state; its `engine` is None while the model loads."""
        self.registry = r = CollectorRegistry()

        def engine_value(read):
            return lambda: read(state.engine) if state.engine is not None else 0

        Gauge("qwenrt:num_requests_running", "Requests in the running batch", registry=r).set_function(
            engine_value(lambda e: e.num_running))
        Gauge("qwenrt:num_requests_waiting", "Requests waiting to be admitted", registry=r).set_function(
            engine_value(lambda e: e.num_waiting))
        Gauge("qwenrt:kv_cache_usage_perc", "Fraction of the cache budget (KV + DeltaNet state) reserved by running "
              "requests", registry=r).set_function(
            engine_value(lambda e: e.scheduler.reserved / e.memory_budget))
        self.prompt_tokens = Counter("qwenrt:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("qwenrt:generation_tokens", "Tokens generated", registry=r)
        self.prefix_queries = Counter("qwenrt:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("qwenrt:prefix_cache_hits", "Prompt tokens restored from the prefix cache",
                                   registry=r)
        self.request_success = Counter("qwenrt:request_success", "Finished requests by finish reason",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("qwenrt:time_to_first_token_seconds", "Time to first token (from arrival at the "
                              "engine)", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("qwenrt:inter_token_latency_seconds", "Time between successive tokens of a request",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("qwenrt:e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("qwenrt:request_queue_time_seconds", "Arrival to the first prefill chunk",
                                    buckets=_LATENCY_BUCKETS, registry=r)

        r.register(DraftCollector(state))
        r.register(FleetCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class DraftCollector:
    """Speculative decoding counters (vLLM's spec_decode names), read from the engine's running totals."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        engine = self.state.engine
        counts = engine.draft_counts if engine is not None else None
        drafts = CounterMetricFamily("qwenrt:spec_decode_num_drafts", "Verifications that carried drafts")
        tokens = CounterMetricFamily("qwenrt:spec_decode_num_draft_tokens", "Draft tokens proposed")
        accepted = CounterMetricFamily("qwenrt:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        per_pos = CounterMetricFamily("qwenrt:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position", labels=["position"])
        drafts.add_metric([], counts.rounds if counts else 0)
        tokens.add_metric([], counts.draft_tokens if counts else 0)
        accepted.add_metric([], counts.accepted_tokens if counts else 0)
        for i, n in enumerate(counts.accepted if counts else []):
            per_pos.add_metric([str(i)], n)
        return [drafts, tokens, accepted, per_pos]


class FleetCollector:
    """The gauges under the names routers read (the Gateway API Inference Extension's model-server protocol): the same
    values as qwenrt's own, plus `vllm:cache_config_info` (block_size: prompt tokens between prefix-cache snapshots,
    the granularity at which a prefix can be restored) and, where adapters are served, `vllm:lora_requests_info`
    (value: when it was read, as vLLM's; labels: the adapters of the running and the waiting requests)."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        engine = self.state.engine
        families = [GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch"),
                    GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be admitted"),
                    GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of the cache budget (KV + DeltaNet "
                                      "state) reserved by running requests, 0-1")]
        values = (0, 0, 0.0) if engine is None else (
            engine.num_running, engine.num_waiting, engine.scheduler.reserved / engine.memory_budget)
        for family, value in zip(families, values):
            family.add_metric([], value)
        if engine is None:
            return families
        info = GaugeMetricFamily("vllm:cache_config_info", "Cache configuration", labels=[
            "block_size", "enable_prefix_caching", "cache_dtype"])
        info.add_metric([str(engine.snapshot_interval), str(engine.prefix_cache is not None).lower(),
                         str(engine.kv_dtype).removeprefix("torch.")], 1)
        families.append(info)
        adapters = self.state.config.adapters
        if adapters:
            running, waiting = (",".join(sorted(names)) for names in engine.adapters_in_use())
            lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            lora.add_metric([str(len(adapters)), running, waiting], time.time())
            families.append(lora)
        return families


class RequestTimer:
    """Feeds one request's outputs into the metrics (called in the engine thread, once per output)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self._last: float | None = None  # when the previous token came out
        self._generated = 0

    def observe(self, out: RequestOutput) -> None:
        m = self.metrics
        if out.token_ids:
            if self._last is None:
                m.prompt_tokens.inc(out.prompt_tokens)
                m.prefix_queries.inc(out.prompt_tokens)
                m.prefix_hits.inc(out.cached_tokens)
                m.ttft.observe(out.first_token_time - out.arrival_time)
                # a prompt restored whole from the prefix cache has no prefill chunk: it waited until its token
                m.queue_time.observe((out.prefill_start_time or out.first_token_time) - out.arrival_time)
            else:
                m.itl.observe(out.time - self._last)
            self._last = out.time
        m.generation_tokens.inc(out.generation_tokens - self._generated)
        self._generated = out.generation_tokens
        if out.finished:
            m.request_success.labels(out.finish_reason).inc()
            m.e2e.observe(out.time - out.arrival_time)
