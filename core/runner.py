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

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from core.compression import Kept
from core.cuda_graphs import DecodeGraphs, PaddedDecode
from core.device import upload
from core.generate import SampledRow, Sampler, SampleRow, check_params, noise_key
from core.model import paged
from core.model.family import DeepstackModel, VisionLanguageModel
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
    positions: torch.Tensor | None  # host, (n,) or (3, n): the prompt's rope positions; None =
    # its indices
    delta: int  # a generated token's rope position minus its index
    spans: tuple[tuple[int, int], ...]  # images its model sees both ways; () when causal
    deepstack: tuple[torch.Tensor, torch.Tensor] | None  # each prompt token's row (host, -1 =
    # none) in a device table of the inputs the first layers add (`DeepstackModel`); None = none
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
        model: VisionLanguageModel,
        num_blocks: int,
        block_size: int,
        eos_ids: set[int],
        batch_invariant: bool = True,
        padded: PaddedDecode | None = None,
    ) -> None:
        """`padded`: run decode-only steps at padded shapes (`core.cuda_graphs`); fast mode
        only. The KV storage then has one block past `num_blocks`, the padding rows' scratch."""
        if padded is not None and batch_invariant:
            raise ValueError("decode graphs run the fast path: batch_invariant must be off")
        text = model.cfg.text
        self.model = model
        self.eos_ids, self.batch_invariant = eos_ids, batch_invariant
        weight = model.lm_head.weight
        self.device = weight.device
        self.kv = paged.PagedKV(
            text.num_layers,
            num_blocks + (padded is not None),
            block_size,
            text.num_kv_heads,
            text.head_dim,
            weight.dtype,
            self.device,
        )
        self.masks = TokenMasks(text.vocab_size)
        self.sampler = Sampler(text.vocab_size, eos_ids, self.device)
        self.graphs = None
        if padded is not None:
            capture = padded.cuda_graphs and self.device.type == "cuda"
            self.graphs = DecodeGraphs(model, self.kv, padded.buckets, capture, padded.compile)
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
        gather, pieces = self._deepstack_rows(chunks)
        parts: list[Sequence[float]] = [token_ids, *Sampler.inputs(rows)]
        if pieces:
            parts.append(gather)
        # The step's one host-to-device copy of the runner's inputs.
        ids, *controls = upload(parts, self.device)
        extras = self._deepstack(pieces, controls.pop().long()) if pieces else []
        raw = self._forward(chunks, ids.long(), extras)
        states = [self._requests[seq_id] for seq_id in ready]
        masked = [MaskedRow(s.matcher, row) for row, s in enumerate(states) if s.matcher]
        sampled = self.sampler.sample(raw, self.masks.apply(raw, masked), rows, controls)
        return self._advance(ready, sampled, errors)

    def _new_state(self, new: NewRequestData) -> _RequestState:
        check_params(new.params)
        image = torch.from_numpy(np.concatenate(new.features)) if new.features else None
        ids = list(new.prompt_token_ids)
        positions, delta = prompt_positions(self.model, new)
        deepstack = None
        if isinstance(self.model, DeepstackModel):
            found = self.model.deepstack_rows(ids, image)
            if found is not None:
                dtype = self.model.lm_head.weight.dtype
                deepstack = found[0], found[1].to(self.device, dtype).contiguous()
        return _RequestState(
            prompt_embeds=self.model.embed(ids, image),
            token_ids=ids,
            num_prompt_tokens=len(ids),
            positions=positions,
            delta=delta,
            spans=new.spans if self.model.bidirectional_images else (),
            deepstack=deepstack,
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

    def _deepstack_rows(self, chunks: list[ScheduledChunk]) -> tuple[list[int], list[torch.Tensor]]:
        """Where each of the step's new tokens (in chunk order) finds its deepstack inputs: a
        row of a zero row followed by `pieces` (0: the zero row), and the pieces: per chunk
        whose prompt part holds visual tokens, the run of its table they cover (a chunk may
        start or end inside an image: chunked prefill, a prefix hit). ([], []) when no new
        token of the step is visual, as in every decode step."""
        pairs = [(c, self._requests[c.seq_id]) for c in chunks]
        if all(s.deepstack is None or c.start >= s.num_prompt_tokens for c, s in pairs):
            return [], []  # decodes only, or a family without deepstack: nothing to build
        parts, pieces, offset = [], [], 1
        for c, state in pairs:
            part = torch.zeros(c.num_tokens, dtype=torch.long)
            stop = min(c.start + c.num_tokens, state.num_prompt_tokens)
            if state.deepstack is not None and c.start < stop:
                rows, table = state.deepstack
                local = rows[c.start : stop]
                seen = local[local >= 0]
                if seen.numel():
                    first, num = int(seen[0]), int(seen[-1]) - int(seen[0]) + 1
                    pieces.append(table.narrow(0, first, num))
                    part[: stop - c.start] = torch.where(local >= 0, local - first + offset, 0)
                    offset += num
            parts.append(part)
        return (torch.cat(parts).tolist(), pieces) if pieces else ([], [])

    def _deepstack(self, pieces: list[torch.Tensor], gather: torch.Tensor) -> list[torch.Tensor]:
        """Per deepstack layer, the (tokens, hidden) rows the step's tokens add to its output:
        their visual tokens' inputs, zero elsewhere (`gather`: `_deepstack_rows`' rows, on the
        device)."""
        hidden = self.model.cfg.text.hidden_size
        table = torch.cat([pieces[0].new_zeros(1, pieces[0].shape[1]), *pieces])
        rows = table.index_select(0, gather)
        return [rows.narrow(1, k * hidden, hidden) for k in range(table.shape[1] // hidden)]

    def _forward(
        self, chunks: list[ScheduledChunk], ids: torch.Tensor, extras: list[torch.Tensor]
    ) -> torch.Tensor:
        """The step's one call into the model: float32 logits of each sampling chunk's last
        token, in chunk order. `ids` are every chunk's sampled-token ids, in chunk order, on the
        device: embedded in one call; `extras`: per deepstack layer its rows (`_deepstack`)."""
        tokens = self.model.language_model.embed_tokens(ids)
        seq_chunks, embeds, used = [], [], 0
        for c in chunks:
            state = self._requests[c.seq_id]
            table = torch.tensor(c.block_ids)
            positions = _chunk_positions(state, c.start, c.start + c.num_tokens)
            seq_chunks.append(
                paged.SeqChunk(c.start, c.num_tokens, table, c.sample, positions, state.spans)
            )
            end, prompt = c.start + c.num_tokens, state.num_prompt_tokens
            # narrow, not [a:b]: slicing cannot run on the fake CUDA tensors of the device test.
            if c.start < prompt:
                embeds.append(state.prompt_embeds.narrow(0, c.start, min(end, prompt) - c.start))
            if end > prompt:
                num = end - max(c.start, prompt)
                embeds.append(tokens.narrow(0, used, num))
                used += num
        x = torch.cat(embeds)
        # The padded decode path takes no deepstack rows (a decode step has none).
        graphs = None if extras else self.graphs
        if graphs is not None and (logits := graphs.run(x, seq_chunks)) is not None:
            return logits
        return paged.forward(self.model, x, seq_chunks, self.kv, self.batch_invariant, extras)

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


def prompt_positions(
    model: VisionLanguageModel, new: NewRequestData
) -> tuple[torch.Tensor | None, int]:
    """The prompt's rope positions (host) and the delta of its generated tokens. Where the
    features of an item dropped or merged tokens, positions come from the uncompressed prompt:
    each kept token keeps the position it had there (for families whose positions are not the
    indices; 1-D rope families stay contiguous). Videos' seconds per temporal patch go only to a
    model that serves video (admission refuses videos for the others)."""
    ids = list(new.prompt_token_ids)
    videos = [s for s in new.seconds if s > 0]
    timing = {"seconds": videos} if videos else {}
    if all(k is None for k in new.kept):
        positions, delta = model.prompt_positions(ids, list(new.grids), **timing)
        return (None if positions is None else positions.cpu()), delta
    full, columns = _uncompressed(ids, new.spans, new.kept)
    positions, delta = model.prompt_positions(full, list(new.grids), **timing)
    if positions is None:
        return None, 0
    kept = positions.cpu().index_select(-1, torch.tensor(columns))
    return kept, delta + len(full) - len(ids)


def _uncompressed(
    ids: list[int], spans: tuple[tuple[int, int], ...], kept: tuple[Kept | None, ...]
) -> tuple[list[int], list[int]]:
    """The prompt with each compressed item back at its full length, and where each token of
    `ids` sits in it."""
    full: list[int] = []
    columns: list[int] = []
    done = 0
    for (start, end), k in zip(spans, kept, strict=True):
        columns += range(len(full), len(full) + start - done)
        full += ids[done:start]
        if k is None:
            columns += range(len(full), len(full) + end - start)
            full += ids[start:end]
        else:
            columns += (len(full) + k.indices).tolist()
            full += [ids[start]] * k.num_tokens
        done = end
    columns += range(len(full), len(full) + len(ids) - done)
    full += ids[done:]
    return full, columns


def _chunk_positions(state: _RequestState, start: int, end: int) -> torch.Tensor | None:
    """The rope positions of indices start..end-1 of a request, on the host; None when they are
    the indices themselves."""
    if state.positions is None and not state.delta:
        return None
    prompt, parts = state.num_prompt_tokens, []
    if start < prompt:
        stop = min(end, prompt)
        if state.positions is None:
            parts.append(torch.arange(start, stop))
        else:
            parts.append(state.positions[..., start:stop])
    if end > prompt:
        generated = torch.arange(max(start, prompt), end) + state.delta
        if state.positions is not None and state.positions.dim() == 2:
            generated = generated.expand(state.positions.shape[0], -1)
        parts.append(generated)
    return torch.cat(parts, dim=-1)
