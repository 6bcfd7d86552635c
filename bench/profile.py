"""Where a decode step, a served token and a served prompt spend their time: per part of the
compiled step (from JAX's profiler), and the host's share beside the device's.

    python -m bench.profile [--dtype bfloat16] [--slots 8] [--prompt 128] [--tokens 64] [--out FILE]

The bench config (``bench/common.py``, random weights), one CPU device, the runner's default
backend (the kernels this machine's calibration takes). Three parts, each with the runner
of ``--slots`` slots beside one of 1 slot (what a request costs among free slots, issue 52):

- **decode step**: one decode step with one live request (context ``--prompt``), traced
  with ``jax.profiler``; each operation the step ran is charged to the part of the model its
  HLO names (the stack's attention, MoE, norms; the unembedding; the sampling), milliseconds a
  step, medians of the traced steps' totals;
- **served token**: one request of ``--prompt`` tokens and ``--tokens`` new ones, greedy, through
  ``InferenceRunner.run`` (the engine's scheduling, dispatch and detokenising included; no
  HTTP): milliseconds a token after the first, against the step alone: the rest is the host's;
- **prompt**: the same request's prefill (its first token), traced as the decode step is.

Times on the device are the sum over the CPU's threads (an operation split across 2 threads
counts twice its wall time), so compare parts with each other and runners with each other;
the step's wall time is given beside. Never run by the tests.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from bench.common import BENCH, cpu

# The part of the model an operation belongs to, from the op_name JAX gives its HLO (first match).
PARTS = (("sampling", ("sample_token", "sampling", "logits_summary", "filter_", "gumbel", "argmax")),
         ("unembedding", ("LanguageModelHead.unembed", "unembed")),
         ("MoE", ("/moe/", "/router", "moe/")),
         ("attention", ("multi_head_attention",)),
         ("norms and residuals", ("rms_norm", "DecoderLayer")),
         ("embedding", ("embed",)),
         ("prefix pool", ("read_prefix", "save_prefix")),
         ("state", ("jit(decode)", "jit(prefill)")))


def op_parts(hlo: str) -> dict[str, str]:
    """Each instruction name of a compiled module's text -> its part (``PARTS``), by its op_name;
    a fusion without one takes the part of the first named instruction of what it calls."""
    named, calls, first_in, current = {}, {}, {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            current = head.group(1)
            continue
        instruction = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if not instruction:
            continue
        op_name, called = re.search(r'op_name="([^"]*)"', line), re.search(r"calls=%([\w.\-]+)", line)
        if op_name:
            named[instruction.group(1)] = op_name.group(1)
            first_in.setdefault(current, op_name.group(1))
        if called:
            calls[instruction.group(1)] = called.group(1)
    parts = {}
    for name in set(named) | set(calls):
        path = named.get(name) or first_in.get(calls.get(name, ""), "")
        parts[name] = next((part for part, keys in PARTS if any(k in path for k in keys)), "other")
    return parts


def traced(call, rounds: int, hlo: str, prepare=lambda: None) -> dict:
    """``call()`` ``rounds`` times under JAX's profiler, each after ``prepare()`` (untimed):
    milliseconds a call by part (the sum of its operations' times on the CPU's threads), and its
    wall time (median)."""
    parts, walls = op_parts(hlo), []
    directory = tempfile.mkdtemp()
    with jax.profiler.trace(directory):
        for _ in range(rounds):
            jax.block_until_ready(prepare())
            start = time.perf_counter()
            jax.block_until_ready(call())
            walls.append(time.perf_counter() - start)
    from jax.profiler import ProfileData

    data = ProfileData.from_file(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)[0])
    by_part = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # the threads that run the compiled program (pool, caller)
                continue
            for event in line.events:
                name = event.name
                if name.startswith(("ThunkExecutor", "Slinky", "end: ")) or name.split(".")[0] in ("while", "cond"):
                    continue  # wrappers: their operations are counted themselves
                by_part[parts.get(name, "other")] += event.duration_ns / 1e6 / rounds
    return {"parts_ms": dict(by_part.most_common()), "wall_ms": statistics.median(walls) * 1e3}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from bench.live import with_live
    from model import init_params
    from runner import Executor, InferenceRunner, ModelRunner, Request

    params = init_params(BENCH, jax.random.PRNGKey(0))
    prompt = np.random.default_rng(0).integers(4, BENCH.vocab_size, args.prompt).tolist()
    results = {}
    for slots in (args.slots, 1):
        spec = ModelRunner(model=BENCH, params=params, dtype=args.dtype)
        engine = Executor.create(spec, batch_size=slots)
        kv_len = BENCH.sequence_len
        step = engine._decode.variant(kv_len=kv_len, steps=1)
        tokens = np.random.default_rng(1).integers(4, BENCH.vocab_size, slots).astype(np.int32)
        box = {"state": engine.new_state()}
        hlo = step.lower(engine.params, box["state"], engine.no_mask, np.int32(1)).compile().as_text()

        def prepare():
            box["state"] = with_live(engine, box["state"], 1, args.prompt, tokens)
            return box["state"]

        def one_step():
            box["state"], out = step(engine.params, box["state"], engine.no_mask, np.int32(1))
            return out

        for _ in range(3):
            prepare()
            one_step()
        decode = traced(one_step, args.rounds, hlo, prepare)
        del engine, box
        runner = InferenceRunner(runner=spec, batch_size=slots).initialize()
        request = lambda: Request(prompt=prompt, max_len=args.tokens, temperature=0.0, ignore_eos=True)  # noqa: E731
        gaps, firsts = [], []
        for _ in range(4):
            start = time.perf_counter()
            times = [time.perf_counter() for _ in runner.run([request()])]
            firsts.append(times[0] - start)
            gaps.append((times[-1] - times[0]) / (len(times) - 1))
        executor = runner.engine.executor
        batch_hlo = [None]
        original = executor.prefill_memory

        def recorded(batch, score=False):  # the prefill's compiled text, for the parts
            if batch_hlo[0] is None:
                batch_hlo[0] = executor._prefill.variant(score=score).lower(
                    executor.params, executor.state, batch).compile().as_text()
            return original(batch, score)

        executor.prefill_memory = recorded
        runner.complete(Request(prompt=prompt, max_len=1, temperature=0.0))
        prefill = traced(lambda: runner.complete(Request(prompt=prompt, max_len=1, temperature=0.0)).token_ids,
                         max(3, args.rounds // 4), batch_hlo[0])
        results[slots] = {"decode": decode, "served_tpot_ms": statistics.median(gaps) * 1e3,
                          "served_first_ms": statistics.median(firsts) * 1e3, "prefill": prefill,
                          "backend": runner.backend_report().splitlines()[0]}
        print(f"{slots} slots: {results[slots]['backend']}", file=sys.stderr)
    print(f"{cpu()}; bench config in {args.dtype}, one request ({args.prompt}-token prompt), KV {BENCH.sequence_len}")
    for what in ("decode", "prefill"):
        names = list(dict.fromkeys(k for r in results.values() for k in r[what]["parts_ms"]))
        print(f"\n| {what}: part, ms on the threads | " + " | ".join(f"{s} slots" for s in results) + " |")
        print("|---|" + "---:|" * len(results))
        for name in names:
            print(f"| {name} | " + " | ".join(f"{r[what]['parts_ms'].get(name, 0):.2f}" for r in results.values()) + " |")
        print(f"| **wall, a call** | " + " | ".join(f"**{r[what]['wall_ms']:.2f}**" for r in results.values()) + " |")
    print("\n| served (run(), no HTTP) | " + " | ".join(f"{s} slots" for s in results) + " |")
    print("|---|" + "---:|" * len(results))
    print("| a token after the first, ms | " + " | ".join(f"{r['served_tpot_ms']:.2f}" for r in results.values()) + " |")
    print("| the decode step alone, ms | " + " | ".join(f"{r['decode']['wall_ms']:.2f}" for r in results.values()) + " |")
    print("| the first token, ms | " + " | ".join(f"{r['served_first_ms']:.1f}" for r in results.values()) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu(), "args": vars(args), "results": {str(k): v for k, v in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
