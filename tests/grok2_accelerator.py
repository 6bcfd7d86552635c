"""Grok-2's forward on an accelerator against the numpy statement (tests/grok2_numpy.py): a script,
not a test of the CPU suite. ``JAX_PLATFORMS=cuda python tests/grok2_accelerator.py`` prints, for
the tiny Grok-2 and a medium one (4 layers, width 512, 400 positions: past its temperature's 128 and
YaRN's original 256), each RoPE scaling: the fp32 logits' error at XLA's highest and default
matmul precision, bf16's error per position and argmax agreement, and cached decode against the
full forward. Results of an H200 run: docs/grok2.md, "Checked"."""
import dataclasses, os, sys, time
sys.path.insert(0, ".")
import jax, jax.numpy as jnp, numpy as np
print("jax", jax.__version__, jax.devices(), flush=True)
from backends import XLA
from model import TINY_GROK2, forward, init_params, new_memory
from tests import grok2_numpy

MEDIUM = dataclasses.replace(TINY_GROK2, emb_size=512, key_size=64, num_q_heads=8, num_kv_heads=2, num_layers=4,
                             widening_factor=2, shared_ffn_size=1024, num_experts=8, sequence_len=1024,
                             embedding_multiplier_scale=512 ** 0.5, attn_output_multiplier=64 ** -0.5,
                             rope_base=208533496.0, rope_original_context=256, rope_scaling_factor=4.0,
                             attn_temperature_len=128, attn_logit_cap=30.0, router_logit_cap=30.0,
                             final_logit_cap=50.0, vocab_size=2048)

def params_of(c, seed):
    p = init_params(c, jax.random.PRNGKey(seed))
    for layer in p["transformer"].values():
        layer["router"]["w"] = layer["router"]["w"] * 4.0
        layer["rms_norm_3"]["scale"] = layer["rms_norm_3"]["scale"] * 3.0
    return p

def decode(p, tokens, prefill, c):
    memory = new_memory(c, tokens.shape[0])
    step = jax.jit(lambda p, t, m: forward(p, t, c, memory=m, backend=XLA()))
    out = step(p, tokens[:, :prefill], memory)
    logits, memory = [out.logits], out.memory
    for i in range(prefill, tokens.shape[1]):
        out = step(p, tokens[:, i:i + 1], memory)
        logits.append(out.logits); memory = out.memory
    return np.concatenate([np.asarray(x) for x in logits], axis=1)

for c, name, t in ((TINY_GROK2, "tiny", 40), (MEDIUM, "medium", 400)):
    for scaling in ("yarn", "yarn_log", "none"):
        cfg = dataclasses.replace(c, rope_scaling=scaling)
        p = params_of(cfg, 0)
        tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (t,), 3, cfg.vocab_size))
        t0 = time.time()
        want, _ = grok2_numpy.forward(jax.device_get(p), tokens, cfg)
        tn = time.time() - t0
        for precision in ("highest", "default"):
            with jax.default_matmul_precision(precision):
                got = np.asarray(jax.jit(lambda p, x: forward(p, x, cfg, backend=XLA()).logits)(p, tokens[None])[0])
            err = np.abs(got - want).max() / np.abs(want).max()
            print(f"{name} {scaling} fp32 precision={precision}: max rel err {err:.2e} (numpy {tn:.1f}s)", flush=True)
        bf16 = dataclasses.replace(cfg, fprop_dtype="bfloat16")
        cast = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), p)
        want16, _ = grok2_numpy.forward(jax.device_get(jax.tree_util.tree_map(lambda w: w.astype(jnp.float32), cast)), tokens, cfg)
        got16 = np.asarray(jax.jit(lambda p, x: forward(p, x, bf16, backend=XLA()).logits)(cast, tokens[None])[0])
        per_pos = np.abs(got16 - want16).max(-1) / (want16.max() - want16.min())
        agree = np.mean(got16.argmax(-1) == want16.argmax(-1))
        print(f"{name} {scaling} bf16: per-position err median {np.median(per_pos):.3%} p90 {np.quantile(per_pos, .9):.3%} "
              f"max {per_pos.max():.3%}; argmax agree {agree:.1%}", flush=True)
        if scaling == "yarn":
            both = np.stack([tokens, np.roll(tokens, 7)])
            with jax.default_matmul_precision("highest"):
                full = np.asarray(jax.jit(lambda p, x: forward(p, x, cfg, backend=XLA()).logits)(p, both))
                cached = decode(p, both, 5 if name == "tiny" else 100, cfg)
            print(f"{name} decode vs full forward fp32(highest): max abs diff {np.abs(full - cached).max():.2e} "
                  f"(logit range {np.ptp(full):.1f})", flush=True)
