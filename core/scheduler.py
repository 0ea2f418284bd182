"""The LLM scheduler: decides, each step, which sequences run how many tokens.

`token-budget` (iteration-level batching): every decoding sequence gets one token, then prefill
chunks fill the rest of `max_batch_tokens`, shortest remaining prompt first (so a long video does
not hold up a one-image question; a prefill passed over `STARVATION_STEPS` steps in a row goes
first until its prompt is in); waiting requests are admitted into what is left, tenants taking
turns. `request-count` admits up to `batch_size` requests only when nothing is running and runs
that batch to completion; `none` is the same with one request. When a sequence
needs a block and none is free, the most recently admitted running sequence is preempted: its
blocks go back to the pool and it waits at the front of the queue, to be recomputed (its prefix is
usually still in the cache, so recomputation is cheap).

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
STARVATION_STEPS = 8  # a prefill passed over this many steps in a row goes first until done


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
    ) -> None:
        self.kv = kv
        self.policy = policy
        self.max_batch_tokens = max_batch_tokens if policy == "token-budget" else sys.maxsize
        self.max_num_seqs = {"token-budget": max_num_seqs, "request-count": batch_size}.get(
            policy, 1
        )
        self.shortest_first = (
            policy == "token-budget"
        )  # the baselines stay first come, first served
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
        if seq.tenant not in self._waiting:
            self._waiting[seq.tenant] = deque()
            self._turns.append(seq.tenant)
        self._waiting[seq.tenant].append(seq)

    def schedule(self) -> SchedulerOutput:
        plan = _Plan(self.max_batch_tokens)
        self._schedule_running(plan)
        if not plan.preempted and (self.policy == "token-budget" or not plan.chunks):
            self._admit(plan)
        self._count_skips(plan)
        chunks = tuple(ScheduledChunk(s, n) for s, n in plan.chunks.items())
        return SchedulerOutput(chunks, sum(plan.chunks.values()), tuple(plan.preempted))

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

    def _prefill_order(self, seq: Sequence) -> tuple[bool, int, int]:
        starved = seq.num_skipped_steps >= STARVATION_STEPS
        return (not starved, seq.num_prompt_tokens - seq.num_computed_tokens, seq.seq_id)

    def _count_skips(self, plan: _Plan) -> None:
        waiting = [s for q in self._waiting.values() for s in q]
        for seq in [*self.running, *self._preempted, *waiting]:
            if seq in plan.chunks:
                if seq.num_skipped_steps < STARVATION_STEPS:
                    seq.num_skipped_steps = 0  # once starved, it keeps first place to the end
            elif seq.in_prefill:
                seq.num_skipped_steps += 1

    def _schedule_running(self, plan: _Plan) -> None:
        decoding = [s for s in self.running if not s.in_prefill]
        prefilling = [s for s in self.running if s.in_prefill]
        if self.shortest_first:
            prefilling.sort(key=self._prefill_order)
        for seq in decoding + prefilling:
            if seq.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
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
        return min(queue, key=self._prefill_order) if self.shortest_first else queue[0]

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
