"""``python run.py serve`` under abusive clients, as a separate process on 127.0.0.1 (its memory
and its exit are what is tested): a 200 MB chunked upload, idle and stalled connections, a
request of 200,000 prompts and a 4 MB prompt while /health is polled, and SIGTERM while an upload
stalls. Every request loop is bounded in count and time; the server is stopped by its PID."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from runner.runner import default_checkpoint
from tests import COMPILE_FAST
from tests.helpers import REPO
from tests.test_sharding import free_port

KEY = "abuse-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
READ_TIMEOUT = 1.5
FILE_LIMIT = 256  # the soft limit the server starts with; it raises it to the hard limit


class ServeProcess:
    """``run.py serve`` on the shipped model, its stderr in a file."""

    def __init__(self, tmp_path, *flags):
        checkpoint = default_checkpoint()
        if checkpoint is None:
            pytest.skip("the shipped model is missing")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        self.log_file = open(self.log_path, "w")
        # one CPU device, as a user runs it; its compiled steps in the session's store
        # ($GROK_RUNNER_COMPILE_CACHE, tests/conftest.py): a later start of the same settings loads them
        env = dict(os.environ, XLA_FLAGS=COMPILE_FAST)
        self.proc = subprocess.Popen(  # bash lowers the soft file limit, then becomes the server
            ["bash", "-c", f'ulimit -Sn {FILE_LIMIT} && exec "$0" "$@"', sys.executable, str(REPO / "run.py"), "serve", "--checkpoint", checkpoint, "--port", str(self.port),
             "--batch-size", "2", "--max-waiting", "4", "--api-key", KEY,
             "--max-scored-tokens", "0", "--pad-sizes", "16,64", *flags],  # fewer variants to compile;
            # echo is refused by its size, scored or not
            cwd=str(REPO), env=env, stdout=self.log_file, stderr=subprocess.STDOUT)
        self.starting = None  # (/health's body, a completion's response) seen while it started
        deadline = time.time() + 300
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if health.status_code == 200:
                    break
                if health.status_code == 503 and self.starting is None:
                    completion = httpx.post(self.url + "/v1/completions", headers=AUTH, timeout=2,
                                            json={"model": "austen-moe", "prompt": "It is", "max_tokens": 2})
                    self.starting = (health.json(), completion)
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not start: " + self.log()
            time.sleep(0.1)

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text()

    def status(self, field: str) -> int:
        """A ``/proc/PID/status`` field in kB."""
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    process = ServeProcess(tmp_path_factory.mktemp("serve"), "--read-timeout", str(READ_TIMEOUT),
                           "--shutdown-timeout", "2")
    yield process
    process.stop()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _head(path: str, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def _response(sock: socket.socket, limit: float = 30) -> bytes:
    """What the server sends until it closes the connection or a whole response arrived."""
    sock.settimeout(limit)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_the_port_answers_503_saying_the_phase_while_the_model_starts(serve):
    """While the model restores and compiles, /health is a 503 whose JSON says the phase (and the
    progress over the compiled steps once they are counted); any other path a 503 with
    Retry-After in OpenAI's error shape; stderr shows each phase and ends with their durations."""
    assert serve.starting is not None, "the port never answered before the model was ready: " + serve.log()
    health, completion = serve.starting
    assert health["status"] == "starting" and health["phase"] in ("starting", "restore", "backend", "layout",
                                                                  "compile", "server"), health
    assert isinstance(health["elapsed_s"], (int, float)) and health["elapsed_s"] >= 0
    if health["phase"] == "compile":
        assert 0 <= health["progress"]["done"] <= health["progress"]["total"]
    assert completion.status_code == 503 and int(completion.headers["retry-after"]) > 0
    assert completion.json()["error"]["code"] == "starting" and "starting" in completion.json()["error"]["message"]
    log = serve.log()
    deadline = time.monotonic() + 60  # /health turns 200 just before the summary line is written
    while "started in " not in log and time.monotonic() < deadline:
        time.sleep(0.2)
        log = serve.log()
    for phase in ("restore", "backend", "layout", "compile"):
        assert f"start: {phase}" in log, log[-3000:]
    assert "compiled steps: " in log  # the progress bar over them
    summary = [line for line in log.splitlines() if line.startswith("started in ")]
    assert len(summary) == 1 and all(f"{phase} " in summary[0] for phase in ("imports", "restore", "compile")), log


def test_the_soft_file_limit_is_raised_to_the_hard_one(serve):
    limits = open(f"/proc/{serve.proc.pid}/limits").read()
    line = next(l for l in limits.splitlines() if l.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard and int(soft) > FILE_LIMIT, line


def test_a_200_mb_chunked_upload_is_refused_without_the_memory(serve):
    """The limit counts the body as it arrives: 413, and the process's peak memory grows by far
    less than the upload (the whole body was kept before: 1 GB took RSS from 449 MB to 2.29 GB)."""
    rss = serve.status("VmRSS")
    try:  # reset the peak (VmHWM) to the current RSS, so the peak measured is this upload's
        with open(f"/proc/{serve.proc.pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    peak_before = serve.status("VmHWM")
    chunk = b"[" + b" " * 65534 + b"]"
    sent, answer = 0, b""
    with _connect(serve.port) as sock:
        sock.sendall(_head("/v1/completions", "Transfer-Encoding: chunked\r\n"))
        try:
            while sent < 200 << 20:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _response(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"more than 4194304 bytes" in answer
    growth_mb = (serve.status("VmHWM") - min(rss, peak_before)) / 1024
    assert growth_mb < 100, f"peak RSS grew by {growth_mb:.0f} MB for a {sent >> 20} MB upload"
    assert httpx.get(serve.url + "/health").status_code == 200


@pytest.mark.parametrize("prompt", ["text", "ids"])
def test_forty_concurrent_oversized_prompts_take_bounded_memory(serve, prompt):
    """40 concurrent 4 MB prompts, each a 400 naming the prompt: the peak RSS grows by less than
    256 MB, whatever their number (each text was tokenized whole before: 1.23 GB). A text is
    refused from its normalized length, never encoded; a large body waits for its turn on disk."""
    value = "the " * 999_000 if prompt == "text" else [1234] * 650_000
    raw = json.dumps({"model": "austen-moe", "prompt": value, "max_tokens": 4}).encode()
    assert len(raw) > 3 << 20
    rss = serve.status("VmRSS")
    try:
        with open(f"/proc/{serve.proc.pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    peak_before = serve.status("VmHWM")
    answers = []

    def send():
        r = httpx.post(serve.url + "/v1/completions", content=raw, timeout=120,
                       headers={**AUTH, "Content-Type": "application/json"})
        answers.append((r.status_code, r.json()["error"]))

    senders = [threading.Thread(target=send) for _ in range(40)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=150)
    assert len(answers) == 40 and {status for status, _ in answers} == {400}, answers[:2]
    assert all(e["param"] == "prompt" and "more than sequence_len (256)" in e["message"] for _, e in answers)
    growth_mb = (serve.status("VmHWM") - min(rss, peak_before)) / 1024
    assert growth_mb < 256, f"peak RSS grew by {growth_mb:.0f} MB for 40 concurrent 4 MB prompts"
    assert httpx.get(serve.url + "/health").status_code == 200


def test_idle_half_sent_and_stalled_connections_are_closed_and_logged(serve):
    socks = []
    try:
        for i in range(30):
            sock = _connect(serve.port)
            if i % 3 == 1:  # half a head
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            elif i % 3 == 2:  # a head, then part of the body, then nothing
                sock.sendall(_head("/v1/completions", "Content-Length: 100\r\n") + b'{"model": ')
            socks.append(sock)
        started = time.time()
        for sock in socks:
            assert _response(sock, limit=READ_TIMEOUT + 20) == b"", "an idle connection got an answer"
        # every one closed, none sooner than the timeout, within a bounded time
        assert time.time() - started < READ_TIMEOUT + 20
        r = httpx.post(serve.url + "/v1/completions", headers=AUTH, timeout=30,
                       json={"model": "austen-moe", "prompt": "It is", "max_tokens": 3})
        assert r.status_code == 200, r.text
    finally:
        for sock in socks:
            sock.close()
    deadline = time.time() + 5
    while time.time() < deadline:
        log = serve.log()
        if log.count("(read timeout)") >= 30:
            break
        time.sleep(0.1)
    assert log.count("the request head was not complete within 1.5 s (read timeout)") >= 20, log[-3000:]
    assert log.count("no more of the request body came within 1.5 s (read timeout)") >= 10, log[-3000:]
    assert log.count("left during the upload") >= 10 and "Traceback" not in log, log[-3000:]


def _poll_health(url: str, stop: threading.Event, worst: list) -> None:
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t = time.perf_counter()
            c.get(url + "/health")
            worst.append(time.perf_counter() - t)
            time.sleep(0.02)


@pytest.mark.parametrize("case", ["200000 prompts", "a 4 MB prompt", "a 4 MB tokenize", "echo over 3000 prompts"])
def test_health_answers_while_a_large_request_is_handled(serve, case):
    """The event loop never waits on one request: /health keeps answering within a second, and
    the large request gets the status that tells the truth."""
    text = "It is a truth universally acknowledged, that a single man in possession " * 55000
    text = text[: (4 << 20) - 200]
    path, body, status = {
        "200000 prompts": ("/v1/completions", {"prompt": ["a truth, yes"] * 200000, "max_tokens": 1}, 400),
        "a 4 MB prompt": ("/v1/completions", {"prompt": text, "max_tokens": 1}, 400),
        "a 4 MB tokenize": ("/tokenize", {"prompt": text}, 200),
        "echo over 3000 prompts": ("/v1/completions", {"prompt": ["It is a truth"] * 3000, "max_tokens": 1,
                                                        "echo": True, "logprobs": 5}, 400),
    }[case]
    raw = json.dumps({"model": "austen-moe", **body}).encode()
    assert len(raw) > 3 << 20 or case.startswith("echo")
    stop, worst = threading.Event(), []
    poller = threading.Thread(target=_poll_health, args=(serve.url, stop, worst))
    poller.start()
    try:
        time.sleep(0.2)
        r = httpx.post(serve.url + path, content=raw, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    assert r.status_code == status, r.text[:300]
    if status == 400:  # too many choices, or a prompt longer than the context
        assert r.json()["error"]["param"] in ("prompt", "max_tokens"), r.text[:300]
    assert len(worst) >= 5 and max(worst) < 1.0, f"/health took up to {max(worst):.2f} s"


def test_serve_caches_prefixes_and_reports_them(serve):
    """``serve`` keeps prompt prefixes by default: a repeated prompt's usage counts its cached
    tokens, its text is unchanged, and /metrics counts the lookups and hits in tokens."""
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be"
    body = {"model": "austen-moe", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    first, again = (httpx.post(serve.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
                    for _ in range(2))
    assert first["usage"]["prompt_tokens"] > 16, first["usage"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (first["usage"]["prompt_tokens"] - 1) // 16 * 16 and cached > 0, again["usage"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    metrics = httpx.get(serve.url + "/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    queries = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_queries_total")]
    assert float(hits[0].split()[-1]) >= cached and float(queries[0].split()[-1]) >= 2 * first["usage"]["prompt_tokens"]


def test_sigterm_with_a_stalled_upload_exits(serve, tmp_path):
    """A stalled upload (with a long read timeout) does not hold the process: it exits within
    the drain timeout plus a few seconds, rc 0, and says what it ended. (It is the module's second
    start of the same model and settings, after ``serve``'s, with the session's compile cache: that
    start compiles nothing, counted, and reads the kernels' calibration from their cache.)"""
    process = ServeProcess(tmp_path, "--read-timeout", "120", "--shutdown-timeout", "2")
    try:
        # the same model and settings as the module's first server, with its compile cache: this
        # start loads every step and compiles nothing, and reads the kernels' calibration
        summary = [line for line in process.log().splitlines() if line.startswith("started in ")]
        assert summary and " 0 compiled)" in summary[0] and summary[0].endswith("; 0 XLA compilations"), \
            process.log()[-3000:]
        assert "calibration: every shape read from the cache" in process.log() or "backend: xla" in process.log()
        stalled = _connect(process.port)
        stalled.sendall(_head("/v1/completions", "Transfer-Encoding: chunked\r\n") + b"5\r\n{\"mod")
        idle = _connect(process.port)
        time.sleep(0.5)
        started = time.time()
        process.proc.send_signal(signal.SIGTERM)
        rc = process.proc.wait(timeout=20)
        took = time.time() - started
        assert rc == 0, process.log()[-3000:]
        assert took < 20
        log = process.log()
        assert "closed 1 connection(s) still uploading a request" in log, log[-3000:]
        assert _response(stalled, limit=5) == b"" and _response(idle, limit=5) == b""
    finally:
        process.stop()
