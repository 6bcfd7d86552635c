"""The chat page at / of ``python run.py serve``, in a real headless browser: Debian's ``chromium``
driven by Playwright (the system browser, no ``playwright install``), against the shipped model
served as a separate process on 127.0.0.1. The page loads nothing from any other host, streams a
reply with its speed, stops a generation (and the server frees the slot), and shows errors as
text. Skipped where the ``playwright`` package or /usr/bin/chromium is absent."""

import os
import re
import signal
import time

import httpx
import pytest

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    pytest.skip("the chat page's browser test needs the playwright package (pip install -e '.[test]')",
                allow_module_level=True)

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"the chat page's browser test needs Debian's chromium at {CHROMIUM} (apt-get install chromium)",
                allow_module_level=True)

from tests.test_http import AUTH, KEY, ServeProcess  # noqa: E402 (after the skips)

# Nothing in the background (updates, sync, field trials): the only requests are the page's own.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MODEL = "austen-moe"
WAIT_MS = 30_000  # any one wait of the page; a reply of the shipped model takes about a second


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    process = ServeProcess(tmp_path_factory.mktemp("chat-serve"), "--shutdown-timeout", "2")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),  # empty: no state from any earlier run
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            bypass_csp=True)  # the page's CSP forbids eval, which Playwright's wait_for_function uses
        context.set_default_timeout(WAIT_MS)
        yield context
        context.close()


class ChatPage:
    """A fresh tab on the page, every request it makes recorded."""

    def __init__(self, browser, serve, key: str = KEY):
        self.page = browser.new_page()
        self.requests: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(serve.url + "/")
        self.page.fill("#api_key", key)
        self.page.dispatch_event("#api_key", "change")  # as leaving the field does: kept, models asked again

    def text(self, selector: str) -> str:
        return self.page.text_content(selector) or ""

    def wait_for_text(self, selector: str, needle: str) -> None:
        self.page.wait_for_function("([s, n]) => (document.querySelector(s).textContent || '').includes(n)",
                                    arg=[selector, needle])

    def send(self, prompt: str, **fields) -> None:
        for name, value in fields.items():
            self.page.fill(f"#{name}", str(value))
        self.page.fill("#prompt", prompt)
        self.page.press("#prompt", "Enter")

    def replies(self) -> list[str]:
        return self.page.locator("#messages .msg.assistant .content").all_text_contents()


@pytest.fixture
def chat(browser, serve):
    page = ChatPage(browser, serve)
    yield page
    page.page.close()


def _metric(serve, name: str, labels: str = "") -> float:
    """The value of metric ``name`` whose labels include ``labels``; 0 if it has no such series yet."""
    for line in httpx.get(serve.url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_page_streams_a_reply_and_loads_nothing_from_elsewhere(chat, serve, browser):
    chat.wait_for_text("#model", MODEL)
    messages = [{"role": "user", "content": "Tell me about Mr Darcy."}]
    chat.send(messages[0]["content"], temperature=0, top_p=0.95, max_tokens=40)
    chat.wait_for_text("#stats", "finish")
    stats = chat.text("#stats")
    assert re.search(r"\d+\.\d tokens/s", stats) and re.search(r"TTFT \d+\.\d\d s", stats), stats
    assert "40 tokens" in stats and "finish: length" in stats, stats  # the usage chunk's count
    # the streamed pieces make the reply the server gives at once for the same settings (greedy)
    whole = httpx.post(serve.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                       json={"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 40}).json()
    [reply] = chat.replies()
    assert reply == whole["choices"][0]["message"]["content"].lstrip() and len(reply.split()) >= 5, (reply, whole)
    assert chat.page.locator("#messages .msg.user .content").all_text_contents() == ["Tell me about Mr Darcy."]
    assert chat.text("#error") == ""
    assert chat.page.input_value("#prompt") == ""
    # a second turn sends the whole conversation: both turns shown, the first reply unchanged
    chat.send("And Elizabeth?", max_tokens=8)
    chat.page.wait_for_function("document.querySelectorAll('#messages .msg.assistant').length == 2")
    chat.wait_for_text("#stats", "finish")
    assert chat.replies()[0] == reply and chat.replies()[1], chat.replies()
    # every request went to the server itself: the page, /v1/models, the chat completions; and the
    # server tells a browser to allow nothing else
    csp = httpx.get(serve.url + "/", timeout=10).headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp, csp
    origin = serve.url + "/"
    assert chat.requests and all(url.startswith(origin) for url in chat.requests), chat.requests
    assert sum(url.endswith("/v1/chat/completions") for url in chat.requests) == 2, chat.requests
    # the key is remembered: a new tab sends it without being told
    again = browser.new_page()
    again.goto(serve.url + "/")
    assert again.input_value("#api_key") == KEY
    again.wait_for_function(f"document.getElementById('model').textContent.includes('{MODEL}')")
    again.close()


def test_stop_cancels_the_generation_and_the_server_frees_its_slot(chat, serve):
    chat.wait_for_text("#model", MODEL)
    aborted = _metric(serve, "vllm:request_success_total", 'finished_reason="abort"')
    chat.send("Write a long letter to your sister.", temperature=0, max_tokens=200)  # 200 tokens at temperature 0
    chat.page.wait_for_function("(document.querySelector('#messages .msg.assistant .content') || {}).textContent")
    # The shipped model writes 200 tokens in about a second: the server is frozen while Stop is
    # clicked, so the click surely lands mid-generation; it sees the closed connection on waking.
    os.kill(serve.proc.pid, signal.SIGSTOP)
    try:
        assert chat.page.is_enabled("#stop") and not chat.page.is_enabled("#send")
        chat.page.click("#stop")
        chat.wait_for_text("#stats", "stopped")
    finally:
        os.kill(serve.proc.pid, signal.SIGCONT)
    assert not chat.page.is_enabled("#stop") and chat.page.is_enabled("#send")
    assert "finish" not in chat.text("#stats")
    assert "stopped" in chat.text("#messages .msg.assistant")
    assert chat.text("#error") == ""
    deadline = time.time() + 10
    while _metric(serve, "vllm:num_requests_running") != 0.0 or \
            _metric(serve, "vllm:request_success_total", 'finished_reason="abort"') != aborted + 1:
        assert time.time() < deadline, "the stopped request still holds its slot, or did not end as aborted"
        time.sleep(0.1)
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0' in httpx.get(serve.url + "/metrics").text
    [reply] = chat.replies()
    assert 0 < len(reply.split()) < 150, reply  # cut short of its 200 tokens


def test_errors_show_as_text(chat, serve):
    chat.wait_for_text("#model", MODEL)
    # a 400 from the server: its message shown, the message taken back to send again
    chat.send("Hi", max_tokens=1000)
    chat.wait_for_text("#error", "more than sequence_len (256)")
    assert chat.text("#error").startswith("400: max_tokens:"), chat.text("#error")
    assert chat.page.input_value("#prompt") == "Hi" and chat.replies() == []
    # a network failure
    chat.page.context.set_offline(True)
    try:
        chat.send("Hi", max_tokens=5)
        chat.wait_for_text("#error", "network error")
    finally:
        chat.page.context.set_offline(False)
    # an error event in the middle of a stream (the server's shape when it shuts down mid-reply),
    # after a piece that looks like markup: shown as text, never parsed
    sse = ('data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "<b>Half</b> a"}}]}\n\n'
           'data: {"choices": [{"index": 0, "delta": {"content": "<img src=x onerror=alert(1)>"}}]}\n\n'
           'data: {"error": {"message": "the server is shutting down", "type": "service_unavailable"}}\n\n'
           "data: [DONE]\n\n")
    chat.page.route("**/v1/chat/completions",
                    lambda route: route.fulfill(status=200, content_type="text/event-stream", body=sse))
    chat.send("Hi", max_tokens=5)
    chat.wait_for_text("#error", "the server is shutting down")
    assert chat.replies() == ["<b>Half</b> a<img src=x onerror=alert(1)>"]  # what came before the error stays
    assert chat.page.locator("#messages b, #messages img").count() == 0
    chat.page.unroute("**/v1/chat/completions")
    # a wrong key: the server's 401 message, from /v1/models and from sending
    chat.page.fill("#api_key", "not-the-key")
    chat.page.dispatch_event("#api_key", "change")
    chat.wait_for_text("#error", "401: missing or wrong API key")
    chat.page.evaluate("document.getElementById('error').textContent = ''")
    chat.send("Hi", max_tokens=5)
    chat.wait_for_text("#error", "401: missing or wrong API key")
    assert len(chat.replies()) == 1  # nothing added
