"""Open-loop load over HTTP against ``python run.py serve``, in the shape of vLLM's benchmark_serving.

    python -m bench.serve [--rates 2,8,inf] [--requests 64] [--batch-size 8] [--out bench/serve.json]

Starts the server on the shipped model in a subprocess (127.0.0.1, a free port), then for each
rate sends ``--requests`` streaming completions with Poisson arrivals (``inf``: all at once): prompts
of 4 to 120 tokens cut from the model's own training text (``../shared/data/austen.txt``, else
generated words), 16 to 64 new tokens, greedy. Per rate: request throughput, output tokens/s, and
TTFT, TPOT and inter-token latency at p50 and p99. Then the HTTP path against ``run()`` in this
process at the same batch size: the same requests all at once, each way three times taking turns
(the server idle while ``run()`` runs), output tokens/s over the wall time of the batch.

Runs on the shipped model because the server speaks text and needs its tokenizer. No peer server
is started here (see BENCHMARKS.md). Never run by the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(HERE, "..", "shared", "data", "austen.txt")


def workload(n: int, seed: int, tokenizer) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: prompts of 4-120 tokens from the training text, 16-64 new tokens."""
    rng = np.random.default_rng(seed)
    if os.path.isfile(TEXT):
        words = open(TEXT, encoding="utf-8").read().split()
    else:
        words = ("it is a truth universally acknowledged that a single man in possession of a good fortune "
                 "must be in want of a wife").split() * 200
    out = []
    for _ in range(n):
        length = int(rng.integers(4, 121))
        start = int(rng.integers(0, len(words) - 200))
        text = " ".join(words[start:start + length])
        ids = tokenizer.encode(text)[:length]
        out.append((tokenizer.decode(ids), int(rng.integers(16, 65))))
    return out


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "austen-moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": times[0] - start if times else float("nan"), "e2e": end - start, "tokens": tokens,
            "itl": [b - a for a, b in zip(times, times[1:])],
            "tpot": (end - times[0]) / max(tokens - 1, 1) if times else float("nan")}


async def load(url: str, work, rate: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(work))) as client:
        start, cpu_start = time.perf_counter(), time.process_time()
        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(one(client, url, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start  # this process: the load generator's own cost
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"rate": rate, "requests": len(results), "duration_s": duration, "client_cpu_cores": client_cpu / duration, "request_per_s": len(results) / duration,
            "output_tokens_per_s": tokens / duration, "output_tokens": tokens,
            **{f"{name}_p{q}_ms": percentile([r[name] for r in results], q) * 1e3
               for name in ("ttft", "tpot") for q in (50, 99)},
            **{f"itl_p{q}_ms": percentile(itl, q) * 1e3 for q in (50, 99)}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="2,8,inf")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", choices=["shipped", "bench"], default="shipped",
                        help="shipped: checkpoints/austen-moe; bench: python -m bench's config (emb 512, 8 layers, "
                        "8 experts) with the shipped tokenizer's vocabulary, random weights, saved to a temporary "
                        "checkpoint (a model whose steps cost more than the shipped one's)")
    parser.add_argument("--out", default="bench/serve.json")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]

    from bench.kernels import cpu
    from runner import InferenceRunner, ModelRunner, Request
    from runner.runner import default_checkpoint

    import tempfile

    checkpoint = default_checkpoint()
    scratch = tempfile.TemporaryDirectory()
    if args.model == "bench":
        import dataclasses

        import jax

        from bench.__main__ import BENCH
        from checkpoints.native import save
        from model import init_params

        config = dataclasses.replace(BENCH, vocab_size=8192)
        save(scratch.name, init_params(config, jax.random.PRNGKey(0)), config,
             tokenizer=os.path.join(checkpoint, "tokenizer.model"))
        checkpoint = scratch.name
    # this process's own runner, for the run() baseline and the workload's tokenizer
    runner = InferenceRunner(runner=ModelRunner(checkpoint_path=checkpoint), batch_size=args.batch_size)
    runner.initialize()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "run.py", "serve", "--checkpoint", checkpoint, "--model-name",
                               "austen-moe", "--port", str(port), "--batch-size", str(args.batch_size),
                               "--max-waiting", "100000"], cwd=HERE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the server did not start: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
        results = {"cpu": cpu(), "machine": platform.machine(), "batch_size": args.batch_size, "rates": []}
        results["model"] = args.model
        print(f"CPU: {results['cpu']}; {args.model} model, batch {args.batch_size}, {args.requests} requests a rate")
        asyncio.run(load(url, workload(8, 99, runner.tokenizer), float("inf"), 99))  # warm-up
        print("| rate (req/s) | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        for i, rate in enumerate(rates):
            row = asyncio.run(load(url, workload(args.requests, i, runner.tokenizer), rate, i))
            results["rates"].append(row)
            print(f"| {rate:g} | {row['request_per_s']:.2f} | {row['output_tokens_per_s']:.1f} | "
                  f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | {row['tpot_p50_ms']:.1f} / "
                  f"{row['tpot_p99_ms']:.1f} | {row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} |")
        work = workload(args.requests, 1000, runner.tokenizer)
        direct, http = [], []
        for _ in range(3):
            start = time.perf_counter()
            done = runner.generate([Request(p, temperature=0.0, max_len=n) for p, n in work])
            direct.append(sum(len(c.token_ids) for c in done) / (time.perf_counter() - start))
            row = asyncio.run(load(url, work, float("inf"), 0))
            http.append(row["output_tokens_per_s"])
            results.setdefault("client_cpu_cores", []).append(row["client_cpu_cores"])
        results["direct_tokens_per_s"], results["http_tokens_per_s"] = direct, http
        ratio = statistics.median(http) / statistics.median(direct)
        results["http_over_direct"] = ratio
        print(f"\nthe same {args.requests} requests at once, output tokens/s (3 each, taking turns): run() "
              f"{', '.join(f'{x:.0f}' for x in direct)}; HTTP {', '.join(f'{x:.0f}' for x in http)}; "
              f"HTTP / run() {ratio:.0%} (medians); the load generator itself used "
              f"{statistics.median(results['client_cpu_cores']):.2f} of the {os.cpu_count()} cores meanwhile")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    finally:
        server.terminate()
        server.wait(timeout=30)
        scratch.cleanup()


if __name__ == "__main__":
    main()
