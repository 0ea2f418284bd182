"""The model runner (model thread only): `execute(SchedulerOutput) -> RunnerOutput`.

It holds every tensor a request needs, keyed by seq_id, on the model's device: prompt embeddings
(images in place), the ids it sampled, its sampling seed and its grammar matcher; made from the
scheduler's `NewRequestData` the first time a request runs and dropped when the scheduler lists
it as finished. A step builds its inputs on the host (the sampled ids to embed, each sampling
row's controls) and copies them to the device once; gathers each chunk's embeddings and blocks,
makes one batched forward pass, masks the logits of the constrained requests (one llguidance
call for all of them) and samples every row at once on the device (`core.generate.Sampler`),
whose tokens come back in the step's one device-to-host copy. It decides nothing about a
request's life, and knows nothing of the scheduler: a failure of one request (a sampling value
admission should have refused, logits without a finite value, a grammar past its limits) comes
back as that request's error; a failure of the batched forward pass raises, for the engine to
end every request of the step."""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from core.device import upload
from core.generate import SampledRow, Sampler, SampleRow, check_params, noise_key
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
    prompt_embeds: torch.Tensor  # (num_prompt_tokens, hidden) on the device, images in place
    token_ids: list[int]  # the prompt, then every token sampled for it
    num_prompt_tokens: int  # prompt length
    params: SamplingParams  # generation controls
    seed: int  # keys its sampling noise (with the number of tokens it has generated)
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
        weight = model.lm_head.weight
        self.device = weight.device
        self.kv = paged.PagedKV(
            text.num_layers,
            num_blocks,
            block_size,
            text.num_kv_heads,
            text.head_dim,
            weight.dtype,
            self.device,
        )
        self.masks = TokenMasks(text.vocab_size)
        self.sampler = Sampler(text.vocab_size, eos_ids, self.device)
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
                where = logs.error_site(exc)
                log.error("new_request_failed", error_type=type(exc).__name__, where=where)
                errors[new.seq_id] = Reason.INTERNAL
        chunks = [c for c in out.chunks if c.seq_id not in errors]
        if not chunks:
            return RunnerOutput(errors=errors)
        ready = [c.seq_id for c in chunks if c.sample]
        rows = [self._sample_row(self._requests[seq_id]) for seq_id in ready]
        token_ids = [i for c in chunks for i in self._new_token_ids(c)]
        # The step's one host-to-device copy of the runner's inputs.
        ids, *controls = upload([token_ids, *Sampler.inputs(rows)], self.device)
        raw = self._forward(chunks, ids.long())
        states = [self._requests[seq_id] for seq_id in ready]
        masked = [MaskedRow(s.matcher, row) for row, s in enumerate(states) if s.matcher]
        sampled = self.sampler.sample(raw, self.masks.apply(raw, masked), rows, controls)
        return self._advance(ready, sampled, errors)

    def _new_state(self, new: NewRequestData) -> _RequestState:
        check_params(new.params)
        image = torch.from_numpy(np.concatenate(new.features)) if new.features else None
        ids = list(new.prompt_token_ids)
        return _RequestState(
            prompt_embeds=self.model.embed(ids, image),
            token_ids=ids,
            num_prompt_tokens=len(ids),
            params=new.params,
            seed=new.seed,
            matcher=None if new.grammar is None else new.grammar.matcher(),
        )

    def _sample_row(self, state: _RequestState) -> SampleRow:
        produced = len(state.token_ids) - state.num_prompt_tokens
        return SampleRow(
            state.params,
            noise_key(state.seed, produced),
            produced < state.params.min_new_tokens,
            state.matcher is not None,
        )

    def _new_token_ids(self, c: ScheduledChunk) -> list[int]:
        """The ids of `c`'s positions past its prompt (sampled tokens), embedded this step."""
        state = self._requests[c.seq_id]
        return state.token_ids[max(c.start, state.num_prompt_tokens) : c.start + c.num_tokens]

    def _forward(self, chunks: list[ScheduledChunk], ids: torch.Tensor) -> torch.Tensor:
        """The step's one call into the model: float32 logits of each sampling chunk's last
        token, in chunk order. `ids` are every chunk's sampled-token ids, in chunk order, on the
        device: embedded in one call."""
        tokens = self.model.language_model.embed_tokens(ids)
        seq_chunks, embeds, used = [], [], 0
        for c in chunks:
            state = self._requests[c.seq_id]
            table = torch.tensor(c.block_ids)
            seq_chunks.append(paged.SeqChunk(c.start, c.num_tokens, table, c.sample))
            end, prompt = c.start + c.num_tokens, state.num_prompt_tokens
            # narrow, not [a:b]: slicing cannot run on the fake CUDA tensors of the device test.
            if c.start < prompt:
                embeds.append(state.prompt_embeds.narrow(0, c.start, min(end, prompt) - c.start))
            if end > prompt:
                num = end - max(c.start, prompt)
                embeds.append(tokens.narrow(0, used, num))
                used += num
        return paged.forward(
            self.model, torch.cat(embeds), seq_chunks, self.kv, self.batch_invariant
        )

    def _advance(
        self, ready: list[int], sampled: list[SampledRow], errors: dict[int, Reason]
    ) -> RunnerOutput:
        """Each sampled token through its request's grammar (or its error), as the runner's
        answer."""
        tokens, logprobs, done = {}, {}, set()
        for seq_id, got in zip(ready, sampled, strict=True):
            state = self._requests[seq_id]
            if state.matcher is not None and state.matcher.is_error():
                # Only a grammar past llguidance's per-step limits gets here (a sampled token
                # always fits its mask): it ends alone, as a refusal of its format.
                log.info("format_failed", seq_id=seq_id)
                errors[seq_id] = Reason.INVALID_REQUEST
                continue
            try:
                step = self._accept(state, got)
            except Exception as exc:
                where = logs.error_site(exc)
                log.error("advance_failed", error_type=type(exc).__name__, where=where)
                errors[seq_id] = Reason.INTERNAL
                continue
            tokens[seq_id] = step.token
            if step.logprobs is not None:
                logprobs[seq_id] = step.logprobs
            if step.grammar_done:
                done.add(seq_id)
        return RunnerOutput(tokens, logprobs, frozenset(done), errors)

    def _accept(self, state: _RequestState, got: SampledRow) -> _Sampled:
        """`got` as the request's next token. EOS comes only where the grammar, if any, is
        complete (the sampler held it back below min_new_tokens unless nothing else was valid)."""
        matcher, token = state.matcher, got.token
        if token < 0:
            raise ValueError("no finite logit to sample from")
        if token in self.eos_ids:
            state.token_ids.append(token)
            return _Sampled(token, None, matcher is not None)
        if matcher is not None and not matcher.consume_token(token):
            raise ValueError("a sampled token outside its grammar's mask")
        state.token_ids.append(token)
        return _Sampled(token, got.logprobs, matcher is not None and matcher.is_stopped())
