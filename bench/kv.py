"""The KV-cache exercise: with a fixed model, sweep context length and batch; record the KV
memory's bytes and the decode latency, beside CONCEPTS.md's formulas:

    M_KV = 2 * B * L * n_kv * d_h * b_kv            (bytes)
    C_decode ~ 2 * P_active + 4 * L * n * d         (FLOPs per token, n = context)

    python -m bench.kv [--contexts 128,512,1024,2048] [--batches 1,8] [--plot BENCHMARKS_kv.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from bench.common import BENCH, busy
from model import init_params
from runner import ModelRunner


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="128,512,1024,2048")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default="bench/kv.png")
    parser.add_argument("--out", default="bench/kv.json")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    params = init_params(BENCH, jax.random.PRNGKey(0))
    c = BENCH
    rows = []
    print("| batch | context | KV bytes read per step (formula) | decode ms/step | FLOPs/token (formula) |")
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        engine = ModelRunner(model=c, params=params)
        engine.initialize(batch_size=b)
        for n in contexts:
            # every slot active at position n - steps: the step attends over exactly n positions
            tokens = np.random.default_rng(n).integers(4, c.vocab_size, b).astype(np.int32)
            state = busy(engine, engine.new_state(), n - args.steps, tokens)
            memory = state.memory
            formula = 2 * b * c.num_layers * c.num_kv_heads * c.key_size * 4 * n  # fp32, n positions
            allocated = sum(x.nbytes for x in memory.k + memory.v)
            # the arrays hold sequence_len positions: the formula at n = sequence_len is their size
            assert allocated == formula * c.sequence_len // n
            step = engine.sample_step.variant(kv_len=n, steps=args.steps)
            times = []
            for i in range(args.repeats + 1):
                start = time.perf_counter()
                state, out = step(engine.params, state)
                jax.block_until_ready(out)
                if i:
                    times.append((time.perf_counter() - start) / args.steps)
                state = busy(engine, state, n - args.steps, tokens)
            ms = statistics.median(times) * 1e3
            flops = 2 * c.num_active_params + 4 * c.num_layers * n * c.emb_size
            rows.append({"batch": b, "context": n, "kv_bytes_formula": formula, "kv_bytes_allocated": allocated,
                         "ms_per_step": ms, "flops_per_token": flops})
            print(f"| {b} | {n} | {formula / 2**20:.1f} MiB | {ms:.1f} | {flops / 1e6:.0f} M |")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[train]'): no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for b in batches:
        mine = [r for r in rows if r["batch"] == b]
        left.plot([r["context"] for r in mine], [r["kv_bytes_formula"] / 2**20 for r in mine], "o-", label=f"batch {b}")
        right.plot([r["context"] for r in mine], [r["ms_per_step"] for r in mine], "o-", label=f"batch {b}")
    left.set(xlabel="context (tokens)", ylabel="KV memory (MiB, fp32)", title="M_KV = 2·B·L·n_kv·d_h·b·n")
    right.set(xlabel="context (tokens)", ylabel="decode ms / step", title="decode latency")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=90)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
