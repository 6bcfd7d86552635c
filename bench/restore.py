"""Restore throughput: a synthetic ~1 GB native checkpoint restored onto devices, beside the raw
sequential read speed of the same files, both from a cold page cache where the OS allows dropping
it (root on Linux) and warm; plus the restoring process's peak host memory.

    python -m bench.restore [--dir /tmp/restore-bench] [--mesh 1,1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from model import TINY

CONFIG = dataclasses.replace(  # int8 experts and attention, float32 embedding: about 1.0 GB
    TINY, vocab_size=32768, emb_size=1024, key_size=128, num_q_heads=8, num_kv_heads=2, num_layers=7,
    widening_factor=8, num_experts=8, num_selected_experts=2, sequence_len=1024)


def write_checkpoint(directory: str) -> int:
    import jax

    from checkpoints.native import save_tensors
    from checkpoints.materialize import disk_shapes

    rng = np.random.default_rng(0)
    entries = []
    for name, shape in disk_shapes(CONFIG).items():
        if name.endswith("/w") and len(shape) >= 2 and "router" not in name:
            scales = shape[:-2] + (1, shape[-1])
            entries.append((name + "/weight", shape, np.dtype(np.int8),
                            lambda s=shape: rng.integers(-127, 128, s, dtype=np.int8)))
            entries.append((name + "/scales", scales, np.dtype(np.float32),
                            lambda s=scales: rng.random(s, dtype=np.float32) / 127))
        else:
            entries.append((name, shape, np.dtype(np.float32), lambda s=shape: rng.standard_normal(s, np.float32)))
    save_tensors(directory, CONFIG, entries)
    del jax
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_read(directory: str) -> float:
    start = time.perf_counter()
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return time.perf_counter() - start


def restore_child(directory: str, mesh: str) -> None:
    """Run in a fresh process: restore, report seconds and peak RSS as JSON."""
    import jax

    from checkpoints import restore
    from model.sharding import make_mesh

    data, model = (int(x) for x in mesh.split(","))
    start = time.perf_counter()
    restored = restore(directory, mesh=make_mesh((data, model), jax.devices()[: data * model]), progress=False)
    jax.block_until_ready(restored.params)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/restore-bench")
    parser.add_argument("--mesh", default="1,1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return restore_child(args.dir, args.mesh)

    if not os.path.exists(os.path.join(args.dir, "config.json")):
        write_checkpoint(args.dir)
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir))
    env = dict(os.environ)
    devices = int(np.prod([int(x) for x in args.mesh.split(",")]))
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "bench.restore", "--child", "--dir", args.dir, "--mesh", args.mesh]
    rows = {"cold": {"raw": [], "restore": [], "rss": []}, "warm": {"raw": [], "restore": [], "rss": []}}
    cold_ok = True
    for _ in range(args.repeats):
        for mode in ("cold", "warm"):
            if mode == "cold":
                cold_ok = drop_caches() and cold_ok
            rows[mode]["raw"].append(raw_read(args.dir))
            if mode == "cold":
                drop_caches()
            child = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            rows[mode]["restore"].append(child["seconds"])
            rows[mode]["rss"].append(child["peak_rss"])
    mb = size / 1e6
    print(f"checkpoint {mb:.0f} MB in {args.dir}, mesh {args.mesh}, median of {args.repeats}")
    print("| page cache | raw read MB/s | restore MB/s | restore / raw | peak RSS of restore (MB) "
          "| peak RSS - checkpoint (MB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, r in rows.items():
        if mode == "cold" and not cold_ok:
            continue
        raw, rest = statistics.median(r["raw"]), statistics.median(r["restore"])
        print(f"| {mode} | {mb / raw:.0f} | {mb / rest:.0f} | {raw / rest:.2f} | "
              f"{statistics.median(r['rss']) / 1e6:.0f} | {(statistics.median(r['rss']) - size) / 1e6:.0f} |")


if __name__ == "__main__":
    main()
