"""The scheduler's plans, on the host alone: how prompts are cut, what a round computes under its
token budget, and that every plan has a shape that warm-up compiled."""

import pytest

from runner import Request
from runner.runner import default_kv_buckets, default_pad_sizes
from runner.scheduler import PAD_SLACK, Scheduler, chunk_lengths, smallest_at_least


@pytest.mark.parametrize("sizes, sequence_len", [((8, 16, 32), 64), (default_pad_sizes(2048), 2048), ((128, 512), 512)])
def test_prompt_chunks_cover_the_prompt_and_pad_little(sizes, sequence_len):
    """Every prompt length: the chunks add up to the prompt, all but the last fill their bucket,
    and the last is padded by at most an eighth of the prompt or PAD_SLACK positions (or sits in
    the smallest bucket)."""
    for n in range(1, sequence_len):
        chunks = chunk_lengths(n, sizes)
        assert sum(chunks) == n
        assert all(c in sizes for c in chunks[:-1]), (n, chunks)
        waste = smallest_at_least(sizes, chunks[-1]) - chunks[-1]
        assert waste <= max(n // 8, PAD_SLACK) or chunks[-1] <= sizes[0], (n, chunks)
    if sequence_len == 2048:  # 1,056 tokens: two chunks of the budget's 512 and 32 in a 32 bucket
        assert chunk_lengths(1056, sizes) == [512, 512, 32] and chunk_lengths(128, sizes) == [128]


def scheduler(budget=512, batch=8, sequence_len=2048, steps=4):
    return Scheduler(batch, default_pad_sizes(sequence_len), default_kv_buckets(sequence_len), sequence_len,
                     budget, steps)


def submit(s, *lengths):
    """Requests of distinct prompts of these lengths."""
    prompts = [[i + 4] + list(range(1, n)) for i, n in enumerate(lengths)]
    return [s.add(Request(p, max_len=8), p, None) for p in prompts]


def test_requests_with_one_prompt_prefill_it_once():
    s = scheduler()
    prompt = list(range(4, 304))  # chunks 256 + 44
    leader, *copies = [s.add(Request(prompt, max_len=8), prompt, None) for _ in range(3)]
    (other,) = submit(s, 10)
    first = s.schedule()
    assert [r.sequence for r in first.prefill] == [leader, other] and not first.forks  # the copies wait
    second = s.schedule()
    assert [r.sequence for r in second.prefill] == [leader] and [f.sequence for f in second.forks] == copies
    assert all(c.decoding and c.computed == 300 for c in copies) and set(second.decode) == {leader, other, *copies}


def test_a_burst_of_prompts_is_prefilled_in_one_call():
    s = scheduler()
    seqs = submit(s, *([40] * 8))
    plan = s.schedule()
    assert [r.sequence for r in plan.prefill] == seqs and (plan.rows, plan.bucket) == (8, 512)  # 320 packed
    assert plan.decode == seqs  # each starts decoding in the same round, after its prefill
    assert [q.slot for q in seqs] == list(range(8)) and not s.waiting


def test_a_round_keeps_to_its_token_budget_oldest_first():
    s = scheduler(budget=512)
    a, b, c = submit(s, 1056, 300, 20)
    shapes = s.prefill_shapes()
    plans, order = [], []
    while any(not q.decoding for q in (a, b, c)):
        plan = s.schedule()
        assert (plan.rows, plan.bucket) in shapes
        real = sum(r.length for r in plan.prefill) + len([q for q in s.running() if q.decoding and q not in
                                                          [r.sequence for r in plan.prefill]])
        assert len(plan.prefill) == 1 or real <= 512
        assert sum(r.length for r in plan.prefill) <= plan.bucket  # packed into one row of the bucket
        order.append([(r.sequence, r.start, r.length) for r in plan.prefill])
        plans.append(plan)
    # a's chunks are its own (cut from its prompt alone), in order; nobody overtakes a
    assert [(st, n) for round_ in order for q, st, n in round_ if q is a] == [(0, 512), (512, 512), (1024, 32)]
    names = {id(a): "a", id(b): "b", id(c): "c"}
    assert [[(names[id(q)], n) for q, _, n in round_] for round_ in order] == [
        [("a", 512)],  # the whole budget
        [("a", 512)],
        [("a", 32), ("b", 256), ("c", 20)],  # 308 tokens packed into 512
        [("b", 44)]]  # beside a's and c's first decode steps
    assert a.computed == 1056 and b.prefilled == 300 and c.prefilled == 20


def test_waiting_requests_take_free_slots_only():
    s = scheduler(batch=2)
    seqs = submit(s, 10, 10, 10)
    plan = s.schedule()
    assert [r.sequence for r in plan.prefill] == seqs[:2] and list(s.waiting) == seqs[2:]
    s.finish(seqs[0])
    plan = s.schedule()
    assert [r.sequence for r in plan.prefill] == seqs[2:] and seqs[2].slot == 0


def test_the_kv_bucket_covers_every_row_in_flight():
    s = scheduler()
    (a,) = submit(s, 60)
    plan = s.schedule()
    # a prefill attends over its tokens' own positions (no bucket), a decode step over a KV bucket
    assert plan.decode_kv_len == 64 and plan.decode_steps == 1  # beside its prefill
    plan = s.schedule()
    assert plan.decode_steps == 4 and plan.decode_kv_len == 256  # 61 + 4 positions
    assert a.dispatched == 65 and a.computed == 60


def test_packed_chunks_start_aligned_and_fit_their_bucket():
    """Chunks of one call are packed at offsets that are multiples of 16 (each block of 16 queries
    reads one cache row), one after another, inside the call's bucket; the call's shape is among
    those compiled, whatever its rows."""
    s = scheduler()
    seqs = submit(s, 40, 7, 100, 16, 250)
    plan = s.schedule()
    assert [r.sequence for r in plan.prefill] == seqs
    offsets = [r.offset for r in plan.prefill]
    assert offsets == [0, 48, 64, 176, 192] and plan.bucket == 512  # 192 + 250 = 442
    assert (plan.rows, plan.bucket) in s.prefill_shapes()
    small = Scheduler(4, (8, 16, 32), default_kv_buckets(64), 64, 24, 2)  # buckets below 16: aligned to 8
    a, b = submit(small, 5, 8)
    plan = small.schedule()
    assert [(r.sequence, r.offset) for r in plan.prefill] == [(a, 0), (b, 8)] and plan.bucket == 16


def test_the_bench_configs_server_compiles_twelve_steps():
    """Issue 50's count: 8 slots, 2,048 positions, the default budget and buckets, scoring on, on
    a backend whose decode reads the live positions alone (the CPU kernel): 6 prefill buckets, 3
    scoring, 1 decode, the fork and the release. On XLA, one decode a KV bucket (4)."""
    import dataclasses

    from model import TINY
    from runner import compiled

    config = dataclasses.replace(TINY, sequence_len=2048)
    cpu = compiled.steps(config, 8, score_prompts=True, live_keys=True)
    assert cpu.count == 12 and len(cpu.prefills) == 9 and len(cpu.decodes) == 1
    assert compiled.steps(config, 8, score_prompts=True).count == 15
