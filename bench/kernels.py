"""Do the CPU kernels pay on this CPU? The runner's default against every kernel and against none.

    python -m bench.kernels [--cycles 2] [--out bench/kernels.json]

On the benchmark config of ``python -m bench`` (emb 512, 8 layers, 8 experts top-2, fp32): a
100-token prompt, 64 new tokens, greedy, at batch 1 and 8, on three runners each: the default
(``backend="auto"``: each kernel where backends/cpu/calibration.py measured it faster), every
kernel (``"cpu"``) and XLA's ops only (``"xla"``). The paths take turns row by row for
``--cycles`` cycles, so each comparison is of one moment of the host. Beside them, the probe of the
issue: one, 8 and 128 rows times a 256 MB weight on the panel kernel and on XLA's dot; and the
startup of ``python run.py`` on the shipped model from empty caches (kernel build, calibration
and compilation), with the kernel cache filled, and with both caches warm.

The CPU is printed first (model, AVX-512 or not); the kernels are built for this CPU unless
``GROK_RUNNER_KERNEL_MARCH`` names another target (``x86-64-v3``: the AVX2 variants). The script
runs on older code too (``expert_panels``/``sampler_kernel`` None, True, False before the
``backend`` setting), to measure before and after in one session.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu import build, ops as panel
from bench.common import BENCH, cpu, serve
from model import init_params
from runner import InferenceRunner, ModelRunner

PATHS = (("default", "auto"), ("kernels", "cpu"), ("xla", "xla"))
OLD_SETTINGS = {"auto": None, "cpu": True, "xla": False}  # before ModelRunner(backend=...)


def model_runner(setting: str, **kwargs) -> ModelRunner:
    if "backend" in {f.name for f in dataclasses.fields(ModelRunner)}:
        return ModelRunner(backend=setting, **kwargs)
    old = OLD_SETTINGS[setting]
    return ModelRunner(expert_panels=old, sampler_kernel=old, **kwargs)
PROMPT, NEW_TOKENS = 100, 64


def matmul_probe(repeats: int = 7) -> list[dict]:
    """Rows x a 256 MB weight ([8192, 8192] float32): panel kernel and XLA's dot, taking turns."""
    k = n = 8192
    w = np.random.default_rng(0).random((k, n), np.float32)
    dense, packed = jnp.asarray(w), jax.device_put(panel.pack(w))
    xla = jax.jit(lambda x, w: x @ w)
    kernel = jax.jit(lambda x, p: panel.panel_matmul(x, p, n))
    out = []
    for rows in (1, 8, 128):
        x = jnp.ones((rows, k), jnp.float32)
        times = {"kernel": [], "xla": []}
        for i in range(repeats + 1):
            for name, call in (("kernel", lambda: kernel(x, packed)), ("xla", lambda: xla(x, dense))):
                start = time.perf_counter()
                call().block_until_ready()
                if i:
                    times[name].append(time.perf_counter() - start)
        out.append({"rows": rows, **{f"{name}_ms": statistics.median(t) * 1e3 for name, t in times.items()}})
    return out


def startup() -> dict:
    """Seconds to the first token of ``python run.py`` (shipped model): both caches empty (the
    kernels are built and calibrated, everything compiles), the kernel cache filled, both warm."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    with tempfile.TemporaryDirectory() as kernels, tempfile.TemporaryDirectory() as xla_a, \
            tempfile.TemporaryDirectory() as xla_b:
        for name, cache in (("empty caches", xla_a), ("kernel cache filled", xla_b), ("both warm", xla_b)):
            proc = subprocess.run([sys.executable, "run.py", "--max-tokens", "8", "--prompt", "It is",
                                   "--compile-cache", cache], cwd=here, capture_output=True, text=True, timeout=600,
                                  env=dict(os.environ, GROK_RUNNER_KERNEL_CACHE=kernels))
            line = next(x for x in proc.stderr.splitlines() if x.startswith("time to first token"))
            out[name] = float(line.split()[4])
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--out", default="bench/kernels.json")
    parser.add_argument("--no-startup", action="store_true")
    args = parser.parse_args(argv)
    if not build.available():
        print(f"no kernels to compare: {build.unavailable_reason()}")
        return
    results = {"cpu": cpu(), "march": os.environ.get("GROK_RUNNER_KERNEL_MARCH", "native"), "rows": []}
    print(f"CPU: {results['cpu']}; kernels built for -march={results['march']}; jax {jax.__version__}")
    results["probe"] = matmul_probe()
    for p in results["probe"]:
        print(f"  {p['rows']:>3} rows x 256 MB: panel kernel {p['kernel_ms']:.1f} ms, XLA's dot {p['xla_ms']:.1f} ms "
              f"(kernel speed / XLA's {p['xla_ms'] / p['kernel_ms']:.2f}x)")

    params = init_params(BENCH, jax.random.PRNGKey(0))
    runners = {}
    for name, setting in PATHS:
        for batch in (1, 8):
            runner = InferenceRunner(runner=model_runner(setting, model=BENCH, params=params),
                                     batch_size=batch, pad_sizes=(128,))
            runner = runner.initialize()
            runners[name, batch] = runner
            if name == "default":
                print(f"default at batch {batch}:\n  " + runner.backend_report().replace("\n", "\n  "))
    for cycle in range(args.cycles):
        for batch in (1, 8):
            for name, _ in PATHS:
                row = serve(runners[name, batch], batch, PROMPT, NEW_TOKENS, seed=cycle)
                results["rows"].append({"path": name, "batch": batch, "cycle": cycle, **row})
    print(f"\n| path | TTFT b1 s | decode b1 tok/s | TTFT b8 s | decode b8 tok/s |   ({args.cycles} cycles: each figure "
          f"the median, range in brackets)")
    print("|---|---:|---:|---:|---:|")
    for name, _ in PATHS:
        cells = []
        for batch in (1, 8):
            rows = [r for r in results["rows"] if r["path"] == name and r["batch"] == batch]
            for key, fmt in (("ttft", "{:.2f}"), ("decode_tokens_per_s", "{:.1f}")):
                values = [r[key] for r in rows]
                cells.append(f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–"
                             f"{fmt.format(max(values))})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    del runners
    if not args.no_startup:
        results["startup"] = startup()
        print("\npython run.py, seconds to the first token: " + ", ".join(
            f"{k} {v:.1f}" for k, v in results["startup"].items()))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
