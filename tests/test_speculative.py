"""Prompt-lookup speculation's device rules against plain statements of them: the n-gram draft,
and verification that keeps plain decoding's distribution exactly (a statistical test on a tiny
vocabulary) and its greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.speculative import ngram_draft, verify
from tests.test_runner import params  # noqa: F401 (fixture)


def reference_draft(history, k, max_n=3, min_n=1):
    """The plain rule: the longest n whose last n tokens occurred earlier, and what followed their
    most recent earlier occurrence with k tokens after it, else their most recent one."""
    for n in range(max_n, min_n - 1, -1):
        if len(history) < n + 1:
            continue
        last = history[-n:]
        earlier = [j for j in range(len(history) - n - 1, -1, -1) if history[j: j + n] == last]
        if earlier:
            j = next((j for j in earlier if j + n + k <= len(history)), earlier[0])
            out = history[j + n: j + n + k]
            return out + [-1] * (k - len(out)), len(out)
    return [-1] * k, 0


def test_ngram_draft_matches_the_plain_rule():
    rng = np.random.default_rng(0)
    s, k = 24, 4
    rows = [[5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2], [9], [4, 4, 4, 4], [1, 2, 3, 4]]
    rows += [rng.integers(0, 4, rng.integers(1, s)).tolist() for _ in range(40)]  # small alphabet: many matches
    history = np.full((len(rows), s), 0, np.int32)
    for i, row in enumerate(rows):
        history[i, : len(row)] = row
        history[i, len(row):] = rng.integers(0, 4, s - len(row))  # past the length: never read
    lengths = np.array([len(r) for r in rows], np.int32)
    draft, count = jax.jit(ngram_draft, static_argnums=(2,))(history, lengths, k)
    for i, row in enumerate(rows):
        want, n = reference_draft(row, k)
        assert np.asarray(draft)[i].tolist() == want and int(count[i]) == n, (row, draft[i], count[i])
    assert np.asarray(draft)[0].tolist() == [8, 5, 6, 7]  # "5 6 7" came before, then "8 5 6 7"
    assert np.asarray(draft)[3].tolist() == [4, -1, -1, -1]  # "4 4 4" at 0 is followed by one token
    assert np.asarray(draft)[1].tolist() == [3, 1, 2, -1]  # "3 1 2" occurred at 2 only, 3 tokens before the end


def test_greedy_verification_keeps_the_argmax_prefix():
    probs = jnp.array([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]] * 3)  # [3, k + 1 = 3, V = 3]
    draft = jnp.array([[1, 0], [1, 2], [2, 0]])
    accepted, nxt = verify(probs, draft, jnp.array([2, 2, 2]), jnp.ones((3,), bool), jax.random.split(
        jax.random.PRNGKey(0), 3))
    assert accepted.tolist() == [2, 1, 0] and nxt.tolist() == [2, 0, 1]
    accepted, nxt = verify(probs[:1], draft[:1], jnp.array([1]), jnp.ones((1,), bool), jax.random.split(
        jax.random.PRNGKey(0), 1))
    assert accepted.tolist() == [1] and nxt.tolist() == [0]  # a one-token draft: then the argmax after it


def test_sampled_verification_keeps_the_target_distribution():
    """On a 4-token vocabulary with fixed targets for two positions: the first emitted token has
    distribution p0, and the second, given the first was the draft token, p1 (as without a draft)."""
    p = jnp.array([[0.1, 0.4, 0.3, 0.2], [0.25, 0.05, 0.5, 0.2], [0.7, 0.1, 0.1, 0.1]])
    n = 40000
    draft = jnp.tile(jnp.array([[1, 3]]), (n, 1))
    probs = jnp.tile(p[None], (n, 1, 1))
    accepted, nxt = jax.jit(verify)(probs, draft, jnp.full((n,), 2), jnp.zeros((n,), bool),
                                    jax.random.split(jax.random.PRNGKey(1), n))
    accepted, nxt = np.asarray(accepted), np.asarray(nxt)
    first = np.where(accepted >= 1, 1, nxt)  # the first token out of each call
    np.testing.assert_allclose(np.bincount(first, minlength=4) / n, p[0], atol=0.01)
    took = accepted >= 1
    second = np.where(accepted[took] >= 2, 3, nxt[took])
    np.testing.assert_allclose(np.bincount(second, minlength=4) / took.sum(), p[1], atol=0.015)
    both = accepted == 2  # after a fully kept draft the third token comes from p2
    np.testing.assert_allclose(np.bincount(nxt[both], minlength=4) / both.sum(), p[2], atol=0.03)
    assert 0.3 < took.mean() < 0.5  # the draft's first token is kept with p0(1) = 0.4


def test_no_draft_samples_the_first_position():
    p = jnp.array([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
    accepted, nxt = verify(p, jnp.array([[-1]]), jnp.array([0]), jnp.zeros((1,), bool),
                           jax.random.split(jax.random.PRNGKey(2), 1))
    assert accepted.tolist() == [0] and nxt.tolist() == [1]


# ---- the engine's speculative steps ------------------------------------------------------------
@pytest.fixture(scope="module")
def runners(params, test_tokenizer):
    """The tiny test model twice: plainly, and verifying up to 4 draft tokens a step (3 slots)."""
    from runner import InferenceRunner, ModelRunner
    from tests.test_runner import CONFIG

    def make(speculative):
        runner = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=3,
                                 pad_sizes=(16, 32), speculative=speculative, tokenizer_path=test_tokenizer)
        runner = runner.initialize(warmup=False)  # the variants the tests call, as they call them
        return runner

    return make(0), make(4)


REPEATING = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]  # a prompt its continuation may quote


from runner import Request  # noqa: E402


def _run(runner, requests):
    events = {}
    for event in runner.run(requests):
        events.setdefault(event.request_id, []).append(event)
    return {rid: ([e.token_id for e in evs if e.token_id is not None], evs[-1]) for rid, evs in events.items()}


def test_greedy_speculation_gives_plain_decodings_tokens_beside_plain_neighbours(runners):
    """Seven requests on three slots (slots reused), speculating greedy ones beside plain sampled
    ones: every request's tokens are those of the plain runner, and the speculating ones did
    draft and accept."""
    from runner import Request

    plain, spec = runners

    def requests():
        out = []
        for i in range(7):
            prompt = REPEATING[i:] + REPEATING[: i + 3]
            if i % 2 == 0:
                out.append(Request(prompt, temperature=0.0, max_len=30 + i, request_id=f"g{i}"))
            else:  # plain neighbours, sampled with their seeds, one with log-probabilities
                out.append(Request(prompt, temperature=0.9, nucleus_p=0.9, rng_seed=i, max_len=25,
                                   speculative=0, logprobs=2 if i == 3 else None, request_id=f"s{i}"))
        return out

    want, got = _run(plain, requests()), _run(spec, requests())
    assert set(want) == set(got)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        assert got[rid][1].finish_reason == want[rid][1].finish_reason
    drafted = [got[rid][1].speculation for rid in got if rid.startswith("g")]
    assert all(s is not None and s.tokens == len(got[rid][0]) - 1 for s, rid in zip(drafted, sorted(got)))
    assert sum(s.accepted for s in drafted) > 0 and sum(s.tokens for s in drafted) > sum(s.steps for s in drafted)
    assert all(got[rid][1].speculation is None for rid in got if rid.startswith("s"))  # not asked: none reported


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there(runners):
    from runner import Request

    plain, spec = runners
    base = _run(plain, [Request(REPEATING, temperature=0.0, max_len=40, request_id="base")])["base"][0]
    stop = base[len(base) // 2]  # a token the greedy continuation reaches half way
    for max_len in (40, 7):
        requests = [Request(REPEATING, temperature=0.0, max_len=max_len, stop_token_ids=[stop], request_id="r")]
        want, got = _run(plain, requests)["r"], _run(spec, [dataclass_copy(requests[0])])["r"]
        assert got[0] == want[0] and got[1].finish_reason == want[1].finish_reason
        assert len(got[0]) <= max_len


def dataclass_copy(request):
    import dataclasses

    return dataclasses.replace(request)


def test_sampled_speculation_is_reproducible_and_drafts(runners):
    from runner import Request

    _, spec = runners
    make = lambda: [Request(REPEATING, temperature=0.2, rng_seed=seed, max_len=40, ignore_eos=True, request_id=f"r{seed}")  # noqa: E731
                    for seed in range(4)]
    first, second = _run(spec, make()), _run(spec, make())
    assert first.keys() == second.keys() and len(first) == 4
    for rid in first:
        assert first[rid][0] == second[rid][0] and len(first[rid][0]) == 40
    assert sum(done[1].speculation.accepted for done in first.values()) > 0


def test_failing_drafts_back_off_then_probe_again(runners):
    """The adaptive draft length, on a model that always says token 0 and a history of 1s: a
    refused draft of 4 drops the row to no draft for PROBE_AFTER steps, then it drafts one token
    and grows by one with every fully accepted draft (now of 0s, which the model says)."""
    from types import SimpleNamespace

    from runner.speculative import PROBE_AFTER, speculate

    _, spec = runners
    engine, v = spec.engine.executor, spec.config.vocab_size
    state = engine.new_state()
    b, s = state.history.shape
    state = state.replace(
        history=jnp.full((b, s), -1, jnp.int32).at[0, :11].set(1), tokens=jnp.ones((b,), jnp.int32),
        memory=state.memory.replace(step=jnp.array([10, 0, 0], jnp.int32)), active=jnp.array([True, False, False]),
        remaining=jnp.full((b,), 100, jnp.int32), speculative=jnp.array([4, 0, 0], jnp.int32),
        draft_len=jnp.array([4, 0, 0], jnp.int32))

    def says_zero(variables, tokens, memory, lengths, last_only, kv_len):
        logits = jnp.zeros((*tokens.shape, v), jnp.float32).at[..., 0].set(10.0)
        return SimpleNamespace(logits=logits, memory=memory.replace(step=memory.step + lengths))

    step = jax.jit(lambda state: speculate(says_zero, engine.selection.backend, None, state, engine.no_mask, 64, 4))
    counts, kept, misses = [], [], []
    for _ in range(PROBE_AFTER + 4):
        state, out = step(state)
        counts.append(int(out.drafted[0]))
        kept.append(int(out.valid[:, 0].sum()))
        misses.append(int(state.misses[0]))
    assert counts == [4] + [0] * PROBE_AFTER + [1, 2, 3], counts
    assert misses == [1] * (PROBE_AFTER + 1) + [0] * 3  # one stall, forgotten once a draft is accepted
    assert kept == [1] * (PROBE_AFTER + 1) + [2, 3, 4]  # the refused draft still gives its corrected token
    assert int(state.memory.step[0]) == 10 + sum(kept) and state.history[0, 11].tolist() == 0


def test_stalls_in_a_row_double_the_wait(runners):
    """A row whose last tokens never occurred before (a history of distinct tokens, a model that
    says a new one each step) stalls at every probe: it waits 16, 32, 64, 128, 128 steps."""
    from types import SimpleNamespace

    from runner.speculative import MAX_DOUBLINGS, PROBE_AFTER, speculate

    _, spec = runners
    engine, v = spec.engine.executor, spec.config.vocab_size
    state = engine.new_state()
    b, s = state.history.shape
    state = state.replace(
        history=jnp.full((b, s), -1, jnp.int32).at[0, :3].set(jnp.arange(3)), tokens=jnp.full((b,), 2, jnp.int32),
        memory=state.memory.replace(step=jnp.array([2, 0, 0], jnp.int32)), active=jnp.array([True, False, False]),
        remaining=jnp.full((b,), 10**6, jnp.int32), speculative=jnp.array([4, 0, 0], jnp.int32),
        draft_len=jnp.array([4, 0, 0], jnp.int32))

    def says_next(variables, tokens, memory, lengths, last_only, kv_len):  # token t -> t + 1: never a repeat
        logits = jax.nn.one_hot((tokens + 1) % v, v) * 10.0
        return SimpleNamespace(logits=logits, memory=memory.replace(step=memory.step + lengths))

    step = jax.jit(lambda state: speculate(says_next, engine.selection.backend, None, state, engine.no_mask, s - 1, 4))
    waits, steps = [], 0
    while len(waits) < 5:
        before = int(state.misses[0])
        state, out = step(state)
        steps += 1
        assert int(out.valid[:, 0].sum()) == 1  # a token a step, drafting or not
        if int(state.misses[0]) > before:  # it stalled: the wait it starts
            waits.append(int(state.wait[0]))
        if int(state.memory.step[0]) >= s - 2:  # the history is full: start the row over, stalls kept
            state = state.replace(memory=state.memory.replace(step=jnp.array([2, 0, 0], jnp.int32)),
                                  history=jnp.full((b, s), -1, jnp.int32).at[0, :3].set(jnp.arange(3)))
    assert waits == [PROBE_AFTER << min(i, MAX_DOUBLINGS) for i in range(5)] == [16, 32, 64, 128, 128], waits
    assert steps == 5 + sum(waits[:4])  # each wait is sat out in plain steps, then one probe


def test_speculation_is_checked_before_anything_runs(runners):
    from runner import Request

    plain, spec = runners
    with pytest.raises(ValueError, match="Request.speculative must be None or an integer in \\[0, 16\\]"):
        Request([1, 2], speculative=17)
    with pytest.raises(ValueError, match="does not combine with repetition_penalty, min_tokens"):
        Request([1, 2], speculative=2, repetition_penalty=1.2, min_tokens=1)
    with pytest.raises(ValueError, match="this runner verifies at most 0 draft tokens"):
        plain.prepare(Request([1, 2], speculative=2, max_len=8))
    with pytest.raises(ValueError, match="at most 4 draft tokens"):
        spec.prepare(Request([1, 2], speculative=5, max_len=8))
    Request([1, 2], speculative=0, repetition_penalty=1.2)  # off: any rule goes
    # the runner's default never turns it on for a request with such a rule
    assert Request([1, 2], presence_penalty=0.5).speculates(4) == 0 and Request([1, 2]).speculates(4) == 4
    assert Request([1, 2], speculative=2).speculates(4) == 2


def test_a_penalised_request_on_a_speculating_runner_decodes_plainly(runners):
    plain, spec = runners
    make = lambda: [Request(REPEATING, temperature=0.0, max_len=30, repetition_penalty=1.3, request_id="p")]  # noqa: E731
    want, got = _run(plain, make())["p"], _run(spec, make())["p"]
    assert got[0] == want[0] and got[1].speculation is None


def test_served_speculation_reports_itself_in_the_usage_and_the_metrics(runners):
    """``speculative`` as a request field: the same text as the runner's, the request's drafts in
    its usage, and the counters in /metrics; a bad value is a 400 naming the field."""
    import httpx

    from server import Server
    from tests.test_server import LiveServer, _metric

    plain, spec = runners
    live = LiveServer(Server(spec, "tiny-spec"))
    try:
        body = {"model": "tiny-spec", "prompt": REPEATING, "max_tokens": 30, "temperature": 0}
        got = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        want = plain.complete(Request(REPEATING, temperature=0.0, max_len=30))
        assert got["choices"][0]["text"] == want.text
        usage = got["usage"]["speculative_decoding"]
        assert usage["decode_tokens"] == 29 and usage["draft_tokens"] > 0 and usage["tokens_per_step"] > 1
        assert usage["acceptance_rate"] == round(usage["accepted_tokens"] / usage["draft_tokens"], 4)
        off = httpx.post(live.url + "/v1/completions", json={**body, "speculative": 0}, timeout=60).json()
        assert off["choices"][0]["text"] == want.text and "speculative_decoding" not in off["usage"]
        assert _metric(live, "vllm:spec_decode_num_draft_tokens_total") == usage["draft_tokens"]
        assert _metric(live, "vllm:spec_decode_num_accepted_tokens_total") == usage["accepted_tokens"]
        assert _metric(live, "grok_runner:spec_decode_tokens_total") == 29
        bad = httpx.post(live.url + "/v1/completions", json={**body, "speculative": 9}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative", bad.text
        clash = httpx.post(live.url + "/v1/completions", json={**body, "speculative": 2, "presence_penalty": 1}, timeout=60)
        assert clash.status_code == 400 and "does not combine with presence_penalty" in clash.text
    finally:
        live.stop()
