"""``Scheduler``: the waiting and running requests and the batch slots, and the plan of each round.

Each round the engine core asks for a ``RoundPlan`` and runs it: at most one prefill call, whose
rows are prompt chunks of several requests (a row per request, all padded to one bucket), then
one decode call that advances every decoding slot by ``decode_steps`` tokens (by one beside a
prefill, so that a round stays about one budget's worth of prefill long; by twice as many while
every slot is taken, when no new request could start sooner anyway). The plan keeps
under a token budget (``max_num_batched_tokens``, vLLM's name): the decoding slots count one token
each, and prompt chunks are added, oldest request first, where the real tokens fit in what is
left and the call's padded size (rows x bucket) fits in the budget too. The first chunk of a
round is always taken, so a prompt never waits behind the budget; a round therefore holds the
running streams for at most one budget's worth of prefill.

A request's chunks are cut when it is submitted, from its prompt alone (``chunk_lengths``), so
what arrives beside it never changes how its prompt is computed: its tokens are the ones it gets
alone. With a prefix cache (``runner.prefix_cache``), a prompt that starts with cached blocks
when it is admitted reads them in its first chunk and only the rest is cut into chunks (their KV
is what its own prefill would compute: a position's K/V depends on the tokens up to it only).
Only its last chunk samples; its first token is emitted when that chunk's output is read.

KV accounting: a slot holds up to ``sequence_len`` positions; a request is admitted when a slot is
free and its prompt plus its ``max_len`` fit there (checked at submit). The host knows each
slot's exact number of computed positions as of the outputs it has read (``Sequence.computed``),
and an upper bound of what is in flight (``Sequence.dispatched``), which picks the KV bucket.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from typing import Optional

import numpy as np

from runner.prefix_cache import PrefixCache
from runner.requests import Request, Speculation
from runner.sampling import SampleSettings
from runner.state import MAX_STOP_IDS, PrefillBatch

# Padding a prompt's last chunk by this many positions costs less than one more device call (at
# small chunk sizes a prefill call's time goes to reading the weights, not to its positions).
PAD_SLACK = 64


def smallest_at_least(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of the sorted ``sizes`` that is >= ``n``, else the largest."""
    return next((size for size in sizes if size >= n), sizes[-1])


def chunk_lengths(total: int, sizes: tuple[int, ...]) -> list[int]:
    """A prompt of ``total`` tokens cut into chunks for buckets ``sizes`` (sorted), so that padding
    wastes little: the rest goes into the smallest bucket that holds it when that pads it by at
    most an eighth of the prompt (or by at most ``PAD_SLACK`` positions), else a full chunk of
    the largest bucket that it fills is taken first. A 1,056-token prompt with buckets 16, 64,
    ..., 1024, 2048 is 1,024 + 32 (in a 64 bucket), not 1,056 in 2,048."""
    chunks, start = [], 0
    while start < total:
        rest = total - start
        fit = smallest_at_least(sizes, rest)
        if fit >= rest and (fit - rest <= max(total // 8, PAD_SLACK) or fit == sizes[0]):
            take = rest
        else:  # the largest bucket the rest fills (one exists: the rest exceeds the smallest)
            take = max(s for s in sizes if s <= rest)
        chunks.append(take)
        start += take
    return chunks


def finish_reason(token: int, request: Request, eos_token: int) -> str:
    """The name of the reason a request ended with ``token`` (the device decided that it did, by
    ``runner.state.ends``)."""
    if token == eos_token and not request.ignore_eos:
        return "eos"
    return "stop" if token in request.stop_token_ids else "length"


def stop_ids(request: Request, eos_token: int) -> list[int]:
    """The ids that end ``request``: EOS first (unless it ignores EOS), then its stop tokens."""
    eos = [] if request.ignore_eos else [eos_token]
    return eos + sorted(set(request.stop_token_ids) - set(eos))


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request in the scheduler: waiting, then in a slot prefilling its prompt, then decoding."""

    request: Request
    ids: list[int]
    sink: object  # where its events go (runner.core.Sink)
    chunks: list[int]  # its prompt's chunk lengths (chunk_lengths), cut when it was submitted (again
    # when it is admitted after a cached prefix: the rest of the prompt)
    prompt_key: int = 0  # a hash of its prompt ids: requests with one prompt prefill it once
    slot: Optional[int] = None
    cached: int = 0  # prompt positions its first chunk reads from the prefix cache (set on admission)
    read_blocks: list = dataclasses.field(default_factory=list)  # the pool blocks holding them
    saved: int = 0  # prompt blocks in the prefix cache: read, or saved by a dispatched chunk
    detokenizer: object = None  # made when it is admitted
    matcher: object = None  # its grammar's state (runner.grammar.Matcher), for a structured output
    unread: int = 0  # dispatched calls that sample a token of it, not read yet (a structured output's)
    chunks_done: int = 0  # chunks dispatched (a dispatched chunk always computes all its tokens)
    prefilled: int = 0  # prompt tokens dispatched
    decode_steps: int = 0  # decode steps dispatched since its last chunk (an upper bound of its tokens)
    generated: int = 0  # tokens read back and emitted
    finished: bool = False
    scores: list = dataclasses.field(default_factory=list)  # its prompt's PromptLogprobs so far, if it asked
    speculative: int = 0  # the most draft tokens a step (Request.speculative, or the runner's); 0: off
    speculation: Speculation = Speculation()  # its speculative decoding so far, as read
    # DecodeOutput.ready by decode call: after that call, its next step may draft; and whether
    # that call accepted any of its drafted tokens
    ready: dict = dataclasses.field(default_factory=dict)
    accepting: dict = dataclasses.field(default_factory=dict)

    def drafting_pays(self, call: int) -> bool:
        """Whether its drafts were being accepted as of call ``call - 2`` (read by then, like
        ``may_draft``): a call for it may then take several speculative steps."""
        return self.accepting.get(call - 2, False)

    def may_draft(self, call: int) -> bool:
        """Whether decode call ``call`` should be speculative for it: as of call ``call - 2``,
        whose outputs are read by the time ``call`` is planned whether the core reads before it
        plans or after it dispatches (runner.core), so the choice, and the tokens, never depend
        on the host's timing. True before it took part in any."""
        return self.ready.get(call - 2, True)

    @property
    def scored(self) -> bool:
        """Its prompt is scored as it is prefilled (``Request.prompt_logprobs``)."""
        return self.request.prompt_logprobs is not None

    @property
    def decoding(self) -> bool:
        return self.chunks_done == len(self.chunks)

    @property
    def computed(self) -> int:
        """Positions of its slot's cache holding its tokens, as of the outputs read so far: the
        prompt, and every generated token but the last (the next step writes that one)."""
        return self.prefilled + max(self.generated - 1, 0)

    @property
    def dispatched(self) -> int:
        """Positions its slot's cache will hold once the calls dispatched so far have run, at most."""
        return self.prefilled + self.decode_steps


@dataclasses.dataclass
class PrefillRow:
    sequence: Sequence
    start: int  # the chunk's first prompt position
    length: int  # its real tokens


@dataclasses.dataclass
class Fork:
    """A waiting request with the same prompt as the request of prefill row ``row``: it takes a
    copy of that row's KV and samples its first token from that row's logits (``n`` > 1 prefills
    its prompt once)."""

    row: int
    sequence: Sequence


@dataclasses.dataclass
class RoundPlan:
    """What one round computes: prefill rows (one call, ``rows`` x ``bucket`` tokens, attending
    over ``prefill_kv_len`` positions, scoring every position with ``score``) and the forks of
    its last chunks, then ``decode`` slots (one call of ``decode_steps`` steps over
    ``decode_kv_len`` positions)."""

    prefill: list[PrefillRow]
    forks: list[Fork] = dataclasses.field(default_factory=list)
    score: bool = False
    rows: int = 0
    bucket: int = 0
    prefill_kv_len: int = 0
    decode: list[Sequence] = dataclasses.field(default_factory=list)
    decode_kv_len: int = 0
    decode_steps: int = 0
    # a speculative decode call's most draft tokens a step (0: a plain call), and the positions
    # each of its slots may advance at most (``Sequence.decode_steps`` is corrected when read)
    decode_speculative: int = 0
    decode_bounds: dict = dataclasses.field(default_factory=dict)
    decode_call: int = 0  # decode calls planned before this one


def row_buckets(batch_size: int) -> tuple[int, ...]:
    """Row counts a prefill call is padded to: powers of two below the batch size, and it (a
    padding row reaches no expert, so it costs a fraction of a real one)."""
    sizes, n = [], 1
    while n < batch_size:
        sizes.append(n)
        n *= 2
    return tuple(sizes) + (batch_size,)


class Scheduler:
    """The waiting queue, the slots and the requests in them; ``schedule()`` plans each round.

    ``pad_sizes`` are the prefill buckets, ``kv_buckets`` the KV lengths a call may attend over,
    ``budget`` the tokens a round may compute (``max_num_batched_tokens``); chunks are cut to
    buckets no larger than it."""

    def __init__(self, batch_size: int, pad_sizes: tuple[int, ...], kv_buckets: tuple[int, ...],
                 sequence_len: int, budget: int, decode_steps: int, eos_token: int,
                 prefix: Optional[PrefixCache] = None, *, vocab_size: int, speculative: int = 0):
        self.batch_size, self.sequence_len = batch_size, sequence_len
        self.speculative = speculative  # the most draft tokens a step (Request.speculative's default); 0: off
        self.prefix = prefix  # the prefix cache's index (None: off)
        # the prefill batch's block tables: a column per cache block (runner.state.PrefillBatch)
        self.blocks = sequence_len // prefix.block_size if prefix is not None else 0
        self.pool_blocks = prefix.num_blocks if prefix is not None else 0
        self.kv_buckets, self.budget, self.decode_steps = kv_buckets, budget, decode_steps
        self.eos_token, self.vocab_size = eos_token, vocab_size
        self.chunk_sizes = tuple(s for s in pad_sizes if s <= budget) or pad_sizes[:1]
        self.row_buckets = row_buckets(batch_size)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.slots: list[Optional[Sequence]] = [None] * batch_size
        self._admitted: list[Sequence] = []  # in slots and still prefilling, oldest first
        self.decode_calls = 0  # decode calls planned so far

    # ---- requests in and out ---------------------------------------------------------------------
    def add(self, request: Request, ids: list[int], sink) -> Sequence:
        sequence = Sequence(request, ids, sink, chunk_lengths(len(ids), self.chunk_sizes), hash(tuple(ids)))
        sequence.speculative = request.speculates(self.speculative)
        self.waiting.append(sequence)
        return sequence

    def find(self, request_id: str) -> Optional[Sequence]:
        """The waiting or running (not finished) sequence of ``request_id``."""
        for s in list(self.waiting) + [s for s in self.slots if s is not None]:
            if s.request.request_id == request_id and not s.finished:
                return s
        return None

    def finish(self, sequence: Sequence) -> None:
        """``sequence`` has ended: out of the queue or its slot, which is free from now on."""
        sequence.finished = True
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        if sequence.slot is not None and self.slots[sequence.slot] is sequence:
            self.slots[sequence.slot] = None
        if sequence in self._admitted:
            self._admitted.remove(sequence)

    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def free_slots(self) -> int:
        return self.slots.count(None)

    def kv_usage(self) -> tuple[int, int]:
        """(positions held by the running requests, positions the slots hold in all)."""
        return sum(s.computed for s in self.running()), self.batch_size * self.sequence_len

    # ---- the plan of a round ---------------------------------------------------------------------
    def schedule(self) -> RoundPlan:
        decoding = [s for s in self.slots if s is not None and s.decoding]
        left = self.budget - len(decoding)
        rows: list[PrefillRow] = []
        bucket = 0
        for sequence in self._candidates():
            if sequence.slot is None and self._leader_of(sequence, [r.sequence for r in rows]):
                continue  # it will copy the leader's prompt when the leader's last chunk is computed
            hit = self._cached_prefix(sequence) if sequence.slot is None else None
            length = hit[1][0] if hit else sequence.chunks[sequence.chunks_done]
            size = smallest_at_least(self.chunk_sizes, length)
            grown = max(bucket, size)
            if rows and (sequence.scored or length > left
                         or grown * smallest_at_least(self.row_buckets, len(rows) + 1) > self.budget):
                continue  # the oldest first; a later one that fits may join (the oldest left out leads soon)
            if sequence.slot is None:
                self._admit(sequence, hit)
            rows.append(PrefillRow(sequence, sequence.prefilled, length))
            left -= length
            bucket = grown
            if sequence.scored:
                break  # a scored chunk is a call of its own: one row, every position unembedded
        plan = RoundPlan(rows, score=bool(rows) and rows[0].sequence.scored)
        if rows:
            plan.rows = smallest_at_least(self.row_buckets, len(rows))
            plan.bucket = bucket
            plan.prefill_kv_len = smallest_at_least(self.kv_buckets, max(r.start + r.length for r in rows))
            for i, row in enumerate(rows):
                row.sequence.chunks_done += 1
                row.sequence.prefilled += row.length
                if row.sequence.decoding:
                    self._admitted.remove(row.sequence)
                    plan.forks += [Fork(i, s) for s in self._forks_of(row.sequence)]
        plan.decode = [s for s in self.slots if s is not None and s.decoding]
        if plan.decode:
            # beside a prefill, one step: the round (the streams' gap between tokens) stays one
            # chunk's prefill long, and a prompt's next chunk, or the next prompt, comes sooner
            # with every slot taken nothing new can start: twice the steps, half the host's work a token
            # structured outputs take one step a call (their next mask needs their token): a call
            # of them alone is one step
            full = not self.slots.count(None)
            alone = all(s.matcher is not None for s in plan.decode)
            steps = plan.decode_steps = 1 if rows or alone else self.decode_steps * (2 if full else 1)
            # a speculative call when a slot may draft and none has a grammar (whose mask needs its last token)
            plan.decode_call, self.decode_calls = self.decode_calls, self.decode_calls + 1
            if (any(s.speculative and s.may_draft(plan.decode_call) for s in plan.decode)
                    and not any(s.matcher is not None for s in plan.decode)):
                # one speculative step a call while no row's drafts are being accepted (probing:
                # the host learns two calls late that none may draft any more, Sequence.may_draft);
                # the plain call's steps while one's are (its text repeats: a longer call costs the
                # host less a token)
                plan.decode_speculative = self.speculative
                if not any(s.speculative and s.drafting_pays(plan.decode_call) for s in plan.decode):
                    steps = plan.decode_steps = 1
            for s in plan.decode:  # positions each may advance: a step's token and its draft
                plan.decode_bounds[s.slot] = steps * (1 + (s.speculative if plan.decode_speculative else 0))
            plan.decode_kv_len = smallest_at_least(
                self.kv_buckets, max(s.dispatched + plan.decode_bounds[s.slot] for s in plan.decode))
            for s in plan.decode:
                s.decode_steps += plan.decode_bounds[s.slot]
        return plan

    def _leader_of(self, sequence: Sequence, scheduled: list[Sequence]) -> Optional[Sequence]:
        """A request with ``sequence``'s prompt that is being prefilled (or is this round)."""
        for other in self._admitted + scheduled:
            if _copies(sequence, other):
                return other
        return None

    def _forks_of(self, leader: Sequence) -> list[Sequence]:
        """Waiting requests with ``leader``'s prompt, admitted into free slots as its copies."""
        out = []
        for sequence in list(self.waiting):
            if not self.slots.count(None):
                break
            if _copies(sequence, leader):
                self.waiting.remove(sequence)
                sequence.slot = self.slots.index(None)
                self.slots[sequence.slot] = sequence
                sequence.chunks_done, sequence.prefilled = len(sequence.chunks), len(sequence.ids)
                out.append(sequence)
        return out

    def saves(self, row: PrefillRow) -> list[tuple[int, int]]:
        """Pool blocks for the prompt blocks that ``row``'s chunk completes (``PrefixCache.allocate``):
        ``(block number, pool block)`` pairs, written by the call that computes the chunk."""
        if self.prefix is None:
            return []
        s = row.sequence
        end = (row.start + row.length) // self.prefix.block_size
        out = self.prefix.allocate(s.ids, s.saved, end)
        s.saved = end
        return out

    def empty_batch(self, rows: int, bucket: int) -> PrefillBatch:
        """``empty_batch`` with this scheduler's block tables."""
        return empty_batch(rows, bucket, self.batch_size, self.blocks, self.pool_blocks, vocab_size=self.vocab_size)

    def unfork(self, sequence: Sequence) -> None:
        """``sequence`` cannot copy its prompt after all (its leader failed): it prefills it itself,
        in the slot it has, first among the prompts in slots."""
        sequence.chunks_done = sequence.prefilled = sequence.decode_steps = 0
        self._admitted.insert(0, sequence)

    def _candidates(self):
        """Prompts to prefill, oldest first: those already in slots, then waiting ones while a
        slot is free for them."""
        yield from list(self._admitted)
        free = self.slots.count(None)
        for sequence in list(self.waiting):
            if free == 0:
                return
            free -= 1
            yield sequence

    def _cached_prefix(self, sequence: Sequence) -> Optional[tuple[list, list[int]]]:
        """The prefix cache's blocks for a waiting ``sequence``'s prompt, and the chunks of the rest
        of it; None if it has none, or needs its prompt computed: a scored prompt needs every
        position's logits, and a repetition penalty every prompt token in its row's history
        (``DecodeState.with_prompts``)."""
        if self.prefix is None or sequence.scored or sequence.request.repetition_penalty != 1:
            return None
        blocks = self.prefix.match(sequence.ids)
        if not blocks:
            return None
        return blocks, chunk_lengths(len(sequence.ids) - len(blocks) * self.prefix.block_size, self.chunk_sizes)

    def _admit(self, sequence: Sequence, hit: Optional[tuple[list, list[int]]] = None) -> None:
        """Into a free slot; with ``hit`` (``_cached_prefix``, this round) its prompt starts after
        the cached blocks, which its first chunk reads."""
        if self.prefix is not None and not sequence.scored:
            self.prefix.use(sequence.ids, hit[0] if hit else [])
        if hit:
            blocks, sequence.chunks = hit
            sequence.read_blocks = [b.index for b in blocks]
            sequence.cached = sequence.prefilled = len(blocks) * self.prefix.block_size
            sequence.saved = len(blocks)
        self.waiting.remove(sequence)
        sequence.slot = self.slots.index(None)
        self.slots[sequence.slot] = sequence
        self._admitted.append(sequence)

    def step_counts(self) -> set[int]:
        """Every number of steps a decode call of ``schedule`` can take."""
        return {1, self.decode_steps, 2 * self.decode_steps}

    def prefill_shapes(self, score: bool = False) -> set[tuple[int, int, int]]:
        """Every (rows, bucket, KV length) a prefill call of ``schedule`` can have: a call's padded
        size fits the budget (or it is one row), and its KV length covers a chunk of its bucket.
        With ``score``, those of a scoring call (always one row)."""
        if score:
            return {shape for shape in self.prefill_shapes() if shape[0] == 1}
        shapes = set()
        for i, t in enumerate(self.chunk_sizes):
            shortest = self.chunk_sizes[i - 1] + 1 if i else 1  # the longest chunk of a call of bucket t
            for kv in self.kv_buckets:
                if kv < smallest_at_least(self.kv_buckets, shortest):
                    continue
                for p in self.row_buckets:
                    if p == 1 or p * t <= self.budget:
                        shapes.add((p, t, kv))
        return shapes


def _copies(sequence: Sequence, leader: Sequence) -> bool:
    """``sequence`` may copy ``leader``'s prefill: the same prompt, and the same prompt scores if
    it asks for them (a copy shares its leader's)."""
    return (sequence.prompt_key == leader.prompt_key and sequence.ids == leader.ids
            and sequence.request.prompt_logprobs in (None, leader.request.prompt_logprobs))


def prefill_row(batch: PrefillBatch, i: int, row: PrefillRow, eos_token: int) -> None:
    """Write ``row`` (a chunk of one request) as row ``i`` of the host arrays of ``batch``."""
    s = row.sequence
    batch.tokens[i, : row.length] = s.ids[row.start: row.start + row.length]
    batch.lengths[i] = row.length
    batch.reset[i] = row.start == s.cached  # its first chunk
    if batch.reset[i] and s.cached:
        batch.cached[i] = s.cached
        batch.read[i, : len(s.read_blocks)] = s.read_blocks
    batch.last[i] = row.start + row.length == len(s.ids)
    # position j predicts prompt token j + 1: what a scoring prefill scores (the last predicts none)
    targets = s.ids[row.start + 1: row.start + row.length + 1]
    batch.targets[i, : len(targets)] = targets
    request_row(batch, i, s, eos_token)


def request_row(batch: PrefillBatch, i: int, sequence: Sequence, eos_token: int) -> None:
    """The slot and settings of ``sequence``'s request in row ``i`` of ``batch``."""
    request = sequence.request
    batch.slots[i] = sequence.slot
    settings = batch.settings
    settings.temperature[i], settings.nucleus_p[i], settings.top_k[i] = (request.temperature, request.nucleus_p,
                                                                          request.top_k)
    settings.logprobs[i] = -1 if request.logprobs is None else request.logprobs
    for name in ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        getattr(settings, name)[i] = getattr(request, name)
    batch.seed[i] = seed_key(request.rng_seed if request.rng_seed is not None else default_seed(request))
    batch.max_len[i] = request.max_len
    batch.min_tokens[i] = request.min_tokens
    batch.speculative[i] = sequence.speculative
    stop = stop_ids(request, eos_token)
    batch.stop_ids[i, : len(stop)] = stop


def empty_batch(rows: int, bucket: int, batch_size: int, blocks: int = 0, pool_blocks: int = 0, *,
                vocab_size: int) -> PrefillBatch:
    """A prefill batch of padding rows only (slot = batch size), as host arrays; its prefix cache
    tables have ``blocks`` columns and name no block (``pool_blocks``: the pool's size); its masks
    ``ceil(vocab_size / 32)`` words, all off."""
    return PrefillBatch(
        slots=np.full((rows,), batch_size, np.int32), tokens=np.zeros((rows, bucket), np.int32),
        lengths=np.zeros((rows,), np.int32), reset=np.zeros((rows,), bool), last=np.zeros((rows,), bool),
        settings=SampleSettings.host(rows), seed=np.zeros((rows, 2), np.uint32),
        max_len=np.ones((rows,), np.int32), min_tokens=np.zeros((rows,), np.int32),
        speculative=np.zeros((rows,), np.int32),
        stop_ids=np.full((rows, MAX_STOP_IDS), -1, np.int32),
        mask=np.zeros((rows, -(-vocab_size // 32)), np.uint32), masked=np.zeros((rows,), bool),
        targets=np.full((rows, bucket), -1, np.int32), cached=np.zeros((rows,), np.int32),
        read=np.zeros((rows, blocks), np.int32), save=np.full((rows, blocks), pool_blocks, np.int32))


def seed_key(seed: int) -> np.ndarray:
    """A seed's PRNG key: its 64 bits (mod 2**64) as two uint32 words, high first
    (``runner.requests.SEED_LIMIT``): ``jax.random.PRNGKey(seed)`` for a seed below 2**32."""
    bits = seed % 2**64
    return np.array([bits >> 32, bits & 0xFFFFFFFF], np.uint32)


def default_seed(request: Request) -> int:
    """The seed of a request that names none: derived from its id, so every process of a
    multi-host run draws the same tokens (each runs the same scheduler on the same requests)."""
    return zlib.crc32(request.request_id.encode())
