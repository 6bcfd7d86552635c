"""Serving benchmark: TTFT, TPOT, output tokens/s, compile and startup time, peak memory, for
batch sizes x prompt lengths; beside, in the same run, the machine's own limits (memory bandwidth,
matmul FLOP/s, probed before every row), the roofline of every configuration, decode steps of
every batch size taking turns (the ratios between batch sizes at one moment of the host's
bandwidth), generation without a KV cache, and (when the ``bench`` extra is installed) the
Hugging Face transformers Mixtral peer of bench/peer.py.

    python -m bench [--quick] [--no-peer] [--out bench/results.json]

Results are printed as markdown tables and written as JSON. Wall-clock figures are medians over
``--repeats`` runs. Never run by the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu import build, ops as panel
from bench.common import BENCH, busy, expected_experts, median_time, serve
from backends import XLA
from model import init_params
from runner import Executor, InferenceRunner, ModelRunner, Request

# About 290M parameters in all, 89M active per token (2 of 8 experts): the benchmark config.
# ---- the machine's limits --------------------------------------------------------------------
class LimitsProbe:
    """The machine's limits: read bandwidth, as a decode step uses it (weights are read, not
    written), of 256 MB by a reduction, XLA's matrix-vector product and the runner's panel
    kernel (which streams faster than XLA here: a roofline below what the runner itself reaches
    would flatter it); and fp32 matmul FLOP/s (2048^3). Both move during a run (neighbours on
    the host), so the benchmark probes before every row and takes the fastest seen in the whole
    run as the limit."""

    def __init__(self, repeats: int):
        n = 64 << 20  # 256 MB of float32, far beyond the caches
        self.repeats = repeats
        self.flat = jnp.ones((n,), jnp.float32)
        self.square = jnp.ones((8192, 8192), jnp.float32)
        self.vec = jnp.ones((1, 8192), jnp.float32)
        self.sum = jax.jit(jnp.sum)
        self.mv = jax.jit(lambda v, w: v @ w)
        self.panels = jax.device_put(panel.pack(np.ones((8192, 8192), np.float32))) if build.available() else None
        self.pm = jax.jit(lambda v, w: panel.panel_matmul(v, w, 8192))
        self.a = jnp.ones((2048, 2048), jnp.float32)
        self.mm = jax.jit(lambda p, q: p @ q)
        self.seen = []

    def __call__(self) -> dict:
        r = self.repeats
        probe = {"read_sum_bytes_per_s": self.flat.nbytes / median_time(lambda: self.sum(self.flat).block_until_ready(), r),
                 "xla_matvec_bytes_per_s": self.square.nbytes / median_time(
                     lambda: self.mv(self.vec, self.square).block_until_ready(), r),
                 "panel_matvec_bytes_per_s": 0.0}
        if self.panels is not None:
            probe["panel_matvec_bytes_per_s"] = self.panels.nbytes / median_time(
                lambda: self.pm(self.vec, self.panels).block_until_ready(), r)
        probe["bandwidth"] = max(probe.values())
        probe["matmul_flops"] = 2 * 2048**3 / median_time(lambda: self.mm(self.a, self.a).block_until_ready(), r)
        self.seen.append(probe)
        return probe

    def fastest(self) -> dict:
        """The probe with the fastest read, and the most FLOP/s of any probe."""
        out = dict(max(self.seen, key=lambda p: p["bandwidth"]))
        out["matmul_flops"] = max(p["matmul_flops"] for p in self.seen)
        out["bandwidth_probes"] = [p["bandwidth"] for p in self.seen]
        out["matmul_flops_probes"] = [p["matmul_flops"] for p in self.seen]
        return out


def low_precision(repeats: int) -> dict:
    """Matrix-vector products in fp32, bf16 and int8 on this backend: bytes of weight per second."""
    rows = {}
    w32 = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.float32)
    v = jnp.ones((1, 4096), jnp.float32)
    for name, w, f in [
        ("float32", w32, lambda w, v: v @ w),
        ("bfloat16", w32.astype(jnp.bfloat16), lambda w, v: v.astype(jnp.bfloat16) @ w),
        ("int8 (dequantised in the matmul)", jnp.clip(w32 * 20, -127, 127).astype(jnp.int8),
         lambda w, v: v @ w.astype(jnp.float32)),
    ]:
        fn = jax.jit(f)
        seconds = median_time(lambda: fn(w, v).block_until_ready(), repeats)
        rows[name] = w.nbytes / seconds
    return rows


# ---- roofline ------------------------------------------------------------------------------
def decode_roofline(config, batch: int, context: int, limits: dict) -> dict:
    """Lower bounds of one decode step: bytes it must read over bandwidth, FLOPs over peak."""
    counts = config.param_counts()
    per_expert = counts["moe"] / config.num_experts
    weights = (counts["embedding"] + counts["attention"] + counts["router"] + counts["norms"]
               + per_expert * expected_experts(batch, config)) * 4
    kv = batch * context * config.kv_bytes_per_token("float32")
    flops = batch * (2 * config.num_active_params + 4 * config.num_layers * context * config.emb_size)
    bytes_time = (weights + kv) / limits["bandwidth"]
    flops_time = flops / limits["matmul_flops"]
    return {"weight_bytes": weights, "kv_bytes": kv, "flops": flops, "seconds": max(bytes_time, flops_time),
            "bound": "memory" if bytes_time >= flops_time else "compute"}


# ---- serving ---------------------------------------------------------------------------------
def interleaved_steps(params, config, batches, context: int, steps: int, rounds: int) -> dict[int, float]:
    """Median seconds of one decode step at each batch size, every slot busy at ``context``, the
    batch sizes taking turns call by call: a ratio between two rows of the serving table compares
    two moments of the host's bandwidth, this one compares the same moment."""

    engines, steps_fn, states, times = {}, {}, {}, {b: [] for b in batches}
    for b in batches:
        engines[b] = ModelRunner(model=config, params=params)
        engines[b] = Executor.create(engines[b], batch_size=b)
        steps_fn[b] = engines[b]._decode.variant(kv_len=1 << (context - 1).bit_length(), steps=steps)
        states[b] = engines[b].new_state()
    tokens = {b: np.random.default_rng(b).integers(4, config.vocab_size, b).astype(np.int32) for b in batches}
    for i in range(rounds + 1):  # the first round compiles and warms up
        for b in batches:
            state = busy(engines[b], states[b], context - steps, tokens[b])
            start = time.perf_counter()
            states[b], out = steps_fn[b](engines[b].params, state, engines[b].no_mask)
            jax.block_until_ready(out)
            if i:
                times[b].append((time.perf_counter() - start) / steps)
    return {b: statistics.median(t) for b, t in times.items()}


def no_cache_generation(params, config, prompt_len: int, new_tokens: int) -> list[tuple[int, float]]:
    """Generation with a full forward pass per token (no KV cache): seconds per token by length."""
    fwd = jax.jit(lambda p, t: init_forward(p, t, config))
    out = []
    for length in (prompt_len, prompt_len + new_tokens // 2, prompt_len + new_tokens):
        tokens = jnp.ones((1, length), jnp.int32)
        out.append((length, median_time(lambda: fwd(params, tokens).block_until_ready(), 3)))
    return out


def init_forward(params, tokens, config):
    from model import forward

    return forward(params, tokens, config, backend=XLA()).logits[:, -1]


def startup_of_default() -> dict | None:
    """Seconds from command start to the first token of `python run.py` (shipped default): cold
    (an empty persistent compilation cache, so everything compiles) and warm (the same cache
    again), as run.py's own summary line reports them."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(here, "checkpoints", "austen-moe")):
        return None
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        for name in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "run.py", "--max-tokens", "8", "--prompt", "It is",
                                   "--compile-cache", cache], cwd=here, capture_output=True, text=True, timeout=600)
            line = next(x for x in proc.stderr.splitlines() if x.startswith("time to first token"))
            out[name] = float(line.split()[4])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch {1, 8}, prompt 128, fewer tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--out", default="bench/results.json")
    parser.add_argument("--no-peer", action="store_true", help="skip the Hugging Face Mixtral peer")
    args = parser.parse_args(argv)
    batches, prompts = ((1, 8), (128,)) if args.quick else ((1, 8, 32), (128, 1024))
    new_tokens = 16 if args.quick else args.new_tokens

    limits = {"matvec_bytes_per_s": low_precision(args.repeats)}
    probe = LimitsProbe(args.repeats)
    probe()
    params = init_params(BENCH, jax.random.PRNGKey(0))
    results = {"config": dataclasses.asdict(BENCH), "limits": limits, "rows": []}
    for batch in batches:
        start = time.perf_counter()
        runner = InferenceRunner(runner=ModelRunner(model=BENCH, params=params), batch_size=batch,
                                 pad_sizes=prompts, decode_steps=args.decode_steps)
        runner = runner.initialize()
        compile_s = time.perf_counter() - start
        for prompt_len in prompts:
            before = probe()
            runs = [serve(runner, batch, prompt_len, new_tokens, seed) for seed in range(args.repeats)]
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row.update(batch=batch, prompt=prompt_len, compile_s=compile_s, bandwidth_before=before["bandwidth"])
            results["rows"].append(row)
        del runner
    probe()
    limits.update(probe.fastest())

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
          f"{jax.devices()[0].platform}; bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s, the fastest of "
          f"{len(probe.seen)} probes over the run ({min(limits['bandwidth_probes']) / 1e9:.1f} to "
          f"{limits['bandwidth'] / 1e9:.1f}; the fastest: reduction {limits['read_sum_bytes_per_s'] / 1e9:.1f}, "
          f"XLA matrix-vector {limits['xla_matvec_bytes_per_s'] / 1e9:.1f}, panel kernel "
          f"{limits['panel_matvec_bytes_per_s'] / 1e9:.1f}); fp32 matmul {limits['matmul_flops'] / 1e9:.0f} GFLOP/s, "
          f"the most of the same probes ({min(limits['matmul_flops_probes']) / 1e9:.0f} to "
          f"{limits['matmul_flops'] / 1e9:.0f})")
    for name, rate in limits["matvec_bytes_per_s"].items():
        print(f"  matrix-vector product, {name}: {rate / 1e9:.2f} GB/s of weights")
    print(f"\nconfig: {BENCH.num_params / 1e6:.0f}M parameters, {BENCH.num_active_params / 1e6:.0f}M active, fp32")
    # "of roofline" takes the run's fastest probe; "at the probe before" the bandwidth read just
    # before the row (with the run's best FLOP/s), which tells a slow phase from a slow row
    print("| batch | prompt | TTFT s | TPOT ms | decode tok/s | roofline tok/s | of roofline | "
          "at the probe before | output tok/s | compile s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in results["rows"]:
        batch, context = row["batch"], row["prompt"] + new_tokens // 2
        roof = decode_roofline(BENCH, batch, context, limits)
        roof_rate = batch / roof["seconds"]
        then = decode_roofline(BENCH, batch, context, {**limits, "bandwidth": row["bandwidth_before"]})
        row.update(roofline=roof, roofline_tokens_per_s=roof_rate, fraction=row["decode_tokens_per_s"] / roof_rate,
                   fraction_at_probe_before=row["decode_tokens_per_s"] * then["seconds"] / batch)
        print(f"| {batch} | {row['prompt']} | {row['ttft']:.2f} | {row['tpot'] * 1e3:.1f} | "
              f"{row['decode_tokens_per_s']:.1f} | {roof_rate:.1f} ({roof['bound']}) | {row['fraction']:.0%} | "
              f"{row['fraction_at_probe_before']:.0%} ({row['bandwidth_before'] / 1e9:.0f} GB/s) | "
              f"{row['output_tokens_per_s']:.1f} | {row['compile_s']:.1f} |")

    rows = results["rows"]
    for prompt_len in prompts:
        one = next(r for r in rows if r["batch"] == 1 and r["prompt"] == prompt_len)
        for r in rows:
            if r["batch"] > 1 and r["prompt"] == prompt_len:
                print(f"batch {r['batch']} / batch 1, prompt {prompt_len}: steady decode "
                      f"{r['decode_tokens_per_s'] / one['decode_tokens_per_s']:.1f}x, output tokens/s "
                      f"{r['output_tokens_per_s'] / one['output_tokens_per_s']:.1f}x")
    context = prompts[0] + new_tokens // 2
    step = interleaved_steps(params, BENCH, batches, context, args.decode_steps, 5 if args.quick else 15)
    results["interleaved_step_s"] = {str(b): t for b, t in step.items()}
    print(f"decode steps at context {context}, the batch sizes taking turns: " + ", ".join(
        f"batch {b} {t * 1e3:.1f} ms" for b, t in step.items()) + "; tokens/s over batch 1's: " + ", ".join(
        f"batch {b} {b * step[1] / t:.1f}x" for b, t in step.items() if b > 1))
    nocache = no_cache_generation(params, BENCH, 128, 64 if not args.quick else 16)
    cached = next(r for r in results["rows"] if r["batch"] == 1)
    results["no_cache"] = nocache
    print("\nwithout a KV cache (batch 1, a full forward per token):")
    for length, seconds in nocache:
        print(f"  context {length}: {seconds * 1e3:.1f} ms/token vs {cached['tpot'] * 1e3:.1f} ms/token cached "
              f"({seconds / cached['tpot']:.1f}x)")
    from bench import peer

    if args.no_peer or not peer.available():
        results["peer"] = None
        print("\npeer (Hugging Face transformers, Mixtral): not measured "
              f"({'--no-peer' if args.no_peer else 'torch/transformers not installed: the bench extra'})")
    else:
        peer_batches = tuple(b for b in batches if b <= 8)
        results["peer"] = peer.measure(BENCH, peer_batches, 128, new_tokens, args.repeats)
        print()
        peer.print_table(results["peer"])
        for r in results["peer"]["rows"]:
            ours = next(o for o in results["rows"] if o["batch"] == r["batch"] and o["prompt"] == r["prompt"])
            print(f"  batch {r['batch']}: this runner decodes {ours['decode_tokens_per_s'] / r['decode_tokens_per_s']:.1f}x "
                  f"as many tokens/s (steady), TPOT {r['tpot'] / ours['tpot']:.1f}x shorter, TTFT "
                  f"{ours['ttft']:.2f} s against {r['ttft']:.2f} s")
    startup = startup_of_default()
    results["startup_default_s"] = startup
    if startup is None:
        print("\nstartup of the shipped default: checkpoints/austen-moe is missing")
    else:
        print(f"\nstartup of the shipped default to first token: {startup['cold']:.2f} s with an empty "
              f"compilation cache, {startup['warm']:.2f} s with it filled")
    results["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak memory of this benchmark process: {results['peak_rss_bytes'] / 2**30:.2f} GiB")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()
