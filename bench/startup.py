"""How long a server takes to start, ours beside the peers in one run: from the command to the
port's first answer and to ``/health`` 200, and ours' phases (its "started in" line).

    python -m bench.startup [--servers ours-cold,ours,ours,vllm,llama] [--out bench/startup.json]

Every server serves the bench config's dimensions, as in ``bench.load`` (the peers set up as in
``bench/peers/``). ``ours`` starts with its usual caches: the compiled steps of an earlier start
of this tree (``--compile-cache``, here one directory for the run) and the kernels' library and
calibration; ``ours-cold`` with an empty compile cache (it compiles every step, and fills the
cache the next ``ours`` reads), ``ours-first`` with empty compile and kernel caches too (it also
builds and calibrates the kernels: a first start on a fresh machine, less the pip install).
Each server is started, timed, and stopped, in the order given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

from bench.load import OURS, PEERS, ours_checkpoint
from bench.serve import HERE, free_port

SUMMARY = re.compile(r"^started in .*$", re.M)


def start(command: list[str], port: int, env=None, cwd=HERE, limit: float = 900) -> dict:
    """Run ``command`` until its ``/health`` answers 200; seconds to the first answer and to 200,
    and what it wrote."""
    log = tempfile.TemporaryFile("w+")
    began = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    first = ready = None
    try:
        while ready is None:
            if process.poll() is not None or time.perf_counter() - began > limit:
                log.seek(0)
                raise RuntimeError(f"{command[0]} did not start: {log.read()[-2000:]}")
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
                first = first or time.perf_counter() - began
                if status == 200:
                    ready = time.perf_counter() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    log.seek(0)
    return {"first_answer_s": round(first, 2), "health_200_s": round(ready, 2), "log": log.read()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="ours-cold,ours,ours,vllm,llama",
                   help="some of ours-first, ours-cold, ours, the peers of bench.load; in this order")
    p.add_argument("--serve-args", default="", help="extra arguments of ours' serve")
    p.add_argument("--out", default="bench/startup.json")
    args = p.parse_args(argv)
    from bench.common import cpu

    scratch = tempfile.TemporaryDirectory()
    checkpoint = ours_checkpoint(scratch.name)
    compiled = os.path.join(scratch.name, "compiled")
    results = {"cpu": cpu(), "args": vars(args), "runs": []}
    print(f"CPU: {results['cpu']}\n\n| server | first answer s | /health 200 s | phases |\n|---|---:|---:|---|")
    for name in args.servers.split(","):
        port, env = free_port(), None
        if name in ("ours", "ours-cold", "ours-first"):
            cache = compiled if name == "ours" else tempfile.mkdtemp(dir=scratch.name)
            if name == "ours-cold":
                compiled = cache  # the next "ours" starts from what this one compiled
            if name == "ours-first":
                env = dict(os.environ, GROK_RUNNER_KERNEL_CACHE=tempfile.mkdtemp(dir=scratch.name))
            command = [sys.executable, os.path.join(HERE, "run.py"), "serve", "--checkpoint", checkpoint,
                       "--model-name", "bench", "--port", str(port), "--batch-size", "8", "--compile-cache", cache,
                       *args.serve_args.split(), *OURS["ours"]]
        else:
            script, extra = PEERS[name]
            if not os.path.exists(script):
                print(f"| {name} | {script} not found, skipped | | |")
                continue
            command, env = ["bash", script, str(port)], dict(os.environ, **extra)
        run = start(command, port, env=env)
        found = SUMMARY.search(run.pop("log"))
        run.update(server=name, phases=found.group(0) if found else "")
        results["runs"].append(run)
        print(f"| {name} | {run['first_answer_s']:.1f} | {run['health_200_s']:.1f} | {run['phases']} |", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
