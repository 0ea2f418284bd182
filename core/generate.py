"""Sampling (model thread) and the output side of one sequence: incremental detokenisation and
stop strings (the caller's event loop)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from core.device import download
from core.sequence import SampleLogprobs
from core.types import SamplingParams
from shared.sampling import GREEDY_BELOW, MAX_TEMPERATURE, TokenLogprob

_Int = TypeVar("_Int", int, torch.Tensor)


_MASK32 = 0xFFFF_FFFF
_GOLDEN = 0x9E37_79B1  # odd, ~2^32 / phi: spreads consecutive token ids over the key space


def _mix32(x: _Int) -> _Int:
    """A 32-bit integer hash (two multiply-xorshift rounds) of values in [0, 2^32), on Python ints
    and int64 tensors alike: every product stays below 2^63, so no device wraps differently."""
    x = ((x ^ (x >> 16)) * 0x045D_9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x045D_9F3B) & _MASK32
    return x ^ (x >> 16)


def noise_key(seed: int, counter: int) -> int:
    """The key of one request's draw: its 64-bit seed and how many tokens it has generated. The
    noise of a draw depends on this key and the token id only, never on the batch."""
    seed &= (1 << 64) - 1
    return _mix32(_mix32(_mix32(seed >> 32) ^ (seed & _MASK32)) ^ (counter & _MASK32))


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Float32 Gumbel noise of token `ids[r, c]` (or `ids[c]`, the same ids for every row) under
    `keys[r]`, on the keys' device: counter-based, so a token's noise depends on its request's
    key and its id only, not on the batch, the device or which other ids are drawn beside it.
    Uniforms take 24 bits of the hash (exact in float32), never 0 or 1."""
    bits = _mix32((keys[:, None] + ids * _GOLDEN) & _MASK32)
    u = ((bits >> 8).float() + 0.5) * 2.0**-24
    return -torch.log(-torch.log(u))


def check_params(params: SamplingParams) -> None:
    """Raises ValueError for values admission refuses (the runner then ends that request alone)."""
    t = params.temperature
    if not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE and 0 <= params.top_p <= 1):
        raise ValueError("sampling parameters outside their ranges")


def sample(logits: torch.Tensor, params: SamplingParams, key: int) -> int:
    """Next token id of one sequence: greedy below GREEDY_BELOW, else temperature + top-k + top-p
    and the Gumbel-max draw of `gumbel` under `key` (`noise_key`). The reference that
    `Sampler.sample` (a whole step at once, on the device) is tested against.

    Computes in float32 after subtracting the largest logit, so no temperature in range overflows;
    parameters outside their ranges or logits without a finite value raise."""
    check_params(params)
    if params.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    logits = logits.float()
    top = logits.max()
    if not torch.isfinite(top):
        raise ValueError("no finite logit to sample from")
    scores = (logits - top) / torch.tensor(params.temperature, dtype=torch.float32)
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if 0 < params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= torch.tensor(params.top_p, dtype=torch.float32)
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    ids = torch.arange(scores.shape[-1], device=logits.device)
    noise = gumbel(torch.tensor([key], device=logits.device), ids)[0]
    return int(torch.argmax(scores + noise))


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One sampling row of a step, as the runner knows it on the host."""

    params: SamplingParams  # the request's controls (checked by `check_params` when it came)
    key: int  # noise_key(its seed, tokens it has generated)
    hold_eos: bool  # below min_new_tokens: EOS is masked, unless its grammar allows nothing else
    constrained: bool  # its row of the logits is masked by a grammar


@dataclass(frozen=True, slots=True)
class SampledRow:
    token: int  # the sampled id; -1 when the row had no finite logit to sample from
    logprobs: SampleLogprobs | None  # when asked for, under the raw logits


def _top_p(scores: torch.Tensor, top_p: torch.Tensor, is_sorted: bool) -> torch.Tensor:
    """`scores` with each row's tokens past its nucleus at -inf: a token is dropped when the mass
    before it already reaches the row's top_p (the first always stays; top_p 0 or 1: none)."""
    order = None
    if not is_sorted:
        scores, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(scores, dim=-1)
    cut = torch.where((top_p > 0) & (top_p < 1), top_p, float("inf"))
    kept = scores.masked_fill((probs.cumsum(-1) - probs) >= cut[:, None], float("-inf"))
    return kept if order is None else torch.empty_like(kept).scatter_(1, order, kept)


class Sampler:
    """A step's sampling, every row at once on the logits' device: EOS held back below
    min_new_tokens, greedy rows exactly argmax, the others temperature + top-k + top-p and a
    Gumbel-max draw from counter-based noise (`gumbel`: reproducible per request seed, whatever
    the batch); logprobs from one log-softmax of the raw logits. The rows' controls arrive as
    host lists (`inputs`) that the runner uploads with the rest of the step's inputs; the
    results come back in one device-to-host copy."""

    def __init__(self, vocab_size: int, eos_ids: set[int], device: torch.device) -> None:
        eos = torch.zeros(vocab_size, dtype=torch.bool)
        eos[sorted(eos_ids)] = True
        self.eos = eos.to(device)

    @staticmethod
    def inputs(rows: list[SampleRow]) -> list[list[float]]:
        """Per row: greedy, temperature, top_p, top_k, noise key, EOS held, constrained."""
        ps = [r.params for r in rows]
        return [
            [float(p.temperature < GREEDY_BELOW) for p in ps],
            [p.temperature for p in ps],
            [p.top_p for p in ps],
            [float(p.top_k) for p in ps],
            [float(r.key) for r in rows],
            [float(r.hold_eos) for r in rows],
            [float(r.constrained) for r in rows],
        ]

    def sample(
        self,
        raw: torch.Tensor,
        logits: torch.Tensor,
        rows: list[SampleRow],
        inputs: list[torch.Tensor],
    ) -> list[SampledRow]:
        """A token per row of `logits` (masked by grammars; `raw` are the model's). `inputs`:
        `Sampler.inputs(rows)` on the device, as float64."""
        greedy, temperature, top_p, top_k, keys, hold, constrained = inputs
        logits = logits.float()
        if any(r.hold_eos for r in rows):
            held = logits.masked_fill(hold.bool()[:, None] & self.eos, float("-inf"))
            # A grammar that allows nothing but EOS wins over min_new_tokens (no other token
            # would be valid); otherwise EOS waits.
            keep = constrained.bool() & ~torch.isfinite(held).any(-1)
            logits = torch.where(keep[:, None], logits, held)
        tokens = torch.argmax(logits, dim=-1)
        if not all(r.params.temperature < GREEDY_BELOW for r in rows):
            t = torch.where(greedy.bool(), 1.0, temperature).float()
            drawn = self._draw(logits, t, top_p.float(), top_k.long(), keys.long(), rows)
            tokens = torch.where(greedy.bool(), tokens, drawn)
        return self._collect(raw, tokens, rows)

    @staticmethod
    def _draw(
        logits: torch.Tensor,
        t: torch.Tensor,
        top_p: torch.Tensor,
        top_k: torch.Tensor,
        keys: torch.Tensor,
        rows: list[SampleRow],
    ) -> torch.Tensor:
        """`sample`'s non-greedy branch on every row (-1 where no logit is finite). When every
        sampling row has a top-k, only the `max(k)` best tokens of each row are sorted, masked
        and drawn from (same tokens, same noise: a fraction of the work at a large vocabulary)."""
        vocab = logits.shape[-1]
        top = logits.max(dim=-1, keepdim=True).values
        scores = (logits - top) / t[:, None]
        drawing = [r.params for r in rows if r.params.temperature >= GREEDY_BELOW]
        ks = [p.top_k for p in drawing if 0 < p.top_k < vocab]
        has_k = (top_k > 0) & (top_k < vocab)
        ids = None
        if len(ks) == len(drawing):  # all rows keep at most max(ks): draw among those only
            scores, ids = torch.topk(scores, max(ks))  # sorted, best first
            kth = scores.gather(1, (top_k.clamp(1, max(ks)) - 1)[:, None])
            scores = scores.masked_fill(has_k[:, None] & (scores < kth), float("-inf"))
        elif ks:
            kth = torch.topk(scores, max(ks)).values.gather(
                1, (top_k.clamp(1, max(ks)) - 1)[:, None]
            )
            scores = scores.masked_fill(has_k[:, None] & (scores < kth), float("-inf"))
        if any(0 < p.top_p < 1 for p in drawing):
            scores = _top_p(scores, top_p, is_sorted=ids is not None)
        if ids is None:
            ids = torch.arange(vocab, device=logits.device)
            drawn = torch.argmax(scores + gumbel(keys, ids), dim=-1)
        else:
            best = torch.argmax(scores + gumbel(keys, ids), dim=-1)
            drawn = ids.gather(1, best[:, None])[:, 0]
        return torch.where(torch.isfinite(top[:, 0]), drawn, -1)

    @staticmethod
    def _collect(
        raw: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]
    ) -> list[SampledRow]:
        """Tokens, and logprobs where asked, in the step's one device-to-host copy (float64
        holds every id exactly): [tokens | their logprobs | top ids | top logprobs]."""
        num_top = max((r.params.top_logprobs for r in rows if r.params.logprobs), default=0)
        parts = [tokens.double()]
        if any(r.params.logprobs for r in rows):
            logprobs = torch.log_softmax(raw.float(), dim=-1)
            chosen = logprobs.gather(1, tokens.clamp(min=0)[:, None])
            top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
            num_top = top.indices.shape[-1]
            parts += [chosen.double(), top.indices.double(), top.values.double()]
        host = download(torch.cat([p.flatten() for p in parts]))
        n, out = len(rows), []
        for i, r in enumerate(rows):
            token, lp = int(host[i]), None
            if r.params.logprobs and token >= 0:
                k, at = min(r.params.top_logprobs, num_top), 2 * n + i * num_top
                top_ids = tuple(int(x) for x in host[at : at + k])
                values = tuple(host[at + n * num_top : at + n * num_top + k])
                lp = SampleLogprobs(host[n + i], top_ids, values)
            out.append(SampledRow(token, lp))
        return out


def logprobs_of(logits: torch.Tensor, token: int, num_top: int) -> SampleLogprobs:
    """`token`'s logprob and the `num_top` likeliest ids under the raw logits, as vLLM reports
    by default: before temperature, top-k/top-p and EOS masking, so the values do not depend on
    the sampling controls and no mask shows up as -inf."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
    return SampleLogprobs(
        float(logprobs[token]), tuple(top.indices.tolist()), tuple(top.values.tolist())
    )


def token_logprobs(
    piece: str, lp: SampleLogprobs | None, token_text: Callable[[int], str]
) -> tuple[TokenLogprob, ...]:
    """The caller's side of `logprobs_of` (none when not asked for): `piece` is the text the
    sampled token completed; the alternatives are named by `token_text`."""
    if lp is None:
        return ()
    top = zip(lp.top_ids, lp.top_logprobs, strict=True)
    return (TokenLogprob(piece, lp.logprob, tuple((token_text(i), v) for i, v in top)),)


class Detokenizer(Protocol):
    def step(self, token: int) -> str:
        """The text `token` completes ("" while a character is unfinished)."""

    def rest(self) -> str:
        """What an unfinished character at the end decodes to."""


class TextStream:
    """Turns generated ids into text deltas and finds stop strings, holding back what may still
    become one. A token costs one incremental decode step and a search of the held-back tail plus
    the new text, never of the whole output: a stop string cannot start in text already emitted,
    since text that could begin one is held back until it cannot."""

    def __init__(self, detok: Detokenizer, stop: tuple[str, ...]) -> None:
        self._detok = detok
        self._stop = tuple(s for s in stop if s)
        # Per stop string, by character c: the lengths k (longest first) with stop[k - 1] == c,
        # so the held-back check tries only prefixes that end like the text does.
        self._ends: list[dict[str, list[int]]] = []
        for s in self._stop:
            ends: dict[str, list[int]] = {}
            for k in range(len(s) - 1, 0, -1):
                ends.setdefault(s[k - 1], []).append(k)
            self._ends.append(ends)
        self._sent: list[str] = []  # text emitted so far
        self.held = ""  # text received, not yet emitted: it may still begin a stop string
        self.piece = ""  # the text the last pushed token completed, emitted or not
        self.stopped = False

    @property
    def text(self) -> str:
        """The output so far, cut before a stop string once one matched."""
        return "".join(self._sent) + self.held

    def push(self, token: int) -> str:
        """Adds one token; returns the text that is now safe to emit."""
        if self.stopped:
            return ""
        piece = self.piece = self._detok.step(token)
        if not piece:
            return ""
        window = self.held + piece
        found = [at for s in self._stop if (at := window.find(s)) != -1]
        if found:
            self.held, self.stopped = "", True
            return self._emit(window[: min(found)])
        keep = self._held_back(window)
        self.held = window[len(window) - keep :]
        return self._emit(window[: len(window) - keep])

    def flush(self) -> str:
        """The rest of the text at the end of generation."""
        if self.stopped:
            return ""
        tail, self.held = self.held + self._detok.rest(), ""
        return self._emit(tail)

    def _emit(self, text: str) -> str:
        if text:
            self._sent.append(text)
        return text

    def _held_back(self, window: str) -> int:
        """Length of the longest end of `window` that begins some stop string."""
        longest = 0
        for s, ends in zip(self._stop, self._ends, strict=True):
            for k in ends.get(window[-1], ()):
                if k <= longest:
                    break
                if k <= len(window) and window.endswith(s[:k]):
                    longest = k
                    break
        return longest
