"""Two checkouts of this project served side by side, taking turns: is the new code as fast as the old?

    python -m bench.alternate --old /tmp/old --new . [--cycles 2] [--batches 1,8,32] [--out bench/alternate.json]

Each cycle runs, in a fresh process inside each checkout in turn (old, then new), the serving row
of ``python -m bench`` on its benchmark config (emb 512, 8 layers, 8 experts top-2, fp32; a
100-token prompt, 64 new tokens, greedy, every slot busy) at each batch size, with the runner's
default settings (whatever each checkout chooses on this CPU). Turns alternate so that both see
the same moments of a shared, noisy host; medians over the cycles, with the range. The compile
caches are each checkout's own (a cold start is not what is compared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROW = r"""
import json, os, sys, jax
import model
assert os.path.abspath(model.__file__).startswith(os.getcwd()), model.__file__  # this checkout's code
try:
    from bench.common import BENCH, serve
except ImportError:  # older checkouts kept these in bench/__main__.py
    from bench.__main__ import BENCH, serve
from model import init_params
from runner import InferenceRunner, ModelRunner
params = init_params(BENCH, jax.random.PRNGKey(0))
rows = []
for batch in map(int, sys.argv[1].split(",")):
    runner = InferenceRunner(runner=ModelRunner(model=BENCH, params=params), batch_size=batch, pad_sizes=(128,))
    runner = runner.initialize()
    serve(runner, batch, 100, 8, seed=99)  # warm-up: every bucket compiled
    rows.append({"batch": batch, **serve(runner, batch, 100, 64, seed=0)})
print("ROWS " + json.dumps(rows))
"""


def run_row(checkout: str, batches: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    done = subprocess.run([sys.executable, "-c", ROW, batches], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{checkout}: {done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("ROWS "))[5:])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", default=".")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--out", default="bench/alternate.json")
    args = parser.parse_args(argv)
    from bench.common import cpu

    results = {"cpu": cpu(), "old": os.path.abspath(args.old), "new": os.path.abspath(args.new), "rows": []}
    for name in ("old", "new"):
        head = subprocess.run(["git", "-C", getattr(args, name), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        results[f"{name}_commit"] = head
    print(f"CPU: {results['cpu']}; old {results['old_commit']}, new {results['new_commit']}", flush=True)
    for cycle in range(args.cycles):
        for name in ("old", "new"):
            for row in run_row(getattr(args, name), args.batches):
                results["rows"].append({"code": name, "cycle": cycle, **row})
                print(f"cycle {cycle} {name} batch {row['batch']}: decode {row['decode_tokens_per_s']:.1f} tok/s, "
                      f"TTFT {row['ttft']:.3f} s", flush=True)
    print("\n| batch | decode tok/s old | new | new / old | TTFT s old | new |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in map(int, args.batches.split(",")):
        cell = {}
        for name in ("old", "new"):
            rows = [r for r in results["rows"] if r["code"] == name and r["batch"] == batch]
            cell[name] = {key: [r[key] for r in rows] for key in ("decode_tokens_per_s", "ttft")}
        fmt = lambda v, f: f"{f.format(statistics.median(v))} ({f.format(min(v))}–{f.format(max(v))})"  # noqa: E731
        ratio = statistics.median(cell["new"]["decode_tokens_per_s"]) / statistics.median(cell["old"]["decode_tokens_per_s"])
        print(f"| {batch} | {fmt(cell['old']['decode_tokens_per_s'], '{:.1f}')} | "
              f"{fmt(cell['new']['decode_tokens_per_s'], '{:.1f}')} | {ratio:.2f} | "
              f"{fmt(cell['old']['ttft'], '{:.2f}')} | {fmt(cell['new']['ttft'], '{:.2f}')} |")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
