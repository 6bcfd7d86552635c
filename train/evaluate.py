"""Held-out loss and expert usage of a shipped checkpoint (used for the model card and tests).

    from train.evaluate import heldout_loss, expert_usage
    heldout_loss("checkpoints/austen-moe")                  # full held-out set, nats/token
    heldout_loss("checkpoints/austen-moe", max_windows=8)   # first 8 windows only

The held-out stream is rebuilt with the checkpoint's own tokenizer and the rule in ``train/data.py``
(every 20th chapter, i % 20 == 19), cut into consecutive non-overlapping windows of
``sequence_len`` (``[bos, sequence_len - 1 stream tokens]``, as in training); the loss is the mean
next-token cross-entropy over every predicted position of those windows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from backends import XLA
import numpy as np

from train import data

BATCH = 8


@functools.lru_cache(maxsize=4)
def _load(checkpoint_dir: str):
    from checkpoints import restore

    restored = restore(checkpoint_dir, dequantize=True, dtype="float32")
    if restored.tokenizer_path is None:
        raise ValueError(f"{checkpoint_dir}: the checkpoint has no tokenizer.model")
    sp = data.load_tokenizer(restored.tokenizer_path)
    held = data.encode_paragraphs(sp, data.split_paragraphs()[1])
    windows = data.heldout_windows(held, restored.config.sequence_len, restored.config.bos_token)
    return restored, windows


def heldout_windows(checkpoint_dir: str, max_windows: int | None = None) -> np.ndarray:
    windows = _load(checkpoint_dir)[1]
    return windows if max_windows is None else windows[:max_windows]


def heldout_loss(checkpoint_dir: str, max_windows: int | None = None) -> float:
    """Mean next-token cross-entropy (nats/token) on the held-out windows (the first ``max_windows``)."""
    from model import forward

    restored, _ = _load(checkpoint_dir)
    windows = heldout_windows(checkpoint_dir, max_windows)
    total, count = 0.0, 0
    for i in range(0, len(windows), BATCH):
        tokens = jnp.asarray(windows[i:i + BATCH])
        logits = forward(restored.params, tokens, restored.config, backend=XLA()).logits
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        total += float(jnp.sum(nll))
        count += nll.size
    return total / count


def expert_usage(checkpoint_dir: str, max_windows: int | None = None) -> np.ndarray:
    """``[num_layers, num_experts]``: the fraction of held-out tokens whose top-k includes expert e
    (each row sums to num_selected_experts; uniform routing gives k / E = 0.25 per expert)."""
    from model import LanguageModel
    from model.transformer import sown

    restored, _ = _load(checkpoint_dir)
    c = restored.config
    lm = LanguageModel(c, XLA())

    @jax.jit
    def counts(params, tokens):
        _, state = lm.apply({"params": params}, tokens, mutable=["intermediates"])
        out = []
        for i in range(c.num_layers):
            probs = sown(state["intermediates"], "router_probs")[i]
            _, idx = jax.lax.top_k(probs[:, 1:], c.num_selected_experts)  # skip the bos position
            out.append(jnp.sum(jax.nn.one_hot(idx, c.num_experts), axis=(0, 1, 2)))
        return jnp.stack(out)

    windows = heldout_windows(checkpoint_dir, max_windows)
    total = np.zeros((c.num_layers, c.num_experts))
    for i in range(0, len(windows), BATCH):
        total += np.asarray(counts(restored.params, jnp.asarray(windows[i:i + BATCH])))
    return total / (len(windows) * (c.sequence_len - 1))


if __name__ == "__main__":
    import sys

    d = sys.argv[1] if len(sys.argv) > 1 else "checkpoints/austen-moe"
    print("held-out loss (8 windows):", heldout_loss(d, 8))
    print("held-out loss (all):", heldout_loss(d))
    print("expert usage:\n", np.round(expert_usage(d), 3))
