"""What the w8a8 mode costs in accuracy on the shipped model (issue 52). The shipped checkpoint
holds its experts and attention projections in int8 (as Grok-1 does), so the references are its
exact products: int8 weights times float32 activations, and times bf16 activations (Grok-1's
released format, "the bf16 model"); beside them w8a8, the same int8 weights times activations
rounded to int8 per block of 32 (llama.cpp's q8_0 dot), with float32 and with bf16 activations
elsewhere. All on the CPU backend with every kernel (``backend="cpu"``: the kernels' own
arithmetic, whatever a calibration would take on this machine).

    python -m bench.accuracy [--checkpoint checkpoints/austen-moe] [--windows 32] [--prompts 16]
        [--tokens 64] [--out bench/accuracy.json]

- Teacher-forced, on the first ``--windows`` held-out windows (``train.evaluate``; 256 tokens
  each): the held-out loss (nats a token), and against each reference (float32, bf16) the mean
  and largest logit error (over the reference's largest logit, a position's) and the share of positions whose
  top token agrees.
- Greedy generation: ``--prompts`` held-out prompts of 32 tokens, ``--tokens`` tokens each: the
  share of completions equal to the reference's, and the mean tokens before the first difference.

Needs ``../shared/data/austen.txt`` (the held-out text). Never run by the tests.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from bench.common import cpu
from runner import InferenceRunner, ModelRunner, Request

WAYS = {"int8 x float32": ("float32", None), "int8 x bf16": ("bfloat16", None), "w8a8 x float32": ("float32", "w8a8"),
        "w8a8 x bf16": ("bfloat16", "w8a8")}
REFERENCES = ("int8 x float32", "int8 x bf16")


def logits_and_completions(checkpoint: str, way: str, windows: np.ndarray, prompts: list, tokens: int):
    dtype, quantize = WAYS[way]
    spec = ModelRunner(checkpoint_path=checkpoint, backend="cpu", dtype=dtype, quantize=quantize)
    runner = InferenceRunner(runner=spec, batch_size=8, pad_sizes=(32,)).initialize(warmup=False)
    executor = runner.engine.executor
    print(f"{way}: {executor.backend_report().splitlines()[0]}", flush=True)
    lengths = np.full((8,), windows.shape[1], np.int32)
    logits = np.concatenate([np.asarray(executor.forward(executor.params, windows[i:i + 8], lengths), np.float32)
                             for i in range(0, len(windows), 8)])
    done = runner.generate([Request(p, temperature=0.0, max_len=tokens, ignore_eos=True) for p in prompts])
    return logits, [c.token_ids for c in done]


def loss(logits: np.ndarray, windows: np.ndarray) -> float:
    shifted = logits[:, :-1] - logits[:, :-1].max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, windows[:, 1:, None], axis=-1).mean())


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> None:
    from train.evaluate import heldout_windows

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="checkpoints/austen-moe")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default="bench/accuracy.json")
    args = p.parse_args(argv)
    windows = np.asarray(heldout_windows(args.checkpoint, -(-args.windows // 8) * 8), np.int32)
    prompts = [w[1:33].tolist() for w in windows[: args.prompts]]
    print(cpu(), flush=True)
    results = {way: logits_and_completions(args.checkpoint, way, windows, prompts, args.tokens) for way in WAYS}
    rows = []
    for way, (logits, completions) in results.items():
        row = {"way": way, "heldout_loss": loss(logits, windows)}
        for ref in REFERENCES:
            want, want_completions = results[ref]
            scale = np.abs(want).max(-1)
            error = np.abs(logits - want).max(-1) / scale
            row[f"vs {ref}"] = {
                "logit_error_mean": float(error.mean()), "logit_error_max": float(error.max()),
                "top1_agreement": float((logits.argmax(-1) == want.argmax(-1)).mean()),
                "greedy_equal": float(np.mean([a == b for a, b in zip(completions, want_completions)])),
                "greedy_tokens_before_difference": float(np.mean([first_difference(a, b) for a, b in
                                                                  zip(completions, want_completions)]))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu(), "checkpoint": args.checkpoint, "windows": len(windows), "prompts": len(prompts),
                   "tokens": args.tokens, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
