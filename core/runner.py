"""Runs one scheduled step on the model (model thread only): gathers each chunk's embeddings and
slots, makes the batched forward pass, masks the logits of the sequences with a response format
(one llguidance call for all of them), samples a token for every sequence that needs one, and
sends token ids and the final event to each request (text and stop strings are the caller's)."""

from __future__ import annotations

import time

import llguidance
import torch

from core import metrics
from core.generate import logprobs_of, sample
from core.kv_cache import KVCacheManager
from core.model import paged
from core.model.llava import Llava
from core.scheduler import Scheduler, SchedulerOutput
from core.sequence import EngineFailure, Finished, RequestStatus, Sequence, Token
from core.structured import MaskedRow, TokenMasks
from shared import logs
from shared.errors import Reason

log = logs.get("core.runner")


class ModelRunner:
    def __init__(
        self,
        model: Llava,
        kv_manager: KVCacheManager,
        scheduler: Scheduler,
        eos_ids: set[int],
        batch_invariant: bool,
    ) -> None:
        text = model.cfg.text
        self.model, self.kv_manager, self.scheduler = model, kv_manager, scheduler
        self.eos_ids, self.batch_invariant = eos_ids, batch_invariant
        self.kv = paged.PagedKV(
            text.num_layers, kv_manager.num_blocks, kv_manager.block_size, text.num_kv_heads,
            text.head_dim,
        )  # fmt: skip
        self.masks = TokenMasks(text.vocab_size)
        # Where each constrained sequence is in its grammar, by seq_id: runner state, made at the
        # sequence's first sampled token and dropped by `release` when it leaves the engine.
        self.matchers: dict[int, llguidance.LLMatcher] = {}

    @torch.inference_mode()
    def embed_prompt(self, ids: list[int], features: torch.Tensor | None) -> torch.Tensor:
        return self.model.embed(torch.tensor(ids), features)

    def step(self, out: SchedulerOutput) -> None:
        """Runs `out` and advances every sequence in it."""
        now = time.perf_counter()
        for chunk in out.chunks:
            if not chunk.seq.first_scheduled:
                chunk.seq.first_scheduled = now
        raw = self._forward(out)
        self.scheduler.update(out)
        ready: list[Sequence] = []  # sequences sampling this step, in logits row order
        for chunk in out.chunks:
            if chunk.seq.num_computed_tokens == chunk.seq.num_tokens:
                ready.append(chunk.seq)
        logits = self._constrain(ready, raw)
        for row, seq in enumerate(ready):
            if seq.seq_id in self.matchers and self.matchers[seq.seq_id].is_error():
                # Only a grammar past llguidance's per-step limits gets here (a sampled token
                # always fits its mask): it ends alone, as a refusal of its format.
                log.info("format_failed", seq_id=seq.seq_id)
                self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
                seq.sink(EngineFailure(Reason.INVALID_REQUEST))
                continue
            self._advance_one(seq, logits[row], raw[row])

    def _constrain(self, ready: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """`logits` with each constrained sequence's row masked to what its grammar allows next
        (a new tensor when any row is constrained)."""
        rows = []
        for row, seq in enumerate(ready):
            if seq.grammar is None:
                continue
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None:
                matcher = self.matchers[seq.seq_id] = seq.grammar.matcher()
            rows.append(MaskedRow(matcher, row))
        return self.masks.apply(logits, rows)

    def release(self, seq_id: int) -> None:
        """Drops a sequence's matcher once it left the engine (finished, aborted, stopped)."""
        self.matchers.pop(seq_id, None)

    def _advance_one(self, seq: Sequence, logits: torch.Tensor, raw: torch.Tensor) -> None:
        """`_advance`, where a failure (a sampling value admission should have refused, logits
        without a finite value) ends this sequence alone with INTERNAL, never its step-mates. A
        failure of the batched forward pass cannot be pinned on one sequence: the engine ends
        every sequence of that step."""
        try:
            self._advance(seq, logits, raw)
        except Exception as exc:
            log.error("advance_failed", error_type=type(exc).__name__, where=logs.error_site(exc))
            if not seq.status.finished:
                self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
            seq.sink(EngineFailure())

    @torch.inference_mode()
    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        chunks, embeds = [], []
        for chunk in out.chunks:
            seq, n = chunk.seq, chunk.num_new_tokens
            start = seq.num_computed_tokens
            table = torch.tensor([b.block_id for b in self.kv_manager.tables[seq.seq_id]])
            chunks.append(paged.SeqChunk(start, n, table, start + n == seq.num_tokens))
            embeds.append(seq.embeds(start, n, self._embed_tokens))
        meta = paged.step_metadata(chunks, self.kv.block_size, self.batch_invariant, self.kv.device)
        return paged.forward_step(
            self.model, torch.cat(embeds), meta, self.kv, self.batch_invariant
        )

    def _embed_tokens(self, ids: list[int]) -> torch.Tensor:
        embeds: torch.Tensor = self.model.language_model.embed_tokens(torch.tensor(ids))
        return embeds

    def _advance(self, seq: Sequence, logits: torch.Tensor, raw: torch.Tensor) -> None:
        """Samples the next token and sends it; ends the sequence on EOS, length, or a grammar
        that allows nothing but EOS. `logits` are masked by the sequence's grammar, `raw` are
        the model's (logprobs report those)."""
        params = seq.params
        produced = seq.num_output_tokens
        matcher = self.matchers.get(seq.seq_id)
        if produced < params.min_new_tokens:
            held = logits.clone()
            held[list(self.eos_ids)] = float("-inf")
            # A grammar that allows nothing but EOS wins over min_new_tokens (no other token
            # would be valid); otherwise EOS waits, and the grammar picks among the rest.
            if matcher is None or bool(torch.isfinite(held).any()):
                logits = held
        token = sample(logits, params, seq.gen)
        seq.token_ids.append(token)
        metrics.GENERATED_TOKENS.inc()
        if produced == 0:
            seq.first_token = time.perf_counter()
            metrics.TTFT.observe(seq.first_token - seq.arrival)
        if token in self.eos_ids:
            self.finish(seq, RequestStatus.FINISHED_STOPPED)
            return
        if matcher is not None and not matcher.consume_token(token):
            raise ValueError("a sampled token outside its grammar's mask")
        logprobs = logprobs_of(raw, token, params.top_logprobs) if params.logprobs else None
        seq.sink(Token(token, logprobs))
        if matcher is not None and matcher.is_stopped():  # complete: only EOS could follow
            self.finish(seq, RequestStatus.FINISHED_STOPPED)
        elif seq.num_output_tokens >= params.max_new_tokens:
            self.finish(seq, RequestStatus.FINISHED_LENGTH)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        self.scheduler.finish(seq, status)
        reason = "length" if status == RequestStatus.FINISHED_LENGTH else "stop"
        seq.sink(finished(seq, seq.num_output_tokens, reason))


def finished(seq: Sequence, num_output_tokens: int, reason: str) -> Finished:
    """The final event of `seq` after `num_output_tokens` tokens, timed now (the model thread's
    ends, and the caller's when a stop string matched)."""
    end = time.perf_counter()
    if num_output_tokens > 1:
        metrics.TPOT.observe((end - seq.first_token) / (num_output_tokens - 1))
    timings = {
        "queue": (seq.first_scheduled - seq.arrival) * 1000,
        "prefill": (seq.first_token - seq.first_scheduled) * 1000,
        "generate": (end - seq.first_token) * 1000,
    }
    return Finished(num_output_tokens, reason, timings)
