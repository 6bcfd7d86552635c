"""Prometheus metrics under vLLM's names, so existing dashboards read them.

Each server has its own registry (several servers in one process, as in the tests, do not
collide). Histograms: time to first token, inter-token latency, end-to-end latency and queue
time; gauges: requests running and waiting, KV cache usage (positions held over positions the
slots have); counters: prompt tokens (as their requests are admitted) and generated tokens (as
they reach their client), requests by finish reason (``stop``,
``length``, ``error`` for a request that failed while served, ``abort`` for one its client left or
the shutdown ended), prefix cache queries and hits (in tokens). Inter-token latency is per token
as the client receives it: the tokens of one decode call arrive together, each counted at their
gap over their number.

``StatsLine``: the same numbers as a log line every few seconds (``--stats-interval``), as vLLM's
``LoggingStatLogger`` logs them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import prometheus_client as prom

log = logging.getLogger("grok_runner.server.stats")

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

    def tokens(self) -> tuple[float, float]:
        """(prompt tokens, generated tokens) counted since start."""
        def total(name):
            return self.registry.get_sample_value(name + "_total", self.labels) or 0.0
        return total("vllm:prompt_tokens"), total("vllm:generation_tokens")

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


class StatsLine:
    """vLLM's periodic stats line (``vllm/v1/metrics/loggers.py``, ``LoggingStatLogger.log``), from
    what the server counts anyway (``Metrics``) and what ``/metrics`` asks the runner
    (``usage()``, ``prefix_cache_counts()``, host-side numbers: nothing waits on the device):

        Avg prompt throughput: 118.4 tokens/s, Avg generation throughput: 40.2 tokens/s, Running: 2 reqs,
        Waiting: 0 reqs, KV cache usage: 12.5% (2/4 slots), Prefix cache: 10/64 blocks, 50.0% hit rate

    Throughputs are over the interval since the last line: prompt tokens as requests are admitted,
    generated tokens as they reach their clients. KV cache usage is the positions held by running
    requests over the positions the slots have (``vllm:kv_cache_usage_perc``), and the slots in
    use; the prefix cache (where there is one) the blocks it holds and its hits over the
    interval's prompt tokens looked up. As vLLM does, a line is logged at INFO while there is
    activity (tokens in this interval or the one before, or a request running or waiting) and at
    DEBUG when idle, so an idle server is quiet at the default level. ``clock``: seconds, monotonic
    (a test's own, for throughputs checkable by hand)."""

    def __init__(self, metrics: Metrics, runner, clock=time.monotonic):
        self.metrics, self.runner, self.clock = metrics, runner, clock
        self._last = self._counts()
        self._was_active = False

    def _counts(self) -> tuple[float, ...]:
        return (self.clock(), *self.metrics.tokens(), *self.runner.prefix_cache_counts())

    def line(self) -> tuple[int, str]:
        """The interval since the last call: (its log level, its line)."""
        now = self._counts()
        elapsed, prompt, generated, queries, hits = (b - a for a, b in zip(self._last, now))
        self._last = now
        prompt_rate, generation_rate = (n / elapsed if elapsed > 0 else 0.0 for n in (prompt, generated))
        running, waiting, held, available = self.runner.usage()
        text = (f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation throughput: "
                f"{generation_rate:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: "
                f"{100 * held / available if available else 0.0:.1f}% ({running}/{self.runner.num_slots} slots)")
        prefix = self.runner.prefix_cache_usage()
        if prefix is not None:
            text += f", Prefix cache: {prefix[0]}/{prefix[1]} blocks"
            if queries:
                text += f", {100 * hits / queries:.1f}% hit rate"
        active = bool(prompt or generated or running or waiting)
        level = logging.INFO if active or self._was_active else logging.DEBUG
        self._was_active = active
        return level, text

    async def run(self, interval: float) -> None:
        """Log a line every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                level, text = self.line()
            except Exception:  # noqa: BLE001 - a bug here must not end the stats lines silently
                log.exception("stats line")
                continue
            log.log(level, "%s", text)
