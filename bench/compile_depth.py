"""How a compiled step's lowering and compile time grow with the model's depth, on abstract shapes.

    python -m bench.compile_depth [--layers 1,8,16,32,64] [--stack unrolled,scan] [--out bench/compile-depth.json]

Grok-1's own widths (emb 6144, 48 query / 8 KV heads of 128, 8 experts top-2 of 32768, vocabulary
131,072), bf16 weights and activations, the XLA backend, a KV memory of 2,048 positions, at each
depth of ``--layers``: a decode step (batch 8, one token a row, into the memory) and a 256-token
prefill (batch 1, into a fresh memory, the last position unembedded), each ``jax.jit`` over
``model.forward`` lowered and compiled from ``jax.ShapeDtypeStruct``s: nothing is allocated, so
Grok-1's 64 layers compile on a laptop. Each way of running the stack in ``--stack`` is measured
in the same run: ``unrolled`` (a Python loop of the layers, each over its own parameters: the
model before issue 50) and ``scan`` (one layer scanned over the stacked parameters: the default);
``server`` times the steps a server builds instead (a packed prefill and a decode call, sampling
included, from ``Executor.abstract``).
Prints a markdown table per way (seconds, and each depth's time over the 1-layer step's) and
writes JSON with the machine. The persistent compilation cache is
off: every figure is a compile. Never run by the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.common import cpu


def steps(num_layers: int, kv_len: int = 2048, decode_batch: int = 8, prefill_len: int = 256, stack: str = "scan"):
    """``{name: lower}`` of the decode and prefill steps at ``num_layers`` (``lower()`` traces and
    lowers one), the stack run as ``stack`` ("scan" or "unrolled"); with "server", the steps a
    server compiles (``Executor.abstract``'s variants, scanned): a packed prefill of
    ``prefill_len`` tokens in ``decode_batch`` rows with its first tokens sampled, and a decode
    call of up to 4 steps of every slot over the whole memory, sampling included."""
    from backends import XLA
    from model import GROK_1, forward
    from model.memory import new_memory
    from model.plan import abstract_params
    from model.transformer import layers_apart

    config = dataclasses.replace(GROK_1, num_layers=num_layers, sequence_len=kv_len, fprop_dtype="bfloat16")
    params = jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16),
                                    abstract_params(config))
    if stack == "server":
        from runner.executor import Executor

        mesh = jax.sharding.Mesh([[jax.devices()[0]]], ("data", "model"))
        executor = Executor.abstract(config, params, mesh, decode_batch)
        lowers = {key[0]: lower for key, _, lower in executor.variants([(decode_batch, prefill_len, False)],
                                                                      [(kv_len, 4, 0)])}
        return {"decode": lowers["decode"], "prefill": lowers["prefill"]}
    backend = XLA(layers=stack)
    if stack == "unrolled":
        params = layers_apart(params, take=lambda a, i: jax.ShapeDtypeStruct(a.shape[1:], a.dtype))

    def step(last_only):
        return jax.jit(lambda p, tokens, memory: forward(p, tokens, config, memory=memory, backend=backend,
                                                         last_only=last_only))

    def memory(batch):
        return jax.eval_shape(lambda: new_memory(config, batch))

    decode_args = (params, jax.ShapeDtypeStruct((decode_batch, 1), jnp.int32), memory(decode_batch))
    prefill_args = (params, jax.ShapeDtypeStruct((1, prefill_len), jnp.int32), memory(1))
    return {"decode": lambda: step(False).lower(*decode_args), "prefill": lambda: step(True).lower(*prefill_args)}


def measure(num_layers: int, stack: str = "scan") -> dict:
    """Lowering and compile seconds of each step at ``num_layers``."""
    out = {}
    for name, lower in steps(num_layers, stack=stack).items():
        began = time.perf_counter()
        lowered = lower()
        lowered_at = time.perf_counter()
        lowered.compile()
        done = time.perf_counter()
        out[name] = {"lower_s": round(lowered_at - began, 3), "compile_s": round(done - lowered_at, 3),
                     "total_s": round(done - began, 3)}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="1,8,16,32,64", help="depths, comma-separated (default 1,8,16,32,64)")
    parser.add_argument("--stack", default="unrolled,scan",
                        help="ways to run the stack, comma-separated (default unrolled,scan: before and after; "
                             "server: the server's own steps, scanned)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    jax.config.update("jax_compilation_cache_dir", None)
    depths = [int(x) for x in args.layers.split(",")]
    stacks = args.stack.split(",")
    measure(1)  # JAX's first lowering and compile in a process pay for its own start: not a step's
    results = {}
    for stack in stacks:  # one way after the other, each over every depth
        results[stack] = {n: measure(n, stack) for n in depths}
    print(f"{cpu()}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for stack, rows in results.items():
        base = rows[min(depths)]
        print(f"\nlayers {stack}:\n")
        print("| layers | decode (batch 8): lower + compile, s | x | 256-token prefill: lower + compile, s | x |")
        print("|---:|---:|---:|---:|---:|")
        for n, row in rows.items():
            d, p = row["decode"], row["prefill"]
            print(f"| {n} | {d['lower_s']:.2f} + {d['compile_s']:.2f} = {d['total_s']:.2f} | "
                  f"{d['total_s'] / base['decode']['total_s']:.1f} | {p['lower_s']:.2f} + {p['compile_s']:.2f} = "
                  f"{p['total_s']:.2f} | {p['total_s'] / base['prefill']['total_s']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu(), "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       "stacks": {stack: {str(n): r for n, r in rows.items()} for stack, rows in results.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
