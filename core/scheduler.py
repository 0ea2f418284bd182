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

Block bookkeeping lives in `KVCacheManager`; this module only decides.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

from core.kv_cache import Block, KVCacheManager
from core.model.paged import TILE
from core.sequence import RequestStatus, Sequence

POLICIES = ("token-budget", "request-count", "none")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence  # who runs
    num_new_tokens: int  # how many of its tokens run this step


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # in execution order
    num_batched_tokens: int  # sum of num_new_tokens
    preempted: tuple[Sequence, ...]  # lost their blocks this step


@dataclass(slots=True)
class _Plan:
    token_budget: int  # tokens left this step
    chunks: dict[Sequence, int] = field(default_factory=dict)  # insertion-ordered
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        policy: str,
        max_batch_tokens: int,
        max_num_seqs: int,
        batch_size: int,
        chunked_prefill: bool,
        max_prefill_chunk: int,
        decode_step_tokens: int = 0,
    ) -> None:
        self.kv = kv
        self.policy = policy
        self.max_batch_tokens = max_batch_tokens if policy == "token-budget" else sys.maxsize
        self.max_num_seqs = {"token-budget": max_num_seqs, "request-count": batch_size}.get(
            policy, 1
        )
        self.token_budget = policy == "token-budget"  # the baselines stay first come, first served
        self.decode_step_tokens = decode_step_tokens if self.token_budget else 0
        self.clock = 0  # tokens scheduled so far: a request's age is measured in them
        self.chunked_prefill = chunked_prefill and policy == "token-budget"
        self.max_prefill_chunk = max_prefill_chunk if self.chunked_prefill else sys.maxsize
        self.running: list[Sequence] = []
        self._preempted: deque[Sequence] = deque()  # served before any tenant queue
        self._waiting: dict[str, deque[Sequence]] = {}  # per tenant, FIFO
        self._turns: deque[str] = deque()  # tenants with waiting requests, next one first
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self._preempted) + sum(len(q) for q in self._waiting.values())

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_clock = self.clock
        if seq.tenant not in self._waiting:
            self._waiting[seq.tenant] = deque()
            self._turns.append(seq.tenant)
        self._waiting[seq.tenant].append(seq)

    def schedule(self) -> SchedulerOutput:
        plan = _Plan(self.max_batch_tokens)
        self._schedule_running(plan)
        if not plan.preempted and (self.policy == "token-budget" or not plan.chunks):
            self._admit(plan)
        chunks = tuple(ScheduledChunk(s, n) for s, n in plan.chunks.items())
        num_tokens = sum(plan.chunks.values())
        self.clock += num_tokens
        return SchedulerOutput(chunks, num_tokens, tuple(plan.preempted))

    def update(self, out: SchedulerOutput) -> None:
        """Records a finished step: progress, and the blocks that became full."""
        size = self.kv.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status != RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            seq.num_computed_tokens += chunk.num_new_tokens
            full = seq.num_computed_tokens // size
            self.kv.register_full_blocks(seq.seq_id, seq.hashes_upto(full, size))

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Ends a sequence (stopped, length or aborted) and frees its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self._preempted:
            self._preempted.remove(seq)
        elif seq in self._waiting.get(seq.tenant, ()):
            self._waiting[seq.tenant].remove(seq)
            self._drop_idle_tenant(seq.tenant)
        self.kv.free(seq.seq_id)
        seq.status = status

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
        return max(0, (computed + budget) // TILE * TILE - computed)

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
        while self.num_waiting and len(self.running) < self.max_num_seqs and plan.token_budget:
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
