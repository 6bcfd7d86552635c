"""The server under abusive clients, measured: what each attack costs ``python run.py serve``.

    python -m bench.abuse [--out bench/abuse.json]

Starts the server on the shipped model in a subprocess (127.0.0.1, a free port; ``--api-key``,
``--batch-size 8``, ``--max-waiting 64``, started with a soft limit of 1,024 open files), then:
a 1 GB and a 200 MB chunked upload (status, peak RSS growth); 1,100 idle sockets (a real request
meanwhile, and how long until the server has closed them all); /health's worst latency while one
large request is handled (200,000 prompts in 3.2 MB, a 4 MB text prompt to completions, chat and
/tokenize, echo with logprobs over 3,000 prompts), with that request's status and time; the
statuses of JSON nested 10,000 deep, 72 prompts on an idle server and 80 prompts; and SIGTERM
while an upload stalls (time to exit, rc). Traffic goes to 127.0.0.1 only; every loop is
bounded. Never run by the tests (tests/test_http.py checks the same cases, smaller).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from bench.serve import HERE, free_port, start_server

KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _status_kb(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:  # VmHWM back to the current RSS (Linux >= 4.0)
        f.write("5")


def chunked_upload(port: int, pid: int, size: int) -> dict:
    rss = _status_kb(pid, "VmRSS")
    _reset_peak(pid)
    chunk, sent, start = b" " * 65536, 0, time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while sent < size:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        answer = sock.recv(4096)
    return {"upload_mb": size >> 20, "status": answer.split(b" ", 2)[1].decode() if answer else "closed",
            "seconds": time.perf_counter() - start, "rss_before_mb": rss / 1024,
            "peak_growth_mb": (_status_kb(pid, "VmHWM") - rss) / 1024}


def idle_sockets(url: str, port: int, count: int) -> dict:
    socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(count)]
    start = time.perf_counter()
    try:
        status = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                            json={"model": "austen-moe", "prompt": "It is", "max_tokens": 4}).status_code
    except httpx.HTTPError as e:
        status = f"{type(e).__name__}: {e}"
    closed, deadline = 0, time.time() + 60
    for sock in socks:
        sock.settimeout(max(0.1, deadline - time.time()))
        try:
            closed += sock.recv(1) == b""
        except OSError:
            pass
        sock.close()
    return {"sockets": count, "request_status_meanwhile": status, "closed_by_server": closed,
            "all_closed_after_s": time.perf_counter() - start}


def health_while(url: str, path: str, raw: bytes) -> dict:
    stop, worst = threading.Event(), []

    def poll():
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(url + "/health")
                worst.append(time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    start = time.perf_counter()
    try:
        status = httpx.post(url + path, content=raw, headers=AUTH, timeout=120).status_code
    except httpx.HTTPError as e:
        status = f"{type(e).__name__}: {e}"
    took = time.perf_counter() - start
    time.sleep(0.3)
    stop.set()
    poller.join()
    return {"path": path, "body_mb": len(raw) / 2**20, "status": status, "seconds": took,
            "health_polls": len(worst), "health_worst_ms": max(worst) * 1e3}


def sigterm_with_a_stalled_upload(command: list[str], port: int, log) -> dict:
    server = start_server(command, port, log)
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod")
    time.sleep(0.5)
    start = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        rc = "still running after 60 s: killed"
    stalled.close()
    return {"exit_s": time.perf_counter() - start, "rc": rc}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "bench", "abuse.json"))
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "run.py", "serve", "--port", str(port), "--api-key", KEY, "--batch-size", "8",
               "--max-waiting", "64"]
    soft_1024 = ["bash", "-c", 'ulimit -Sn 1024 && exec "$0" "$@"']  # the file limit most systems start with
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    out = {"cpu": cpu, "cores": os.cpu_count(), "command": " ".join(command[1:])}
    log = tempfile.TemporaryFile("w+")
    server = start_server(soft_1024 + command, port, log)
    try:
        out["uploads"] = [chunked_upload(port, server.pid, size) for size in (200 << 20, 1 << 30)]
        print(out["uploads"], flush=True)
        out["idle"] = idle_sockets(url, port, 1100)
        print(out["idle"], flush=True)
        text = ("It is a truth universally acknowledged, that a single man in possession " * 56000)[: 4_000_000]
        body = {"model": "austen-moe", "max_tokens": 1}
        cases = [("/v1/completions", {**body, "prompt": ["a truth, yes"] * 200000}),
                 ("/v1/completions", {**body, "prompt": text}),
                 ("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}),
                 ("/tokenize", {"model": "austen-moe", "prompt": text}),
                 ("/v1/completions", {**body, "prompt": ["It is a truth"] * 3000, "echo": True, "logprobs": 5}),
                 ("/v1/completions", {**body, "prompt": [[5, 6, 7]] * 72}),
                 ("/v1/completions", {**body, "prompt": [[5, 6, 7]] * 80})]
        out["large"] = [health_while(url, path, json.dumps(b).encode()) for path, b in cases]
        out["large"].append(health_while(url, "/v1/completions", b"[" * 10000 + b"]" * 10000))
        for row in out["large"]:
            print(row, flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    log.seek(0)
    out["server_log_lines"] = len(log.read().splitlines())
    port2 = free_port()
    command2 = [sys.executable, "run.py", "serve", "--port", str(port2)]
    with tempfile.TemporaryFile("w+") as log2:
        out["sigterm"] = sigterm_with_a_stalled_upload(command2, port2, log2)
    print(out["sigterm"], flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
