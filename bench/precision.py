"""The precisions of the CPU backend side by side in one run (issues 36, 52): float32, bf16
(Grok-1's activations, bf16 weights), int8 weights with float32 activations and int8 weights with
bf16 activations (Grok-1's released format), and w8a8 (int8 weights times activations rounded to
int8 per block of 32, ``--quantize w8a8``) with float32 and bf16 activations elsewhere, with
llama.cpp's llama-bench on GGUFs of the same dimensions in f32, bf16 and q8_0.

    python -m bench.precision [--batches 1,8] [--tokens 128] [--prefill 512,1024] [--repeats 3] [--ways A,B]
        [--llama-bench PATH --gguf f32=F.gguf,bf16=B.gguf,q8_0=Q.gguf] [--out bench/precision.json]

- The bench config (bench/common.py BENCH, random weights): engine decode tokens/s at each batch
  (``bench.speculation.decode_rate``: every request's tokens once all have their first, tokens all
  but uniform over the vocabulary, so routing spreads as a trained model's does); the runners
  (``--ways``, default all) take turns, request set by request set; medians over ``--repeats``.
- Prefill: one first chunk of N real tokens in one row (``ModelRunner.run_prefill``, as
  ``bench.prefill`` times it), tokens/s, medians, the four taking turns.
- The machine's limits, probed in the same run (``bench.__main__.LimitsProbe``, and the bf16
  matrix rate: the best of XLA's bf16 dot and the bf16 panel kernel on 512 x 2048 x 2048), and
  the share of them each figure reaches: decode's weight bytes a step over the read bandwidth,
  prefill's FLOPs over the float32 or bf16 matrix rate.
- llama.cpp: ``llama-bench -p PREFILL -n TOKENS -t 2`` (prompt processing and text generation at
  batch 1) on each GGUF, before our runners start (never sharing the cores).

Never run by the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.__main__ import LimitsProbe
from bench.common import BENCH, cpu, expected_experts, median_time
from bench.speculation import decode_rate
from model import init_params
from runner import Executor, InferenceRunner, ModelRunner, Request
from runner.batches import empty_batch

WAYS = {"float32": ("float32", None), "bf16": ("bfloat16", None), "int8 x float32": ("float32", "int8"),
        "int8 x bf16": ("bfloat16", "int8"), "w8a8 x float32": ("float32", "w8a8"), "w8a8 x bf16": ("bfloat16", "w8a8")}


def weight_bytes(config, batch: int, way: str) -> float:
    """Bytes of weights one decode step reads: the experts ``batch`` tokens reach (uniform
    routing), the attention projections, the router and norms, the embedding (the unembedding
    reads all of it). Floats at 4 or 2 bytes by the activations; int8: a byte a weight and a
    float32 scale a column."""
    c, counts = config, config.param_counts()
    reached = expected_experts(batch, c)
    quantized = counts["moe"] / c.num_experts * reached + counts["attention"]
    floats = counts["embedding"] + counts["router"] + counts["norms"]
    size = 2 if "bf16" in way else 4
    if not way.startswith(("int8", "w8a8")):
        return size * (quantized + floats)
    columns = c.num_layers * (reached * (2 * c.ffn_size + c.emb_size)
                              + (c.num_q_heads + 2 * c.num_kv_heads) * c.key_size + c.emb_size)
    return quantized + 4 * columns + size * floats


def prefill_flops(config, tokens: int) -> float:
    """FLOPs of a first chunk of ``tokens``: every token through the attention projections and
    its two experts, and the causal half of the attention's two products (the unembedding of the
    last token is left out)."""
    c, counts = config, config.param_counts()
    active = counts["attention"] + counts["moe"] * c.num_selected_experts / c.num_experts
    attention = 2 * 2 * c.num_layers * c.num_q_heads * c.key_size * tokens * (tokens + 1) / 2
    return 2 * tokens * active + attention


def bf16_matrix_rate(repeats: int) -> float:
    """The best FLOP/s of a bf16 product here: XLA's bf16 dot and the bf16 panel kernel, 512 x
    2048 x 2048."""
    from backends.cpu import build, ops

    a = jnp.ones((512, 2048), jnp.bfloat16)
    b = jnp.ones((2048, 2048), jnp.bfloat16)
    dot = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32))
    best = 2 * 512 * 2048**2 / median_time(lambda: dot(a, b).block_until_ready(), repeats)
    if build.available():
        panels = jax.device_put(ops.pack_pairs(np.ones((2048, 2048), np.float32)))
        x = jnp.ones((512, 2048), jnp.float32)
        kernel = jax.jit(lambda x, w: ops.bf16_panel_matmul(x, w, 2048))
        best = max(best, 2 * 512 * 2048**2 / median_time(lambda: kernel(x, panels).block_until_ready(), repeats))
    return best


def llama_bench(args) -> list[dict]:
    rows = []
    for spec in filter(None, (args.gguf or "").split(",")):
        name, path = spec.split("=", 1)
        done = subprocess.run([args.llama_bench, "-m", path, "-p", str(max(args.prefill)), "-n", str(args.tokens),
                               "-t", "2", "-r", str(args.repeats), "-o", "json"], capture_output=True, text=True,
                              timeout=1800)
        if done.returncode:
            rows.append({"way": f"llama.cpp {name}", "error": done.stderr[-400:]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        for test in json.loads(done.stdout):
            phase = "prefill" if test.get("n_prompt") else "decode"
            rows.append({"way": f"llama.cpp {name}", "phase": phase, "batch": 1,
                         "tokens": test.get("n_prompt") or test.get("n_gen"), "tok_s": test["avg_ts"],
                         "tok_s_stddev": test.get("stddev_ts"), "build": test.get("build_commit"),
                         "cpu": test.get("cpu_info")})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def ours(args, limits: LimitsProbe) -> list[dict]:
    params = init_params(BENCH, jax.random.PRNGKey(0))
    ways = {way: WAYS[way] for way in args.ways}
    rows = []
    for b in args.batches:
        runners = {}
        for way, (dtype, quantize) in ways.items():
            model = ModelRunner(model=BENCH, params=params, dtype=dtype, quantize=quantize)
            runners[way] = InferenceRunner(runner=model, batch_size=b, pad_sizes=(64,), decode_steps=2)
            runners[way] = runners[way].initialize()
            print(f"batch {b}, {way}: {runners[way].backend_report()}", flush=True)
        rng = np.random.default_rng(b)
        prompts = [rng.integers(4, BENCH.vocab_size, 64).tolist() for _ in range(b)]
        rates = {way: [] for way in ways}
        limits()
        for repeat in range(args.repeats + 1):  # the first warms up
            for way in ways:
                requests = [Request(p, temperature=100.0, rng_seed=i + 100 * repeat, max_len=args.tokens,
                                    ignore_eos=True) for i, p in enumerate(prompts)]
                rate, _ = decode_rate(runners[way], requests)
                if repeat:
                    rates[way].append(rate)
        for way in ways:
            rows.append({"way": way, "phase": "decode", "batch": b, "tok_s": statistics.median(rates[way]),
                         "tok_s_all": rates[way], "weight_bytes_per_step": weight_bytes(BENCH, b, way)})
            print(json.dumps(rows[-1]), flush=True)
        del runners
    models = {}
    for way, (dtype, quantize) in ways.items():
        models[way] = ModelRunner(model=BENCH, params=params, dtype=dtype, quantize=quantize)
        models[way] = Executor.create(models[way], batch_size=1)
    for tokens in args.prefill:
        batch = empty_batch(1, tokens, 1, vocab_size=BENCH.vocab_size)
        batch.slots[0], batch.lengths[0], batch.first[0], batch.row[:] = 0, tokens, True, 0
        batch.tokens[:] = np.random.default_rng(tokens).integers(4, BENCH.vocab_size, tokens)
        for model in models.values():
            jax.block_until_ready(model.prefill_memory(batch))  # compiles
        took = {way: [] for way in ways}
        limits()
        for _ in range(args.repeats):
            for way, model in models.items():
                start = time.perf_counter()
                jax.block_until_ready((model.prefill_memory(batch), model.state))
                took[way].append(time.perf_counter() - start)
        for way in ways:
            seconds = statistics.median(took[way])
            rows.append({"way": way, "phase": "prefill", "batch": 1, "tokens": tokens, "tok_s": tokens / seconds,
                         "seconds_all": took[way], "flops": prefill_flops(BENCH, tokens)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def shares(rows, limits: dict) -> None:
    """Each of our rows' share of the machine limit it is bound by."""
    for row in rows:
        if row["way"].startswith("llama.cpp") or "tok_s" not in row:
            continue
        if row["phase"] == "decode":
            steps = row["tok_s"] / row["batch"]
            row["bandwidth_share"] = row["weight_bytes_per_step"] * steps / limits["bandwidth"]
        else:
            peak = limits["bf16_matmul_flops"] if "bf16" in row["way"] else limits["matmul_flops"]
            row["matrix_share"] = row["flops"] * row["tok_s"] / row["tokens"] / peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prefill", default="512,1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llama-bench", default=None)
    p.add_argument("--gguf", default=None, help="NAME=PATH,... for llama-bench")
    p.add_argument("--ways", default=",".join(WAYS), help=f"which of ours, of {', '.join(WAYS)}")
    p.add_argument("--out", default="bench/precision.json")
    args = p.parse_args(argv)
    args.ways = [w.strip() for w in args.ways.split(",")]
    unknown = set(args.ways) - set(WAYS)
    if unknown:
        p.error(f"--ways: unknown {sorted(unknown)}, expected some of {list(WAYS)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prefill = [int(t) for t in args.prefill.split(",")]
    print(cpu(), flush=True)
    rows = llama_bench(args) if args.llama_bench else []
    limits = LimitsProbe(args.repeats)
    rows += ours(args, limits)
    fastest = limits.fastest()
    fastest["bf16_matmul_flops"] = bf16_matrix_rate(args.repeats)
    shares(rows, fastest)
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu(), "config": "bench (bench/common.py)", "limits": fastest, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
