"""Structured output with llguidance (chosen by `visor bench structured`): compiling a response
format (JSON schema, regex, Lark grammar) against the model's tokenizer, a bounded LRU cache of
compiled grammars, and the token masks of a step's constrained sequences.

Compiling runs on a worker thread at admission (llguidance releases the GIL while it builds), so
a schema that does not compile is refused before any encode or prefill; a compiled grammar holds
no request data, so one cache serves every tenant. Matcher state (where each sequence is in its
grammar) lives with the model runner, one deep copy of the compiled matcher per sequence."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

from shared.errors import Reason, VisorError
from shared.sampling import ResponseFormat

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON (", " and ": " between items, no other whitespace): the answer cannot wander off
# into unbounded whitespace, and it reads like json.dumps. A schema's "x-guidance" may change it.
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


class Grammar:
    """One compiled response format: a matcher at the start of the grammar, never advanced.
    Shared by every request that asks for the same format (read-only)."""

    __slots__ = ("_start",)

    def __init__(self, start: llguidance.LLMatcher) -> None:
        self._start = start

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence."""
        return self._start.deep_copy()


class GrammarCompiler:
    """Compiles response formats for one tokenizer, with an LRU cache of `cache_size` grammars
    keyed by (kind, text). Thread-safe: admission compiles on worker threads."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_ids: set[int],
        cache_size: int,
        max_grammar_size: int | None = None,
    ) -> None:
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids)
        )
        # llguidance's own bounds (grammar symbols, lexer states, fuel), its defaults unless
        # given: past one, the format is refused as too complex. verbose_errors off: its messages
        # quote the grammar, and they are never shown anyway.
        self._limits = llguidance.LLParserLimits(
            max_grammar_size=max_grammar_size, verbose_errors=False
        )
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses (tests and benchmarks read it)

    async def admit(self, fmt: ResponseFormat | None) -> Grammar | None:
        """`compile` on a worker thread, never the event loop (None for free text). The core's
        servicer calls it before any encode or prefill, so a bad format costs no compute."""
        return None if fmt is None else await asyncio.to_thread(self.compile, fmt)

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """The compiled grammar of `fmt`; INVALID_REQUEST naming the kind when it does not
        compile or is over llguidance's size limits (the text is never echoed)."""
        key = (fmt.kind, fmt.text)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        grammar = Grammar(self._build(fmt))
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, fmt: ResponseFormat) -> llguidance.LLMatcher:
        refused = VisorError(
            Reason.INVALID_REQUEST,
            f"response_format.{fmt.kind} does not compile or exceeds the grammar limits",
        )
        try:
            source = _source(fmt)
        except ValueError:
            raise refused from None
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise refused
        return matcher


def _source(fmt: ResponseFormat) -> str:
    if fmt.kind == "json_schema":
        schema = json.loads(fmt.text)  # ValueError when it is not JSON
        if not isinstance(schema, dict):
            raise ValueError("the schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if fmt.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(fmt.text)
    return llguidance.LLMatcher.grammar_from_lark(fmt.text)


@dataclass(frozen=True, slots=True)
class MaskedRow:
    """One constrained sequence of a step: its matcher and its row of the step's logits."""

    matcher: llguidance.LLMatcher  # the sequence's state in its grammar
    row: int  # index into the step's logits


class TokenMasks:
    """The runner's side: fills one bitmask row per constrained sequence of a step in one
    llguidance call (its executor spreads the rows over threads, without the GIL) and applies
    all rows to the logits at once."""

    def __init__(self, vocab_size: int, num_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(num_threads)
        self._bits = torch.arange(32, dtype=torch.int32)

    def apply(self, logits: torch.Tensor, rows: list[MaskedRow]) -> torch.Tensor:
        """`logits` (num_rows, vocab) with every token its row's grammar forbids at -inf; a new
        tensor (the raw logits stay as they are for logprobs). Rows not listed are unchanged."""
        if not rows:
            return logits
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        pairs = [(r.matcher, i) for i, r in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(rows))
        # llguidance fills host memory: one copy of the words to the logits' device.
        bitmask = bitmask.to(logits.device, non_blocking=True)
        allowed = unpack(bitmask, self._bits.to(logits.device), logits.shape[-1])
        index = torch.tensor([r.row for r in rows], device=logits.device)
        out = logits.clone()
        out[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return out


def unpack(bitmask: torch.Tensor, bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) booleans from (rows, ceil(vocab / 32)) int32 bit words, bit i of word w
    standing for token 32 * w + i (llguidance's and xgrammar's layout); tokens past the mask's
    width are forbidden."""
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)
