"""Sampling (model thread) and the output side of one sequence: incremental detokenisation and
stop strings (the caller's event loop)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from core.sequence import SampleLogprobs
from core.types import SamplingParams
from shared.sampling import GREEDY_BELOW, MAX_TEMPERATURE, TokenLogprob


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """Next token id: greedy below GREEDY_BELOW, else temperature + top-k + top-p sampling.

    Computes in float32 after subtracting the largest logit, so no temperature in range overflows
    and the probabilities are never NaN; parameters outside their ranges (admission refuses them)
    or logits without a finite value raise, and the runner ends this sequence alone."""
    t = params.temperature
    if not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE and 0 <= params.top_p <= 1):
        raise ValueError("sampling parameters outside their ranges")
    if t < GREEDY_BELOW:
        return int(torch.argmax(logits))
    logits = logits.float()
    top = logits.max()
    if not torch.isfinite(top):
        raise ValueError("no finite logit to sample from")
    scores = (logits - top) / t
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if 0 < params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen))


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
