"""The KV-cache exercise: with a fixed model, sweep context length and batch; record the KV
memory's bytes and the decode latency, beside CONCEPTS.md's formulas:

    M_KV = 2 * B * L * n_kv * d_h * b_kv            (bytes)
    C_decode ~ 2 * P_active + 4 * L * n * d         (FLOPs per token, n = context)

    python -m bench.kv [--contexts 128,512,1024,2048] [--batches 1,8] [--kv-dtypes float32,int8]
                       [--plot bench/kv.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from bench.common import BENCH, busy, cpu
from model import init_params
from runner import Executor, ModelRunner


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="128,512,1024,2048")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--kv-dtypes", default="float32", help="comma-separated caches to compare side by side "
                        "(float32, int8): their steps are timed taking turns, call by call")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default="bench/kv.png")
    parser.add_argument("--out", default="bench/kv.json")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    kv_dtypes = args.kv_dtypes.split(",")
    params = init_params(BENCH, jax.random.PRNGKey(0))
    c = BENCH
    rows = []
    print(f"CPU: {cpu()}")
    print("| batch | context | KV | KV bytes read per step (formula) | decode ms/step | vs the first | FLOPs/token (formula) |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for b in batches:
        engines = {}
        for kv in kv_dtypes:
            engines[kv] = ModelRunner(model=c, params=params, kv_dtype=kv)
            engines[kv] = Executor.create(engines[kv], batch_size=b)
            print(f"batch {b}, {kv} KV: {engines[kv].backend_report().splitlines()[0]}; attention "
                  f"{'kernel' if 'attention' in getattr(engines[kv].selection.backend, 'on', ()) else 'XLA'}")
        for n in contexts:
            # every slot active at position n - steps: the step attends over exactly n positions
            tokens = np.random.default_rng(n).integers(4, c.vocab_size, b).astype(np.int32)
            states = {kv: busy(e, e.new_state(), n - args.steps, tokens) for kv, e in engines.items()}
            times = {kv: [] for kv in engines}
            for i in range(args.repeats + 1):
                for kv, engine in engines.items():  # taking turns: the host's bandwidth moves
                    step = engine._decode.variant(kv_len=n, steps=args.steps)
                    start = time.perf_counter()
                    states[kv], out = step(engine.params, states[kv], engine.no_mask)
                    jax.block_until_ready(out)
                    if i:
                        times[kv].append((time.perf_counter() - start) / args.steps)
                    states[kv] = busy(engine, states[kv], n - args.steps, tokens)
            first = None
            for kv, engine in engines.items():
                memory = states[kv].memory
                formula = b * n * c.kv_bytes_per_token(kv)  # n positions, scales included
                allocated = sum(x.nbytes for x in jax.tree_util.tree_leaves((memory.k, memory.v)))
                # the arrays hold sequence_len positions: the formula at n = sequence_len is their size
                assert allocated == formula * c.sequence_len // n
                ms = statistics.median(times[kv]) * 1e3
                first = first or ms
                flops = 2 * c.num_active_params + 4 * c.num_layers * n * c.emb_size
                rows.append({"batch": b, "context": n, "kv_dtype": kv, "kv_bytes_formula": formula,
                             "kv_bytes_allocated": allocated, "ms_per_step": ms, "flops_per_token": flops,
                             "cpu": cpu()})
                print(f"| {b} | {n} | {kv} | {formula / 2**20:.1f} MiB | {ms:.1f} | {first / ms:.2f}x | "
                      f"{flops / 1e6:.0f} M |")
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
        for kv in kv_dtypes:
            mine = [r for r in rows if r["batch"] == b and r["kv_dtype"] == kv]
            label = f"batch {b}, {kv} KV"
            left.plot([r["context"] for r in mine], [r["kv_bytes_formula"] / 2**20 for r in mine], "o-", label=label)
            right.plot([r["context"] for r in mine], [r["ms_per_step"] for r in mine], "o-", label=label)
    left.set(xlabel="context (tokens)", ylabel="KV memory (MiB)", title="M_KV = 2·B·L·n_kv·d_h·b·n")
    right.set(xlabel="context (tokens)", ylabel="decode ms / step", title="decode latency")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=90)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
