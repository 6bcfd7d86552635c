"""MoE strategy benchmark, by token count: every expert on every token ("dense") vs each expert on
its own tokens only ("grouped"), with the expert weights stacked ``[E, K, N]`` (as stored), split
into one buffer per expert (the runner's CPU layout on XLA's dots, model/experts.py), or in
column panels for the C++ kernel (the runner's layout on one CPU device, model/panel.py; when the
kernel builds).

    python -m bench.moe [--emb 512] [--experts 8] [--top 2] [--layers 8] [--repeats 10]

A call runs ``--layers`` MoE layers in sequence, each with its own weights, so that, as in a real
decode step, the weights come from memory and not from the last call's cache. Reported: median ms
per layer, and the weight bytes the tokens' routing needs (the distinct experts hit) per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from model import TINY
from model import panel
from model.experts import split_experts
from model.layers import MoELayer

LAYOUTS = ("stacked", "split", "panels")


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
    layouts = LAYOUTS if panel.available() else LAYOUTS[:2]
    variants = [(impl, layout) for layout in layouts for impl in ("dense", "grouped")]
    names = [f"{impl}, {layout}" for impl, layout in variants]
    print("| tokens | experts hit | " + " | ".join(names) + " | best |")
    print("|---:|---:|" + "---:|" * (len(names) + 1))
    layer_params = [MoELayer(config, "dense").init(jax.random.PRNGKey(i), jnp.zeros((1, 1, config.emb_size)),
                                                   jnp.ones((1, 1, e)) / e)["params"] for i in range(args.layers)]
    held = {"stacked": layer_params, "split": [split_experts({"moe": p})["moe"] for p in layer_params]}
    if "panels" in layouts:
        held["panels"] = [split_experts({"moe": p}, panels=True)["moe"] for p in layer_params]
    for m in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.PRNGKey(0), (m, 1, config.emb_size))
        probs = [jax.nn.softmax(3 * jax.random.normal(jax.random.PRNGKey(100 + i), (m, 1, e)))
                 for i in range(args.layers)]
        hit = np.mean([len(np.unique(np.argsort(-np.asarray(p).reshape(m, e), axis=1)[:, :k])) for p in probs])
        row = []
        for impl, layout in variants:
            def run(params, x, probs, impl=impl):
                for p, pr in zip(params, probs):  # the residual stream carries through the layers
                    x = x + MoELayer(config, impl).apply({"params": p}, x, pr)
                return x
            row.append(median_seconds(jax.jit(run), held[layout], x, probs, repeats=args.repeats) / args.layers)
        best = names[int(np.argmin(row))]
        print(f"| {m} | {hit:.1f} | " + " | ".join(f"{s * 1e3:.2f} ({hit * expert_bytes / s / 1e9:.1f})" for s in row)
              + f" | {best} |")


if __name__ == "__main__":
    main()
