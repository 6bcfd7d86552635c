"""Prometheus metrics under vLLM's names, so existing dashboards read them.

Each server has its own registry (several servers in one process, as in the tests, do not
collide). Histograms: time to first token, inter-token latency, end-to-end latency and queue
time; gauges: requests running and waiting, KV cache usage (positions held over positions the
slots have); counters: prompt and generation tokens, requests by finish reason (``stop``,
``length``, ``error`` for a request that failed while served, ``abort`` for one its client left or
the shutdown ended), prefix cache queries and hits (in tokens). Inter-token latency is per token
as the client receives it: the tokens of one decode call arrive together, each counted at their
gap over their number.
"""

from __future__ import annotations

import prometheus_client as prom

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = prom.CollectorRegistry()
        labels = ["model_name"]
        r, self.labels = self.registry, {"model_name": model_name}

        def histogram(name, doc):
            return prom.Histogram(name, doc, labels, buckets=_LATENCY, registry=r).labels(**self.labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a request.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.")
        self.queue = histogram("vllm:request_queue_time_seconds", "Time from arrival to the first token's "
                               "prefill (waiting for a slot) in seconds.")
        self.running = prom.Gauge("vllm:num_requests_running", "Requests in a decode slot.", labels,
                                  registry=r).labels(**self.labels)
        self.waiting = prom.Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", labels,
                                  registry=r).labels(**self.labels)
        self.kv_usage = prom.Gauge("vllm:kv_cache_usage_perc", "Fraction of the slots' KV positions holding a running "
                                   "request's tokens (1 = all).",
                                   labels, registry=r).labels(**self.labels)
        self.prompt_tokens = prom.Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels,
                                          registry=r).labels(**self.labels)
        self.generation_tokens = prom.Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                              registry=r).labels(**self.labels)
        self.success = prom.Counter("vllm:request_success", "Finished requests by finish reason.",
                                    labels + ["finished_reason"], registry=r)
        self.prefix_queries = prom.Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                           "cache.", labels, registry=r).labels(**self.labels)
        self.prefix_hits = prom.Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                        "(not computed).", labels, registry=r).labels(**self.labels)
        self._prefix_seen = (0, 0)
        # speculative decoding (runner/speculative.py), counted when a request that speculated ends:
        # vLLM's two counters, and ours for tokens per step (tokens / steps)
        self.spec_drafted = prom.Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed by n-gram "
                                         "lookup and verified.", labels, registry=r).labels(**self.labels)
        self.spec_accepted = prom.Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                          registry=r).labels(**self.labels)
        self.spec_steps = prom.Counter("grok_runner:spec_decode_steps", "Decode steps of requests that speculate.",
                                       labels, registry=r).labels(**self.labels)
        self.spec_tokens = prom.Counter("grok_runner:spec_decode_tokens", "Tokens those decode steps generated.",
                                        labels, registry=r).labels(**self.labels)

    def finished(self, reason: str) -> None:
        self.success.labels(finished_reason=reason, **self.labels).inc()

    def speculated(self, speculation) -> None:
        """A finished request's ``Speculation`` into the counters."""
        self.spec_drafted.inc(speculation.drafted)
        self.spec_accepted.inc(speculation.accepted)
        self.spec_steps.inc(speculation.steps)
        self.spec_tokens.inc(speculation.tokens)

    def update_load(self, running: int, waiting: int, held: int, available: int) -> None:
        """Requests running and waiting; KV positions ``held`` by running requests of ``available``."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(held / available if available else 0.0)

    def update_prefix_cache(self, queries: int, hits: int) -> None:
        """The prefix cache's running totals (``InferenceRunner.prefix_cache_counts``) into the counters."""
        seen_queries, seen_hits = self._prefix_seen
        self.prefix_queries.inc(queries - seen_queries)
        self.prefix_hits.inc(hits - seen_hits)
        self._prefix_seen = (queries, hits)

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)
