"""/metrics in Prometheus' text format (prometheus_client), read live from the service.

Throughput (tokens and tokens/s over the last 10 s), batch occupancy (rows now, and the mean
rows per token step), queue length, sequences in q_E, wall time in each mode, prefill and
flow time, prefix-cache and continuation hits, requests by endpoint and status, and the
time to first token as a histogram.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Live:
    def __init__(self, service) -> None:
        self.service = service

    def collect(self):
        snap = self.service.snapshot()

        def gauge(name, doc, value):
            return GaugeMetricFamily(f"hybridlm_{name}", doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(f"hybridlm_{name}", doc, value=value)

        yield counter("tokens_generated", "Tokens emitted by every sequence", snap["tokens_total"])
        yield gauge("tokens_per_second", "Tokens emitted per second over the last 10 s", snap["tokens_per_second"])
        yield counter("token_steps", "Engine steps that took a token step", snap["steps_total"])
        yield gauge("batch_rows", "Sequences in the batch (q_G) now", snap["batch"])
        yield gauge("batch_capacity", "The largest batch (--max-batch)", snap["max_batch"])
        mean = snap["rows_total"] / snap["steps_total"] if snap["steps_total"] else 0.0
        yield gauge("batch_occupancy_mean", "Mean rows per token step since start", mean)
        yield gauge("queue_length", "Sequences waiting to join the batch", snap["queue"])
        yield gauge("external_sequences", "Sequences in q_E (a server-side tool running)", snap["external"])
        yield counter("jumps", "Jumps taken (server-side tool calls)", snap["jumps_total"])
        modes = CounterMetricFamily("hybridlm_mode_seconds", "Wall seconds spent by ended arcs in each mode",
                                    labels=["mode"])
        for mode, seconds in snap["mode_seconds"].items():
            modes.add_metric([mode], seconds)
        yield modes
        yield counter("prefill_seconds", "Wall seconds inside prefills", snap["prefill_seconds"])
        yield counter("flow_seconds", "Wall seconds inside token steps", snap["flow_seconds"])
        yield counter("prompt_tokens", "Prompt tokens of admitted requests", snap["prompt_tokens"])
        pc = snap["prefix_cache"]
        yield counter("prefix_cache_hits", "Prefills that found a cached prefix", pc["hits"])
        yield counter("prefix_cache_misses", "Prefills that found none", pc["misses"])
        yield counter("prefix_cache_hit_tokens", "Tokens not prefilled thanks to the cache", pc["hit_tokens"])
        yield gauge("prefix_cache_bytes", "Bytes of states held by the prefix cache", pc["bytes"])
        cs = snap["continuations"]
        yield counter("continuation_hits", "Requests continued from the state of a client-side jump", cs["hits"])
        yield counter("continuation_misses", "Tool results whose state was not kept (prefilled)", cs["misses"])
        yield gauge("continuation_bytes", "Bytes of kept continuation states", cs["bytes"])
        ended = CounterMetricFamily("hybridlm_arcs_ended", "Arcs ended, by termination cause", labels=["cause"])
        for cause, n in snap["ended_by_cause"].items():
            ended.add_metric([cause], n)
        yield ended
        requests = CounterMetricFamily("hybridlm_requests", "Requests by endpoint and HTTP status",
                                       labels=["endpoint", "status"])
        for (endpoint, status), n in snap["requests"].items():
            requests.add_metric([endpoint, str(status)], n)
        yield requests


class Metrics:
    def __init__(self, service) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.registry.register(_Live(service))
        self._ttft = Histogram("hybridlm_time_to_first_token_seconds", "Seconds from a request to its first token",
                               buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def request(self, endpoint: str, status: int) -> None:
        self.service.counters.request(endpoint, status)

    def render(self) -> bytes:
        return generate_latest(self.registry)
