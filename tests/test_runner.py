"""The runner: slots, buckets, streaming, sampling settings, cancellation and bad requests."""

import dataclasses

import jax
import numpy as np
import pytest

from backends import XLA
from model import TINY, forward, init_params
from runner import InferenceRunner, ModelRunner, Request, sample_from_model
from runner.compile_count import compilations
from runner.startup import Startup
from runner.batches import empty_batch
from tests.helpers import lively

CONFIG = dataclasses.replace(TINY, vocab_size=320)
PAD_SIZES = (8, 16, 32)  # a 40-token prompt is prefilled as 32 + 8
BUDGET = 32  # prefill calls of up to 4 x 8, 2 x 16 or 1 x 32 positions: 6 variants to compile, not 9


@pytest.fixture(scope="session")
def params():
    return lively(init_params(CONFIG, jax.random.PRNGKey(0)))


@pytest.fixture(scope="session")
def runner(params, test_tokenizer):
    r = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=4,
                        pad_sizes=PAD_SIZES, tokenizer_path=test_tokenizer, max_num_batched_tokens=BUDGET)
    r = r.initialize()
    return r


@pytest.fixture(scope="session")
def greedy_reference(params):
    """Greedy continuation by full forward passes without any cache (one compile: fixed padding)."""
    fwd = jax.jit(lambda p, t, n: forward(p, t, CONFIG, lengths=n, backend=XLA()).logits)

    def generate(prompt, n, eos=None):
        seq = list(prompt)
        out = []
        for _ in range(n):
            padded = np.zeros((1, CONFIG.sequence_len), np.int32)
            padded[0, : len(seq)] = seq
            token = int(np.asarray(fwd(params, padded, np.array([len(seq)])))[0, len(seq) - 1].argmax())
            out.append(token)
            seq.append(token)
            if token == eos:
                break
        return out

    return generate


def prompt_ids(i, length):
    rng = np.random.default_rng(i)
    return rng.integers(4, CONFIG.vocab_size, length).tolist()


def collect(stream):
    """{request_id: [events]} for a stream run to the end."""
    events = {}
    for event in stream:
        events.setdefault(event.request_id, []).append(event)
    return events


def tokens_of(events):
    return [e.token_id for e in events if e.token_id is not None]


def mixed_requests(n):
    lengths = [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 40, 12]
    requests = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        settings = [dict(temperature=0.0), dict(temperature=1.0, rng_seed=i),
                    dict(temperature=0.7, nucleus_p=0.9, rng_seed=100 + i),
                    dict(temperature=1.3, top_k=5, rng_seed=7)][i % 4]
        requests.append(Request(prompt_ids(i, length), max_len=1 + (i * 5) % 17, **settings))
    return requests


def test_each_request_alone_equals_among_many(runner):
    requests = mixed_requests(32)
    together = collect(runner.run(requests))
    assert set(together) == {r.request_id for r in requests}  # none lost
    for r in requests:
        events = together[r.request_id]
        assert [e.index for e in events] == list(range(len(events)))  # none duplicated or skipped
        assert [e.finish_reason is not None for e in events] == [False] * (len(events) - 1) + [True]
        alone = collect(runner.run([dataclasses.replace(r, request_id=None)]))
        (alone_events,) = alone.values()
        assert tokens_of(events) == tokens_of(alone_events), r


def test_greedy_equals_full_forward_without_cache_in_reused_slots(runner, greedy_reference):
    # long requests first, so later ones land in slots that held other contexts
    requests = [Request(prompt_ids(50 + i, n), temperature=0.0, max_len=m)
                for i, (n, m) in enumerate([(30, 20), (40, 15), (5, 12), (9, 9), (2, 18), (17, 6), (33, 10)])]
    events = collect(runner.run(requests))
    for r in requests:
        assert tokens_of(events[r.request_id]) == greedy_reference(r.prompt, r.max_len)


def test_same_seed_same_tokens_and_different_seeds_differ(runner):
    prompt = prompt_ids(60, 10)
    runs = [runner.generate([prompt], temperature=1.0, rng_seed=s, max_len=20)[0].token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_near_zero_temperature_and_top_p_give_the_argmax(runner, greedy_reference):
    prompt = prompt_ids(61, 12)
    want = greedy_reference(prompt, 10)
    assert runner.generate([prompt], temperature=0.0, max_len=10)[0].token_ids == want
    assert runner.generate([prompt], temperature=1e-6, rng_seed=3, max_len=10)[0].token_ids == want
    assert runner.generate([prompt], temperature=1.0, nucleus_p=1e-6, rng_seed=3, max_len=10)[0].token_ids == want
    assert runner.generate([prompt], temperature=2.0, top_k=1, rng_seed=3, max_len=10)[0].token_ids == want


def test_eos_and_stop_tokens_end_a_request(runner, greedy_reference):
    prompt = prompt_ids(62, 6)
    full = greedy_reference(prompt, 12)
    stop = full[4]
    done = runner.generate([prompt], temperature=0.0, max_len=12, stop_token_ids=[stop])[0]
    assert done.token_ids == full[: full.index(stop) + 1] and done.finish_reason == "stop"
    original = runner.engine.outputs.eos_token
    try:
        runner.engine.outputs.eos_token = full[6]  # the EOS id every request's stop ids start with
        done = runner.generate([prompt], temperature=0.0, max_len=12)[0]
    finally:
        runner.engine.outputs.eos_token = original
    assert done.token_ids == full[: full.index(full[6]) + 1] and done.finish_reason == "eos"
    assert runner.generate([prompt], temperature=0.0, max_len=3)[0].finish_reason == "length"


def test_no_compilation_after_warmup(runner):
    compilations()  # start counting
    runner.generate([Request([5], max_len=2)])  # host-side helpers touched once
    before = compilations()
    collect(runner.run(mixed_requests(50)))
    runner.generate(["the house", "a letter from her sister"], temperature=0.5, rng_seed=1, max_len=5)
    runner.generate(["the house"] * 3, temperature=0.5, rng_seed=1, max_len=5)  # one prefill, two forks
    assert compilations() == before


def test_without_the_warmup_each_variant_is_compiled_when_first_called_and_kept_in_the_store(runner, params,
                                                                                             tmp_path, monkeypatch):
    """``initialize(warmup=False)``: a variant is compiled the first time a round calls it and kept
    in ``compile_cache``; a second runner of the same model loads it and compiles nothing (its
    decode step loaded on another thread while its prefill loads), and all give the warmed-up
    runner's tokens. An executable JAX took from its persistent compilation cache (as the session
    runner's programs are here) is used but never stored: serialised again, its calls failed
    (NOT_FOUND) once loaded."""
    import threading

    from runner.executables import ExecutableStore

    loads, load = [], ExecutableStore.load

    def recorded(self, name):
        loads.append((name.split()[0], threading.current_thread().name.split("_")[0]))
        return load(self, name)

    monkeypatch.setattr(ExecutableStore, "load", recorded)

    def make(store):
        return InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=4, pad_sizes=PAD_SIZES,
                               max_num_batched_tokens=BUDGET, compile_cache=str(store)).initialize(warmup=False)

    def tokens(r):
        done = r.generate(prompts, temperature=0.0, max_len=6)
        assert all(c.error is None for c in done), [c.error for c in done]
        return [c.token_ids for c in done]

    prompts = [[5, 6, 7], list(range(10, 30))]  # buckets 8 and 32: two of the prefill shapes, not all
    want = tokens(runner)
    hits = tmp_path / "hits"  # the session runner compiled every program: each compile is a cache hit
    assert tokens(make(hits)) == want and not list(hits.rglob("*.exe"))
    assert tokens(make(hits)) == want
    store = tmp_path / "store"
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        first = make(store)
        assert not list(store.rglob("*.exe"))  # nothing compiled at start
        assert tokens(first) == want
        stored = sorted(store.rglob("*.exe"))
        variants = len(first.engine.executor.variants(*first.engine.variants(False)))
        assert 0 < len(stored) < variants  # the ones called, each once
        compilations()
        before = compilations()
        loads.clear()
        assert tokens(make(store)) == want
        assert compilations() == before and sorted(store.rglob("*.exe")) == stored
        threads = {kind: {thread for k, thread in loads if k == kind} for kind in ("decode", "prefill")}
        assert threads["decode"] == {"load-ahead"} and "load-ahead" not in threads["prefill"], loads
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


def test_every_step_serialises_after_it_ran(runner):
    """A step that has run can still be serialised (the store and JAX's persistent cache write a
    step after compiling it, and nothing may make that depend on whether it ran): no program
    holds a sort, whose comparator XLA:CPU replaces by a native one it cannot serialise on a
    first run (jaxlib 0.10.2, ``model.layers.by_expert``)."""
    done = runner.generate([prompt_ids(7, 5), prompt_ids(8, 40)], temperature=0.0, max_len=4)
    assert all(c.error is None for c in done)
    steps = runner.engine.executor._executables
    assert len(steps) >= 3
    for key, step in steps.items():
        assert " sort(" not in step.as_text(), key
        step.runtime_executable().serialize()


def test_steps_compiled_ahead_from_the_headers_are_what_a_server_start_loads(tmp_path):
    """``compile_ahead`` fills the store from the checkpoint's headers alone (nothing read, on the
    XLA backend): a runner of the same settings then loads every step and compiles nothing, and
    gives the tokens of one that compiled its own. It needs a store, and the XLA backend where one
    CPU device would take the CPU backend (whose layout is made from the weights)."""
    from runner.runner import default_checkpoint

    checkpoint = default_checkpoint()
    if checkpoint is None:
        pytest.skip("the shipped checkpoint is not in this installation")

    def make(store, backend="xla"):
        return InferenceRunner(runner=ModelRunner(checkpoint_path=checkpoint, backend=backend), batch_size=2,
                               pad_sizes=(16, 32), max_num_batched_tokens=32, compile_cache=store)

    store = tmp_path / "store"
    jax.config.update("jax_enable_compilation_cache", False)  # JAX's cached programs are never stored
    try:
        done = make(str(store)).compile_ahead()
        assert done["loaded"] == 0 and done["compiled"] == len(list(store.rglob("*.exe"))) > 4
        assert make(str(store)).compile_ahead() == {"loaded": done["compiled"], "compiled": 0}
        compilations()
        before = compilations()
        served = make(str(store)).initialize()
        assert compilations() == before  # every step loaded
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    prompts = ["It is a truth universally acknowledged", "My dear"]
    want = make(None).initialize(warmup=False).generate(prompts, temperature=0.0, max_len=8)
    got = served.generate(prompts, temperature=0.0, max_len=8)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    with pytest.raises(ValueError, match="compile_cache"):
        make(None).compile_ahead()
    with pytest.raises(ValueError, match="XLA backend"):
        make(str(store), backend="auto").compile_ahead()


def test_nothing_compiles_while_serving_any_feature(params, test_tokenizer):
    """Every variant a request can reach is compiled at start: counted from the end of
    ``initialize`` (no warm-up request), a load that cancels waiting and running requests, forks
    (one prompt for several requests), scores prompts, constrains to a JSON schema, speculates,
    reads the prefix cache and samples with every rule compiles nothing."""
    r = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=4, pad_sizes=PAD_SIZES,
                        tokenizer_path=test_tokenizer, max_num_batched_tokens=BUDGET, score_prompts=True,
                        speculative=2, prefix_cache_blocks="auto").initialize()
    before = compilations()
    stream = r.run()
    loop = prompt_ids(3, 4) * 5  # a repeating prompt: its drafts are accepted
    long = Request(prompt_ids(50, 5), temperature=0.0, max_len=40)  # cancelled while it runs
    requests = [long] + mixed_requests(12) + [
        Request(loop, temperature=0.0, max_len=12), Request(loop, temperature=0.0, max_len=12, speculative=1),
        Request(prompt_ids(40, 20), prompt_logprobs=2, logprobs=3, max_len=3),
        Request("the house", json_schema={"type": "object"}, temperature=0.0, max_len=12),
        Request(prompt_ids(41, 9), repetition_penalty=1.3, presence_penalty=0.5, min_tokens=2, max_len=6)]
    requests += [Request(prompt_ids(42, 30), temperature=0.7, rng_seed=i, max_len=4) for i in range(3)]  # forks
    for q in requests:
        stream.submit(q)
    stream.cancel(requests[-4].request_id)  # waiting
    ended = set()
    for event in iter(lambda: next(stream), None):
        if event.index == 1 and event.request_id == long.request_id:
            assert stream.cancel(event.request_id)  # running
        if event.finish_reason:
            ended.add(event.request_id)
    assert ended == {q.request_id for q in requests}
    assert r.engine.scheduler.prefix.queries > 0
    r.generate([prompt_ids(42, 30)] * 2, max_len=3)  # the prefix cache's blocks, read
    assert compilations() == before


def test_a_warm_start_loads_the_scoring_prefills_after_it_and_scores_alike(params, test_tokenizer, tmp_path):
    """A start from a store that holds every step loads the prefills that score prompts on a
    thread of their own after it (only echo with logprobs calls them); a scoring request then
    gets the scores of a start that loaded everything, and nothing compiles."""
    def make():
        return InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=4, pad_sizes=PAD_SIZES,
                               tokenizer_path=test_tokenizer, max_num_batched_tokens=BUDGET, score_prompts=True,
                               compile_cache=str(tmp_path))

    def scores(r):
        events = list(r.run([Request(prompt_ids(40, 20), prompt_logprobs=2, temperature=0.0, max_len=3)]))
        scored = next(e.prompt_logprobs for e in events if e.prompt_logprobs is not None)
        return [(e.token_id, e.logprob) for e in scored], [e.token_id for e in events]

    jax.config.update("jax_enable_compilation_cache", False)
    try:
        first = make().initialize()  # compiles every step, scoring ones included, and stores them
        assert not first.engine.executor._loading
        want = scores(first)
        second = make()
        startup = Startup.quiet()
        second.initialize(startup=startup)
        loading = second.engine.executor._loading
        assert loading and all(key[0] == "prefill" and key[3] for key in loading), sorted(loading)
        assert f"{len(loading)} loading after the start" in startup.notes["compile"]
        compilations()
        before = compilations()
        assert scores(second) == want
        assert compilations() == before
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


def test_stop_strings_end_a_request_in_the_runner(runner):
    """A stop string ends its request where the text first holds it (across token boundaries), the
    string and what follows are not in the output, its slot is released at once, and its neighbours'
    tokens are their own."""
    free = runner.generate(["the house of her sister"], temperature=0.0, max_len=24)[0]
    assert len(free.text) > 12
    cut = len(free.text) // 2
    stop = free.text[cut: cut + 3]  # a piece of text that may span tokens
    neighbour = Request(prompt_ids(77, 9), temperature=0.0, max_len=12)
    alone = runner.complete(neighbour)
    done, beside = runner.generate([Request("the house of her sister", temperature=0.0, max_len=24, stop=[stop, "zz"]),
                                    dataclasses.replace(neighbour, request_id=None)])
    assert done.finish_reason == "stop" and done.text == free.text[: free.text.index(stop)]
    assert len(done.token_ids) < len(free.token_ids) and done.token_ids == free.token_ids[: len(done.token_ids)]
    assert beside.token_ids == alone.token_ids
    assert not runner.engine.scheduler.running() and not np.asarray(runner.state.active).any()
    events = list(runner.run([Request("the house of her sister", temperature=0.0, max_len=24, stop=stop)]))
    assert events[-1].stop_reason == stop and "".join(e.text for e in events) == done.text
    for bad in (["a"] * 5, [""], [3], "", {"x"}):
        with pytest.raises(ValueError, match="Request.stop"):
            Request("x", stop=bad)


def test_cancellation_frees_the_slot(runner):
    long = [Request(prompt_ids(70 + i, 5), temperature=0.0, max_len=40) for i in range(6)]
    stream = runner.run()  # server mode: next() gives None once idle
    for r in long:
        stream.submit(r)
    first = next(stream)
    assert stream.cancel(long[5].request_id)  # still queued: all 4 slots are taken
    running = first.request
    assert stream.cancel(running.request_id)
    events = {}
    for event in iter(lambda: next(stream), None):
        events.setdefault(event.request_id, []).append(event)
    events[running.request_id].insert(0, first)
    cancelled = [e for e in events[running.request_id] if e.finish_reason]
    assert len(cancelled) == 1 and cancelled[0].finish_reason == "cancelled" and cancelled[0].token_id is None
    assert [e.finish_reason for e in events[long[5].request_id]] == ["cancelled"]
    for r in long[:5]:  # long[4] got the cancelled request's slot
        if r is not running:
            assert len(tokens_of(events[r.request_id])) == 40
    assert not stream.cancel("no-such-request")


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=["a", 1]), "prompt"),
    (dict(prompt=3.5), "prompt"),
    (dict(prompt=[1], temperature=-0.1), "temperature"),
    (dict(prompt=[1], temperature="hot"), "temperature"),
    (dict(prompt=[1], nucleus_p=0.0), "nucleus_p"),
    (dict(prompt=[1], nucleus_p=1.5), "nucleus_p"),
    (dict(prompt=[1], top_k=-1), "top_k"),
    (dict(prompt=[1], top_k=2.5), "top_k"),
    (dict(prompt=[1], max_len=0), "max_len"),
    (dict(prompt=[1], max_len=True), "max_len"),
    (dict(prompt=[1], rng_seed=-(2**63) - 1), "rng_seed"),
    (dict(prompt=[1], rng_seed=2**64), "rng_seed"),
    (dict(prompt=[1], rng_seed=1.0), "rng_seed"),
    (dict(prompt=[1], min_p=1.5), "min_p"),
    (dict(prompt=[1], repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt=[1], frequency_penalty=2.5), "frequency_penalty"),
    (dict(prompt=[1], presence_penalty=float("nan")), "presence_penalty"),
    (dict(prompt=[1], max_len=4, min_tokens=5), "min_tokens"),
    (dict(prompt=[1], min_tokens=-1), "min_tokens"),
    (dict(prompt=[1], ignore_eos=1), "ignore_eos"),
    (dict(prompt=[1], skip_special_tokens="no"), "skip_special_tokens"),
    (dict(prompt=[1], stop_token_ids="ab"), "stop_token_ids"),
]


@pytest.mark.parametrize("fields, name", BAD)
def test_bad_requests_raise_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        Request(**fields)


def test_bad_submissions_do_not_disturb_running_requests(runner):
    good = [Request(prompt_ids(80 + i, 9), temperature=0.0, max_len=12) for i in range(3)]
    want = {r.request_id: tokens_of(e) for r, e in zip(good, collect(runner.run(good)).values())}
    good = [dataclasses.replace(r, request_id=r.request_id + "-again") for r in good]
    want = {r.request_id: want[r.request_id[: -len("-again")]] for r in good}
    stream = runner.run(good)
    events = [next(stream) for _ in range(5)]
    for request, name in [(Request([1] * 60, max_len=10), "max_len"),
                          (Request([CONFIG.vocab_size + 1]), "prompt"),
                          (Request([1], stop_token_ids=[10**6]), "stop_token_ids"),
                          ("not a request", "Request")]:
        with pytest.raises(ValueError, match=name):
            stream.submit(request)
    events += list(stream)
    got = {}
    for e in events:
        got.setdefault(e.request_id, []).append(e.token_id)
    assert got == want


def test_text_streams_incrementally_and_round_trips(runner):
    done = runner.generate(["the house of her sister"], temperature=1.0, rng_seed=5, max_len=30)[0]
    assert done.text == runner.tokenizer.decode(
        [t for t in done.token_ids if t not in (CONFIG.eos_token,)]) or done.finish_reason == "eos"
    stream_text = "".join(e.text for e in runner.run([Request("the house of her sister", temperature=1.0,
                                                               rng_seed=5, max_len=30)]))
    assert stream_text == done.text


def test_sample_from_model_is_reference_compatible(runner):
    gen = runner.run()
    assert next(gen) is None  # primed and idle, like the reference's generator
    text = sample_from_model(gen, "the letter", max_len=6, temperature=0.01)
    again = sample_from_model(gen, "the letter", max_len=6, temperature=0.01)
    assert isinstance(text, str) and text == again


def test_the_four_functions_are_usable_on_their_own(runner, params):
    engine = runner.engine.executor  # its jitted steps, called on a state of the test's own
    tokens = np.array([prompt_ids(90, 8)], np.int32)
    logits = engine.forward(engine.params, tokens, np.array([8]))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(forward(params, tokens, CONFIG, backend=XLA()).logits), atol=1e-5)
    state = engine.new_state()
    batch = empty_batch(2, 8, runner.num_slots, vocab_size=CONFIG.vocab_size)  # one request in slot 2, a padding row
    batch.slots[0], batch.tokens[:], batch.row[:], batch.lengths[0] = 2, tokens[0], 0, 8
    batch.first[0] = batch.last[0] = True
    batch.settings.temperature[0], batch.max_len[0], batch.stop_ids[0, 0] = 0, 3, CONFIG.eos_token
    state, first, _, _ = engine._prefill(engine.params, state, batch, score=False)
    assert int(first.sample.token_id[0, 0]) == int(np.asarray(logits)[0, -1].argmax())
    assert np.asarray(first.valid).tolist() == [[True, False]]
    # a decode variant of 4 steps, asked for 1 (the count is an argument): its other rows are not valid
    state, out = engine._decode(engine.params, state, engine.no_mask, np.int32(1), kv_len=64, steps=4)
    np.testing.assert_array_equal(np.asarray(out.valid)[:, 2], [True, False, False, False])
    assert int(state.memory.step[2]) == 9
    state, out = engine._decode(engine.params, state, engine.no_mask, np.int32(4), kv_len=64, steps=4)
    # max_len 3: the first token came from prefill, two more from decode, then the slot stops itself
    np.testing.assert_array_equal(np.asarray(out.valid)[:, 2], [True, False, False, False])
    assert not np.asarray(out.valid)[:, [0, 1, 3]].any()
    assert int(state.memory.step[2]) == 10 and int(state.memory.step[0]) == 0


def test_pad_sizes_and_batch_validation(params):
    with pytest.raises(ValueError, match="pad_sizes"):
        InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), pad_sizes=(0, 8)).initialize(warmup=False)
    with pytest.raises(ValueError, match="batch_size 3 is not divisible"):
        from model.sharding import make_mesh
        InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=3,
                        mesh=make_mesh((2, 1), jax.devices()[:2])).initialize(warmup=False)


def test_default_pad_sizes():
    from runner import default_pad_sizes

    assert default_pad_sizes(64) == (16, 32, 64) and default_pad_sizes(100) == (16, 32, 64, 100)
    assert default_pad_sizes(8192) == (16, 32, 64, 128, 256, 512)  # up to the budget: the largest chunk
    assert default_pad_sizes(8192, budget=2048)[-2:] == (1024, 2048)


def test_tokenizer_vocabulary_mismatch_is_an_error(params, test_tokenizer):
    small = dataclasses.replace(CONFIG, vocab_size=256)
    with pytest.raises(ValueError, match="320 pieces but the model's vocab_size is 256"):
        InferenceRunner(runner=ModelRunner(model=small, params=init_params(small, jax.random.PRNGKey(0))),
                        tokenizer_path=test_tokenizer).initialize(warmup=False)


