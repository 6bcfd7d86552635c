"""MoE strategy benchmark: every expert on every token ("dense") vs the selected experts' weights
gathered per token ("gather"), by token count; medians of repeated jitted calls.

    python -m bench.moe [--emb 512] [--experts 8] [--top 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax

from model import TINY
from model.layers import MoELayer


def median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--emb", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", default="1,2,3,4,8,16,64,256")
    args = parser.parse_args(argv)
    config = dataclasses.replace(TINY, emb_size=args.emb, widening_factor=8, num_experts=args.experts,
                                 num_selected_experts=args.top)
    print(f"emb {config.emb_size}, ffn {config.ffn_size}, experts {config.num_experts} top "
          f"{config.num_selected_experts}, fp32, {jax.devices()[0].platform}")
    impls = ("dense", "switch")
    print("| tokens | " + " | ".join(f"{i} ms" for i in impls) + " | best |")
    print("|---:|" + "---:|" * (len(impls) + 1))
    for m in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.PRNGKey(0), (m, 1, config.emb_size))
        probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (m, 1, config.num_experts)))
        params = MoELayer(config, "dense").init(jax.random.PRNGKey(2), x, probs)["params"]
        row = []
        for impl in impls:
            if impl == "switch" and m * config.num_selected_experts > 16:
                row.append(float("nan"))  # unrolled per (token, slot): only for small batches
                continue
            fn = jax.jit(lambda p, x, pr, impl=impl: MoELayer(config, impl).apply({"params": p}, x, pr))
            row.append(median_seconds(fn, params, x, probs, repeats=args.repeats) * 1e3)
        best = impls[min(range(len(impls)), key=lambda i: row[i] if row[i] == row[i] else float("inf"))]
        print(f"| {m} | " + " | ".join(f"{v:.3f}" for v in row) + f" | {best} |")


if __name__ == "__main__":
    main()
