"""Experiment: does a hand-written matmul beat XLA:CPU's dots at decode shapes?

    python -m bench.ffi_matmul [--rows 1,2,4,8,16,64] [--repeats 9] [--out bench/ffi_matmul.json]

Decode multiplies a few rows (the batch, or an expert's share of it) by weights far bigger than
the caches, so a step is bound by how fast the weights stream from memory. This builds
``bench/ffi_matmul.cc`` (a register-blocked fp32 kernel, threaded over XLA's intra-op pool, called
through ``jax.ffi``) with the C++ compiler in ``$CXX`` (default ``g++``) and compares it with
XLA's own dot on the benchmark config's matmul shapes, both weight layouts: ``NN`` (``x @ w``,
``w [K, N]``) and ``NT`` (``x @ w.T``, ``w [N, K]``). Each call runs a chain of distinct weight
matrices (each step depends on the last, as the layers of a decode step do), so the weights come
from memory; the figure is weight bytes per second. Beside them, ``panels``: the runner's kernel
(``backends/cpu/ops.py``), the same register blocking over weights packed in column panels, which it
reads front to back. The plain-layout kernel here is the experiment that led to it; the runner
does not use it. Skips (exit 0, saying why) without a C++ compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu import build, ops as panel
from bench.common import median_time

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ffi_matmul.cc")
# (K, N, matrices per chain): an expert's up and down projections and the tied unembedding of
# bench/__main__.py's config (emb 512, expert width 2736, vocabulary 32768).
SHAPES = ((512, 2736, 24), (2736, 512, 24), (512, 32768, 4))


def build(out_dir: str) -> str | None:
    """Compile the kernel into ``out_dir``; the library's path, or None without a compiler."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return None
    lib = os.path.join(out_dir, "libffi_matmul.so")
    subprocess.run([cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}",
                    SOURCE, "-o", lib], check=True, capture_output=True)
    return lib


def kernel_matmul(x, w, transposed: bool):
    n = w.shape[0] if transposed else w.shape[1]
    return jax.ffi.ffi_call("bench_ffi_matmul", jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32))(
        x, w, transposed=transposed)


def chain(matmul):
    """One call: every weight in turn, each input depending on the previous output."""
    def run(x, ws):
        total = jnp.float32(0)
        for w in ws:
            out = matmul(x, w)
            total = total + out.sum()
            x = x + 1e-9 * total
        return out
    return jax.jit(run)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="bench/ffi_matmul.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(tmp)
        if lib is None:
            print(f"skipped: no C++ compiler ({os.environ.get('CXX', 'g++')}) to build {SOURCE}")
            return
        jax.ffi.register_ffi_target("bench_ffi_matmul", jax.ffi.pycapsule(ctypes.cdll.LoadLibrary(lib).matmul),
                                    platform="cpu")

    key = jax.random.PRNGKey(0)
    for m in (1, 3, 5, 8, 13):  # the kernel's row blocks and tails, against XLA
        x, w = jax.random.normal(key, (m, 517)), jax.random.normal(jax.random.fold_in(key, 1), (37, 517))
        for transposed, wt in ((True, w), (False, w.T)):
            np.testing.assert_allclose(kernel_matmul(x, wt, transposed), x @ w.T, rtol=1e-4, atol=1e-4)

    # name -> (matmul(x, w, n), the weight layout it takes)
    variants = {"XLA NN": (lambda x, w, n: x @ w, "NN"), "XLA NT": (lambda x, w, n: x @ w.T, "NT"),
                "kernel NN": (lambda x, w, n: kernel_matmul(x, w, False), "NN"),
                "kernel NT": (lambda x, w, n: kernel_matmul(x, w, True), "NT")}
    if build.available():
        variants["panels"] = (panel.panel_matmul, "panels")
    rows = []
    print(f"{os.cpu_count()} cores, jax {jax.__version__}; GB/s of weights, median of {args.repeats}")
    print("| rows | K x N | " + " | ".join(variants) + " | kernel / XLA | panels / XLA |")
    print("|---:|---|" + "---:|" * (len(variants) + 2))
    for m in (int(r) for r in args.rows.split(",")):
        for k, n, count in SHAPES:
            x = jax.random.normal(key, (m, k))
            nn = [jax.random.normal(jax.random.fold_in(key, i), (k, n)) for i in range(count)]
            weights = {"NN": nn, "NT": [jnp.asarray(w.T) for w in nn],
                       "panels": [jnp.asarray(panel.pack(w)) for w in nn]}
            rates = {}
            for name, (matmul, layout) in variants.items():
                fn = chain(lambda x, w, f=matmul: f(x, w, n))
                seconds = median_time(lambda: jax.block_until_ready(fn(x, weights[layout])), args.repeats)
                rates[name] = count * k * n * 4 / seconds
            xla = max(rates["XLA NN"], rates["XLA NT"])
            ratio = max(rates["kernel NN"], rates["kernel NT"]) / xla
            panels = rates.get("panels", float("nan")) / xla
            rows.append({"rows": m, "K": k, "N": n, "bytes_per_s": rates, "kernel_over_xla": ratio,
                         "panels_over_xla": panels})
            print(f"| {m} | {k} x {n} | " + " | ".join(f"{r / 1e9:.1f}" for r in rates.values()) + f" | {ratio:.2f}x | {panels:.2f}x |",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump({"cores": os.cpu_count(), "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
