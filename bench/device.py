"""The accelerator check: Grok-1-width layers on one device, decode and prefill against the chip's limits.

    python -m bench.device [--layers N] [--peak-tb-s 4.8] [--peak-tflops 989]   # one H200
    python -m bench.device --tiny                                             # the script itself, on CPU

Builds Grok-1's layer (emb 6144, 48 query / 8 KV heads of 128, ffn 32768, 8 experts top-2, int8
weights with bf16 scales as released, bf16 activations, vocabulary 131072) with random weights
made on the device, as many layers as fit in its memory (about 5 GB each) beside the KV caches
and the largest batch's activations, on the XLA backend (``jax.lax.ragged_dot`` MoE). Prints
one JSON line:

- ``decode``: batch 1, 8 and 64 at context 1024: tokens/s, and model-bandwidth utilisation (the
  bytes a step must read, over the step's time, over ``--peak-tb-s``): every attention and
  router weight, the experts the batch's tokens route to (expected distinct experts of uniform
  routing), the tied embedding for the unembedding, and the KV cache up to the context;
- ``prefill``: one 2,048-token forward: seconds, the FLOPs the selected experts and attention
  need (``2 x tokens x active parameters`` plus the attention scores), XLA's own count from the
  compiled HLO's cost analysis against it, and FLOP utilisation against ``--peak-tflops``
  (bf16 dense);
- ``moe``: one MoE layer at 2,048 tokens on ``ragged_dot`` against every expert on every token
  (dense, combined by the gates): milliseconds each.

Peaks default to an H200 SXM's datasheet (4.8 TB/s HBM3e, 989 dense bf16 TFLOP/s). Every part
runs within a deadline (``--budget-s``, default 420 s): what is left is reported as skipped. No
test runs it; ``--tiny`` runs the same code on a small config in seconds on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from backends import XLA
from bench.common import expected_experts, median_time
from model import GROK_1, TINY, forward, new_memory
from model.layers import MoELayer, gelu
from model.plan import abstract_params


def device_params(config, key):
    """Random parameters of ``config`` made on the device: int8 weights with bf16 scales (the
    release's layout), float32 norms, router and embedding."""
    shapes = abstract_params(config, quantized=True)
    leaves, tree = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(key, len(leaves))

    def make(leaf, k):
        if leaf.dtype == jnp.int8:
            return jax.jit(lambda k: jax.random.randint(k, leaf.shape, -127, 128, jnp.int32).astype(jnp.int8))(k)
        if leaf.dtype == jnp.bfloat16:  # scales: about 1 / (127 sqrt(fan-in))
            return jnp.full(leaf.shape, 1.0 / (127 * 64), jnp.bfloat16)
        fan_in = leaf.shape[-2] if len(leaf.shape) >= 2 else 1
        return jax.jit(lambda k: jax.random.normal(k, leaf.shape, jnp.float32) / math.sqrt(fan_in))(k)

    return jax.tree_util.tree_unflatten(tree, [make(leaf, k) for leaf, k in zip(leaves, keys)])


def nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def layer_bytes(config) -> int:
    one = dataclasses.replace(config, num_layers=1)
    shapes = abstract_params(one, quantized=True)
    return nbytes(shapes["transformer"])


def decode_bytes(config, params, batch: int, context: int) -> int:
    """What one decode step must read: all weights but the unrouted experts, plus the KV cache."""
    c = config
    layers = params["transformer"]["layers"]  # every layer's, stacked
    moe = nbytes(layers["moe"])
    rest = nbytes(layers) - moe
    routed = moe * expected_experts(batch, c) / c.num_experts
    kv = 2 * batch * c.num_kv_heads * context * c.key_size * jnp.dtype(c.dtype).itemsize
    return int(rest + routed + c.num_layers * kv + nbytes(params["language_model"]))


def prefill_flops(config, tokens: int) -> float:
    """FLOPs a prefill of ``tokens`` needs: the active parameters (the selected experts only), the
    causal attention scores and values, and the last token's unembedding (a prefill samples one)."""
    c = config
    d, h = c.emb_size, c.key_size
    attention = d * (c.num_q_heads + 2 * c.num_kv_heads) * h + c.num_q_heads * h * d
    experts = c.num_selected_experts * 3 * d * c.ffn_size
    router = d * c.num_experts
    per_token = c.num_layers * (attention + experts + router)
    scores = c.num_layers * 2 * c.num_q_heads * h * tokens * (tokens + 1) / 2  # q.k and p.v, causal
    return 2.0 * tokens * per_token + 2.0 * scores + 2.0 * c.vocab_size * d  # the last token unembedded


def dense_moe(config):
    """Every expert on every token, combined by the gates (the way ``ragged_dot`` is measured against)."""
    def run(params, x_MD, probs_ME):
        gates, idx = jax.lax.top_k(probs_ME, config.num_selected_experts)
        combine = jnp.einsum("Mk,MkE->ME", gates.astype(x_MD.dtype),
                             jax.nn.one_hot(idx, config.num_experts, dtype=x_MD.dtype))
        w = {name: params[name]["w"].astype(x_MD.dtype) for name in ("linear", "linear_v", "linear_1")}
        hidden = gelu(jnp.einsum("MD,EDF->EMF", x_MD, w["linear"]), config.activation) * jnp.einsum(
            "MD,EDF->EMF", x_MD, w["linear_v"])
        return jnp.einsum("ME,EMD->MD", combine, jnp.einsum("EMF,EFD->EMD", hidden, w["linear_1"]))
    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="default: as many as fit")
    parser.add_argument("--peak-tb-s", type=float, default=4.8)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--tiny", action="store_true", help="a small config, to run the script itself anywhere")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    device = jax.devices()[0]
    base = dataclasses.replace(TINY, num_layers=2, sequence_len=256) if args.tiny else GROK_1
    base = dataclasses.replace(base, fprop_dtype="bfloat16")
    batches, context, prefill_tokens = ((1, 8, 64), 1024, 2048) if not args.tiny else ((1, 8), 64, 128)
    per_layer = layer_bytes(base)
    stats = getattr(device, "memory_stats", lambda: None)() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    if args.layers:
        layers = args.layers
    elif free > 0:  # room for the caches of the largest batch, the logits and the compiler's buffers
        kv = 2 * max(batches) * base.num_kv_heads * context * base.key_size * 2
        reserve = 16 << 30
        layers = max(1, min(base.num_layers, int((free - reserve - 4 * base.vocab_size * base.emb_size)
                                                  // (per_layer + kv))))
    else:
        layers = base.num_layers
    config = dataclasses.replace(base, num_layers=layers, sequence_len=max(context, prefill_tokens))
    out = {"device": str(device.device_kind), "platform": device.platform, "jax": jax.__version__,
           "layers": layers, "layer_gb": per_layer / 1e9, "free_gb": free / 1e9,
           "peaks": {"tb_s": args.peak_tb_s, "tflops": args.peak_tflops}, "skipped": []}
    params = device_params(config, jax.random.PRNGKey(0))
    out["params_gb"] = nbytes(params) / 1e9
    backend = XLA.for_platform(device.platform)
    out["backend"] = backend.describe()

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    rng = np.random.default_rng(0)
    out["decode"] = []
    step = jax.jit(lambda p, tokens, memory: forward(p, tokens, config, memory=memory, backend=backend,
                                                       kv_len=context), donate_argnums=2)
    for batch in batches:
        if left() < 60:
            out["skipped"].append(f"decode batch {batch}")
            continue
        memory = new_memory(config, batch).replace(step=jnp.full((batch,), context - 1, jnp.int32))
        tokens = jnp.asarray(rng.integers(4, config.vocab_size, (batch, 1)), jnp.int32)
        state = {"memory": memory}

        def one():
            result = step(params, tokens, state["memory"])
            state["memory"] = result.memory.replace(step=jnp.full((batch,), context - 1, jnp.int32))
            return result.logits

        seconds = median_time(lambda: jax.block_until_ready(one()), 10)
        need = decode_bytes(config, params, batch, context)
        out["decode"].append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": batch / seconds,
                              "bytes_per_step_gb": need / 1e9,
                              "bandwidth_utilisation": need / seconds / (args.peak_tb_s * 1e12)})
        del state, memory
    if left() > 60:
        tokens = jnp.asarray(rng.integers(4, config.vocab_size, (1, prefill_tokens)), jnp.int32)
        prefill = jax.jit(lambda p, t: forward(p, t, config, backend=backend, last_only=True).logits)
        compiled = prefill.lower(params, tokens).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        seconds = median_time(lambda: jax.block_until_ready(compiled(params, tokens)), 3)
        need = prefill_flops(config, prefill_tokens)
        out["prefill"] = {"tokens": prefill_tokens, "seconds": seconds, "needed_tflop": need / 1e12,
                          "xla_tflop": float(cost.get("flops", float("nan"))) / 1e12,
                          "xla_over_needed": float(cost.get("flops", float("nan"))) / need,
                          "flop_utilisation": need / seconds / (args.peak_tflops * 1e12)}
    else:
        out["skipped"].append("prefill")
    if left() > 30:
        moe_params = jax.tree_util.tree_map(lambda a: a[0], params["transformer"]["layers"]["moe"])  # layer 0
        x = jax.random.normal(jax.random.PRNGKey(1), (prefill_tokens, config.emb_size), jnp.bfloat16)
        probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(2), (prefill_tokens, config.num_experts)), -1)
        ragged = jax.jit(lambda p, x, pr: MoELayer(config, XLA(grouped="ragged")).apply(
            {"params": p}, x[None], pr[None]))
        dense = jax.jit(dense_moe(config))
        out["moe"] = {"tokens": prefill_tokens,
                      "ragged_dot_ms": median_time(lambda: jax.block_until_ready(ragged(moe_params, x, probs)), 5) * 1e3,
                      "dense_ms": median_time(lambda: jax.block_until_ready(dense(moe_params, x, probs)), 5) * 1e3}
        out["moe"]["dense_over_ragged"] = out["moe"]["dense_ms"] / out["moe"]["ragged_dot_ms"]
    else:
        out["skipped"].append("moe")
    out["seconds"] = time.perf_counter() - start
    print(json.dumps(out))


if __name__ == "__main__":
    main()
