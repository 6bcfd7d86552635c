"""The MoE by token count, on each way the backends run it: ``jax.lax.ragged_dot`` over the stacked
weights (the XLA backend on accelerators; XLA:CPU lowers it densely, every row times every
expert), a loop of dots per expert over the stacked weights (the XLA backend on CPU), the same
loop over weights split one buffer per expert (the CPU backend without kernels), and the grouped
panel kernel (the CPU backend with its kernel, where it builds).

    python -m bench.moe [--emb 512] [--experts 8] [--top 2] [--layers 8] [--repeats 10]

A call runs ``--layers`` MoE layers in sequence, each with its own weights, so that, as in a real
decode step, the weights come from memory and not from the last call's cache. Reported: median ms
per layer, and the weight bytes the tokens' routing needs (the distinct experts hit) per second;
and XLA's own FLOP count of one layer from the compiled HLO's cost analysis against the FLOPs the
routed rows need (``3 * 2 * rows * D * F``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from backends import XLA
from backends.cpu import CPU, build
from model import TINY
from model.layers import MoELayer

WAYS = {"ragged_dot": XLA(grouped="ragged"), "loop, stacked": XLA(grouped="loop"), "loop, split": CPU(),
        "panel kernel": CPU(on=frozenset({"moe"}))}


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
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", default="1,2,4,8,16,32,128")
    args = parser.parse_args(argv)
    config = dataclasses.replace(TINY, emb_size=args.emb, widening_factor=8, num_experts=args.experts,
                                 num_selected_experts=args.top)
    e, k = config.num_experts, config.num_selected_experts
    expert_bytes = 3 * config.emb_size * config.ffn_size * 4
    print(f"emb {config.emb_size}, ffn {config.ffn_size}, experts {e} top {k}, {args.layers} layers, fp32, "
          f"{jax.devices()[0].platform}; ms per layer (GB/s of the routed experts' weights)")
    ways = {name: b for name, b in WAYS.items() if name != "panel kernel" or build.available()}
    names = list(ways)
    print("| tokens | experts hit | " + " | ".join(names) + " | best | XLA FLOPs / needed: " + ", ".join(names) + " |")
    print("|---:|---:|" + "---:|" * (len(names) + 2))
    layer_params = [nn.meta.unbox(MoELayer(config, XLA()).init(jax.random.PRNGKey(i), jnp.zeros((1, 1, config.emb_size)),
                                                        jnp.ones((1, 1, e)) / e)["params"]) for i in range(args.layers)]
    held = {name: [backend.prepare({"moe": p})["moe"] for p in layer_params] for name, backend in ways.items()}
    for m in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.PRNGKey(0), (m, 1, config.emb_size))
        probs = [jax.nn.softmax(3 * jax.random.normal(jax.random.PRNGKey(100 + i), (m, 1, e)))
                 for i in range(args.layers)]
        hit = np.mean([len(np.unique(np.argsort(-np.asarray(p).reshape(m, e), axis=1)[:, :k])) for p in probs])
        row, flops = [], []
        for name, backend in ways.items():
            def run(params, x, probs, backend=backend):
                for p, pr in zip(params, probs):  # the residual stream carries through the layers
                    x = x + MoELayer(config, backend).apply({"params": p}, x, pr)
                return x
            fn = jax.jit(run)
            row.append(median_seconds(fn, held[name], x, probs, repeats=args.repeats) / args.layers)
            cost = fn.lower(held[name], x, probs).compile().cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            flops.append(cost.get("flops", float("nan")) / args.layers / (3 * 2 * m * k * config.emb_size * config.ffn_size))
        best = names[int(np.argmin(row))]
        print(f"| {m} | {hit:.1f} | " + " | ".join(f"{s * 1e3:.2f} ({hit * expert_bytes / s / 1e9:.1f})" for s in row)
              + f" | {best} | " + ", ".join(f"{f:.1f}x" for f in flops) + " |", flush=True)


if __name__ == "__main__":
    main()
