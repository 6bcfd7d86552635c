"""Decode speed past the one-token roofline (issue 25): float32 weights, int8 weights read as int8,
and int8 with n-gram speculative decoding, side by side in one run, with llama.cpp's llama-bench
in f32 and q8_0 on the same dimensions.

    python -m bench.speculation [--batches 1,8] [--tokens 128] [--speculative 4] [--repeats 3]
        [--llama-bench PATH --gguf-f32 F32.gguf --gguf-q8 Q8.gguf] [--out bench/speculation.json]

- The bench config (bench/common.py BENCH, random weights): decode tokens/s of every request
  together once all have their first token, at each batch size, for three workloads: ``greedy``
  (the random model's greedy continuation falls into repeats: an output that repeats itself),
  ``sampled`` (temperature 1: the random model is so sure of its next token that this repeats
  too; at 4 as well) and ``uniform`` (temperature 100: tokens all but uniform over the
  vocabulary, so a draft is almost never found: the cost of speculating where it cannot help).
  The three
  runners take turns, request set by request set; medians over ``--repeats``.
- The weight bytes a decode step reads (formula: the experts a batch reaches, the attention
  projections, the embedding; int8 with its scales), and the ceiling they give at the best read
  bandwidth probed in this run.
- The shipped model (checkpoints/austen-moe, trained): acceptance where a prompt holds a passage
  that the output quotes (the passage, then its opening again) and on plain continuation.
- llama.cpp: ``llama-bench -p 0 -n TOKENS -t 2`` (text generation at batch 1) on GGUFs of the
  bench config's dimensions (bench/peers/make_gguf.py OUT 32768, then llama-quantize q8_0).
- The logit error of quantising the bench config at load, and the peak host memory of restoring
  an int8 checkpoint (bench/restore.py's, 1 GB) read as int8 against dequantised at load.

Never run by the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import jax
import numpy as np

from bench.__main__ import LimitsProbe
from bench.common import BENCH, cpu, expected_experts
from backends import XLA
from model import init_params
from runner import InferenceRunner, ModelRunner, Request

WAYS = ("float32", "int8", "int8 + speculation")


def weight_bytes(config, batch: int, int8: bool, tokens_per_row: float = 1.0) -> float:
    """Bytes of weights one decode step reads: the experts ``batch x tokens_per_row`` tokens reach
    (uniform routing), the attention projections, the router and norms, the embedding (float32:
    the unembedding reads all of it). int8: a byte a weight and a float32 scale per column."""
    c, counts = config, config.param_counts()
    per_expert = counts["moe"] / c.num_experts
    experts = per_expert * expected_experts(max(1, round(batch * tokens_per_row)), c)
    quantized = experts + counts["attention"]
    floats = counts["embedding"] + counts["router"] + counts["norms"]
    if not int8:
        return 4 * (quantized + floats)
    reached = expected_experts(max(1, round(batch * tokens_per_row)), c)
    columns = c.num_layers * (reached * (2 * c.ffn_size + c.emb_size)
                              + (c.num_q_heads + 2 * c.num_kv_heads) * c.key_size + c.emb_size)
    return quantized + 4 * columns + 4 * floats


def decode_rate(runner: InferenceRunner, requests) -> tuple[float, dict]:
    """Decode tokens/s of ``requests`` run together: tokens after the moment every request has
    its first one, over the time from then to the last; and the requests' speculation summed."""
    first, last, count, times = {}, 0.0, 0, []
    spec = {"steps": 0, "tokens": 0, "drafted": 0, "accepted": 0}
    for event in runner.run(requests):
        now = time.perf_counter()
        if event.token_id is not None:
            first.setdefault(event.request_id, now)
            times.append(now)
        if event.speculation is not None:
            for name in spec:
                spec[name] += getattr(event.speculation, name)
        last = now
    start = max(first.values())
    count = sum(1 for t in times if t > start)
    return count / (last - start), spec


def bench_config(args, limits: LimitsProbe) -> list[dict]:
    params = init_params(BENCH, jax.random.PRNGKey(0))
    rows = []
    for b in args.batches:
        runners = {}
        for way in WAYS:
            model = ModelRunner(model=BENCH, params=params, quantize=None if way == "float32" else "int8")
            runners[way] = InferenceRunner(runner=model, batch_size=b, pad_sizes=(64,), decode_steps=2,
                                           speculative=args.speculative if "speculation" in way else 0)
            runners[way] = runners[way].initialize()
            print(f"batch {b}, {way}: {model.backend_report().splitlines()[0]}", flush=True)
        rng = np.random.default_rng(b)
        prompts = [rng.integers(4, BENCH.vocab_size, 64).tolist() for _ in range(b)]
        for workload, temperature in args.workloads:
            rates = {way: [] for way in WAYS}
            specs = {}
            limits()
            for repeat in range(args.repeats + 1):  # the first warms up
                for way in WAYS:
                    requests = [Request(p, temperature=temperature, rng_seed=i + 100 * repeat, max_len=args.tokens,
                                        ignore_eos=True) for i, p in enumerate(prompts)]
                    rate, spec = decode_rate(runners[way], requests)
                    if repeat:
                        rates[way].append(rate)
                        specs[way] = spec
            for way in WAYS:
                spec = specs[way]
                acceptance = spec["accepted"] / spec["drafted"] if spec["drafted"] else None
                per_step = spec["tokens"] / spec["steps"] if spec["steps"] else 1.0
                row = {"batch": b, "workload": workload, "way": way, "tok_s": statistics.median(rates[way]),
                       "tok_s_all": rates[way], "acceptance": acceptance, "tokens_per_step": per_step,
                       "weight_bytes_per_step": weight_bytes(BENCH, b, way != "float32", per_step if
                                                             "speculation" in way else 1.0)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def shipped(args) -> list[dict]:
    """Acceptance on the trained default model: a quoted passage, and plain continuation."""
    from runner.runner import default_checkpoint

    runner = InferenceRunner(runner=ModelRunner(checkpoint_path=default_checkpoint()), batch_size=1,
                             speculative=args.speculative)
    runner = runner.initialize()
    plainly = InferenceRunner(runner=ModelRunner(checkpoint_path=default_checkpoint()), batch_size=1)
    plainly = plainly.initialize()
    passage = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
               "in want of a wife. However little known the feelings or views of such a man may be on his first "
               "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, "
               "that he is considered the rightful property of some one or other of their daughters.")
    workloads = {"quote": passage + "\n\n" + passage[:60], "plain": "Elizabeth walked into the garden and"}
    rows = []
    for name, prompt in workloads.items():
        ids = runner.tokenizer.encode(prompt)
        tokens = min(args.tokens, runner.config.sequence_len - len(ids))
        rates = {"plain": [], "speculation": []}
        for repeat in range(args.repeats + 1):
            for way, r in (("plain", plainly), ("speculation", runner)):
                rate, spec = decode_rate(r, [Request(ids, temperature=0.0, max_len=tokens, ignore_eos=True)])
                if repeat:
                    rates[way].append(rate)
        out = runner.complete(Request(ids, temperature=0.0, max_len=tokens, ignore_eos=True))
        want = plainly.complete(Request(ids, temperature=0.0, max_len=tokens, ignore_eos=True))
        row = {"workload": name, "tokens": tokens, "acceptance": spec["accepted"] / max(1, spec["drafted"]),
               "tokens_per_step": spec["tokens"] / max(1, spec["steps"]), "drafted": spec["drafted"],
               "plain_tok_s": statistics.median(rates["plain"]), "spec_tok_s": statistics.median(rates["speculation"]),
               "same_tokens": out.token_ids == want.token_ids, "text": out.text[:160]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# The child reads its peak from VmHWM: getrusage's ru_maxrss survives fork + exec on Linux, so a
# child of this (large) process would report the parent's size.
MEMORY_CHILD = """
import sys, time, numpy as np
from runner import Executor, ModelRunner
start = time.perf_counter()
m = Executor.create(ModelRunner(checkpoint_path=sys.argv[1], backend="cpu", dequantize=sys.argv[2] == "1"), batch_size=1)
m.forward(m.params, np.ones((1, 8), np.int32), np.array([8], np.int32)).block_until_ready()
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(peak, time.perf_counter() - start)
"""


def peak_memory(args) -> list[dict]:
    """Peak host memory of a process that restores bench.restore's int8 checkpoint (about 1 GB:
    int8 experts and attention, a float32 embedding) and runs a forward on the CPU backend: its
    int8 weights read as int8, and dequantised to float32 at load (the default before)."""
    import os
    import sys

    from bench.restore import write_checkpoint

    directory = args.memory_checkpoint
    if not os.path.isfile(os.path.join(directory, "config.json")):
        os.makedirs(directory, exist_ok=True)
        write_checkpoint(directory)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    rows = []
    for way, flag in (("int8 read as int8", "0"), ("dequantised at load", "1")):
        done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, directory, flag], capture_output=True, text=True,
                              timeout=1800, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        if done.returncode:
            print(f"{way} failed: {done.stderr[-800:]}")
            continue
        rss, seconds = done.stdout.split()[-2:]
        rows.append({"way": way, "checkpoint_bytes": size, "peak_rss_bytes": int(rss), "seconds": float(seconds)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def quantization_error(args) -> dict:
    """Quantising the bench config's float32 weights at load (``ModelRunner(quantize="int8")``):
    its logits against the float32 model's, on 4 random prompts of 64 tokens."""
    from model import forward
    from model.quant import QuantizedWeight8bit, dequantize, quantize_params

    params = init_params(BENCH, jax.random.PRNGKey(0))
    deq = jax.tree_util.tree_map(lambda w: dequantize(w, jax.numpy.float32), quantize_params(params),
                                 is_leaf=lambda x: isinstance(x, QuantizedWeight8bit))
    tokens = np.random.default_rng(0).integers(4, BENCH.vocab_size, (4, 64)).astype(np.int32)
    a = np.asarray(jax.jit(lambda p, t: forward(p, t, BENCH, backend=XLA()).logits)(params, tokens))
    b = np.asarray(jax.jit(lambda p, t: forward(p, t, BENCH, backend=XLA()).logits)(deq, tokens))
    out = {"max_abs_over_max_logit": float(np.abs(a - b).max() / np.abs(a).max()),
           "mean_abs_over_std": float(np.abs(a - b).mean() / a.std()),
           "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean())}
    print(json.dumps({"quantization_error": out}), flush=True)
    return out


def llama(args) -> list[dict]:
    rows = []
    for name, path in (("f32", args.gguf_f32), ("q8_0", args.gguf_q8)):
        if not (args.llama_bench and path):
            continue
        done = subprocess.run([args.llama_bench, "-m", path, "-p", "0", "-n", str(args.tokens), "-t", "2",
                               "-r", str(args.repeats), "-o", "json"], capture_output=True, text=True, timeout=1800)
        if done.returncode:
            print(f"llama-bench {name} failed: {done.stderr[-500:]}")
            continue
        result = json.loads(done.stdout)[0]
        row = {"llama.cpp": name, "tok_s": result["avg_ts"], "tok_s_stddev": result["stddev_ts"],
               "build": result.get("build_commit"), "model_size": result.get("model_size")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--speculative", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-bench")
    parser.add_argument("--gguf-f32")
    parser.add_argument("--gguf-q8")
    parser.add_argument("--workloads", default="greedy=0,sampled=1,uniform=100",
                        help="name=temperature of each bench-config workload")
    parser.add_argument("--skip-shipped", action="store_true")
    parser.add_argument("--only", default="llama,speed,shipped,error,memory",
                        help="comma-separated parts to run (llama, speed, shipped, error, memory)")
    parser.add_argument("--memory-checkpoint", default="/tmp/int8-checkpoint")
    parser.add_argument("--out", default="bench/speculation.json")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.workloads = [(name, float(t)) for name, t in (w.split("=") for w in args.workloads.split(","))]
    print(f"CPU: {cpu()}", flush=True)
    limits = LimitsProbe(3)
    results = {"cpu": cpu(), "args": {k: v for k, v in vars(args).items()}}
    parts = set(args.only.split(","))
    results["llama.cpp"] = llama(args) if "llama" in parts else []  # first: its threads never share our cores
    results["bench_config"] = bench_config(args, limits) if "speed" in parts else []
    results["limits"] = limits.fastest() if limits.seen else limits()
    if "shipped" in parts and not args.skip_shipped:
        results["shipped"] = shipped(args)
    if "error" in parts:
        results["quantization_error"] = quantization_error(args)
    if "memory" in parts:
        results["peak_memory"] = peak_memory(args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    bandwidth = results["limits"]["bandwidth"]
    print(f"\nCPU: {cpu()}; best read bandwidth probed: {bandwidth / 1e9:.1f} GB/s")
    print("| batch | workload | weights | tok/s | vs float32 | acceptance | tokens a step | weight MB a step | "
          "ceiling tok/s |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    base = {}
    for row in results["bench_config"]:
        key = (row["batch"], row["workload"])
        base.setdefault(key, row["tok_s"])
        ceiling = bandwidth / row["weight_bytes_per_step"] * row["batch"] * row["tokens_per_step"]
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"| {row['batch']} | {row['workload']} | {row['way']} | {row['tok_s']:.1f} | {row['tok_s'] / base[key]:.2f}x"
              f" | {acc} | {row['tokens_per_step']:.2f} | {row['weight_bytes_per_step'] / 1e6:.0f} | {ceiling:.0f} |")
    for row in results["llama.cpp"]:
        print(f"| 1 | llama-bench tg{args.tokens} | llama.cpp {row['llama.cpp']} | {row['tok_s']:.1f} | "
              f"{row['tok_s'] / base.get((1, 'greedy'), row['tok_s']):.2f}x | | | | |")


if __name__ == "__main__":
    main()
