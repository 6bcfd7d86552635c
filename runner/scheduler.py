"""``Scheduler``: the waiting and running requests, the batch slots and every KV block (the prefix
cache's index: nothing else changes it), and the plan of each round.

Each round the engine asks for a ``RoundPlan`` and runs it: at most one prefill call, whose
rows are prompt chunks of several requests (a row per request, packed into one row of tokens
padded to a bucket), then
one decode call that advances every decoding slot by ``decode_steps`` tokens (by one beside a
prefill, so that a round stays about one budget's worth of prefill long; by twice as many while
every slot is taken, when no new request could start sooner anyway). The plan keeps
under a token budget (``max_num_batched_tokens``, vLLM's name): the decoding slots count one token
each, and prompt chunks are added, oldest request first, where their tokens fit in what is
left and in the largest bucket. The first chunk of a
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
slot's exact number of computed positions as of the outputs it has read (``RequestState.computed``),
and an upper bound of what is in flight (``RequestState.dispatched``), which picks the KV bucket.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from runner.prefix_cache import PrefixCache
from runner.requests import Request
from runner.speculative import Drafting, plan_call
from runner.state import CHUNK_ALIGN

# Padding a prompt's last chunk by this many positions costs less than one more device call (at
# small chunk sizes a prefill call's time goes to reading the weights, not to its positions).
PAD_SLACK = 64


def smallest_at_least(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of the sorted ``sizes`` that is >= ``n``, else the largest."""
    return next((size for size in sizes if size >= n), sizes[-1])


def every_other_from_top(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The largest of the sorted ``sizes``, the third largest, ...: (64, 256, 1024, 2048) ->
    (256, 2048)."""
    return tuple(sorted(sizes[::-1][::2]))


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


@dataclasses.dataclass(eq=False)
class RequestState:
    """A request in the scheduler: waiting, then in a slot prefilling its prompt, then decoding.
    The scheduler owns its slot, chunks and positions; the output processor
    (``runner/outputs.py``) its ``detokenizer``, ``matcher`` and ``scores``."""

    request: Request
    ids: list[int]
    sink: object  # where its events go (runner.engine.Sink)
    chunks: list[int]  # its prompt's chunk lengths (chunk_lengths), cut when it was submitted (again
    # when it is admitted after a cached prefix: the rest of the prompt)
    prompt_key: int = 0  # a hash of its prompt ids: requests with one prompt prefill it once
    slot: Optional[int] = None
    cached: int = 0  # prompt positions its first chunk reads from the prefix cache (set on admission)
    read_blocks: list = dataclasses.field(default_factory=list)  # the pool blocks holding them
    saved: int = 0  # prompt blocks in the prefix cache: read, or saved by a dispatched chunk
    detokenizer: object = None  # made when it is admitted
    stops: object = None  # its stop strings' matcher (runner.stops.StopMatcher), if it has any
    matcher: object = None  # its grammar's state (runner.grammar.Matcher), for a structured output
    unread: int = 0  # dispatched calls that sample a token of it, not read yet (a structured output's)
    chunks_done: int = 0  # chunks dispatched (a dispatched chunk always computes all its tokens)
    prefilled: int = 0  # prompt tokens dispatched
    decode_positions: int = 0  # positions its decode calls may have added since its last chunk, at most
    generated: int = 0  # tokens read back and emitted
    finished: bool = False
    scores: list = dataclasses.field(default_factory=list)  # its prompt's PromptLogprobs so far, if it asked
    drafting: Optional[Drafting] = None  # its speculative decoding's control (runner.speculative); None: off

    @property
    def speculative(self) -> int:
        """The most draft tokens a step it may verify (0: it does not speculate)."""
        return self.drafting.k if self.drafting is not None else 0

    @property
    def constrained(self) -> bool:
        """A structured output (``Request.json_schema``): each call samples one token of it under its grammar's mask."""
        return self.request.json_schema is not None

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
        return self.prefilled + self.decode_positions


@dataclasses.dataclass
class PrefillRow:
    sequence: RequestState
    start: int  # the chunk's first prompt position
    length: int  # its real tokens
    offset: int = 0  # where its tokens start in the call's packed row of tokens


@dataclasses.dataclass
class Fork:
    """A waiting request with the same prompt as the request of prefill row ``row``: it takes a
    copy of that row's KV and samples its first token from that row's logits (``n`` > 1 prefills
    its prompt once)."""

    row: int
    sequence: RequestState


@dataclasses.dataclass
class RoundPlan:
    """What one round computes: prefill rows (one call of ``rows`` rows, their chunks packed into
    ``bucket`` tokens, scoring every position with ``score``) and the forks of its last chunks,
    then ``decode`` slots (one call of ``decode_steps`` steps over ``decode_kv_len`` positions)."""

    prefill: list[PrefillRow]
    forks: list[Fork] = dataclasses.field(default_factory=list)
    score: bool = False
    rows: int = 0
    bucket: int = 0
    decode: list[RequestState] = dataclasses.field(default_factory=list)
    decode_kv_len: int = 0
    decode_steps: int = 0
    # a speculative decode call's most draft tokens a step (0: a plain call), and the positions
    # each of its slots may advance at most (``RequestState.decode_positions`` is corrected when read)
    decode_speculative: int = 0
    decode_bounds: dict = dataclasses.field(default_factory=dict)
    decode_call: int = 0  # decode calls planned before this one


class Scheduler:
    """The waiting queue, the slots and the requests in them; ``schedule()`` plans each round.

    ``pad_sizes`` are the prefill buckets, ``kv_buckets`` the KV lengths a call may attend over,
    ``budget`` the tokens a round may compute (``max_num_batched_tokens``); chunks are cut to
    buckets no larger than it."""

    def __init__(self, batch_size: int, pad_sizes: tuple[int, ...], kv_buckets: tuple[int, ...],
                 sequence_len: int, budget: int, decode_steps: int,
                 prefix: Optional[PrefixCache] = None, *, speculative: int = 0):
        self.batch_size, self.sequence_len = batch_size, sequence_len
        self.speculative = speculative  # the most draft tokens a step (Request.speculative's default); 0: off
        self.prefix = prefix  # the prefix cache's index (None: off)
        self.pool_blocks = prefix.num_blocks if prefix is not None else 0
        self.kv_buckets, self.budget, self.decode_steps = kv_buckets, budget, decode_steps
        self.chunk_sizes = tuple(s for s in pad_sizes if s <= budget) or pad_sizes[:1]
        # A prefill call packs its rows' chunks into one row of tokens padded to a chunk size,
        # each token attending to its own slot's positions up to its own: a variant a bucket,
        # whatever the rows or their positions (every variant is compiled, or loaded, at start:
        # BENCHMARKS.md, "Start-up"). A scored chunk (one row, every position unembedded) is
        # padded to every other bucket from the largest.
        self.score_sizes = every_other_from_top(self.chunk_sizes)
        # each chunk of a call starts at a multiple of this (``runner.state.CHUNK_ALIGN``, or the
        # smallest bucket where that is smaller: two of its chunks still share a call)
        self.align = min(CHUNK_ALIGN, self.chunk_sizes[0])
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.slots: list[Optional[RequestState]] = [None] * batch_size
        self._admitted: list[RequestState] = []  # in slots and still prefilling, oldest first
        self.decode_calls = 0  # decode calls planned so far

    # ---- requests in and out ---------------------------------------------------------------------
    def add(self, request: Request, ids: list[int], sink) -> RequestState:
        sequence = RequestState(request, ids, sink, chunk_lengths(len(ids), self.chunk_sizes), hash(tuple(ids)))
        k = request.speculates(self.speculative)
        sequence.drafting = Drafting(k) if k else None
        self.waiting.append(sequence)
        return sequence

    def find(self, request_id: str) -> Optional[RequestState]:
        """The waiting or running (not finished) sequence of ``request_id``."""
        for s in list(self.waiting) + [s for s in self.slots if s is not None]:
            if s.request.request_id == request_id and not s.finished:
                return s
        return None

    def finish(self, sequence: RequestState) -> None:
        """``sequence`` has ended: out of the queue or its slot, which is free from now on."""
        sequence.finished = True
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        if sequence.slot is not None and self.slots[sequence.slot] is sequence:
            self.slots[sequence.slot] = None
        if sequence in self._admitted:
            self._admitted.remove(sequence)

    def running(self) -> list[RequestState]:
        return [s for s in self.slots if s is not None]

    def free_slots(self) -> int:
        return self.slots.count(None)

    def kv_usage(self) -> tuple[int, int]:
        """(positions held by the running requests, positions the slots hold in all)."""
        return sum(s.computed for s in self.running()), self.batch_size * self.sequence_len

    # ---- the plan of a round ---------------------------------------------------------------------
    def schedule(self) -> RoundPlan:
        """This round's plan: prompt chunks under the budget (``_plan_prefill``), their forks, and
        one decode call of every decoding slot (``_plan_decode``)."""
        plan = self._plan_prefill()
        self._plan_decode(plan)
        return plan

    def _plan_prefill(self) -> RoundPlan:
        decoding = [s for s in self.slots if s is not None and s.decoding]
        left = self.budget - len(decoding)
        packed = 0  # the call's chunks so far, each aligned: they fit in the largest bucket
        rows: list[PrefillRow] = []
        for sequence in self._candidates():
            if sequence.slot is None and self._leader_of(sequence, [r.sequence for r in rows]):
                continue  # it will copy the leader's prompt when the leader's last chunk is computed
            hit = self._cached_prefix(sequence) if sequence.slot is None else None
            length = hit[1][0] if hit else sequence.chunks[sequence.chunks_done]
            offset = -(-packed // self.align) * self.align
            if rows and (sequence.scored or length > left or offset + length > self.chunk_sizes[-1]):
                continue  # the oldest first; a later one that fits may join (the oldest left out leads soon)
            if sequence.slot is None:
                self._admit(sequence, hit)
            rows.append(PrefillRow(sequence, sequence.prefilled, length, offset))
            left -= length
            packed = offset + length
            if sequence.scored:
                break  # a scored chunk is a call of its own: one row, every position unembedded
        plan = RoundPlan(rows, score=bool(rows) and rows[0].sequence.scored)
        if rows:
            plan.rows = self.batch_size
            plan.bucket = smallest_at_least(self.score_sizes if plan.score else self.chunk_sizes, packed)
            for i, row in enumerate(rows):
                row.sequence.chunks_done += 1
                row.sequence.prefilled += row.length
                if row.sequence.decoding:
                    self._admitted.remove(row.sequence)
                    plan.forks += [Fork(i, s) for s in self._forks_of(row.sequence)]
        return plan

    def _plan_decode(self, plan: RoundPlan) -> None:
        """The plan's decode call. Beside a prefill, one step: the round (the streams' gap between
        tokens) stays one chunk's prefill long, and a prompt's next chunk, or the next prompt,
        comes sooner. With every slot taken nothing new can start: twice the steps, half the
        host's work a token. Structured outputs take one step a call (their next mask needs their
        token): a call of them alone is one step. Whether it is speculative, and then its steps,
        is speculation's rule (``runner.speculative.plan_call``)."""
        plan.decode = [s for s in self.slots if s is not None and s.decoding]
        if not plan.decode:
            return
        full = not self.slots.count(None)
        alone = all(s.constrained for s in plan.decode)
        steps = 1 if plan.prefill or alone else self.decode_steps * (2 if full else 1)
        plan.decode_call, self.decode_calls = self.decode_calls, self.decode_calls + 1
        plan.decode_speculative, plan.decode_steps = plan_call(
            [s.drafting for s in plan.decode if s.drafting is not None], plan.decode_call, self.speculative, steps,
            constrained=any(s.constrained for s in plan.decode))
        for s in plan.decode:  # positions each may advance: a step's token and its draft
            plan.decode_bounds[s.slot] = plan.decode_steps * (1 + (s.speculative if plan.decode_speculative else 0))
        plan.decode_kv_len = smallest_at_least(
            self.kv_buckets, max(s.dispatched + plan.decode_bounds[s.slot] for s in plan.decode))
        for s in plan.decode:
            s.decode_positions += plan.decode_bounds[s.slot]

    # ---- what the calls did ----------------------------------------------------------------------
    def update_from_decode(self, call: int, bounds: dict[int, int], out, rows: dict[int, RequestState]) -> None:
        """Decode call ``call``'s outputs (host arrays), before its tokens are emitted: the
        positions each row was planned to advance at most (``bounds``) become the tokens it
        generated (``RequestState.decode_positions`` is exact again once read), and a speculating
        request's control reads what the call did."""
        generated = out.valid.sum(axis=0)
        for column, sequence in rows.items():
            n = int(generated[column])
            sequence.decode_positions -= bounds[column] - n
            if sequence.drafting is not None:
                sequence.drafting.read(call, out, column, n)

    def prefill_dispatched(self) -> None:
        """A prefill call was dispatched: the prefix blocks it writes may be read by later calls."""
        if self.prefix is not None:
            self.prefix.commit()

    def row_dropped(self, save_blocks) -> None:
        """A prefill row was left out of its call (its request failed first): the pool blocks it
        would have written (``PrefillBatch.save``'s row) are free again."""
        if self.prefix is not None:
            self.prefix.drop([int(b) for b in save_blocks if b < self.pool_blocks])

    def state_lost(self) -> list[RequestState]:
        """A device call failed and took the device state with it: every running request ends (they
        are returned), and the prefix pool's contents are forgotten."""
        running = self.running()
        for sequence in running:
            self.finish(sequence)
        if self.prefix is not None:
            self.prefix.clear()
        return running

    def only_constrained(self) -> bool:
        """Every running request is a structured output (each call samples one token of each)."""
        running = self.running()
        return bool(running) and all(s.constrained for s in running)

    def _leader_of(self, sequence: RequestState, scheduled: list[RequestState]) -> Optional[RequestState]:
        """A request with ``sequence``'s prompt that is being prefilled (or is this round)."""
        for other in self._admitted + scheduled:
            if _copies(sequence, other):
                return other
        return None

    def _forks_of(self, leader: RequestState) -> list[RequestState]:
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

    def unfork(self, sequence: RequestState) -> None:
        """``sequence`` cannot copy its prompt after all (its leader failed): it prefills it itself,
        in the slot it has, first among the prompts in slots."""
        sequence.chunks_done = sequence.prefilled = sequence.decode_positions = 0
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

    def _cached_prefix(self, sequence: RequestState) -> Optional[tuple[list, list[int]]]:
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

    def _admit(self, sequence: RequestState, hit: Optional[tuple[list, list[int]]] = None) -> None:
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

    def prefill_shapes(self, score: bool = False) -> set[tuple[int, int]]:
        """Every (rows, bucket) a prefill call of ``schedule`` can have: the batch's rows, its chunks
        packed into a chunk size. With ``score``, those of a scoring call (one real row)."""
        return {(self.batch_size, t) for t in (self.score_sizes if score else self.chunk_sizes)}


def _copies(sequence: RequestState, leader: RequestState) -> bool:
    """``sequence`` may copy ``leader``'s prefill: the same prompt, and the same prompt scores if
    it asks for them (a copy shares its leader's)."""
    return (sequence.prompt_key == leader.prompt_key and sequence.ids == leader.ids
            and sequence.request.prompt_logprobs in (None, leader.request.prompt_logprobs))
