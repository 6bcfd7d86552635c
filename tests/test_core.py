"""The engine core and its clients: many streams, threads and ``generate`` calls on one runner,
each getting exactly its own requests' tokens; failures contained to their request; every bad
request a ValueError naming its field before anything runs."""

import dataclasses
import threading

import numpy as np
import pytest

from runner import Request, sample_from_model
from tokenization import IncrementalDetokenizer
from tests.test_runner import CONFIG, greedy_reference, params, prompt_ids, runner  # noqa: F401 (fixtures)


def solo(runner, request):
    """What ``request`` generates alone on the runner (same settings and seed, its own id)."""
    done = runner.complete(dataclasses.replace(request, request_id=None))
    assert done.finish_reason in ("length", "eos", "stop"), done
    return done.token_ids


def mixed(i, n=12):
    """Request i of a mixed batch: greedy or seeded sampling, various lengths and settings."""
    if i % 2 == 0:
        return Request(prompt_ids(200 + i, 3 + i % 7), temperature=0.0, max_len=n)
    return Request(prompt_ids(200 + i, 4 + i % 5), temperature=0.9, nucleus_p=0.9, top_k=20 * (i % 3),
                   rng_seed=i, max_len=n)


def tokens(events):
    return [e.token_id for e in events if e.token_id is not None]


def test_two_live_streams_each_get_their_own_tokens(runner):
    a_requests, b_requests = [mixed(i) for i in range(3)], [mixed(i) for i in range(3, 6)]
    a, b = runner.run(a_requests), runner.run(b_requests)
    got = {}
    streams = [a, b]
    while streams:  # alternate between the two streams, event by event
        for s in list(streams):
            event = next(s, None)
            if event is None:
                streams.remove(s)
            else:
                assert event.request in (a_requests if s is a else b_requests)
                got.setdefault(event.request_id, []).append(event)
    for r in a_requests + b_requests:
        assert tokens(got[r.request_id]) == solo(runner, r), r
        assert got[r.request_id][-1].finish_reason == "length"


def test_generate_during_a_stream_leaves_the_stream_whole(runner):
    stream_requests = [Request(prompt_ids(300 + i, 5), temperature=0.0, max_len=40) for i in range(2)]
    stream = runner.run(stream_requests)
    first = [next(stream) for _ in range(3)]
    done = runner.generate([mixed(10), mixed(11)])
    assert [c.token_ids for c in done] == [solo(runner, mixed(10)), solo(runner, mixed(11))]
    events = first + list(stream)
    for r in stream_requests:
        mine = [e for e in events if e.request is r]
        assert len(tokens(mine)) == 40 and tokens(mine) == solo(runner, r)


def test_sample_from_model_swallows_no_other_requests_events(runner):
    gen = runner.run()
    assert next(gen) is None  # the reference's protocol: prime, then send
    other = Request(prompt_ids(400, 6), temperature=0.0, max_len=40)
    first = gen.send(other)
    text = sample_from_model(gen, "the letter", max_len=6, temperature=0.01)
    assert text == sample_from_model(gen, "the letter", max_len=6, temperature=0.01)
    events = [first] + list(iter(lambda: next(gen), None))
    assert all(e.request is other for e in events)
    assert len(tokens(events)) == 40 and tokens(events) == solo(runner, other)


@pytest.mark.parametrize("background", [False, True])
def test_three_client_threads_get_their_solo_outputs(runner, background):
    want = {i: solo(runner, mixed(i, 10)) for i in range(9)}
    got, errors = {}, []

    def stream_client(k):
        try:
            for event in runner.run([mixed(i, 10) for i in range(3 * k, 3 * k + 3)]):
                got.setdefault((event.request.prompt[0], event.request.max_len, k), []).append(event)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def generate_client():
        try:
            for i, c in zip(range(6, 9), runner.generate([mixed(i, 10) for i in range(6, 9)])):
                got[("generate", i)] = c.token_ids
        except Exception as e:  # pragma: no cover
            errors.append(e)

    if background:
        runner.engine.start()
    try:
        threads = [threading.Thread(target=stream_client, args=(k,)) for k in (0, 1)]
        threads.append(threading.Thread(target=generate_client))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a client hung"
    finally:
        runner.engine.stop()
    assert not errors, errors
    for k in (0, 1):
        for i in range(3 * k, 3 * k + 3):
            r = mixed(i, 10)
            assert tokens(got[(r.prompt[0], 10, k)]) == want[i], i
    for i in range(6, 9):
        assert got[("generate", i)] == want[i], i
    assert runner.engine.idle()


def test_a_request_failing_while_served_ends_alone(runner, monkeypatch):
    requests = [mixed(i, 16) for i in range(4)]
    want = {r.request_id: solo(runner, r) for r in requests}
    bad = requests[1]
    init, add = IncrementalDetokenizer.__init__, IncrementalDetokenizer.add
    calls = {"n": 0}

    def tagging_init(self, tokenizer, prompt_ids, *args, **kwargs):
        init(self, tokenizer, prompt_ids, *args, **kwargs)
        self.failing = list(prompt_ids) == list(bad.prompt)

    def failing_add(self, token):
        if self.failing:
            calls["n"] += 1
            if calls["n"] == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer failure (test)")
        return add(self, token)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", tagging_init)
    monkeypatch.setattr(IncrementalDetokenizer, "add", failing_add)
    events = {}
    for event in runner.run(requests):
        events.setdefault(event.request_id, []).append(event)
    last = events[bad.request_id][-1]
    assert last.finish_reason == "error" and "detokenizer failure" in last.error and last.token_id is None
    assert len(tokens(events[bad.request_id])) == 2
    for r in requests:
        if r is not bad:
            assert tokens(events[r.request_id]) == want[r.request_id]
    monkeypatch.undo()
    assert runner.engine.idle()
    # the failed request's slot is free and clean: the same request now runs to its end
    assert runner.complete(dataclasses.replace(bad, request_id=None)).token_ids == want[bad.request_id]


def test_duplicate_request_ids_are_refused(runner):
    with pytest.raises(ValueError, match="request_id.*must differ"):
        runner.generate([Request([5, 6], request_id="same", max_len=3), Request([7, 8], request_id="same", max_len=3)])
    stream = runner.run()
    stream.submit(Request([5, 6, 7], request_id="taken", max_len=30, temperature=0.0))
    with pytest.raises(ValueError, match="'taken' is already in use"):
        stream.submit(Request([9], request_id="taken", max_len=3))
    with pytest.raises(ValueError, match="'taken' is already in use"):
        runner.generate([Request([9], request_id="taken", max_len=3)])
    events = list(iter(lambda: next(stream), None))
    assert len(tokens(events)) == 30 and all(e.request_id == "taken" for e in events)
    assert runner.complete(Request([9], request_id="taken", max_len=3)).finish_reason == "length"  # free again


def test_a_request_cannot_change_after_it_is_checked():
    r = Request([1, 2], temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(r, temperature=float("nan"))


def test_values_that_are_accepted_as_they_should_be(runner):
    r = Request(np.array([5, 6, 7], np.int64), stop_token_ids=None, top_k=np.int32(5), max_len=np.int64(4),
                rng_seed=np.uint32(7), temperature=np.float32(0.5))
    assert r.prompt == [5, 6, 7] and r.stop_token_ids == () and type(r.top_k) is int and type(r.max_len) is int
    assert Request([np.int16(3)], stop_token_ids=np.array([4, 5])).stop_token_ids == (4, 5)
    assert runner.complete(r).finish_reason in ("length", "eos")


BAD_REQUESTS = [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=np.int64(5)), "prompt"),  # a numpy scalar
    (dict(prompt=np.ones((2, 2), np.int32)), "prompt"),
    (dict(prompt="a\ud800b"), "prompt"),  # a lone surrogate: no UTF-8 for it
    (dict(prompt=[1, 2.5]), "prompt"),
    (dict(prompt=[1, -1]), "prompt"),
    (dict(prompt=[2**31]), "prompt"),
    (dict(prompt=12), "prompt"),
    (dict(prompt=b"bytes"), "prompt"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(nucleus_p=0.0), "nucleus_p"),
    (dict(nucleus_p=1.5), "nucleus_p"),
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(max_len=0), "max_len"),
    (dict(max_len=2**31), "max_len"),
    (dict(max_len=True), "max_len"),
    (dict(rng_seed=-(2**63) - 1), "rng_seed"),
    (dict(rng_seed=2**64), "rng_seed"),
    (dict(stop_token_ids="13"), "stop_token_ids"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(stop_token_ids=7), "stop_token_ids"),
    (dict(request_id=3), "request_id"),
    (dict(request_id=""), "request_id"),
]


@pytest.mark.parametrize("fields, name", BAD_REQUESTS)
def test_every_bad_field_is_a_value_error_naming_it(fields, name):
    kwargs = {"prompt": [5, 6], **fields}
    with pytest.raises(ValueError, match=f"Request.{name}"):
        Request(**kwargs)


@pytest.mark.parametrize("fields, name", [
    (dict(prompt=[CONFIG.vocab_size]), "prompt"),
    (dict(stop_token_ids=[CONFIG.vocab_size + 5]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(10, 20))), "stop_token_ids"),
    (dict(max_len=CONFIG.sequence_len), "max_len"),
])
def test_what_depends_on_the_model_is_refused_at_submit(runner, fields, name):
    stream = runner.run()
    with pytest.raises(ValueError, match=f"Request.{name}"):
        stream.submit(Request(**{"prompt": [5, 6], **fields}))
    assert next(stream) is None and runner.engine.idle()  # nothing was queued


def test_a_request_failing_at_admission_ends_alone(runner, monkeypatch):
    import runner.engine as core

    requests = [mixed(i, 8) for i in range(3)]
    want = {r.request_id: solo(runner, r) for r in requests}
    real = core.prefill_row

    def failing(batch, i, row, eos):
        if row.sequence.request is requests[0]:
            raise OverflowError("a host-side bug (test)")
        return real(batch, i, row, eos)

    monkeypatch.setattr(core, "prefill_row", failing)
    events = {}
    for event in runner.run(requests):
        events.setdefault(event.request_id, []).append(event)
    assert [(e.finish_reason, e.error) for e in events[requests[0].request_id]] == [
        ("error", "OverflowError: a host-side bug (test)")]
    for r in requests[1:]:
        assert tokens(events[r.request_id]) == want[r.request_id]


# ---- rounds that mix prefill chunks and decoding (the scheduler's plans) ----------------------------
@pytest.fixture(scope="module")
def tight(params):  # noqa: F811
    """A runner whose round budget (24 tokens) cuts prompts into chunks of 8 and 16 and makes every
    round that admits a prompt also decode the running requests; it scores prompts."""
    from runner import InferenceRunner, ModelRunner

    r = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=4, pad_sizes=(8, 16, 32),
                        max_num_batched_tokens=24, score_prompts=True)
    r = r.initialize()
    return r


@pytest.fixture
def plans(monkeypatch):
    """Record the plan of every round of a runner: ``plans(runner)`` returns the live list."""
    def record(runner):
        seen, real = [], runner.engine.scheduler.schedule

        def schedule():
            plan = real()
            seen.append(plan)
            return plan

        monkeypatch.setattr(runner.engine.scheduler, "schedule", schedule)
        return seen
    return record


def long_mixed(i, n=10):
    """Prompts of 20-55 tokens (2-4 chunks under a 24-token budget), greedy or seeded."""
    length = 20 + (i * 13) % 36
    if i % 2 == 0:
        return Request(prompt_ids(500 + i, length), temperature=0.0, max_len=n)
    return Request(prompt_ids(500 + i, length), temperature=0.8, top_k=10 * (i % 3), rng_seed=i, max_len=n)


def test_chunked_prompts_beside_decoding_equal_their_solo_runs(tight, plans):
    """Bursts of arrivals while others decode: several prompts per prefill call, long prompts in
    chunks interleaved with decode rounds; every request gets the tokens it gets alone."""
    requests = [long_mixed(i) for i in range(6)] + [mixed(i, 10) for i in range(6)]
    want = {r.request_id: solo(tight, r) for r in requests}
    seen = plans(tight)
    stream = tight.run()
    for r in requests[:3]:
        stream.submit(r)
    got = {}
    for n, event in enumerate(iter(lambda: next(stream), None)):
        got.setdefault(event.request_id, []).append(event)
        if n == 2:  # a burst arrives while the first ones decode
            for r in requests[3:]:
                stream.submit(r)
    for r in requests:
        assert tokens(got[r.request_id]) == want[r.request_id], r
    mixed_rounds = [p for p in seen if p.prefill and p.decode and any(s not in [r.sequence for r in p.prefill]
                                                                       for s in p.decode)]
    assert mixed_rounds, "no round decoded beside a prefill"
    assert any(len(p.prefill) > 1 for p in seen), "no prefill call held several prompts"
    assert any(r.start > 0 for p in seen for r in p.prefill), "no prompt was chunked"
    assert all(sum(r.length for r in p.prefill) <= 24 or len(p.prefill) == 1 for p in seen)


def test_chunked_greedy_equals_a_full_forward(tight, greedy_reference):
    prompt = prompt_ids(77, 50)  # chunks 16 + 16 + 16 + 2
    assert tight.prefill_chunks(prompt) == [16, 16, 16, 2]
    assert tight.complete(Request(prompt, temperature=0.0, max_len=10)).token_ids == greedy_reference(prompt, 10)


def test_a_request_cancelled_mid_prefill_leaves_its_slot_clean(tight, plans):
    seen = plans(tight)
    long = Request(prompt_ids(600, 55), temperature=0.0, max_len=5)
    stream = tight.run()
    stream.submit(long)
    tight.engine.wait_for(lambda: len(seen) >= 1)  # one round: its first chunk only
    assert seen[0].prefill[0].sequence.request is long and not seen[0].prefill[0].sequence.decoding
    assert stream.cancel(long.request_id)
    events = list(iter(lambda: next(stream), None))
    assert [e.finish_reason for e in events] == ["cancelled"] and events[0].token_id is None
    after = [mixed(i, 8) for i in range(4)] + [long_mixed(1, 8)]  # one of them gets its slot
    outs = tight.generate(after)
    assert [c.token_ids for c in outs] == [solo(tight, r) for r in after]
    assert tight.engine.idle() and not tight.engine.scheduler.running()


def test_a_prompt_shared_by_several_requests_is_prefilled_once(runner, plans):
    """``n`` > 1 (and any requests arriving together with one prompt): one prefill, the others
    copy its KV and sample their first tokens from its logits, each with its own settings and
    seed: the tokens each gets alone."""
    prompt = prompt_ids(700, 20)
    requests = [Request(prompt, temperature=0.0, max_len=6)] + [
        Request(prompt, temperature=0.9, top_k=5 * s, rng_seed=s, max_len=6 + s) for s in range(3)]
    want = [solo(runner, r) for r in requests]
    seen = plans(runner)
    assert [c.token_ids for c in runner.generate(requests)] == want
    assert sum(len(p.prefill) for p in seen) == 1 and sum(len(p.forks) for p in seen) == 3


# ---- log-probabilities: computed when asked, prompt scores as part of the prefill -------------------
def log_softmax_of(runner, ids):
    """Each position's log-probabilities ``[len(ids), V]`` from one full forward, without a cache."""
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, : len(ids)] = ids
    logits = runner.logits(tokens, np.array([len(ids)], np.int32))[0, : len(ids)].astype(np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def test_prompt_logprobs_come_from_the_chunked_prefill_and_equal_a_full_forward(tight, plans):
    from runner.compile_count import compilations

    prompt = prompt_ids(880, 50)  # chunks 16 + 16 + 16 + 2, each its own scoring call
    plain = Request(prompt, temperature=0.0, max_len=6)
    scored = Request(prompt, temperature=0.0, max_len=6, logprobs=3, prompt_logprobs=4)
    want = solo(tight, plain)
    seen = plans(tight)
    compilations()
    before = compilations()
    events = list(tight.run([scored]))
    assert compilations() == before, "scoring compiled while serving"
    assert tokens(events) == want
    scoring = [p for p in seen if p.score]
    assert len(scoring) == 4 and all(len(p.prefill) == 1 for p in scoring)
    logp = log_softmax_of(tight, prompt + want)
    first = events[0].prompt_logprobs
    assert [e.token_id for e in first] == prompt and first[0].logprob is None and first[0].top_tokens == ()
    assert all(e.prompt_logprobs is None for e in events[1:])
    for i, e in enumerate(first[1:], start=1):  # token i given the tokens before it
        np.testing.assert_allclose(e.logprob, logp[i - 1, prompt[i]], atol=2e-4)
        ids = [t for t, _ in e.top_tokens]
        assert len(ids) == 4 and ids == list(np.argsort(-logp[i - 1], kind="stable")[:4])
        np.testing.assert_allclose([p for _, p in e.top_tokens], np.exp(logp[i - 1, ids]), rtol=2e-4, atol=1e-6)
    for k, e in enumerate(events):  # the generated tokens' own log-probabilities, 3 alternatives
        at = len(prompt) - 1 + k
        np.testing.assert_allclose(e.logprob, logp[at, e.token_id], atol=2e-4)
        assert [t for t, _ in e.top_tokens] == list(np.argsort(-logp[at], kind="stable")[:3])


def test_logprobs_are_reported_only_when_asked(tight, runner):
    events = list(tight.run([Request(prompt_ids(881, 5), temperature=0.7, rng_seed=3, max_len=4)]))
    assert all(e.logprob is None and e.top_tokens == () and e.prompt_logprobs is None for e in events)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        Request([1, 2], prompt_logprobs=21)
    with pytest.raises(ValueError, match="score_prompts=True"):  # its scoring variants were not compiled
        runner.prepare(Request([1, 2], max_len=4, prompt_logprobs=1))


def test_copies_of_a_scored_prompt_share_its_scores_and_prefill(tight, plans):
    prompt = prompt_ids(882, 20)
    requests = [Request(prompt, temperature=0.9, rng_seed=s, max_len=4, prompt_logprobs=2) for s in range(3)]
    requests.append(Request(prompt, temperature=0.0, max_len=4))  # no scores: it may copy a scored prefill
    want = [solo(tight, dataclasses.replace(r, prompt_logprobs=None)) for r in requests]
    seen = plans(tight)
    stream = tight.run(requests)
    events = {}
    for e in stream:
        events.setdefault(e.request_id, []).append(e)
    assert [tokens(events[r.request_id]) for r in requests] == want
    prefilled = {row.sequence.request.request_id for p in seen for row in p.prefill}
    assert len(prefilled) == 1 and sum(len(p.forks) for p in seen) == 3
    scores = [events[r.request_id][0].prompt_logprobs for r in requests]
    assert scores[0] == scores[1] == scores[2] and len(scores[0]) == 20 and scores[3] is None


def test_an_oversized_prompt_is_refused_without_being_encoded(runner, monkeypatch):
    """A text that cannot fit is refused from its normalized length (a 4 MB prompt cost 177 MB of
    ids before): the message says how many tokens it has at least. A long text that normalizes
    short (control characters the normalizer drops) is not refused; id lists are counted."""
    encode = runner.tokenizer.encode
    encoded = []
    monkeypatch.setattr(runner.tokenizer, "encode", lambda text: encoded.append(len(text)) or encode(text))
    with pytest.raises(ValueError, match=r"Request.prompt has at least \d+ tokens \(its 400000 characters once normalized, at most "
                                         r"\d+ a token\), more than sequence_len \(64\) leaves room for: at most 63"):
        runner.prepare(Request("the " * 100_000, max_len=1))
    assert encoded == []
    short = "the house " + "\x01" * 5000
    assert runner.tokenizer.sp.normalize(short).strip("\u2581") == "the\u2581house", "the normalizer drops them"
    assert runner.prepare(Request(short, max_len=1)) == encode(short) and encoded == [len(short)]
    with pytest.raises(ValueError, match=r"Request.prompt has 64 tokens, more than sequence_len \(64\)"):
        runner.prepare(Request([5] * 64, max_len=1))
    assert len(runner.prepare(Request([5] * 63, max_len=1))) == 63
