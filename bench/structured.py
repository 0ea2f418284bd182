"""Which structured-output library: llguidance, xgrammar and outlines-core on the demo tokenizer.

Per library: compile time per schema; per-token cost at batch 16 (16 sequences each advancing one
token per step: fill the 16 token masks, apply them, sample, advance the 16 matchers), against
unconstrained sampling of the same 16 rows timed in the same run; and schema coverage (which of a
set of JSON schemas each compiles, and whether what it then generates validates). Tokens are drawn
from random logits through the mask, so the numbers do not depend on a model. Prints one JSON
object."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.generate import noise_key, sample
from core.structured import JSON_OPTIONS, unpack
from core.types import SamplingParams

BATCH = 16
EOS = 2
PARAMS = SamplingParams(max_new_tokens=1, temperature=1.0)

COVERAGE: dict[str, dict[str, Any]] = {
    "flat_required": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum_const": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "v": {"const": 2}},
        "required": ["colour", "v"],
        "additionalProperties": False,
    },
    "array_numbers": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    "nested": {
        "type": "object",
        "properties": {
            "box": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer"},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 6},
                        "maxItems": 3,
                    },
                },
                "required": ["x", "tags"],
                "additionalProperties": False,
            }
        },
        "required": ["box"],
        "additionalProperties": False,
    },
    "anyof": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}, {"type": "null"}]},
    "oneof": {
        "oneOf": [
            {"type": "boolean"},
            {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        ]
    },
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "min_max": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 3, "maximum": 97},
            "f": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
            "s": {"type": "string", "minLength": 2, "maxLength": 5},
        },
        "required": ["n", "f", "s"],
        "additionalProperties": False,
    },
    "ref_defs": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/pt"},
        "maxItems": 3,
    },
    "recursive_ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_email": {"type": "string", "format": "email"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "unique_items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "additional_properties_schema": {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "maxProperties": 2,
    },
}
TIMED = ("flat_required", "nested", "ref_defs")  # the schemas timed at batch 16


class Library:
    """One library behind the same small interface: compile, start, fill masks, advance."""

    name = ""
    vocab = 512

    def compile(self, schema: str) -> Any:
        raise NotImplementedError

    def start(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, states: list[Any], bitmask: torch.Tensor) -> None:
        raise NotImplementedError

    def advance(self, state: Any, token: int) -> bool:
        """Consumes `token`; True when only end-of-sequence may follow."""
        raise NotImplementedError


class Llguidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer_json: str) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab, eos_token=EOS)
        self.executor = llguidance.LLExecutor(1)

    def compile(self, schema: str) -> Any:
        source = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        matcher = self.llg.LLMatcher(self.tok, source, log_level=0)
        if matcher.is_error():
            raise ValueError("does not compile")
        return matcher

    def start(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, states: list[Any], bitmask: torch.Tensor) -> None:
        pairs = [(s, i) for i, s in enumerate(states)]
        words = bitmask.shape[1]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(states))

    def advance(self, state: Any, token: int) -> bool:
        if not state.consume_token(token):
            raise ValueError("token refused")
        return bool(state.is_stopped())


class Xgrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer_json: str) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        tok = _hf_tokenizer(tokenizer_json)
        hf = PreTrainedTokenizerFast(tokenizer_object=tok)  # type: ignore[no-untyped-call]
        hf.eos_token = "</s>"
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab)
        self.xgr = xgrammar
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(1)

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(", ", ": ")
        )

    def start(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, states: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(states, bitmask)

    def advance(self, state: Any, token: int) -> bool:
        if not state.accept_token(token):
            raise ValueError("token refused")
        return False  # the next mask allows only end-of-sequence, which is then sampled


class OutlinesCore(Library):
    name = "outlines-core"

    def __init__(self, tokenizer_json: str) -> None:
        import outlines_core  # type: ignore[import-untyped]

        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(EOS, _byte_vocab(tokenizer_json))

    def compile(self, schema: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(schema)
        return self.oc.Index(regex, self.vocabulary)

    def start(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, states: list[Any], bitmask: torch.Tensor) -> None:
        for i, guide in enumerate(states):  # no batched call: one guide at a time
            row = bitmask[i]
            guide.write_mask_into(row.data_ptr(), row.numel(), 4)

    def advance(self, state: Any, token: int) -> bool:
        state.advance(token)
        return bool(state.is_finished())


def _hf_tokenizer(tokenizer_json: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


def _byte_vocab(tokenizer_json: str) -> dict[bytes, list[int]]:
    """The byte-level BPE vocabulary as raw bytes per token (outlines-core matches bytes),
    special tokens left out."""
    tok = _hf_tokenizer(tokenizer_json)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    to_byte = {chr(b): b for b in printable}
    extra = [b for b in range(256) if b not in printable]
    to_byte.update({chr(256 + n): b for n, b in enumerate(extra)})
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    vocab: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if text not in specials:
            vocab.setdefault(bytes(to_byte[c] for c in text), []).append(i)
    return vocab


@dataclass
class Run:
    """Per-step times (seconds) of one library on one schema at batch BATCH."""

    fill: list[float]
    apply: list[float]
    sample: list[float]
    advance: list[float]


def _steps(lib: Library | None, compiled: Any, num_steps: int, seed: int) -> Run:
    """`num_steps` steps of BATCH sequences; a sequence whose grammar ended starts again."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.arange(32, dtype=torch.int32)
    states = [lib.start(compiled) for _ in range(BATCH)] if lib else []
    run = Run([], [], [], [])
    bitmask = torch.full((BATCH, (Library.vocab + 31) // 32), -1, dtype=torch.int32)
    for step in range(num_steps):
        logits = torch.randn(BATCH, Library.vocab, generator=gen)
        t0 = time.perf_counter()
        if lib:
            lib.fill(states, bitmask)
        t1 = time.perf_counter()
        if lib:
            logits = logits.masked_fill(~unpack(bitmask, bits, Library.vocab), float("-inf"))
        t2 = time.perf_counter()
        tokens = [sample(logits[i], PARAMS, noise_key(seed + i, step)) for i in range(BATCH)]
        t3 = time.perf_counter()
        if lib:
            for i, token in enumerate(tokens):
                if token == EOS or lib.advance(states[i], token):
                    states[i] = lib.start(compiled)
        t4 = time.perf_counter()
        run.fill.append(t1 - t0)
        run.apply.append(t2 - t1)
        run.sample.append(t3 - t2)
        run.advance.append(t4 - t3)
    return run


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 4)


def _timed(lib: Library, num_steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in TIMED:
        text = json.dumps(COVERAGE[name])
        compile_s = []
        for _ in range(3):
            t0 = time.perf_counter()
            compiled = lib.compile(text)
            compile_s.append(time.perf_counter() - t0)
        run = _steps(lib, compiled, num_steps, seed=1)
        # The constrained path's own work per step (fill + apply + advance), against sampling
        # the same 16 rows in the same steps (the baseline's operation, timed side by side: on a
        # shared 2-core machine two separate runs differ by more than the overhead).
        extra = [sum(t) for t in zip(run.fill, run.apply, run.advance, strict=True)]
        base = _ms(run.sample)
        out[name] = {
            "compile_ms": _ms(compile_s),
            "fill_ms_per_step": _ms(run.fill),
            "apply_ms_per_step": _ms(run.apply),
            "advance_ms_per_step": _ms(run.advance),
            "sample_ms_per_step": _ms(run.sample),
            "overhead_us_per_token": round(_ms(extra) * 1000 / BATCH, 2),
            "ratio_to_sampling": round((base + _ms(extra)) / base, 2),
        }
    return out


def _coverage(lib: Library, samples: int, max_tokens: int) -> dict[str, Any]:
    import jsonschema  # type: ignore[import-untyped]

    decode = _hf_tokenizer(Path(_MODEL, "tokenizer.json").read_text()).decode
    out: dict[str, Any] = {}
    for name, schema in COVERAGE.items():
        try:
            compiled = lib.compile(json.dumps(schema))
        except Exception:
            out[name] = "does not compile"
            continue
        done = valid = 0
        gen = torch.Generator().manual_seed(7)
        bits = torch.arange(32, dtype=torch.int32)
        draws = 0
        for _ in range(samples):
            state, ids = lib.start(compiled), []
            for _ in range(max_tokens):
                mask = torch.full((1, (lib.vocab + 31) // 32), -1, dtype=torch.int32)
                lib.fill([state], mask)
                logits = torch.randn(lib.vocab, generator=gen)
                logits = logits.masked_fill(~unpack(mask, bits, lib.vocab)[0], float("-inf"))
                token = sample(logits, PARAMS, noise_key(7, draws))
                draws += 1
                if token == EOS or lib.advance(state, token):
                    done += 1
                    ids.append(token)
                    valid += _validates(decode(ids, skip_special_tokens=True), schema, jsonschema)
                    break
                ids.append(token)
        out[name] = _verdict(done, valid, samples)
    return out


def _verdict(done: int, valid: int, samples: int) -> str:
    """ "ok" when every completed answer validated; "invalid" when one did not; "incomplete"
    when none ended within the token cap (unbounded strings under random logits)."""
    if not done:
        return f"incomplete 0/{samples}"
    return f"{'ok' if valid == done else 'invalid'} {valid}/{done} valid, {done}/{samples} ended"


def _validates(text: str, schema: dict[str, Any], jsonschema: Any) -> bool:
    try:
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        jsonschema.validate(json.loads(text), schema, format_checker=checker)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


_MODEL = "models/demo"


def _libraries(tokenizer_json: str) -> tuple[list[Library], dict[str, str]]:
    libs: list[Library] = []
    missing: dict[str, str] = {}
    makers: list[Callable[[str], Library]] = [Llguidance, Xgrammar, OutlinesCore]
    for make in makers:
        try:
            libs.append(make(tokenizer_json))
        except Exception as exc:  # a library that cannot run here is reported, not fatal
            missing[make.__name__] = f"{type(exc).__name__}: {exc}"[:200]
    return libs, missing


def main(model: Path, num_steps: int, samples: int) -> int:
    global _MODEL
    _MODEL = str(model)
    torch.set_num_threads(1)
    tokenizer_json = (model / "tokenizer.json").read_text()
    libs, missing = _libraries(tokenizer_json)
    baseline = _steps(None, None, num_steps, seed=1)
    report: dict[str, Any] = {
        "bench": "structured",
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": 1},
        "batch": BATCH,
        "vocab": Library.vocab,
        "steps": num_steps,
        "baseline_unconstrained": {
            "sample_ms_per_step": _ms(baseline.sample),
            "us_per_token": round(_ms(baseline.sample) * 1000 / BATCH, 2),
        },
        "not_run": missing,
        "libraries": {},
    }
    for lib in libs:
        cover = _coverage(lib, samples, max_tokens=160)
        report["libraries"][lib.name] = {
            "timed": _timed(lib, num_steps),
            "coverage": cover,
            "schemas_compiled": sum(c != "does not compile" for c in cover.values()),
            "schemas_ok": sum(c.startswith("ok") for c in cover.values()),
            "of": len(cover),
        }
    print(json.dumps(report, indent=1))
    return 0
