"""vLLM's sampling extras (min_p, the repetition, frequency and presence penalties, min_tokens,
ignore_eos) and the 64-bit seeds: each rule on the device against a plain numpy statement of the
same rule, then through the runner against a host loop of full forwards, side by side with
requests that use none."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import XLA
from runner import Request
from runner.sampling import Constraints, SampleSettings, filter_logits, process_logits, unpack_mask
from runner.batches import seed_key
from tests.test_runner import CONFIG, collect, params, prompt_ids, runner, tokens_of  # noqa: F401 (fixtures)


def reference_rules(logits, rp, fp, pp, counts, seen, banned, allowed):
    """vLLM's order, one row at a time, in plain numpy."""
    out = logits.astype(np.float64).copy()
    for b in range(out.shape[0]):
        if allowed[b] is not None:
            out[b, ~allowed[b]] = -np.inf
        for t in banned[b]:
            if t >= 0:
                out[b, t] = -np.inf
        for t in range(out.shape[1]):
            if seen[b, t] or counts[b, t] > 0:
                out[b, t] = out[b, t] / rp[b] if out[b, t] > 0 else out[b, t] * rp[b]
            out[b, t] -= fp[b] * counts[b, t] + pp[b] * (counts[b, t] > 0)
    return out


def test_process_logits_matches_the_plain_rule():
    rng = np.random.default_rng(0)
    b, v = 4, 70  # a vocabulary that is not a multiple of 32
    logits = rng.normal(0, 3, (b, v)).astype(np.float32)
    counts = rng.integers(0, 3, (b, v)) * (rng.random((b, v)) < 0.2)
    seen = rng.random((b, v)) < 0.2
    rp, fp, pp = np.array([1.0, 1.3, 0.7, 2.0]), np.array([0.0, 0.5, -0.4, 1.5]), np.array([0.0, -1.0, 0.3, 2.0])
    banned = np.array([[-1, -1], [3, 5], [-1, 9], [-1, -1]])
    allowed = [None, None, rng.random(v) < 0.5, rng.random(v) < 0.1]
    words = np.zeros((b, 3), np.uint32)
    for row, mask in enumerate(allowed):
        if mask is not None:
            for t in np.flatnonzero(mask):
                words[row, t // 32] |= np.uint32(1 << (t % 32))
    settings = SampleSettings.host(b, repetition_penalty=0, frequency_penalty=0, presence_penalty=0)
    settings = settings.replace(repetition_penalty=rp.astype(np.float32), frequency_penalty=fp.astype(np.float32),
                                presence_penalty=pp.astype(np.float32))
    rules = Constraints(counts=counts.astype(np.int32), seen=seen, banned=banned.astype(np.int32), mask=words,
                        masked=np.array([m is not None for m in allowed]))
    got = np.asarray(jax.jit(process_logits)(logits, settings, rules))
    want = reference_rules(logits, rp, fp, pp, counts, seen, banned, allowed)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(unpack_mask(words, v))[2:], np.stack(allowed[2:]))


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (3, 50)).astype(np.float32)
    min_p = np.array([0.0, 0.05, 0.5], np.float32)
    temperature = np.array([1.0, 0.7, 1.5], np.float32)
    settings = SampleSettings.host(3, nucleus_p=1.0).replace(min_p=min_p, temperature=temperature)
    got = np.asarray(jax.jit(filter_logits, static_argnums=2)(logits, settings, XLA()))
    for row in range(3):
        scaled = logits[row].astype(np.float64) / temperature[row]
        probs = np.exp(scaled - scaled.max())
        keep = probs >= min_p[row] * probs.max() * (1 - 1e-6)
        np.testing.assert_array_equal(np.isfinite(got[row]), keep)


def test_seeds_are_64_bit_and_distinct():
    assert seed_key(5).tolist() == np.asarray(jax.random.PRNGKey(5)).tolist()  # unchanged below 2**32
    seeds = [0, 1, -1, -2, 2**32, 2**32 + 1, 2**63 - 1, -(2**63), 2**63 + 5, 12345678901234]
    keys = {tuple(seed_key(s).tolist()) for s in seeds}
    assert len(keys) == len(seeds)
    assert seed_key(-1).tolist() == seed_key(2**64 - 1).tolist()  # the same 64 bits, by design


def host_loop(runner, prompt, n, rp=1.0, fp=0.0, pp=0.0, banned_until=0, stop=()):
    """Greedy decoding by full forwards, each step's logits under the rules in numpy."""
    engine = runner.engine.executor
    seq, out = list(prompt), []
    counts = np.zeros(CONFIG.vocab_size, np.int64)
    seen = np.zeros(CONFIG.vocab_size, bool)
    seen[list(prompt)] = True
    for i in range(n):
        padded = np.zeros((1, CONFIG.sequence_len), np.int32)
        padded[0, : len(seq)] = seq
        logits = np.asarray(engine.forward(engine.params, padded, np.array([len(seq)])))[0, len(seq) - 1]
        banned = np.array([list(stop) if i < banned_until else []], np.int64).reshape(1, -1)
        rules = reference_rules(logits[None], [rp], [fp], [pp], counts[None], seen[None], banned, [None])
        token = int(rules[0].argmax())
        out.append(token)
        seq.append(token)
        counts[token] += 1
        if token in stop and i >= banned_until:
            break
    return out


def test_penalties_through_the_runner_equal_the_host_rule_beside_plain_requests(runner):
    prompts = [prompt_ids(700 + i, 6 + 3 * i) for i in range(4)]
    prompts[0] = prompt_ids(700, 40)  # prefilled in two chunks (32 + 8): both mark the prompt's tokens
    cases = [dict(repetition_penalty=1.6), dict(frequency_penalty=1.2), dict(presence_penalty=-1.5),
             dict(repetition_penalty=0.8, frequency_penalty=0.4, presence_penalty=0.6)]
    n = 12
    requests = [Request(p, temperature=0.0, max_len=n, **case) for p, case in zip(prompts, cases)]
    plain = [Request(prompt_ids(800 + i, 7), temperature=0.9, rng_seed=i, max_len=n) for i in range(2)]
    alone = {r.request_id: tokens_of(e) for r, e in zip(plain, collect(runner.run(plain)).values())}
    events = collect(runner.run(requests[:2] + plain + requests[2:]))
    for r, p, case in zip(requests, prompts, cases):
        want = host_loop(runner, p, n, case.get("repetition_penalty", 1.0), case.get("frequency_penalty", 0.0),
                         case.get("presence_penalty", 0.0))
        assert tokens_of(events[r.request_id]) == want, case
    for r in plain:  # their neighbours' rules do not reach them
        assert tokens_of(events[r.request_id]) == alone[r.request_id]
    # and the penalties change something: a plain greedy run differs for at least one case
    assert any(host_loop(runner, p, n) != tokens_of(events[r.request_id]) for r, p in zip(requests, prompts))


def test_min_tokens_and_ignore_eos(runner):
    prompt = prompt_ids(901, 9)
    free = host_loop(runner, prompt, 10)
    stop = free[2]  # a token the plain run generates third: a stop id there ends it at 3 tokens
    ended = runner.complete(Request(prompt, temperature=0.0, max_len=10, stop_token_ids=[stop]))
    assert ended.token_ids == free[:3] and ended.finish_reason == "stop"
    held = runner.complete(Request(prompt, temperature=0.0, max_len=10, stop_token_ids=[stop], min_tokens=6))
    want = host_loop(runner, prompt, 10, banned_until=6, stop=(CONFIG.eos_token, stop))
    assert held.token_ids == want and len(held.token_ids) >= 6
    assert all(t not in (stop, CONFIG.eos_token) for t in held.token_ids[:6])
    # ignore_eos: EOS is an ordinary token (the stop rule's list loses it); the budget ends the request
    request = Request(prompt, temperature=0.0, max_len=5, ignore_eos=True)
    from runner.batches import stop_ids
    from runner.outputs import finish_reason
    assert CONFIG.eos_token not in stop_ids(request, CONFIG.eos_token)
    assert finish_reason(CONFIG.eos_token, request, CONFIG.eos_token) == "length"
    done = runner.complete(request)
    assert len(done.token_ids) == 5 and done.finish_reason == "length"


def test_min_p_one_is_greedy_and_sampling_settings_mix(runner):
    prompt = prompt_ids(950, 8)
    greedy = host_loop(runner, prompt, 8)
    sampled = runner.complete(Request(prompt, temperature=1.5, min_p=1.0, rng_seed=4, max_len=8))
    assert sampled.token_ids == greedy  # min_p = 1 keeps the most likely token only
    a = runner.complete(Request(prompt, temperature=1.0, rng_seed=-7, max_len=8)).token_ids
    b = runner.complete(Request(prompt, temperature=1.0, rng_seed=2**64 - 7, max_len=8)).token_ids
    c = runner.complete(Request(prompt, temperature=1.0, rng_seed=2**40, max_len=8)).token_ids
    assert a == b  # the same 64 bits
    assert a != c or a != runner.complete(Request(prompt, temperature=1.0, rng_seed=0, max_len=8)).token_ids


# ---- structured output: the grammar's mask applied on the device ------------------------------
SMALL_SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"enum": ["calm", "cross"]}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}},
     "required": ["mood", "n"], "additionalProperties": False},
    {"type": "object"},  # any object (response_format json_object)
]


def grammar_loop(runner, prompt, schema, n):
    """Greedy structured output by full forwards: each step's logits masked by the grammar in
    numpy (llguidance's own bitmask), argmax, the grammar advanced; until the document is complete."""
    from runner.grammar import Matcher, apply_bitmask_numpy, num_mask_words

    engine, matcher = runner.engine.executor, Matcher(runner.grammar_of(Request([1], json_schema=schema)))
    words = np.zeros(num_mask_words(CONFIG.vocab_size), np.uint32)
    seq, out = list(prompt), []
    for _ in range(n):
        padded = np.zeros((1, CONFIG.sequence_len), np.int32)
        padded[0, : len(seq)] = seq
        logits = np.asarray(engine.forward(engine.params, padded, np.array([len(seq)])))[0, len(seq) - 1]
        matcher.fill_mask(words)
        token = int(apply_bitmask_numpy(logits, words).argmax())
        assert matcher.accept(token)
        out.append(token)
        seq.append(token)
        if matcher.done:
            break
    return out


def test_greedy_structured_output_equals_the_host_rule(runner):
    prompt = prompt_ids(990, 3)
    for schema in SMALL_SCHEMAS:
        want = grammar_loop(runner, prompt, schema, 50)
        got = runner.complete(Request(prompt, temperature=0.0, max_len=50, json_schema=schema))
        assert got.token_ids == want, schema
        if got.finish_reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(got.text), schema)


def test_structured_outputs_parse_and_validate_beside_free_text(runner):
    import jsonschema

    plain = [Request(prompt_ids(960 + i, 5), temperature=1.0, rng_seed=i, max_len=20) for i in range(2)]
    alone = {r.request_id: tokens_of(e) for r, e in zip(plain, collect(runner.run(plain)).values())}
    constrained = [Request(prompt_ids(970 + i, 2), temperature=1.0, rng_seed=i, max_len=60, json_schema=schema)
                   for i in range(4) for schema in SMALL_SCHEMAS]
    events = collect(runner.run(constrained[:5] + plain + constrained[5:]))
    finished = 0
    for r in constrained:
        last = events[r.request_id][-1]
        text = "".join(e.text for e in events[r.request_id])
        assert last.finish_reason in ("stop", "length"), last
        if last.finish_reason == "stop":  # the document is complete: it parses and validates
            jsonschema.validate(json.loads(text), r.json_schema)
            finished += 1
    # a random model spends much of a 60-token budget on the whitespace JSON allows (up to 20
    # characters a gap), so some end by length, their text a prefix of a valid document
    assert finished >= len(constrained) // 4, finished
    for r in plain:  # the masks of their neighbours do not reach them
        assert tokens_of(events[r.request_id]) == alone[r.request_id]
    with pytest.raises(ValueError, match="json_schema"):
        runner.prepare(Request([1], max_len=8, json_schema={"type": "object", "not": {"type": "string"}}))


def test_the_kernels_cut_masked_logits_as_xla_does():
    """Masked and banned tokens reach the top-k/top-p cut as -inf: the CPU kernel's radix select
    keeps the same sets as XLA's sort (a row with one finite logit included)."""
    from backends.cpu import CPU, build

    if not build.available():
        pytest.skip("no CPU sampling kernel on this machine")
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (4, 300)).astype(np.float32)
    logits[:, rng.random(300) < 0.7] = -np.inf
    logits[3] = -np.inf
    logits[3, 5] = 1.0
    settings = SampleSettings.host(4, temperature=0.9, nucleus_p=0.8, top_k=5)
    cut = jax.jit(filter_logits, static_argnums=2)
    xla = np.asarray(cut(logits, settings, XLA()))
    kernel = np.asarray(cut(logits, settings, CPU(on=frozenset({"sampling_cut", "logits_summary"}))))
    np.testing.assert_array_equal(np.isfinite(xla), np.isfinite(kernel))
    assert np.isfinite(xla[3]).tolist() == [t == 5 for t in range(300)]


def test_a_cancelled_structured_output_leaves_its_neighbours_alone(runner):
    """A constrained request cancelled mid-way (its slot held or stepping) frees its slot; the free
    requests beside it, and one that takes its slot, get their solo tokens."""
    plain = [Request(prompt_ids(980 + i, 5), temperature=1.0, rng_seed=i, max_len=24) for i in range(4)]
    alone = {r.request_id: tokens_of(e) for r, e in zip(plain, collect(runner.run(plain)).values())}
    constrained = Request(prompt_ids(985, 3), temperature=1.0, rng_seed=9, max_len=50, json_schema={"type": "object"})
    stream = runner.run()
    for r in [constrained] + plain:  # 4 slots: the last plain request waits for the cancelled one's
        stream.submit(r)
    events = {}
    for event in iter(lambda: next(stream), None):
        events.setdefault(event.request_id, []).append(event)
        if event.request_id == constrained.request_id and event.index == 2 and not event.finish_reason:
            assert stream.cancel(constrained.request_id)
    assert events[constrained.request_id][-1].finish_reason == "cancelled"
    for r in plain:
        assert tokens_of(events[r.request_id]) == alone[r.request_id]
