"""Train the project's default checkpoint: a small Grok-1-architecture MoE LM on Jane Austen.

    python -m train.train_default --out checkpoints/austen-moe            # the shipped model
    python -m train.train_default --steps 60 --probe --emb 192 ...         # a timing/loss probe

Reproducible: a fixed seed fixes the initial parameters and the data order (window offsets drawn
from ``numpy.random.default_rng(seed)``); the number of steps is fixed (no wall-clock cutoff).
The forward pass is the project's own ``model.LanguageModel(config, XLA(grouped="ragged"))`` (the
MoE's grouped matmul as ``jax.lax.ragged_dot``, which has a gradient); the loss
is next-token cross-entropy plus a Switch-style load-balancing loss on the sown ``router_probs``.
Optimiser: optax AdamW (linear warm-up + cosine decay, weight decay on matrices only) after
global-norm clipping at 1.0. The result is saved in the native format with the attention and
expert matrices quantized to int8 (``model.quantize(w, groups=1)``, as the Grok-1 release).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import model
from backends import XLA
from model import LanguageModel, ModelConfig
from model.transformer import sown
from train import data

SEED = 0


def make_config(args) -> ModelConfig:
    key_size = args.emb // args.heads
    return ModelConfig(
        vocab_size=data.VOCAB_SIZE, emb_size=args.emb, key_size=key_size, num_q_heads=args.heads,
        num_kv_heads=args.kv_heads, num_layers=args.layers, widening_factor=args.widening,
        num_experts=8, num_selected_experts=2, sequence_len=args.context,
        embedding_multiplier_scale=math.sqrt(args.emb), output_multiplier_scale=0.5773502691896257,
        attn_output_multiplier=1.0 / math.sqrt(key_size), pad_token=0, eos_token=2, bos_token=1,
        fprop_dtype="float32")


def init_params(config: ModelConfig, seed: int):
    """``model.init_params``, with the embedding rescaled from N(0, 1) to N(0, 1/D): the input is
    then unit-RMS after the sqrt(D) multiplier and the initial logits have std ~0.58 (with N(0, 1)
    they would have std ~0.58 sqrt(D) and the initial loss would be far above ln V)."""
    params = model.init_params(config, jax.random.PRNGKey(seed))
    emb = params["language_model"]["in_out_embed"]["embeddings"]
    params["language_model"]["in_out_embed"]["embeddings"] = emb / math.sqrt(config.emb_size)
    return params


def load_balancing_loss(intermediates, config: ModelConfig):
    """Switch-style aux loss, mean over layers of E * sum_e f_e P_e (f_e: fraction of the top-k
    (token, slot) assignments to expert e; P_e: mean router probability of e)."""
    e, k = config.num_experts, config.num_selected_experts
    losses = []
    for i in range(config.num_layers):
        probs = sown(intermediates, "router_probs")[i]  # [B,T,E]
        probs = probs.reshape(-1, e)
        _, idx = jax.lax.top_k(probs, k)
        f = jnp.mean(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=(0, 1))  # sums to 1
        p = jnp.mean(probs, axis=0)
        losses.append(e * jnp.sum(jax.lax.stop_gradient(f) * p))
    return jnp.mean(jnp.stack(losses))


def cross_entropy(logits, tokens):
    """Mean next-token cross-entropy: position t predicts token t+1 (the last position has no target)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll)


def make_fns(config: ModelConfig, optimizer, aux_coef: float):
    lm = LanguageModel(config, XLA(grouped="ragged"))

    def loss_fn(params, tokens):
        out, state = lm.apply({"params": params}, tokens, mutable=["intermediates"])
        ce = cross_entropy(out.logits, tokens)
        aux = load_balancing_loss(state["intermediates"], config)
        return ce + aux_coef * aux, (ce, aux)

    @jax.jit
    def train_step(params, opt_state, tokens):
        (_, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, ce, aux, optax.global_norm(grads)

    @jax.jit
    def eval_loss(params, tokens):
        out = lm.apply({"params": params}, tokens)
        return cross_entropy(out.logits, tokens)

    return train_step, eval_loss


def make_optimizer(params, steps: int, lr: float, warmup: int, wd: float):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=steps, end_value=lr * 0.1)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)  # matrices only: no norm scales
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd, mask=decay_mask),
    ), schedule


def sample_batch(rng: np.random.Generator, stream: np.ndarray, batch: int, context: int, bos: int):
    """``batch`` random windows of the training stream, each ``[bos, context-1 stream tokens]``."""
    starts = rng.integers(0, len(stream) - (context - 1), size=batch)
    body = np.stack([stream[s:s + context - 1] for s in starts])
    return np.concatenate([np.full((batch, 1), bos, np.int32), body], axis=1)


def quantize_params(params):
    """int8 (groups=1) for every ``w`` of rank >= 2 except ``router/w``; everything else float32."""
    def q(path, leaf):
        names = [getattr(p, "key", str(p)) for p in path]
        if names[-1] == "w" and leaf.ndim >= 2 and names[-2] != "router":
            return model.quantize(leaf, groups=1)
        return leaf
    return jax.tree_util.tree_map_with_path(q, params)


def plot_losses(log: dict, path: str) -> None:
    import matplotlib  # imported only here: training itself does not need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    tr = log["train"]
    ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train (batch, 50-step log)")
    ho = log["heldout"]
    ax.plot([r["step"] for r in ho], [r["loss"] for r in ho], "o-", label="held-out subset")
    ax.axhline(math.log(log["config"]["vocab_size"]), color="gray", ls=":", label="uniform ln V")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, 10)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("austen-moe training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="checkpoints/austen-moe", help="checkpoint directory to write")
    p.add_argument("--work", default="/tmp/austen-moe-work", help="scratch dir (tokenizer, float params)")
    p.add_argument("--log", default=None, help="JSON training log (default: <out>/train_log.json)")
    p.add_argument("--steps", type=int, default=750)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--emb", type=int, default=192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--widening", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5%% of steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=32, help="fixed held-out subset (first N windows)")
    p.add_argument("--probe", action="store_true", help="timing/loss probe: evaluate at the end, save nothing")
    args = p.parse_args(argv)

    t_start = time.time()
    config = make_config(args)
    os.makedirs(args.work, exist_ok=True)
    tok_path = data.train_tokenizer(os.path.join(args.work, "tokenizer"), data.split_paragraphs()[0])
    train_stream, held_stream = data.token_streams(tok_path)
    held = data.heldout_windows(held_stream, config.sequence_len, config.bos_token)[: args.eval_windows]
    print(f"train tokens {len(train_stream)}, held-out tokens {len(held_stream)}; "
          f"params {config.num_params:,} (active {config.num_active_params:,})", flush=True)

    params = init_params(config, args.seed)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    optimizer, schedule = make_optimizer(params, args.steps, args.lr, warmup, args.weight_decay)
    opt_state = optimizer.init(params)
    train_step, eval_loss = make_fns(config, optimizer, args.aux_coef)
    rng = np.random.default_rng(args.seed)

    def heldout():
        return float(np.mean([eval_loss(params, jnp.asarray(held[i:i + 16]))
                              for i in range(0, len(held), 16)]))

    log = {"config": {k: getattr(config, k) for k in config.__dataclass_fields__}, "args": vars(args),
           "train": [], "heldout": []}
    log_path = args.log or os.path.join(args.work if args.probe else args.out, "train_log.json")
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    eval_every = max(1, args.steps // 10)
    acc, t_train, t0 = [], 0.0, time.time()
    for step in range(1, args.steps + 1):
        tokens = jnp.asarray(sample_batch(rng, train_stream, args.batch, config.sequence_len, config.bos_token))
        params, opt_state, ce, aux, gnorm = train_step(params, opt_state, tokens)
        acc.append((ce, aux, gnorm))
        if step % args.log_every == 0 or step == args.steps or step == 1:
            ce_m, aux_m, g_m = (float(np.mean([float(a[j]) for a in acc])) for j in range(3))
            acc = []
            now = time.time()
            rec = {"step": step, "loss": ce_m, "aux": aux_m, "grad_norm": g_m,
                   "lr": float(schedule(step)), "elapsed_s": now - t_start}
            log["train"].append(rec)
            print(json.dumps(rec), flush=True)
        if step % eval_every == 0 or step == args.steps:
            rec = {"step": step, "loss": heldout(), "elapsed_s": time.time() - t_start}
            log["heldout"].append(rec)
            print("heldout", json.dumps(rec), flush=True)
            with open(log_path, "w") as f:
                json.dump(log, f, indent=1)
        if step == 1:
            t0 = time.time()  # excludes compilation from the steady-state rate
    t_train = time.time() - t0
    tps = (args.steps - 1) * args.batch * config.sequence_len / t_train
    log["summary"] = {"steps": args.steps, "batch": args.batch, "context": config.sequence_len,
                      "tokens_seen": args.steps * args.batch * config.sequence_len,
                      "steps_per_s": (args.steps - 1) / t_train, "tokens_per_s": tps,
                      "final_train_loss": log["train"][-1]["loss"],
                      "final_heldout_subset_loss": log["heldout"][-1]["loss"],
                      "wall_s_training": time.time() - t_start,
                      "num_params": config.num_params, "num_active_params": config.num_active_params}
    print("summary", json.dumps(log["summary"]), flush=True)
    with open(log_path, "w") as f:
        json.dump(log, f, indent=1)
    if args.probe:
        return

    from checkpoints.native import save

    np.savez(os.path.join(args.work, "params_float32.npz"),
             **{"/".join(getattr(k, "key", str(k)) for k in path): np.asarray(v)
                for path, v in jax.tree_util.tree_flatten_with_path(params)[0]})
    save(args.out, quantize_params(params), config, tokenizer=tok_path)
    log["summary"]["wall_s_total"] = time.time() - t_start
    with open(log_path, "w") as f:
        json.dump(log, f, indent=1)
    try:
        plot_losses(log, os.path.join(args.out, "loss.png"))
    except ImportError:
        print("matplotlib not installed: no loss.png", flush=True)
    print(f"saved {args.out} in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
