"""Open-loop load over HTTP against ``python run.py serve``, in the shape of vLLM's benchmark_serving.

    python -m bench.serve [--rates 2,8,inf] [--requests 64] [--batch-size 8] [--out bench/serve.json]

Starts the server on the shipped model in a subprocess (127.0.0.1, a free port), then for each
rate sends ``--requests`` streaming completions with Poisson arrivals (``inf``: all at once): prompts
of 4 to 120 tokens cut from the model's own training text (``../shared/data/austen.txt``, else
generated words), 16 to 64 new tokens, greedy. Per rate: request throughput, output tokens/s, and
TTFT, TPOT and inter-token latency at p50 and p99. Then the HTTP path against ``run()`` in this
process at the same batch size: the same requests all at once, each way three times taking turns
(the server idle while ``run()`` runs), output tokens/s over the wall time of the batch.

``--model bench`` serves the config of ``python -m bench`` (random weights, the shipped tokenizer)
instead of the shipped model. With it, ``--peer`` sends the same load, in the same run, to
``transformers serve --continuous-batching`` on CPU serving a Hugging Face Mixtral of the same
dimensions (``bench/peer.py``; the shipped tokenizer converted so that it encodes identically, so
both servers see the same prompt tokens). Needs torch, transformers and accelerate
(``pip install -e '.[bench]'``). Never run by the tests.
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
    """The q-th percentile of the finite values (a stream that carried no text has no TTFT)."""
    values = [v for v in values if np.isfinite(v)]
    return float(np.percentile(values, q)) if values else float("nan")


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
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


async def load(url: str, work, rate: float, seed: int, model: str = "austen-moe") -> dict:
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(work))) as client:
        start, cpu_start = time.perf_counter(), time.process_time()
        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(one(client, url, model, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start  # this process: the load generator's own cost
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    empty = sum(not np.isfinite(r["ttft"]) for r in results)  # finished without one chunk of text
    return {"rate": rate, "requests": len(results), "empty_streams": empty, "duration_s": duration, "client_cpu_cores": client_cpu / duration, "request_per_s": len(results) / duration,
            "output_tokens_per_s": tokens / duration, "output_tokens": tokens,
            **{f"{name}_p{q}_ms": percentile([r[name] for r in results], q) * 1e3
               for name in ("ttft", "tpot") for q in (50, 99)},
            **{f"itl_p{q}_ms": percentile(itl, q) * 1e3 for q in (50, 99)}}


def free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def start_server(command: list[str], port: int, log, cwd: str = HERE, env=None) -> subprocess.Popen:
    """Start a server subprocess (in ``cwd``, with ``env``: None inherits ours) and wait until its ``/health`` answers 200 (15 minutes
    at most: ours compiles every variant at start, over 5 minutes cold on a 2-core EPYC)."""
    server = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.time() > deadline:
            server.kill()
            log.seek(0)
            raise RuntimeError(f"{command[0]} did not start: {log.read()[-2000:]}")
        time.sleep(0.5)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def rate_table(url: str, model: str, rates, requests: int, tokenizer) -> list[dict]:
    """A warm-up, then one row a rate (the same workloads for every server: seeded by the rate's index)."""
    asyncio.run(load(url, workload(8, 99, tokenizer), float("inf"), 99, model))
    print("| rate (req/s) | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for i, rate in enumerate(rates):
        row = asyncio.run(load(url, workload(requests, i, tokenizer), rate, i, model))
        rows.append(row)
        print(f"| {rate:g} | {row['request_per_s']:.2f} | {row['output_tokens_per_s']:.1f} | "
              f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | {row['tpot_p50_ms']:.1f} / "
              f"{row['tpot_p99_ms']:.1f} | {row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} |"
              + (f" {row['empty_streams']} of {row['requests']} streams carried no text" if row["empty_streams"] else ""),
              flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="2,8,inf")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", choices=["shipped", "bench"], default="shipped",
                        help="shipped: checkpoints/austen-moe; bench: python -m bench's config (emb 512, 8 layers, "
                        "8 experts) with the shipped tokenizer's vocabulary, random weights, saved to a temporary "
                        "checkpoint (a model whose steps cost more than the shipped one's)")
    parser.add_argument("--peer", action="store_true",
                        help="with --model bench: the same load against transformers serve --continuous-batching "
                        "on a Mixtral of the same dimensions, after ours")
    parser.add_argument("--out", default="bench/serve.json")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if args.peer and args.model != "bench":
        parser.error("--peer needs --model bench (the peer serves a model of the bench config's dimensions)")
    if args.peer:
        from bench import peer

        import importlib.util

        if not peer.available() or importlib.util.find_spec("accelerate") is None:  # transformers serve needs it
            parser.error("--peer needs torch, transformers and accelerate: pip install -e '.[bench]'")

    from bench.common import cpu
    from runner import InferenceRunner, ModelRunner, Request
    from runner.runner import default_checkpoint

    import tempfile

    checkpoint = default_checkpoint()
    tokenizer_file = os.path.join(checkpoint, "tokenizer.model")
    scratch = tempfile.TemporaryDirectory()
    log = tempfile.TemporaryFile("w+")
    if args.model == "bench":
        import dataclasses

        import jax

        from bench.common import BENCH
        from checkpoints.native import save
        from model import init_params

        config = dataclasses.replace(BENCH, vocab_size=8192)
        checkpoint = os.path.join(scratch.name, "ours")
        save(checkpoint, init_params(config, jax.random.PRNGKey(0)), config, tokenizer=tokenizer_file)
    # this process's own runner, for the run() baseline and the workload's tokenizer
    runner = InferenceRunner(runner=ModelRunner(checkpoint_path=checkpoint), batch_size=args.batch_size)
    runner = runner.initialize()
    results = {"cpu": cpu(), "machine": platform.machine(), "batch_size": args.batch_size, "model": args.model}
    print(f"CPU: {results['cpu']}; {args.model} model, batch {args.batch_size}, {args.requests} requests a rate")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server([sys.executable, "run.py", "serve", "--checkpoint", checkpoint, "--model-name",
                           "austen-moe", "--port", str(port), "--batch-size", str(args.batch_size),
                           "--max-waiting", "100000"], port, log)
    try:
        results["rates"] = rate_table(url, "austen-moe", rates, args.requests, runner.tokenizer)
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
    finally:
        stop_server(server)
    if args.peer:
        import transformers

        hf = os.path.join(scratch.name, "mixtral")
        peer.mixtral_like(config).save_pretrained(hf)
        peer.fast_tokenizer(tokenizer_file).save_pretrained(hf)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        name = f"transformers {transformers.__version__} serve --continuous-batching"
        print(f"\nthe peer: {name}, MixtralForCausalLM of the same dimensions, fp32, CPU")
        server = start_server(["transformers", "serve", hf, "--device", "cpu", "--dtype", "float32",
                               "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)], port, log)
        try:
            results["peer"] = {"server": name, "rates": rate_table(url, hf, rates, args.requests, runner.tokenizer)}
        finally:
            stop_server(server)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    scratch.cleanup()


if __name__ == "__main__":
    main()
