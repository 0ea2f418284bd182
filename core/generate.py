"""Sampling, stop strings and incremental detokenisation for one sequence."""

from __future__ import annotations

import torch

from core.types import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """Next token id: greedy at temperature 0, else temperature + top-k + top-p sampling."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if 0 < params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


class TextStream:
    """Turns generated ids into text deltas, holding back what may still become a stop string
    or an unfinished UTF-8 character."""

    def __init__(self, decode: object, stop: tuple[str, ...]) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self._sent = 0  # characters of the text already emitted
        self.stopped = False
        self.text = ""

    def push(self, token: int) -> str:
        """Adds one token; returns the text that is now safe to emit."""
        self.ids.append(token)
        text: str = self._decode(self.ids)  # type: ignore[operator]
        for stop in self._stop:
            at = text.find(stop)
            if at != -1:
                text, self.stopped = text[:at], True
        self.text = text
        safe = len(text) if self.stopped else self._safe_end(text)
        if safe <= self._sent:
            return ""
        delta, self._sent = text[self._sent : safe], safe
        return delta

    def flush(self) -> str:
        """The rest of the text at the end of generation."""
        delta, self._sent = self.text[self._sent :], len(self.text)
        return delta

    def _safe_end(self, text: str) -> int:
        base = len(text) - int(text.endswith("\ufffd"))
        end = base
        for stop in self._stop:
            for k in range(min(len(stop) - 1, base), 0, -1):
                if text[:base].endswith(stop[:k]):
                    end = min(end, base - k)
                    break
        return max(end, self._sent)
