"""Operating the server: its log level, the access log, the periodic stats line and cross-origin
access (CORS), against a real server on 127.0.0.1 over the shipped model (the session's
``shipped_runner``: nothing compiles here), and in a headless browser for CORS (Debian's
chromium driven by Playwright; that test is skipped where either is absent, as test_chat_page.py's)."""

import contextlib
import http.server
import logging
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server import Server, configure_logging
from server.metrics import Metrics, StatsLine
from tests.helpers import REPO
from tests.test_server import LiveServer

MODEL = "austen-moe"
KEY = "operations-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PAGE_ORIGIN = "http://app.example"
STATS = re.compile(r"Avg prompt throughput: (\d+\.\d) tokens/s, Avg generation throughput: (\d+\.\d) tokens/s, "
                   r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: (\d+\.\d)% \((\d+)/(\d+) slots\)")
LOGGERS = ("", "grok_runner", "grok_runner.server", "uvicorn", "uvicorn.error", "uvicorn.asgi")


@contextlib.contextmanager
def served(runner, **kwargs):
    """``with served(runner, **Server kwargs) as (server, live):`` a server of its own, stopped after."""
    server = Server(runner, MODEL, **kwargs)
    live = LiveServer(server)
    try:
        yield server, live
    finally:
        live.stop()


def wait_for(condition, what, limit: float = 30.0) -> None:
    """Until ``condition()``; ``what`` (a string, or a callable giving one when it fails: the
    state then, not the state when the wait began) says what did not happen."""
    deadline = time.time() + limit
    while not condition():
        assert time.time() < deadline, what() if callable(what) else what
        time.sleep(0.02)


def completion(live, stream=False, headers=AUTH, **fields):
    body = {"model": MODEL, "prompt": "It is a truth", "max_tokens": 8, "temperature": 0, "stream": stream, **fields}
    return httpx.post(live.url + "/v1/completions", json=body, headers=headers, timeout=60)


@pytest.fixture
def logging_restored():
    """The loggers' levels (and the root's handlers) as they were before the test."""
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    handlers = list(logging.getLogger().handlers)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = handlers


# ---- settings ---------------------------------------------------------------------------------------
def test_bad_settings_are_refused_naming_them(shipped_runner):
    with pytest.raises(ValueError, match="one of debug, info, warning, error, critical, got 'verbose'"):
        configure_logging("verbose")
    for kwargs, field in [({"stats_interval": -1}, "stats_interval"), ({"stats_interval": "10"}, "stats_interval"),
                          ({"stats_interval": float("inf")}, "stats_interval"), ({"access_log": "yes"}, "access_log"),
                          ({"allowed_origins": "http://a.example"}, "allowed_origins"),
                          ({"allowed_origins": ["http://a.example/"]}, "'http://a.example/' is not an origin"),
                          ({"allowed_origins": ["a.example"]}, "'a.example' is not an origin")]:
        with pytest.raises(ValueError, match=re.escape(field)):
            Server(shipped_runner, MODEL, **kwargs)
    # as a browser spells an origin: scheme and host in lower case
    assert Server(shipped_runner, MODEL, allowed_origins=["HTTPS://App.Example:8443"]).allowed_origins == (
        "https://app.example:8443",)


# ---- log level --------------------------------------------------------------------------------------
def test_the_log_level_sets_what_a_server_process_writes_to_stderr():
    script = ("import logging; from server import configure_logging; configure_logging('info'); "
              "logging.getLogger('grok_runner.server').info('shown'); "
              "logging.getLogger('grok_runner.server').debug('no'); "
              "logging.getLogger('grok_runner').info('the runner repeats the report: not at info'); "
              "logging.getLogger('uvicorn.error').info('the banner: not at info'); "
              "logging.getLogger('uvicorn.error').warning('a warning'); logging.getLogger('jax').info('not at info'); "
              "configure_logging('DEBUG'); logging.getLogger('uvicorn.error').debug('debug')")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert [line.split(" ", 2)[2] for line in lines] == [
        "INFO grok_runner.server: shown", "WARNING uvicorn.error: a warning", "DEBUG uvicorn.error: debug"], done.stderr


def test_a_running_server_logs_at_the_level_set(shipped_runner, caplog, logging_restored):
    def ours(level):
        return [r for r in caplog.records if r.name.startswith("grok_runner.server") and r.levelno == level]

    configure_logging("warning")
    with served(shipped_runner, access_log=True, stats_interval=0.05) as (_, live):
        assert completion(live, headers={}).status_code == 200
        time.sleep(0.5)  # ten intervals: lines that would have been logged at info
        assert not ours(logging.INFO), [r.getMessage() for r in ours(logging.INFO)]
        configure_logging("info")
        assert completion(live, headers={}).status_code == 200
        wait_for(lambda: any(r.name == "grok_runner.server.access" for r in ours(logging.INFO)), "no access line")
        wait_for(lambda: any(r.name == "grok_runner.server.stats" for r in ours(logging.INFO)), "no stats line")
        assert not ours(logging.DEBUG)
        configure_logging("debug")  # idle: the stats lines go on at debug
        wait_for(lambda: any(r.name == "grok_runner.server.stats" for r in ours(logging.DEBUG)), "no debug stats line")
    assert logging.getLogger("uvicorn.error").getEffectiveLevel() == logging.DEBUG
    configure_logging("error")
    assert [logging.getLogger(n).getEffectiveLevel() for n in ("grok_runner.server", "grok_runner", "uvicorn.error",
                                                               "")] == [logging.ERROR] * 4


# ---- access log -------------------------------------------------------------------------------------
def test_the_access_log_has_a_line_per_request_when_on_and_none_when_off(shipped_runner, caplog):
    caplog.set_level(logging.INFO, logger="grok_runner.server.access")

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "grok_runner.server.access"]

    def requests(live):
        assert httpx.get(live.url + "/health").status_code == 200
        whole = completion(live)
        assert whole.status_code == 200
        streamed = completion(live, stream=True)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert completion(live, headers={"Authorization": "Bearer not-the-key"}).status_code == 401
        assert httpx.get(live.url + "/no/such/path?key=" + KEY).status_code == 404
        return whole.json()["id"], re.search(r'"id": "(cmpl-\w+)"', streamed.text).group(1)

    with served(shipped_runner, api_key=KEY, access_log=True) as (_, live):
        whole_id, streamed_id = requests(live)
        wait_for(lambda: len(lines()) == 5, lambda: f"not 5 access lines: {lines()}")
    address = r'127\.0\.0\.1:\d+ '
    ms = r' \d+\.\d ms'
    for line, pattern in zip(lines(), [
            f'"GET /health" 200{ms}', f'"POST /v1/completions" 200{ms} {whole_id}',
            f'"POST /v1/completions" 200{ms} {streamed_id}', f'"POST /v1/completions" 401{ms}',
            f'"GET /no/such/path" 404{ms}']):  # the path without its query string
        assert re.fullmatch(address + pattern, line), (line, pattern)
    assert not [r for r in caplog.records if KEY in r.getMessage() or "not-the-key" in r.getMessage()]
    caplog.clear()
    with served(shipped_runner, api_key=KEY) as (_, live):  # off by default
        requests(live)
    assert lines() == []


# ---- stats line ---------------------------------------------------------------------------------------
def test_the_stats_line_reports_load_and_throughput_while_there_is_activity(shipped_runner, caplog):
    caplog.set_level(logging.DEBUG, logger="grok_runner.server.stats")

    def stats():
        return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "grok_runner.server.stats"]

    with served(shipped_runner, stats_interval=0.2) as (_, live):
        threads = [threading.Thread(target=completion, args=(live,), kwargs={"headers": {}, "max_tokens": 24})
                   for _ in range(3)]  # three requests for one slot: one runs, two wait
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        def idle_lines():  # lines after the last one at info (0: none at info yet)
            levels = [level for level, _ in stats()]
            return levels[::-1].index(logging.INFO) if logging.INFO in levels else 0
        wait_for(lambda: idle_lines() >= 3, lambda: f"no activity, or no idle lines after it: {stats()}")
    parsed = [(level, STATS.fullmatch(text)) for level, text in stats()]
    assert all(match for _, match in parsed), stats()
    numbers = [(level, [float(x) for x in match.groups()]) for level, match in parsed]
    active = [n for level, n in numbers if level == logging.INFO]
    assert any(n[0] > 0 for n in active) and any(n[1] > 0 for n in active), stats()  # prompt, generation tokens/s
    assert all(n[6] == shipped_runner.num_slots and n[5] == n[2] <= n[6] for _, n in numbers), stats()
    # one stretch of lines at info, from the first request to the interval after the last token;
    # at debug before it and after it, when there is nothing to report
    info = [i for i, (level, _) in enumerate(numbers) if level == logging.INFO]
    assert info == list(range(info[0], info[-1] + 1)), stats()
    assert all(n[:5] == [0.0] * 5 for _, n in numbers[info[-1] + 1:]), stats()


def test_the_stats_line_by_hand():
    """Throughputs over the interval, KV use and the prefix cache's, with numbers set by hand."""

    class Runner:
        num_slots, counts, load = 4, (0, 0), (2, 1, 300, 1000)

        def prefix_cache_usage(self):  # blocks the prefix cache holds, blocks in its pool
            return 10, 64

        def usage(self):
            return self.load

        def prefix_cache_counts(self):
            return self.counts

    metrics, runner, now = Metrics(MODEL), Runner(), [100.0]
    line = StatsLine(metrics, runner, clock=lambda: now[0])
    metrics.prompt_tokens.inc(300)
    metrics.generation_tokens.inc(50)
    runner.counts, now[0] = (200, 50), 104.0  # 200 prompt tokens looked up, 50 found
    assert line.line() == (logging.INFO, "Avg prompt throughput: 75.0 tokens/s, Avg generation throughput: 12.5 "
                           "tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 30.0% (2/4 slots), Prefix "
                           "cache: 10/64 blocks, 25.0% hit rate")
    runner.load, now[0] = (0, 0, 0, 1000), 106.0  # idle, after an active interval: still INFO, as vLLM
    assert line.line() == (logging.INFO, "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 "
                           "tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0% (0/4 slots), Prefix "
                           "cache: 10/64 blocks")
    now[0] = 108.0
    assert line.line()[0] == logging.DEBUG


# ---- CORS ---------------------------------------------------------------------------------------------
def preflight(live, origin: str, path: str = "/v1/chat/completions"):
    return httpx.options(live.url + path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cross_origin_access_is_off_by_default(shipped_runner):
    with served(shipped_runner, api_key=KEY) as (_, live):
        r = preflight(live, PAGE_ORIGIN)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers  # the browser refuses
        for r in (completion(live, headers={**AUTH, "Origin": PAGE_ORIGIN}),
                  httpx.get(live.url + "/v1/models", headers={**AUTH, "Origin": PAGE_ORIGIN})):
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cross_origin_access_for_the_allowed_origins(shipped_runner, monkeypatch):
    with served(shipped_runner, api_key=KEY, allowed_origins=[PAGE_ORIGIN, "http://localhost:3000"]) as (server, live):
        r = preflight(live, PAGE_ORIGIN)  # without the key: a browser sends none with a preflight
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE_ORIGIN, r.headers
        assert {"GET", "POST"} <= set(r.headers["access-control-allow-methods"].replace(" ", "").split(","))
        assert {"authorization", "content-type"} <= set(
            r.headers["access-control-allow-headers"].lower().replace(" ", "").split(","))
        assert r.headers["access-control-max-age"] == "600"
        origin = {"Origin": PAGE_ORIGIN}
        answers = {
            "whole": completion(live, headers={**AUTH, **origin}),
            "streamed": completion(live, stream=True, headers={**AUTH, **origin}),
            "401": completion(live, headers=origin),
            "404": httpx.get(live.url + "/no/such/path", headers=origin),
            "503": None,
        }
        server.draining = True  # refusing new requests, as while shutting down
        answers["503"] = completion(live, headers={**AUTH, **origin})
        server.draining = False

        def bug(messages):
            raise RuntimeError("a bug")
        monkeypatch.setattr(server, "_render", bug)
        answers["500"] = httpx.post(live.url + "/tokenize", headers={**AUTH, **origin},
                                    json={"messages": [{"role": "user", "content": "Hi"}]})
        assert [answers[k].status_code for k in ("whole", "streamed", "401", "404", "503", "500")] == [
            200, 200, 401, 404, 503, 500]
        assert answers["streamed"].text.endswith("data: [DONE]\n\n")
        for name, r in answers.items():
            assert r.headers.get("access-control-allow-origin") == PAGE_ORIGIN, (name, r.headers)
            assert "origin" in r.headers["vary"].lower(), (name, r.headers)
        assert "retry-after" in answers["503"].headers["access-control-expose-headers"].lower()
        # another origin: no CORS headers (its browser refuses the answer), the preflight refused
        evil = "http://evil.example"
        r = preflight(live, evil)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = completion(live, headers={**AUTH, "Origin": evil})
        assert "access-control-allow-origin" not in r.headers
    with served(shipped_runner, api_key=KEY, allowed_origins=["*"]) as (_, live):
        assert preflight(live, "http://anywhere.example").headers["access-control-allow-origin"] == "*"
        r = completion(live, stream=True, headers={**AUTH, "Origin": "http://anywhere.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


# ---- CORS in a browser --------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# a page of another origin (another port) calling the API as a web app would: a streamed chat
# completion with the key in a header (so the browser sends a preflight first)
CALL = """async ([url, key]) => {
    try {
        const r = await fetch(url + "/v1/chat/completions", {method: "POST", headers: {
            "Authorization": "Bearer " + key, "Content-Type": "application/json"}, body: JSON.stringify({
            model: "austen-moe", messages: [{role: "user", content: "Hi"}], max_tokens: 4, stream: true})});
        return {status: r.status, text: await r.text()};
    } catch (e) {
        return {error: String(e)};
    }
}"""


class PageServer:
    """A blank page on another port of 127.0.0.1: another origin than the API's."""

    def __init__(self):
        class Page(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = b"<!doctype html><title>another origin</title>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_page_of_another_origin_calls_the_api_only_when_its_origin_is_allowed(shipped_runner):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs the playwright package "
                                   "(pip install -e '.[test]')")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"the browser test needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    page_server = PageServer()
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.goto(page_server.origin + "/")
            results = {}
            for name, origins in [("allowed", [page_server.origin]), ("off", None),
                                  ("another allowed", ["http://localhost:1"])]:
                with served(shipped_runner, api_key=KEY, allowed_origins=origins) as (_, live):
                    results[name] = page.evaluate(CALL, [live.url, KEY])
            browser.close()
    finally:
        page_server.stop()
    allowed = results["allowed"]
    assert allowed.get("status") == 200 and allowed["text"].endswith("data: [DONE]\n\n"), allowed
    for name in ("off", "another allowed"):  # the browser refuses: fetch() fails
        assert "Failed to fetch" in results[name].get("error", ""), (name, results[name])
