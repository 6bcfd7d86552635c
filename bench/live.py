"""What a decode step costs with L live requests in a fixed batch of slots, against a runner of
L slots.

    python -m bench.live [--slots 8] [--live 1,2,4,8] [--context 256] [--rounds 15] [--out FILE]

The bench config (``bench/common.py``, random weights; fp32, or ``--dtype``, ``--quantize``), one CPU device, the runner's
default backend. One ``ModelRunner`` of ``--slots`` slots and one of L slots for each L; each
timed call is ``steps`` decode steps from a state whose first L slots are busy at ``--context``
(the rest free), the runners taking turns call by call, medians over ``--rounds``. A free slot
still runs through the attention and the dense layers of a fixed batch; what the step should not
pay for is the MoE's experts (issue 22: the 1-live step within 15% of a 1-slot runner's).
``--prefill P,...`` also times a prompt of P tokens (prefill and its first token, a 1-slot
runner; medians of ``--rounds``), in one bucket of ``sequence_len`` (``--buckets context``: the
bucket's padding should cost less than its real tokens) or in the default buckets and chunks;
``--together N`` also times N such prompts at once through a runner of N slots (its rounds:
chunks under the token budget, beside the decode calls of the prompts already done), each with
its first token, medians of ``--rounds``: what serving's prefill costs against one alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from bench.common import BENCH, busy, cpu
from model import init_params
from runner import Executor, InferenceRunner, ModelRunner, Request


def with_live(engine, state, live: int, position: int, tokens: np.ndarray):
    """``busy`` (every slot at ``position``), then all but the first ``live`` slots freed."""
    state = busy(engine, state, position, tokens)
    active = np.arange(len(tokens)) < live
    return state.replace(active=jax.device_put(active, engine._state_shardings.active))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--live", default="1,2,4,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--prefill", default="", help="prompt lengths to prefill")
    p.add_argument("--buckets", choices=["context", "default"], default="context",
                   help="--prefill in one bucket of sequence_len, or in the runner's default buckets")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--together", type=int, default=0, help="--prefill's prompts also N at once, N slots")
    p.add_argument("--quantize", choices=["int8", "w8a8"], default=None)
    p.add_argument("--out")
    args = p.parse_args(argv)
    model = dict(dtype=args.dtype, quantize=args.quantize)
    lives = [int(x) for x in args.live.split(",")]
    params = init_params(BENCH, jax.random.PRNGKey(0))
    kv_len = 1 << args.context.bit_length()
    runs = {}  # (slots, live) -> (engine, step function, state, tokens)
    for slots, live in [(args.slots, live) for live in lives] + [(live, live) for live in lives if live != args.slots]:
        key = (slots, live)
        if slots not in {s for s, _ in runs}:
            engine = ModelRunner(model=BENCH, params=params, **model)
            engine = Executor.create(engine, batch_size=slots)
            step = engine._decode.variant(kv_len=kv_len, steps=args.steps)
            tokens = np.random.default_rng(slots).integers(4, BENCH.vocab_size, slots).astype(np.int32)
            shared = [engine, step, engine.new_state(), tokens]
        else:
            shared = next(v for (s, _), v in runs.items() if s == slots)
        runs[key] = shared
    times = {key: [] for key in runs}
    for i in range(args.rounds + 1):  # the first round compiles and warms up
        for (slots, live), shared in runs.items():
            engine, step, state, tokens = shared
            state = with_live(engine, state, live, args.context, tokens)
            start = time.perf_counter()
            shared[2], out = step(engine.params, state, engine.no_mask, np.int32(args.steps))
            jax.block_until_ready(out)
            if i:
                times[(slots, live)].append((time.perf_counter() - start) / args.steps * 1e3)
    med = {key: statistics.median(t) for key, t in times.items()}
    print(f"{cpu()}; bench config in {args.dtype}{', ' + args.quantize + ' weights' if args.quantize else ''}, "
          f"{engine.selection.backend.describe()}")
    print(f"context {args.context}, {args.steps} steps a call, medians of {args.rounds}")
    print(f"| live requests L | {args.slots}-slot runner, ms/step | L-slot runner, ms/step | ratio |")
    print("|---:|---:|---:|---:|")
    rows = []
    for live in lives:
        fixed, own = med[(args.slots, live)], med[(live, live)]
        rows.append({"live": live, "fixed_ms": fixed, "own_ms": own, "ratio": fixed / own})
        print(f"| {live} | {fixed:.2f} | {own:.2f} | {fixed / own:.2f} |")
    prefill = {}
    if args.prefill:
        runner = InferenceRunner(runner=ModelRunner(model=BENCH, params=params, **model), batch_size=1,
                                 pad_sizes=(BENCH.sequence_len,) if args.buckets == "context" else None)
        runner = runner.initialize()
        rng = np.random.default_rng(0)
        for length in [int(x) for x in args.prefill.split(",")]:
            ids = rng.integers(4, BENCH.vocab_size, length).tolist()
            runner.complete(Request(ids, temperature=0.0, max_len=1))  # warm
            took = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                runner.complete(Request(ids, temperature=0.0, max_len=1))
                took.append(time.perf_counter() - start)
            prefill[length] = statistics.median(took) * 1e3
            where = f"a {BENCH.sequence_len}-token bucket" if args.buckets == "context" else "the default buckets"
            print(f"prefill of {length} tokens in {where}: {prefill[length]:.0f} ms")
    together = {}
    if args.prefill and args.together:
        runner = InferenceRunner(runner=ModelRunner(model=BENCH, params=params, **model), batch_size=args.together,
                                 pad_sizes=(BENCH.sequence_len,) if args.buckets == "context" else None)
        runner = runner.initialize()
        rng = np.random.default_rng(1)
        for length in [int(x) for x in args.prefill.split(",")]:
            def requests():
                return [Request(rng.integers(4, BENCH.vocab_size, length).tolist(), temperature=0.0, max_len=1)
                        for _ in range(args.together)]
            runner.generate(requests())  # warm
            took = []
            for _ in range(args.rounds):
                batch = requests()
                start = time.perf_counter()
                runner.generate(batch)
                took.append(time.perf_counter() - start)
            together[length] = statistics.median(took) * 1e3
            rate = args.together * length / together[length] * 1e3
            print(f"{args.together} prompts of {length} tokens at once, {args.together} slots: {together[length]:.0f} ms "
                  f"({rate:.0f} tokens/s; alone: {length / prefill[length] * 1e3:.0f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu(), "args": vars(args), "rows": rows, "prefill_ms": prefill,
                       "together_ms": together}, f, indent=1)


if __name__ == "__main__":
    main()
