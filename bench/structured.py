"""Structured output's cost per token, on the shipped model: the same batch of requests decoded
free, all under a JSON schema, and half and half, taking turns in one run; and the grammar
engine's own host time per token (llguidance's mask and accept), replayed over the tokens the
constrained requests generated.

Every request runs ``--tokens`` tokens (free ones with ``ignore_eos``; the schema asks for more
than that many, so the constrained ones end by length too), so the workloads' times per token
compare directly. A constrained request costs more than its mask: the host reads each of its
tokens before the next call (its next mask needs it), so the device waits for the host, and it
takes one token per decode call where the others take several.

    python -m bench.structured [--batch 8] [--tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from bench.common import cpu
from runner import InferenceRunner, ModelRunner, Request
from runner.runner import default_checkpoint

# eight lines of prose (the model writes prose into strings): more than --tokens tokens
SCHEMA = {"type": "object", "properties": {"lines": {"type": "array", "minItems": 8, "maxItems": 8,
                                                     "items": {"type": "string", "maxLength": 64}}},
          "required": ["lines"], "additionalProperties": False}
PROMPTS = ["It is a truth universally acknowledged, that", "Her letter, as a list of lines:",
           "Mr Darcy said", "The ball at Netherfield", "Emma wrote to her sister", "In Bath that winter",
           "Lady Catherine declared", "The parsonage garden"]


def requests(batch: int, tokens: int, constrained: int, seed: int) -> list[Request]:
    """``batch`` requests of ``tokens`` tokens each; the first ``constrained`` under ``SCHEMA``."""
    return [Request(PROMPTS[i % len(PROMPTS)], temperature=0.8, rng_seed=seed + i, max_len=tokens,
                    ignore_eos=i >= constrained, json_schema=SCHEMA if i < constrained else None)
            for i in range(batch)]


def host_cost(runner, completions) -> list[float]:
    """Microseconds of mask + accept per token, replaying each constrained completion."""
    from runner.grammar import Matcher, num_mask_words

    compiled = runner.grammar_of(completions[0].request)
    words = np.zeros(num_mask_words(runner.config.vocab_size), np.uint32)
    times = []
    for done in completions:
        matcher = Matcher(compiled)
        for token in done.token_ids:
            start = time.perf_counter()
            matcher.fill_mask(words)
            assert matcher.accept(token)
            times.append((time.perf_counter() - start) * 1e6)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/structured.json")
    args = p.parse_args(argv)
    runner = InferenceRunner(runner=ModelRunner(checkpoint_path=default_checkpoint()), batch_size=args.batch)
    runner = runner.initialize()
    b = args.batch
    workloads = {"free": 0, "half under the schema": b // 2, "all under the schema": b}
    times = {name: [] for name in workloads}
    # per request: its time to its last token over its tokens (ms), by kind
    own = {(name, kind): [] for name in workloads for kind in ("free", "constrained")}
    finished, constrained_done = {}, []
    for repeat in range(args.repeats + 1):  # the first round warms up (and compiles the grammar)
        for name, constrained in workloads.items():
            batch = requests(b, args.tokens, constrained, seed=100 * repeat)
            start = time.perf_counter()
            ends, tokens = {}, {}
            for event in runner.run(batch):
                tokens[event.request_id] = tokens.get(event.request_id, 0) + (event.token_id is not None)
                if event.finish_reason:
                    ends[event.request_id] = (time.perf_counter() - start, event.finish_reason)
            took = time.perf_counter() - start
            if repeat:
                times[name].append(took / sum(tokens.values()) * 1e3)
                finished[name] = sorted({reason for _, reason in ends.values()})
                for r in batch:
                    kind = "constrained" if r.json_schema is not None else "free"
                    own[name, kind].append(ends[r.request_id][0] / tokens[r.request_id] * 1e3)
        if repeat == args.repeats:  # the constrained requests' tokens, for the host's cost
            constrained_done = runner.generate(requests(b, args.tokens, b, seed=7))
    host = host_cost(runner, constrained_done)
    print(f"{cpu()}; shipped model, batch {b}, {args.tokens} tokens a request, temperature 0.8, "
          f"medians of {args.repeats}")
    base = statistics.median(times["free"])
    print("| workload | ms per token (batch throughput) | vs free | a free request's ms per own token | "
          "a constrained request's | finish reasons |\n|---|---:|---:|---:|---:|---|")
    rows = []
    for name in workloads:
        ms = statistics.median(times[name])
        mine = {kind: statistics.median(own[name, kind]) if own[name, kind] else None
                for kind in ("free", "constrained")}
        rows.append({"workload": name, "ms_per_token": ms, "vs_free": ms / base, "finish": finished[name],
                     "free_request_ms_per_token": mine["free"],
                     "constrained_request_ms_per_token": mine["constrained"]})
        cells = [f"{mine[k]:.2f}" if mine[k] is not None else "-" for k in ("free", "constrained")]
        print(f"| {name} | {ms:.2f} | {ms / base:.2f}x | {cells[0]} | {cells[1]} | {', '.join(finished[name])} |")
    host_row = {"mask_accept_us_mean": statistics.mean(host), "mask_accept_us_p50": statistics.median(host),
                "mask_accept_us_p99": float(np.percentile(host, 99)), "tokens": len(host)}
    print(f"grammar engine (llguidance) on the host: mask + accept {host_row['mask_accept_us_p50']:.0f} us median, "
          f"{host_row['mask_accept_us_mean']:.0f} mean, {host_row['mask_accept_us_p99']:.0f} p99 per token "
          f"({len(host)} tokens)")
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu(), "batch": b, "tokens": args.tokens, "rows": rows, "host": host_row}, f, indent=1)


if __name__ == "__main__":
    main()
