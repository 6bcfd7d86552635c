"""Serving under load, ours against peers in one run: the loads of issue 22, token-id prompts.

    python -m bench.load [--servers ours,vllm,llama] [--scenarios rate1,burst32,long32,arrivals]
                         [--ours-tree DIR] [--out bench/load.json]

Every server serves the bench config's dimensions (``bench/common.py``, with the shipped
tokenizer's 8,192-token vocabulary) with random weights in float32, 8 sequences at a time, on the
machine's 2 threads, and gets the same requests: prompts of random token ids (so every server
computes the same number of prompt tokens), greedy, streamed, ``ignore_eos`` for the peers (ours
gets a checkpoint that names the last id EOS instead, so that a tree from before issue 24, which
had no such field, gets the same requests; each scenario reports its finish reasons). A chunk's tokens are counted by its logprobs where it has them (ours streams what one
decode call made as one chunk, so it is asked for ``logprobs: 0``), else one a chunk. Each server runs alone (started, measured, stopped), one after the other.

- ``rate1``: 32 requests arriving as a Poisson process at 1 request/s, 128-token prompts, 64 new
  tokens each: TTFT, TPOT, ITL per token as the client receives it, output tokens/s.
- ``burst32``: the same 32 requests all at once.
- ``long32``: 32 distinct 1,056-token prompts at once, 16 new tokens each: the total time.
- ``prefix32``: 32 requests at once sharing a 1,024-token prefix, each with its own 32-token
  suffix, 16 new tokens each (issue 23): TTFT and the total time; the peers cache prefixes too.
- ``arrivals``: 4 streams decode (128-token prompts, 600 new tokens); over 4 s without arrivals,
  then while four 1,024-token prompts arrive 1.5 s apart, their ITL p50 / p99 / max.

Servers: ``ours`` is ``python run.py serve`` of this tree, or of ``--ours-tree`` (a checkout of
another commit, for before/after in one run), on a checkpoint written here; ``ours-nocache`` is
this tree with its prefix cache off (``--prefix-cache-gb 0``), ``ours-int8`` with an int8 KV cache
(``--kv-dtype int8``, its prefix pool int8 too), ``ours-bf16`` in bf16 (``--dtype bfloat16``),
``ours-q8`` with int8 weights (``--quantize int8``) and ``ours-q8-bf16`` with int8 weights and bf16
activations, ``ours-w8a8`` and ``ours-w8a8-bf16`` the same with ``--quantize w8a8``. ``vllm`` and
``llama`` run the scripts ``/tmp/peers/vllm.sh PORT`` and ``/tmp/peers/llama.sh PORT`` (how to set
them up: bench/peers/README.md); ``vllm-bf16`` is vLLM with ``VLLM_DTYPE=bfloat16``, ``llama-bf16``
and ``llama-q8`` llama-server on the bf16 and q8_0 GGUFs (``LLAMA_GGUF``). A server whose script
is missing is skipped, and said so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time

import httpx
import numpy as np

from bench.serve import HERE, free_port, percentile, start_server, stop_server

VOCAB = 8192
# peer: (its script, the environment that picks its precision)
PEERS = {"vllm": ("/tmp/peers/vllm.sh", {}), "vllm-bf16": ("/tmp/peers/vllm.sh", {"VLLM_DTYPE": "bfloat16"}),
         "llama": ("/tmp/peers/llama.sh", {}),
         "llama-bf16": ("/tmp/peers/llama.sh", {"LLAMA_GGUF": "/tmp/peers/grok-bench-bf16.gguf"}),
         "llama-q8": ("/tmp/peers/llama.sh", {"LLAMA_GGUF": "/tmp/peers/grok-bench-q8_0.gguf"})}
# ours: the arguments of its serve that make each variant
OURS = {"ours": [], "ours-nocache": ["--prefix-cache-gb", "0"], "ours-int8": ["--kv-dtype", "int8"],
        "ours-bf16": ["--dtype", "bfloat16"], "ours-q8": ["--quantize", "int8"],
        "ours-q8-bf16": ["--quantize", "int8", "--dtype", "bfloat16"], "ours-w8a8": ["--quantize", "w8a8"],
        "ours-w8a8-bf16": ["--quantize", "w8a8", "--dtype", "bfloat16"], "ours-before": []}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB, length).tolist() for _ in range(n)]


@dataclasses.dataclass
class Server:
    name: str
    url: str
    model: str
    extra: dict  # body fields this server needs (ignore_eos for the peers)


async def stream(client: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int,
                 times: list[float] | None = None) -> dict:
    """One streamed completion: the arrival time of every chunk that carried text, appended to
    ``times`` as they come (so a cancelled stream keeps them)."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **server.extra}
    start = time.perf_counter()
    times, finish = ([] if times is None else times), None
    async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = (chunk.get("choices") or [{}])[0]
            # a chunk may carry several tokens (ours: what one decode call made); with logprobs
            # asked for, their count is the chunk's, each token arriving when its chunk did
            tokens = len((choice.get("logprobs") or {}).get("tokens") or []) or (1 if choice.get("text") else 0)
            times.extend([time.perf_counter()] * tokens)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    end = time.perf_counter()
    return {"start": start, "end": end, "times": times, "tokens": len(times), "finish": finish}


def summary(results: list[dict], duration: float) -> dict:
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in results if len(r["times"]) > 1]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in results)
    finishes = {f: sum(r["finish"] == f for r in results) for f in {r["finish"] for r in results}}
    return {"requests": len(results), "duration_s": duration, "output_tokens": tokens, "finish": finishes,
            "output_tokens_per_s": tokens / duration,
            **{f"ttft_p{q}_ms": percentile(ttft, q) * 1e3 for q in (50, 99)},
            **{f"tpot_p{q}_ms": percentile(tpot, q) * 1e3 for q in (50, 99)},
            **{f"itl_p{q}_ms": percentile(itl, q) * 1e3 for q in (50, 99)}}


async def open_loop(server: Server, work: list[tuple[list[int], int]], rate: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=len(work) + 8)) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(stream(client, server, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return summary(results, time.perf_counter() - start)


async def arrivals(server: Server) -> dict:
    """Four decoding streams, first alone, then while long prompts arrive: their gaps per token."""
    times: list[list[float]] = [[] for _ in range(4)]
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=16)) as client:
        running = [asyncio.create_task(stream(client, server, p, 600, t)) for p, t in zip(prompts(4, 128, 7), times)]
        await asyncio.sleep(3.0)  # every stream decoding
        quiet = (time.perf_counter(), time.perf_counter() + 4.0)
        await asyncio.sleep(4.0)
        busy_start = time.perf_counter()
        long = []
        for p in prompts(4, 1024, 8):
            long.append(asyncio.create_task(stream(client, server, p, 4)))
            await asyncio.sleep(1.5)
        done = await asyncio.gather(*long)
        busy = (busy_start, max(r["end"] for r in done))
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    out = {}
    for name, (lo, hi) in (("alone", quiet), ("arrivals", busy)):
        g = [b - a for t in times for a, b in zip(t, t[1:]) if lo <= a and b <= hi]
        out[name] = {"gaps": len(g), **{f"itl_p{q}_ms": percentile(g, q) * 1e3 for q in (50, 99)},
                     "itl_max_ms": max(g) * 1e3 if g else float("nan")}
    out["long_ttft_ms"] = [(r["times"][0] - r["start"]) * 1e3 if r["times"] else float("nan") for r in done]
    return out


SCENARIOS = {
    "rate1": lambda s: open_loop(s, [(p, 64) for p in prompts(32, 128, 1)], 1.0, 1),
    "burst32": lambda s: open_loop(s, [(p, 64) for p in prompts(32, 128, 1)], float("inf"), 1),
    "long32": lambda s: open_loop(s, [(p, 16) for p in prompts(32, 1056, 2)], float("inf"), 2),
    "prefix32": lambda s: open_loop(s, [(prompts(1, 1024, 3)[0] + p, 16) for p in prompts(32, 32, 4)],
                                    float("inf"), 3),
    "arrivals": arrivals,
}


def ours_checkpoint(directory: str) -> str:
    import jax

    from bench.common import BENCH
    from checkpoints.native import save
    from model import init_params
    from runner.runner import default_checkpoint

    # EOS is named an id past the tokenizer's pieces' use (the last one): trees before issue 24 have
    # no ignore_eos, and every server should generate every token asked for
    config = dataclasses.replace(BENCH, vocab_size=VOCAB, eos_token=VOCAB - 1)
    path = os.path.join(directory, "ours")
    save(path, init_params(config, jax.random.PRNGKey(0)), config,
         tokenizer=os.path.join(default_checkpoint(), "tokenizer.model"))
    return path


def markdown(results: dict) -> str:
    """The figures of a run as one table, a row a server."""
    rows = ["| server | rate1 TTFT p50 / p99 ms | rate1 TPOT p50 / p99 ms | rate1 ITL p99 ms | burst32 tok/s "
            "| burst32 TTFT p50 ms | long32 total s | arrivals ITL p50 / p99 / max ms, alone | the same while long "
            "prompts arrive | long prompts' TTFT ms | prefix32 TTFT p50 / p99 ms | prefix32 total s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["servers"].items():
        def get(scenario, key, fmt="{:.0f}"):
            value = r.get(scenario, {}).get(key)
            return "-" if value is None else fmt.format(value)

        arrivals = r.get("arrivals", {})
        gaps = lambda w: " / ".join(f"{arrivals[w][k]:.0f}" for k in ("itl_p50_ms", "itl_p99_ms", "itl_max_ms")) \
            if w in arrivals else "-"  # noqa: E731
        long_ttft = ", ".join(f"{x:,.0f}" for x in arrivals.get("long_ttft_ms", [])) or "-"
        rows.append(f"| {name} | {get('rate1', 'ttft_p50_ms')} / {get('rate1', 'ttft_p99_ms')} | "
                    f"{get('rate1', 'tpot_p50_ms', '{:.1f}')} / {get('rate1', 'tpot_p99_ms', '{:.1f}')} | "
                    f"{get('rate1', 'itl_p99_ms')} | {get('burst32', 'output_tokens_per_s', '{:.1f}')} | "
                    f"{get('burst32', 'ttft_p50_ms', '{:,.0f}')} | {get('long32', 'duration_s', '{:.1f}')} | "
                    f"{gaps('alone')} | {gaps('arrivals')} | {long_ttft} | "
                    f"{get('prefix32', 'ttft_p50_ms', '{:,.0f}')} / {get('prefix32', 'ttft_p99_ms', '{:,.0f}')} | "
                    f"{get('prefix32', 'duration_s', '{:.1f}')} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="ours,vllm,llama",
                   help=f"some of {', '.join(OURS)} (ours-before with --ours-tree), {', '.join(PEERS)}; "
                        "in this order")
    p.add_argument("--scenarios", default="rate1,burst32,long32,arrivals,prefix32")
    p.add_argument("--ours-tree", help="a checkout of another commit: served as ours-before")
    p.add_argument("--serve-args", default="", help="extra arguments of ours' serve (both trees)")
    p.add_argument("--out", default="bench/load.json")
    p.add_argument("--table", metavar="FILE", help="print the table of a run's JSON, and run nothing")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return
    from bench.common import cpu

    scratch = tempfile.TemporaryDirectory()
    checkpoint = ours_checkpoint(scratch.name)
    log = tempfile.TemporaryFile("w+")
    results = {"cpu": cpu(), "args": vars(args), "servers": {}}
    print(f"CPU: {results['cpu']}")
    for name in args.servers.split(","):
        port = free_port()
        env = None
        if name in OURS:
            tree = args.ours_tree if name == "ours-before" else HERE
            if tree is None:
                p.error("ours-before needs --ours-tree")
            command = [sys.executable, os.path.join(tree, "run.py"), "serve", "--checkpoint", checkpoint,
                       "--model-name", "bench", "--port", str(port), "--batch-size", "8",
                       "--max-waiting", "1000"] + args.serve_args.split() + OURS[name]
            server = Server(name, f"http://127.0.0.1:{port}", "bench", {"logprobs": 0})
            env_tree = tree
        else:
            script, extra = PEERS[name]
            gguf = extra.get("LLAMA_GGUF")
            if not os.path.exists(script) or (gguf and not os.path.exists(gguf)):
                print(f"{name}: {gguf if gguf and os.path.exists(script) else script} not found, skipped")
                continue
            command = ["bash", script, str(port)]
            server = Server(name, f"http://127.0.0.1:{port}", "", {"ignore_eos": True})
            env_tree, env = HERE, dict(os.environ, **extra)
        started = time.perf_counter()
        process = start_server(command, port, log, cwd=env_tree, env=env)
        if not server.model:
            server.model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        print(f"\n{name}: up in {time.perf_counter() - started:.0f} s")
        row = {}
        try:
            asyncio.run(open_loop(server, [(q, 8) for q in prompts(8, 128, 99)], float("inf"), 99))  # warm-up
            for scenario in args.scenarios.split(","):
                row[scenario] = asyncio.run(SCENARIOS[scenario](server))
                print(f"  {scenario}: {json.dumps(row[scenario])}", flush=True)
        finally:
            stop_server(process)
        results["servers"][name] = row
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("\n" + markdown(results))
    scratch.cleanup()


if __name__ == "__main__":
    main()
