"""``GET /metrics``: the engine's figures as Prometheus text, under vLLM's metric names.

A scraper (or a dashboard built for vLLM) reads the same names from mini-vLLM:
prefix-cache queries and hits (the pool's, and a KV-cache offloading tier's
as ``vllm:external_prefix_cache_*``), running and waiting requests, preemptions, KV-cache
usage, prompt and generation tokens, and finished requests by finish reason. The
figures are read from ``AsyncLLM.stats`` at each scrape.

vLLM equivalent: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``), served
at ``/metrics`` by ``vllm/entrypoints/openai/api_server.py``.
"""

from __future__ import annotations

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..async_llm import AsyncLLM

# vLLM's FinishReason names: /metrics has vllm:request_success for each from the start (0 until one finishes so).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# Prometheus's text format, version 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    """The server's Prometheus registry, holding one collector: the engine's figures."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))

    def response(self) -> Response:
        """The ``/metrics`` page, read now."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)


class EngineCollector:
    """The engine's figures under vLLM's metric names, labelled with the served model's name."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats
        labels = ["model_name"]
        values = [self.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits
        )
        yield counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
            stats.external_prefix_cache_queries,
        )
        yield counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
            stats.external_prefix_cache_hits,
        )
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.num_blocks_in_use / stats.num_blocks if stats.num_blocks else 0.0,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
        finished = CounterMetricFamily(
            "vllm:request_success", "Count of finished requests by finish reason.", labels=[*labels, "finished_reason"]
        )
        for reason in sorted(set(FINISH_REASONS) | set(stats.finished_by_reason)):
            finished.add_metric([self.model_name, reason], stats.finished_by_reason.get(reason, 0))
        yield finished
