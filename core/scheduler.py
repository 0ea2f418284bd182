"""The LLM scheduler: decides, each step, which sequences run how many tokens.

`token-budget` (iteration-level batching): every decoding sequence gets one token, then prefill
chunks fill the rest of `max_batch_tokens`, earliest deadline first, a prompt's deadline being
its arrival plus its length on the clock of tokens the engine has run (so a one-image question
goes before a video that came a little earlier, and a passed-over prefill gets its turn once the
engine has run as many tokens as it is long); waiting requests are admitted into what is left,
tenants taking turns. A prefill whose remaining prompt costs more than the nearest-to-done
decoding sequence still has to run (`decode_step_tokens` prefill tokens per decode step) sits
out steps that have decoders, so a short answer is not slowed to the pace of a video's prefill;
past its deadline it no longer yields. `request-count` admits up to `batch_size` requests only
when nothing is running and runs that batch to completion; `none` is the same with one request.
When a sequence needs a block and none is free, the most recently admitted running sequence is
preempted: its blocks go back to the pool and it waits at the front of the queue, to be
recomputed (its prefix is usually still in the cache, so recomputation is cheap).

A step on vLLM v1's lines: `schedule()` decides and allocates blocks, the model runner runs the
`SchedulerOutput`, and `update()` appends the sampled tokens and ends a request on EOS, a complete
grammar, its length or a failure the runner reports. `update` and `finish_requests` (aborts from
outside a step) are the only places a request finishes or frees its blocks. The runner holds EOS
back until `min_new_tokens` (unless the grammar allows nothing else, when it reports the grammar
complete); an EOS before then without that is a runner bug, and ends the request as INTERNAL.

Block bookkeeping lives in `KVCacheManager`; this module only decides. It holds no tensors and
never imports torch: scheduler tests run with no model.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from core.config import Policy, SchedulerConfig
from core.kv_cache import Block, ImageSpan, KVCacheManager
from core.outputs import (
    EngineOutput,
    NewRequestData,
    RunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
)
from core.sequence import RequestStatus, Sequence
from shared.errors import Reason


@dataclass(slots=True)
class _Plan:
    token_budget: int  # tokens left this step
    chunks: dict[Sequence, int] = field(default_factory=dict)  # insertion-ordered
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        eos_ids: Iterable[int],
        tile: int,
        whole_images: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        """`tile`: prefill chunks end on multiples of it (the runner's batch-invariant tile).
        `whole_images`: the model sees an image's tokens both ways, so no prefill chunk ends
        inside one (a chunk may start inside one: a prefix hit whose cached keys saw the whole
        image). `sliding_window`: every layer of the model attends that far back only, so a
        sequence's blocks behind it go back to the pool (None: some layer is global)."""
        self.whole_images, self.sliding_window = whole_images, sliding_window
        self.policy = Policy(config.policy)
        self.token_budget = self.policy is Policy.TOKEN_BUDGET  # the baselines stay FIFO
        self.kv = KVCacheManager(num_blocks, config.block_size, config.prefix_caching)
        self.eos_ids = frozenset(eos_ids)
        self.tile = tile
        self.max_batch_tokens = config.max_batch_tokens if self.token_budget else sys.maxsize
        self.max_num_seqs = {
            Policy.TOKEN_BUDGET: config.max_num_seqs,
            Policy.REQUEST_COUNT: config.batch_size,
        }.get(self.policy, 1)
        self.decode_step_tokens = config.decode_step_tokens if self.token_budget else 0
        self.chunked_prefill = config.chunked_prefill and self.token_budget
        self.max_prefill_chunk = config.max_prefill_chunk if self.chunked_prefill else sys.maxsize
        self.clock = 0  # tokens scheduled so far: a request's age is measured in them
        self.running: list[Sequence] = []
        self._preempted: deque[Sequence] = deque()  # served before any tenant queue
        self._waiting: dict[str, deque[Sequence]] = {}  # per tenant, FIFO
        self._turns: deque[str] = deque()  # tenants with waiting requests, next one first
        self._requests: dict[int, Sequence] = {}  # every unfinished request, by seq_id
        self._inputs: dict[int, NewRequestData] = {}  # for the runner, until first scheduled
        self._finished_ids: list[int] = []  # finished since the last schedule()
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self._preempted) + sum(len(q) for q in self._waiting.values())

    def has_work(self) -> bool:
        """Requests to run, or finished ones the runner has not heard of yet."""
        return bool(self.running or self._finished_ids) or self.num_waiting > 0

    def add(self, seq: Sequence, inputs: NewRequestData) -> None:
        seq.arrival_clock = self.clock
        self._requests[seq.seq_id] = seq
        self._inputs[seq.seq_id] = inputs
        if seq.tenant not in self._waiting:
            self._waiting[seq.tenant] = deque()
            self._turns.append(seq.tenant)
        self._waiting[seq.tenant].append(seq)

    def schedule(self) -> SchedulerOutput:
        plan = _Plan(self.max_batch_tokens)
        self._schedule_running(plan)
        if not plan.preempted and (self.token_budget or not plan.chunks):
            self._admit(plan)
        now = time.perf_counter()
        new, chunks = [], []
        for seq, n in plan.chunks.items():
            inputs = self._inputs.pop(seq.seq_id, None)
            if inputs is not None:
                new.append(inputs)
                seq.first_scheduled = now
            start = seq.num_computed_tokens
            blocks = tuple(b.block_id for b in self.kv.tables[seq.seq_id])
            chunks.append(ScheduledChunk(seq.seq_id, start, n, blocks, start + n == seq.num_tokens))
        num_tokens = sum(plan.chunks.values())
        self.clock += num_tokens
        finished, self._finished_ids = tuple(self._finished_ids), []
        preempted = tuple(s.seq_id for s in plan.preempted)
        return SchedulerOutput(tuple(new), tuple(chunks), num_tokens, preempted, finished)

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[EngineOutput]:
        """Records a step the runner ran: progress, the blocks that became full, each sampled
        token; finishes a request on EOS, a complete grammar, its length, or its failure."""
        outputs = []
        size = self.kv.block_size
        for chunk in out.chunks:
            seq = self._requests[chunk.seq_id]
            failure = self._failure(seq, chunk, result)
            if failure is not None:
                self._finish(seq, RequestStatus.FINISHED_ABORTED)
                outputs.append(
                    EngineOutput(seq.seq_id, None, None, seq.num_output_tokens, seq.status, failure)
                )
                continue
            seq.num_computed_tokens += chunk.num_tokens
            full = seq.num_computed_tokens // size
            self.kv.register_full_blocks(seq.seq_id, seq.hashes_upto(full, size))
            if self.sliding_window is not None:
                self.kv.free_behind(seq.seq_id, seq.num_computed_tokens, self.sliding_window)
            if chunk.sample:
                outputs.append(self._append(seq, result.sampled[seq.seq_id], result))
        return outputs

    def _failure(self, seq: Sequence, chunk: ScheduledChunk, result: RunnerOutput) -> Reason | None:
        """Why `seq` ends failed this step: its error in the runner, or an answer that breaks
        the runner's side of the step (no token for a sampling chunk; EOS before
        min_new_tokens while its grammar, if any, allowed more), ended as INTERNAL rather
        than run on."""
        failure = result.errors.get(seq.seq_id)
        if failure is not None or not chunk.sample:
            return failure
        token = result.sampled.get(seq.seq_id)
        if token is None:
            return Reason.INTERNAL
        early = seq.num_output_tokens < seq.params.min_new_tokens
        if token in self.eos_ids and early and seq.seq_id not in result.grammar_done:
            return Reason.INTERNAL
        return None

    def _append(self, seq: Sequence, token: int, result: RunnerOutput) -> EngineOutput:
        seq.token_ids.append(token)
        if seq.num_output_tokens == 1:
            seq.first_token = time.perf_counter()
        eos = token in self.eos_ids
        if eos or seq.seq_id in result.grammar_done:
            self._finish(seq, RequestStatus.FINISHED_STOPPED)
        elif seq.num_output_tokens >= seq.params.max_new_tokens:
            self._finish(seq, RequestStatus.FINISHED_LENGTH)
        if eos:  # ends the request without being streamed
            return EngineOutput(seq.seq_id, None, None, seq.num_output_tokens, seq.status)
        lp = result.logprobs.get(seq.seq_id)
        return EngineOutput(seq.seq_id, token, lp, seq.num_output_tokens, seq.status)

    def finish_requests(self, seq_ids: Iterable[int], status: RequestStatus) -> None:
        """Ends requests from outside a step (their caller went away, or a stop string matched
        on the caller's side); ids already finished are ignored."""
        for seq_id in seq_ids:
            seq = self._requests.get(seq_id)
            if seq is not None:
                self._finish(seq, status)

    def _finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Frees the blocks at once; the runner drops the request's state at the next step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self._preempted:
            self._preempted.remove(seq)
        elif seq in self._waiting.get(seq.tenant, ()):
            self._waiting[seq.tenant].remove(seq)
            self._drop_idle_tenant(seq.tenant)
        self.kv.free(seq.seq_id)
        seq.status = status
        del self._requests[seq.seq_id]
        self._inputs.pop(seq.seq_id, None)
        self._finished_ids.append(seq.seq_id)

    def _num_new(self, seq: Sequence, computed: int, budget: int) -> int:
        """Tokens `seq` may run now: the rest of its prompt, a chunk of it ending on a tile
        boundary, or one token once the prompt is in (decode, or replay after preemption)."""
        if computed >= seq.num_prompt_tokens:
            return min(1, budget)
        budget = min(budget, self.max_prefill_chunk)  # one long prompt leaves room for others
        remaining = seq.num_prompt_tokens - computed
        if remaining <= budget:
            return remaining
        if not self.chunked_prefill:
            return 0
        n = max(0, (computed + budget) // self.tile * self.tile - computed)
        return self._whole_images(seq, computed, computed + n) - computed if n else 0

    def _whole_images(self, seq: Sequence, computed: int, end: int) -> int:
        """A prefill chunk's end moved off any image the model sees both ways: back to the
        tile boundary before the image, or past its end (over the step's budget) when that
        would leave nothing to run."""
        if not self.whole_images:
            return end
        while (span := _inside(seq, end)) is not None:
            back = span.start // self.tile * self.tile
            if back > computed and _inside(seq, back) is None:
                return back
            end = min(seq.num_prompt_tokens, -(-span.end // self.tile) * self.tile)
        return end

    def _prefill_order(self, seq: Sequence) -> tuple[int, int]:
        """Earliest deadline first; a prompt's deadline is its arrival plus its length, both on
        the clock of tokens the engine has run."""
        return (seq.arrival_clock + seq.num_prompt_tokens, seq.seq_id)

    def _yields(self, seq: Sequence, plan: _Plan) -> bool:
        """True when `seq`'s prefill should sit this step out for a decoder that is nearly done:
        its remaining prompt costs more than that decoder's remaining steps (never once `seq`
        is past its deadline)."""
        if not self.decode_step_tokens or self._prefill_order(seq)[0] <= self.clock:
            return False
        left = [
            s.params.max_new_tokens - s.num_output_tokens for s in plan.chunks if not s.in_prefill
        ]
        remaining = seq.num_prompt_tokens - seq.num_computed_tokens
        return bool(left) and remaining > self.decode_step_tokens * min(left)

    def _schedule_running(self, plan: _Plan) -> None:
        decoding = [s for s in self.running if not s.in_prefill]
        prefilling = [s for s in self.running if s.in_prefill]
        if self.token_budget:
            prefilling.sort(key=self._prefill_order)
        for seq in decoding + prefilling:
            if seq.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.in_prefill and self._yields(seq, plan):
                continue
            n = self._num_new(seq, seq.num_computed_tokens, plan.token_budget)
            if n > 0 and self._grow(seq, seq.num_computed_tokens + n, plan):
                plan.chunks[seq] = n
                plan.token_budget -= n

    def _grow(self, seq: Sequence, num_tokens: int, plan: _Plan) -> bool:
        """Finds blocks for `seq`, preempting the newest running sequences as needed; False when
        `seq` itself had to go."""
        while not self.kv.can_allocate(seq.seq_id, num_tokens, []):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self.kv.allocate(seq.seq_id, num_tokens, [])
        return True

    def _preempt(self, victim: Sequence, plan: _Plan) -> None:
        self.running.remove(victim)
        self.kv.free(victim.seq_id)
        plan.token_budget += plan.chunks.pop(victim, 0)
        plan.preempted.append(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted.appendleft(victim)

    def _admit(self, plan: _Plan) -> None:
        while self.num_waiting and len(self.running) < self.max_num_seqs and plan.token_budget > 0:
            seq = self._peek()
            if self._yields(seq, plan):
                return
            prefix = self._prefix(seq)
            start = len(prefix) * self.kv.block_size
            n = self._num_new(seq, start, plan.token_budget)
            if n == 0:
                if plan.chunks or self.chunked_prefill:
                    return
                n = seq.num_prompt_tokens - start  # alone in its step: may exceed the budget
            if not self.kv.can_allocate(seq.seq_id, start + n, prefix):
                return
            self._pop(seq)
            self.kv.allocate(seq.seq_id, start + n, prefix)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = start
                self.kv.count_lookup(seq.num_prompt_tokens, start)
            seq.num_computed_tokens = start
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            plan.chunks[seq] = n
            plan.token_budget -= n

    def _prefix(self, seq: Sequence) -> list[Block]:
        """Cached leading blocks; at least one token is left to compute, for the logits."""
        size = self.kv.block_size
        max_blocks = (seq.num_tokens - 1) // size
        return self.kv.cached_prefix(seq.hashes_upto(max_blocks, size), max_blocks)

    def _peek(self) -> Sequence:
        if self._preempted:
            return self._preempted[0]
        queue = self._waiting[self._turns[0]]
        return min(queue, key=self._prefill_order) if self.token_budget else queue[0]

    def _pop(self, seq: Sequence) -> None:
        if self._preempted and self._preempted[0] is seq:
            self._preempted.popleft()
            return
        tenant = self._turns.popleft()
        self._waiting[tenant].remove(seq)
        if self._waiting[tenant]:
            self._turns.append(tenant)  # its next request waits for every other tenant's turn
        else:
            del self._waiting[tenant]

    def _drop_idle_tenant(self, tenant: str) -> None:
        if not self._waiting[tenant]:
            del self._waiting[tenant]
            self._turns.remove(tenant)


def _inside(seq: Sequence, index: int) -> ImageSpan | None:
    """The image of `seq` that a chunk ending at `index` would cut, if any."""
    return next((s for s in seq.spans if s.start < index < s.end), None)
