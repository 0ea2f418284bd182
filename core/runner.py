"""The model runner (model thread only): `execute(SchedulerOutput) -> RunnerOutput`.

It holds every tensor a request needs, keyed by seq_id: prompt embeddings (images in place), the
ids it sampled, its sampling generator and its grammar matcher; made from the scheduler's
`NewRequestData` the first time a request runs and dropped when the scheduler lists it as
finished. A step gathers each chunk's embeddings and blocks, makes one batched forward pass, masks
the logits of the constrained requests (one llguidance call for all of them) and samples a token
for every request that needs one. It decides nothing about a request's life, and knows nothing of
the scheduler: a failure of one request (a sampling value admission should have refused, logits
without a finite value, a grammar past its limits) comes back as that request's error; a failure
of the batched forward pass raises, for the engine to end every request of the step."""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from core.generate import logprobs_of, sample
from core.model import paged
from core.model.llava import Llava
from core.outputs import NewRequestData, RunnerOutput, ScheduledChunk, SchedulerOutput
from core.sequence import SampleLogprobs
from core.structured import MaskedRow, TokenMasks
from core.types import SamplingParams
from shared import logs
from shared.errors import Reason

log = logs.get("core.runner")


@dataclass(slots=True)
class _RequestState:
    prompt_embeds: torch.Tensor  # (num_prompt_tokens, hidden), images already in place
    token_ids: list[int]  # the prompt, then every token sampled for it
    num_prompt_tokens: int  # prompt length
    params: SamplingParams  # generation controls
    gen: torch.Generator  # its sampling randomness
    matcher: llguidance.LLMatcher | None  # where it is in its grammar; None = free text


@dataclass(frozen=True, slots=True)
class _Sampled:
    token: int  # the sampled id
    logprobs: SampleLogprobs | None  # when asked for (never for EOS)
    grammar_done: bool  # its grammar is complete after this token (or accepted EOS)


class ModelRunner:
    def __init__(
        self,
        model: Llava,
        num_blocks: int,
        block_size: int,
        eos_ids: set[int],
        batch_invariant: bool = True,
    ) -> None:
        text = model.cfg.text
        self.model = model
        self.eos_ids, self.batch_invariant = eos_ids, batch_invariant
        self.kv = paged.PagedKV(
            text.num_layers, num_blocks, block_size, text.num_kv_heads, text.head_dim
        )
        self.masks = TokenMasks(text.vocab_size)
        self._requests: dict[int, _RequestState] = {}

    @property
    def matchers(self) -> dict[int, llguidance.LLMatcher]:
        """The grammar matchers held now, by seq_id."""
        return {i: s.matcher for i, s in self._requests.items() if s.matcher is not None}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for seq_id in out.finished_ids:
            self._requests.pop(seq_id, None)
        errors: dict[int, Reason] = {}
        for new in out.new_requests:
            try:
                self._requests[new.seq_id] = self._new_state(new)
            except Exception as exc:
                log.error("embed_failed", error_type=type(exc).__name__, where=logs.error_site(exc))
                errors[new.seq_id] = Reason.INTERNAL
        chunks = [c for c in out.chunks if c.seq_id not in errors]
        if not chunks:
            return RunnerOutput(errors=errors)
        raw = self._forward(chunks)
        return self._sample(chunks, raw, errors)

    def _new_state(self, new: NewRequestData) -> _RequestState:
        image = torch.from_numpy(np.concatenate(new.features)).float() if new.features else None
        ids = list(new.prompt_token_ids)
        return _RequestState(
            prompt_embeds=self.model.embed(torch.tensor(ids), image),
            token_ids=ids,
            num_prompt_tokens=len(ids),
            params=new.params,
            gen=torch.Generator().manual_seed(new.seed & 0x7FFF_FFFF_FFFF_FFFF),
            matcher=None if new.grammar is None else new.grammar.matcher(),
        )

    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The step's one call into the model: float32 logits of each sampling chunk's last
        token, in chunk order."""
        seq_chunks, embeds = [], []
        for c in chunks:
            table = torch.tensor(c.block_ids)
            seq_chunks.append(paged.SeqChunk(c.start, c.num_tokens, table, c.sample))
            embeds.append(self._embeds(self._requests[c.seq_id], c.start, c.num_tokens))
        kv, invariant = self.kv, self.batch_invariant
        meta = paged.step_metadata(seq_chunks, kv.block_size, invariant, kv.device)
        return paged.forward_step(self.model, torch.cat(embeds), meta, kv, invariant)

    def _embeds(self, state: _RequestState, start: int, num: int) -> torch.Tensor:
        """Input embeddings of positions start..start+num (prompt rows, then sampled tokens)."""
        end, prompt = start + num, state.num_prompt_tokens
        parts = []
        if start < prompt:
            parts.append(state.prompt_embeds[start : min(end, prompt)])
        if end > prompt:
            ids = torch.tensor(state.token_ids[max(start, prompt) : end])
            parts.append(self.model.language_model.embed_tokens(ids))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _sample(
        self, chunks: list[ScheduledChunk], raw: torch.Tensor, errors: dict[int, Reason]
    ) -> RunnerOutput:
        """A token for every sampling chunk (the rows of `raw`, in order), or its error."""
        ready = [c.seq_id for c in chunks if c.sample]
        states = [self._requests[seq_id] for seq_id in ready]
        rows = [MaskedRow(s.matcher, row) for row, s in enumerate(states) if s.matcher is not None]
        logits = self.masks.apply(raw, rows)
        sampled, logprobs, done = {}, {}, set()
        for row, (seq_id, state) in enumerate(zip(ready, states, strict=True)):
            if state.matcher is not None and state.matcher.is_error():
                # Only a grammar past llguidance's per-step limits gets here (a sampled token
                # always fits its mask): it ends alone, as a refusal of its format.
                log.info("format_failed", seq_id=seq_id)
                errors[seq_id] = Reason.INVALID_REQUEST
                continue
            try:
                got = self._sample_one(state, logits[row], raw[row])
            except Exception as exc:
                where = logs.error_site(exc)
                log.error("advance_failed", error_type=type(exc).__name__, where=where)
                errors[seq_id] = Reason.INTERNAL
                continue
            sampled[seq_id] = got.token
            if got.logprobs is not None:
                logprobs[seq_id] = got.logprobs
            if got.grammar_done:
                done.add(seq_id)
        return RunnerOutput(sampled, logprobs, frozenset(done), errors)

    def _sample_one(
        self, state: _RequestState, logits: torch.Tensor, raw: torch.Tensor
    ) -> _Sampled:
        """The next token of one request. `logits` are masked by its grammar, `raw` are the
        model's (logprobs report those). EOS waits for min_new_tokens, unless the grammar allows
        nothing else (no other token would be valid)."""
        params, matcher = state.params, state.matcher
        if len(state.token_ids) - state.num_prompt_tokens < params.min_new_tokens:
            held = logits.clone()
            held[list(self.eos_ids)] = float("-inf")
            if matcher is None or bool(torch.isfinite(held).any()):
                logits = held
        token = sample(logits, params, state.gen)
        if token in self.eos_ids:  # only where the grammar, if any, is complete
            state.token_ids.append(token)
            return _Sampled(token, None, matcher is not None)
        if matcher is not None and not matcher.consume_token(token):
            raise ValueError("a sampled token outside its grammar's mask")
        state.token_ids.append(token)
        lp = logprobs_of(raw, token, params.top_logprobs) if params.logprobs else None
        return _Sampled(token, lp, matcher is not None and matcher.is_stopped())
