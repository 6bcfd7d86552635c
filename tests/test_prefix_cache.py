"""The prefix cache (runner/prefix_cache.py): prompts that start with cached blocks read them and
prefill only the rest, and every request gets exactly the tokens it gets without the cache."""

import dataclasses

import numpy as np
import pytest

from runner import Request
from runner.prefix_cache import PrefixCache
from tests.test_core import solo, tokens
from tests.test_runner import CONFIG, PAD_SIZES, BUDGET, collect, params, prompt_ids, runner  # noqa: F401 (fixtures)

BLOCK = 8
POOL = 14  # blocks: a 40-token prefix takes 5, so a few distinct prompts evict it


@pytest.fixture(scope="module")
def cached(params):  # noqa: F811
    """``runner``'s settings (the reference: no cache) with a prefix cache of 14 blocks of 8."""
    from runner import InferenceRunner, ModelRunner

    r = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=4, pad_sizes=PAD_SIZES,
                        max_num_batched_tokens=BUDGET, prefix_cache_blocks=POOL, prefix_block_size=BLOCK)
    return r.initialize(warmup=False)  # the variants the tests call, compiled (or loaded) as they call them


def shared(prefix, i, n=8):
    """A request of ``prefix`` + its own suffix of 3-12 tokens, greedy or seeded."""
    ids = prefix + prompt_ids(900 + i, 3 + (i * 5) % 10)
    if i % 2 == 0:
        return Request(ids, temperature=0.0, max_len=n)
    return Request(ids, temperature=0.8, top_k=7 * (i % 3), rng_seed=i, max_len=n)


def test_shared_prefixes_are_read_from_the_cache_and_change_no_token(cached, runner):  # noqa: F811
    prefix = prompt_ids(800, 40)  # 5 blocks
    requests = [shared(prefix, i) for i in range(7)]
    want = {r.request_id: solo(runner, r) for r in requests}
    queries, hits = cached.prefix_cache_counts()
    got = collect(cached.run(requests[:1]))  # alone: it computes and saves the prefix
    got.update(collect(cached.run(requests[1:])))  # a burst: every one reads it
    for r in requests:
        assert tokens(got[r.request_id]) == want[r.request_id], r
    assert got[requests[0].request_id][0].cached_tokens == 0
    assert all(got[r.request_id][0].cached_tokens == 40 for r in requests[1:])
    q, h = cached.prefix_cache_counts()
    assert q - queries == sum(len(r.prompt) for r in requests) and h - hits == 6 * 40


def test_a_prompt_of_whole_blocks_still_computes_its_last_token(cached, runner):  # noqa: F811
    prompt = prompt_ids(801, 24)  # 3 blocks: 2 read, the last block's 8 tokens computed
    cached.complete(Request(prompt, temperature=0.0, max_len=4))
    again = Request(prompt, temperature=0.7, rng_seed=5, max_len=6)
    events = list(cached.run([again]))
    assert events[0].cached_tokens == 16 and tokens(events) == solo(runner, again)


def test_chunked_prompts_copies_and_eviction_keep_every_token(cached, runner):  # noqa: F811
    prefix = prompt_ids(802, 48)  # 6 blocks; with a suffix, 2 chunks of 32 + the rest
    first = shared(prefix, 20)
    assert tokens(list(cached.run([first]))) == solo(runner, first)
    # n > 1: one request reads the blocks, its copies fork from it
    copies = [dataclasses.replace(shared(prefix, 21), rng_seed=s, temperature=0.9, request_id=None) for s in range(3)]
    got = collect(cached.run(copies))
    assert [tokens(got[r.request_id]) for r in copies] == [solo(runner, r) for r in copies]
    assert max(e[0].cached_tokens for e in got.values()) == 48
    # distinct prompts fill the 14-block pool and evict the prefix's blocks, least recently used first
    others = [Request(prompt_ids(810 + i, 40), temperature=0.0, max_len=4) for i in range(3)]
    assert [c.token_ids for c in cached.generate(others)] == [solo(runner, r) for r in others]
    assert len(cached.engine.scheduler.prefix) <= POOL
    late = shared(prefix, 22)
    events = list(cached.run([late]))
    assert events[0].cached_tokens < 48, "the prefix survived three 5-block prompts in a 14-block pool"
    assert tokens(events) == solo(runner, late)


def test_blocks_of_a_request_cancelled_mid_prefill_are_whole(cached, runner):  # noqa: F811
    """A prompt cancelled after its first chunk left its completed blocks in the cache: a later
    request with the same prompt reads them and computes the rest, with the tokens it gets alone."""
    prompt = prompt_ids(803, 56)  # chunks 32 + 24
    seen = []
    real = cached.engine.scheduler.schedule

    def schedule():
        seen.append(real())
        return seen[-1]

    cached.engine.scheduler.schedule = schedule
    try:
        stream = cached.run()
        request = Request(prompt, temperature=0.0, max_len=5)
        stream.submit(request)
        cached.engine.wait_for(lambda: len(seen) >= 1)  # its first chunk only
        assert stream.cancel(request.request_id)
        assert [e.finish_reason for e in iter(lambda: next(stream), None)] == ["cancelled"]
    finally:
        del cached.engine.scheduler.schedule
    again = Request(prompt, temperature=0.0, max_len=5)
    events = list(cached.run([again]))
    assert events[0].cached_tokens == 32 and tokens(events) == solo(runner, again)


def test_a_recycled_block_carries_nothing_of_its_previous_owner(cached, runner):  # noqa: F811
    """Every block of the pool is written by some prompt, then recycled for others: a request
    reads only blocks of its own exact prefix, and its tokens are its own."""
    prompts = [prompt_ids(820 + i, 33) for i in range(8)]  # 4 blocks each: 32 > 14 blocks in all
    requests = [Request(p, temperature=0.0, max_len=6) for p in prompts]
    outs = cached.generate(requests)
    assert [c.token_ids for c in outs] == [solo(runner, r) for r in requests]
    # the last prompt's blocks are in recycled pool blocks, each written before by another prompt
    again = Request(prompts[-1], temperature=0.9, rng_seed=8, max_len=6)
    events = list(cached.run([again]))
    assert events[0].cached_tokens == 32 and tokens(events) == solo(runner, again)
    # one token changed in the first block: nothing cached matches
    edited = list(prompts[-1])
    edited[3] = (edited[3] + 1) % CONFIG.vocab_size
    request = Request(edited, temperature=0.0, max_len=6)
    events = list(cached.run([request]))
    assert events[0].cached_tokens == 0 and tokens(events) == solo(runner, request)


# ---- the index alone (host only) ----------------------------------------------------------------------
def test_a_hash_collision_can_only_miss(monkeypatch):
    """A hit compares the block's tokens and its parent exactly: with every key equal, a different
    prompt finds nothing, and the same prompt still finds its own blocks."""
    cache = PrefixCache(8, 4)
    monkeypatch.setattr(cache, "key", lambda parent, tokens: b"same")
    a = list(range(10, 23))
    assert [j for j, _ in cache.allocate(a, 0, 3)] == [0]  # the same key: the other blocks are "cached"
    cache.commit()
    assert len(cache.match(a)) == 1  # its first block, whose tokens and parent match
    assert cache.match([99] + a[1:]) == []


def test_matches_use_whole_ready_blocks_and_leave_a_token_to_compute():
    cache = PrefixCache(6, 4)
    ids = list(range(100, 113))  # 13 tokens: 3 whole blocks
    assert [j for j, _ in cache.allocate(ids, 0, 3)] == [0, 1, 2]
    assert cache.match(ids) == [], "blocks are read only once the call writing them is dispatched"
    cache.commit()
    assert len(cache.match(ids)) == 3
    assert len(cache.match(ids[:12])) == 2  # 12 tokens: the third block would leave nothing to compute
    assert len(cache.match(ids[:9] + [0, 0, 0, 0])) == 2
    cache.use(ids, cache.match(ids))
    assert (cache.queries, cache.hits) == (13, 12)
    # LRU: three more blocks fill the pool; the next allocation evicts the oldest chain's deepest block
    other = list(range(200, 213))
    assert len(cache.allocate(other, 0, 3)) == 3
    cache.commit()
    cache.use(other, cache.match(other))
    assert len(cache.allocate(list(range(300, 305)), 0, 1)) == 1
    cache.commit()
    assert len(cache.match(ids)) == 2 and len(cache.match(other)) == 3
    cache.clear()
    assert cache.match(other) == [] and len(cache) == 0


def test_pool_settings_are_checked(params):  # noqa: F811
    from runner import InferenceRunner, ModelRunner

    for fields, match in (({"prefix_cache_blocks": -2}, "prefix_cache_blocks"),
                          ({"prefix_cache_blocks": 4, "prefix_block_size": 48}, "prefix_block_size 48"),
                          ({"prefix_cache_blocks": 4, "prefix_cache_bytes": 10}, "not both")):
        r = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=4, pad_sizes=PAD_SIZES,
                            **fields)
        with pytest.raises(ValueError, match=match):
            r = r.initialize(warmup=False)
    auto = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=2, pad_sizes=PAD_SIZES,
                           prefix_cache_blocks="auto")
    auto = auto.initialize(warmup=False)
    assert auto.engine.executor.prefix_blocks == 2 * CONFIG.sequence_len // 16
    assert np.asarray(auto.state.pool.k[0]).shape == (8, CONFIG.num_kv_heads, 16, CONFIG.key_size)
    block = CONFIG.kv_bytes_per_token() * 16  # K and V of every layer, 16 positions
    sized = InferenceRunner(runner=ModelRunner(model=CONFIG, params=params), batch_size=2, pad_sizes=PAD_SIZES,
                            prefix_cache_bytes=5 * block + block // 2)
    sized = sized.initialize(warmup=False)
    assert sized.engine.executor.prefix_blocks == 5 and sized.state.pool.num_blocks == 5
