"""What sampling costs a decode step, on XLA's ops and on the CPU sampling kernels.

    python -m bench.sampling [--batches 1,8,32] [--repeats 5]

The benchmark model (``python -m bench``'s, fp32, 32768 tokens) decodes at context 256, every slot
with the same settings: greedy; temperature 0.8; temperature 0.8 with top-p 0.95; and that with
top-k 50 as well. Each runs on the XLA backend (``backend="xla"``: a sort of each row for the
top-k/top-p cut, ``jax.lax.top_k`` for the reported top 8, ``logsumexp``) and on the CPU backend
with every kernel (``backend="cpu"``; ``backends/cpu/sampling.cc``: the cut by radix select, the
top 8 and the normaliser in one pass). The backends differ in the rest of the step too (the
MoE, the projections), so what sampling costs is read within a backend, setting against greedy. The variants take turns call by
call, so all of them see the same machine: its memory bandwidth moves by 30% within minutes.
Reported: median ms per decode step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from bench.common import BENCH, busy
from model import init_params
from runner import Executor, ModelRunner
from runner.sampling import SampleSettings

SETTINGS = {  # name: (temperature, top-p, top-k)
    "greedy": (0.0, 1.0, 0),
    "T 0.8": (0.8, 1.0, 0),
    "T 0.8, top-p 0.95": (0.8, 0.95, 0),
    "T 0.8, top-k 50, top-p 0.95": (0.8, 0.95, 50),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="decode steps per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/sampling.json")
    args = parser.parse_args(argv)
    params = init_params(BENCH, jax.random.PRNGKey(0))
    print(f"ms per decode step at context {args.context} ({jax.devices()[0].platform}; medians of "
          f"{args.repeats} calls of {args.steps} steps)")
    print("| batch | " + " | ".join(f"{n}: XLA | kernels | ratio" for n in SETTINGS) + " |")
    print("|---:|" + "---:|" * (3 * len(SETTINGS)))
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        engines = {True: Executor.create(ModelRunner(model=BENCH, params=params, backend="cpu"), batch_size=b),
                   False: Executor.create(ModelRunner(model=BENCH, params=params, backend="xla"), batch_size=b)}
        rng = np.random.default_rng(b)
        tokens = rng.integers(4, BENCH.vocab_size, b).astype(np.int32)
        variants = [(name, kernel) for name in SETTINGS for kernel in (False, True)]
        states, steps, times = {}, {}, {v: [] for v in variants}
        for name, kernel in variants:
            engine = engines[kernel]
            sh = engine._state_shardings
            temperature, top_p, top_k = SETTINGS[name]
            # with the summary, as served with logprobs
            settings = SampleSettings.host(b, temperature=temperature, nucleus_p=top_p, top_k=top_k, logprobs=0)
            keys = rng.integers(0, 2**32, (b, 2), dtype=np.uint32)  # each slot its own draws
            states[name, kernel] = engine.new_state().replace(settings=jax.device_put(settings, sh.settings),
                                                              keys=jax.device_put(keys, sh.keys))
            steps[name, kernel] = engine._decode.variant(kv_len=args.context, steps=args.steps)
        for i in range(args.repeats + 1):  # the first round compiles and warms up
            for v in variants:
                engine = engines[v[1]]
                state = busy(engine, states[v], args.context - args.steps, tokens)
                start = time.perf_counter()
                states[v], out = steps[v](engine.params, state, engine.no_mask)
                jax.block_until_ready(out)
                if i:
                    times[v].append((time.perf_counter() - start) / args.steps * 1e3)
        ms = {v: statistics.median(t) for v, t in times.items()}
        row = {"batch": b, **{f"{name}, {'kernels' if kernel else 'XLA'}": ms[name, kernel] for name, kernel in variants}}
        rows.append(row)
        cells = []
        for name in SETTINGS:
            cells += [f"{ms[name, False]:.1f}", f"{ms[name, True]:.1f}", f"{ms[name, False] / ms[name, True]:.2f}x"]
        print(f"| {b} | " + " | ".join(cells) + " |", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
