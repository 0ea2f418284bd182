"""The input processor (event loop side, as in vLLM v1): every admission check of a request,
once, before any compute, in time that does not depend on what the header declares.

It checks the sampling values, stop strings, logprob and format controls, the items' count and
declared geometry; tokenises the conversation once (one id per image slot; an item that declares
a frame interval is shown as a video, where the model serves video); counts each item's
visual tokens from its declared grid with the arithmetic compression itself uses
(`compression.item_tokens`: the rule's count, then the profile's), so a request at the limit is
admitted and one token over is refused before encoding; checks the request's total against the
per-request cap (TOKEN_BUDGET); takes a place in the scheduler's queue (OVERLOADED past
`max_waiting`); and compiles the response format on a worker thread. The `Admitted` record serves
both the servicer's check before encoding and generation, which only expands the image slots to
the visual tokens the features brought.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from dataclasses import dataclass, replace
from types import TracebackType

from core import compression
from core.config import SchedulerConfig
from core.kv_cache import ImageSpan
from core.model.tokenizer import IMAGE, VIDEO, ChatTokenizer, ChatTurn
from core.structured import Grammar, GrammarCompiler
from core.types import CoreInfo, InferRequest, ItemSpec
from shared.errors import Reason, VisorError
from shared.preprocess import PreprocessRule
from shared.sampling import check_logprobs, check_response_format, check_sampling, check_stop

# Seconds between a video item's frames at most: rope time steps stay small integers (a GIF's
# longest delay is 655 s).
MAX_FRAME_INTERVAL_S = 3600.0


class QueueSlot:
    """A place in the scheduler's queue, held from admission until the scheduler has the request
    (or it is dropped before): a request being encoded counts as waiting, so a burst is refused
    before it costs any encoding. Released once, whoever releases it first."""

    __slots__ = ("_held", "_owner")

    def __init__(self, owner: InputProcessor) -> None:
        self._owner = owner
        self._held = True

    def release(self) -> None:
        self._owner.release(self)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed admission. `with admitted:` gives its queue place back if it never
    reaches the scheduler."""

    req: InferRequest  # as it arrived
    prompt_ids: tuple[int, ...]  # tokenised once; one id per image slot, expanded at generation
    num_visual: tuple[int, ...]  # per item, visual tokens admission counted (the most)
    slots: tuple[int, ...]  # per item, its image slots in the prompt (Gemma 3: views; else 1)
    seed: int  # sampling seed: the request's own, else derived from its id
    grammar: Grammar | None  # compiled response format; None = free text
    slot: QueueSlot  # its place in the scheduler's queue until the scheduler has it

    def __enter__(self) -> Admitted:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.slot.release()


class InputProcessor:
    def __init__(
        self,
        tokenizer: ChatTokenizer,
        info: CoreInfo,
        config: SchedulerConfig,
        max_request_tokens: int,
        grammars: GrammarCompiler,
    ) -> None:
        self.tokenizer, self.info, self.grammars = tokenizer, info, grammars
        self.max_request_tokens = max_request_tokens
        self.max_waiting = config.max_waiting
        self.max_items, self.max_item_tiles = config.max_items, config.max_item_tiles
        self.max_stop_strings, self.max_stop_bytes = config.max_stop_strings, config.max_stop_bytes
        self.max_format_bytes = config.max_format_bytes
        self.num_waiting = 0  # the scheduler's queue after the last step (the model thread writes)
        self._queued = 0  # admitted, not yet in the scheduler (guarded by _lock)
        self._lock = threading.Lock()

    async def admit(
        self,
        req: InferRequest,
        visual: list[int] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Admitted:
        """`check`, a place in the queue, and the compiled response format (on a worker thread).

        `visual`: the visual tokens of features already at hand (in-process callers), counted
        instead of the declared items; `prompt_ids`: a text-only prompt already tokenised."""
        ids, counts, slots = self.check(req, visual, prompt_ids)
        slot = self._reserve()
        try:
            grammar = await self.grammars.admit(req.params.response_format)
        except BaseException:
            slot.release()
            raise
        p = req.params
        seed = p.seed or int.from_bytes(hashlib.sha256(req.request_id.encode()).digest()[:8])
        return Admitted(req, tuple(ids), counts, slots, seed, grammar, slot)

    def check(
        self,
        req: InferRequest,
        visual: list[int] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
        """Refuses what this core cannot serve; returns the prompt ids (one per image slot),
        each item's visual tokens and its image slots. Visual tokens are counted from the
        declared grids and text tokens with one token per image slot, before any pixel or token
        exists. A fixed-view item (Gemma 3) has a slot per view, each laid out by the template."""
        p = req.params
        check_sampling(p.temperature, p.top_p, p.top_k, p.min_new_tokens, p.max_new_tokens)
        check_stop(p.stop, self.max_stop_strings, self.max_stop_bytes)
        check_logprobs(p.logprobs, p.top_logprobs)
        check_response_format(p.response_format, self.max_format_bytes, "max_format_bytes")
        if p.max_new_tokens < 1:
            raise VisorError(Reason.INVALID_REQUEST, "max_new_tokens must be >= 1")
        if len(req.items if visual is None else visual) > self.max_items:
            raise VisorError(
                Reason.IMAGE_COUNT_LIMIT, f"more than the core's max_items ({self.max_items})"
            )
        if visual is None:  # counted from the declared grids under the named profile
            counts = self._declared(req.items, compression.profile(req.profile))
        else:  # in-process callers that compressed the features themselves
            counts = tuple(visual)
        if sum(t.num_images for t in req.turns) != len(counts):
            raise VisorError(Reason.INVALID_REQUEST, "turns show a different number of items")
        slots = self._slots(req.items, len(counts))
        turns, tok = _with_kinds(req.turns, req.items), self.tokenizer
        ids = tok.encode_prompt(turns, list(slots)) if prompt_ids is None else prompt_ids
        wanted = [tok.slot_id(k) for t in turns for k in t.items]
        placed = [i for i in ids if tok.is_slot(i)]
        if placed != [s for s, n in zip(wanted, slots, strict=True) for _ in range(n)]:
            raise VisorError(Reason.INVALID_REQUEST, "the chat template has other image places")
        total = len(ids) - sum(slots) + sum(counts) + p.max_new_tokens
        if total > self.max_request_tokens:
            raise VisorError(
                Reason.TOKEN_BUDGET,
                f"request needs more than the {self.max_request_tokens} tokens "
                "(visual + text + max_new_tokens) one request may hold",
            )
        return ids, counts, slots

    def _slots(self, items: tuple[ItemSpec, ...], num_items: int) -> tuple[int, ...]:
        """Each item's image slots: its views where the tokenizer lays images out view by view
        (Gemma 3: each view its own run of tokens, as its processor writes them), else one."""
        if self.tokenizer.layout is not None and len(items) == num_items:
            return tuple(item.shape[0] for item in items)
        return (1,) * num_items

    def _declared(
        self, items: tuple[ItemSpec, ...], chosen: compression.Profile
    ) -> tuple[int, ...]:
        """Each item's visual tokens under the rule, then the profile (per tile, view or
        temporal patch: `compression.item_tokens`)."""
        rule = self.info.rule
        counts = []
        for item in items:
            self._check_item(item)
            self._check_video(item)
            counts.append(_item_tokens(rule, item, chosen))
        return tuple(counts)

    def _check_item(self, item: ItemSpec) -> None:
        """Refuses an item whose declared geometry is not what this core's rule produces: the
        version (the rule's digest), dtype, the shape the grid implies, and the rule's own
        bounds on that shape (views or frames at most max_item_tiles)."""
        rule = self.info.rule
        frames = item.shape[0] if item.shape else 0
        if not 1 <= frames <= self.max_item_tiles or item.tile_rows * item.tile_cols < 1:
            raise VisorError(
                Reason.INVALID_REQUEST,
                f"an item's grid is empty or its views / frames are over the core's "
                f"max_item_tiles ({self.max_item_tiles})",
            )
        if (
            item.preprocess_version != self.info.preprocess_version
            or item.resolution != rule.resolution
            or item.dtype not in self.info.accepted_dtypes
            or item.shape != rule.item_shape(item.tile_rows, item.tile_cols, frames)
        ):
            raise VisorError(
                Reason.INVALID_REQUEST, "item geometry does not match this core's encoder"
            )
        rule.check_shape(item.shape)

    def _check_video(self, item: ItemSpec) -> None:
        """Refuses a video this core's model cannot be shown, and frames without timing: a
        video's rope positions need the seconds between its frames."""
        frames = item.shape[0] if self.info.rule.kind == "native" else 1  # else: views
        interval = item.frame_interval_s
        if not 0 <= interval <= MAX_FRAME_INTERVAL_S or (frames > 1 and not item.is_video):
            raise VisorError(
                Reason.INVALID_REQUEST,
                f"an item of several frames must declare their frame_interval_s (> 0, at most "
                f"{MAX_FRAME_INTERVAL_S:g})",
            )
        if item.is_video and self.tokenizer.video_token_id is None:
            raise VisorError(
                Reason.INVALID_REQUEST,
                "this core's model serves still images only: send one frame per item (the "
                "gateway's max_sampled_frames = 1)",
            )

    def _reserve(self) -> QueueSlot:
        with self._lock:
            if self._queued + self.num_waiting >= self.max_waiting:
                raise VisorError(
                    Reason.OVERLOADED, f"the scheduler queue is full ({self.max_waiting} waiting)"
                )
            self._queued += 1
        return QueueSlot(self)

    def release(self, slot: QueueSlot) -> None:
        with self._lock:
            if slot._held:
                slot._held = False
                self._queued -= 1

    def prompt(
        self, admitted: Admitted, visual: list[int], keys: list[bytes]
    ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt with each image slot expanded to its share of its item's `visual` tokens
        (at most what admission counted), and where each slot's tokens sit (one span per run:
        a model that sees images both ways sees each view so), named by its item's content
        key."""
        counted, slots = admitted.num_visual, admitted.slots
        if (
            len(visual) != len(counted)
            or any(v > c for v, c in zip(visual, counted, strict=True))
            or any(v % n for v, n in zip(visual, slots, strict=True))
        ):
            raise VisorError(Reason.INTERNAL, "features differ from what admission counted")
        per_slot = [(v // n, key) for v, n, key in zip(visual, slots, keys, strict=True)]
        runs = [run for run, n in zip(per_slot, slots, strict=True) for _ in range(n)]
        ids = self.tokenizer.expand(list(admitted.prompt_ids), [count for count, _ in runs])
        spans, pos = [], 0
        for count, key in runs:
            while not self.tokenizer.is_slot(ids[pos]):
                pos += 1
            spans.append(ImageSpan(pos, pos + count, key))
            pos += count
        return ids, tuple(spans)


def _item_tokens(rule: PreprocessRule, item: ItemSpec, chosen: compression.Profile) -> int:
    """An item's visual tokens (`compression.item_tokens`); under a rule with pinpoints
    (LLaVA-OneVision), from its grid, one of the rule's canvases, and its source size, with no
    compression profile (the model reads the grid's tokens as one unpadded map)."""
    if not rule.pinpoints:
        return compression.item_tokens(rule, item.shape, chosen)
    if chosen.steps:
        raise VisorError(
            Reason.INVALID_REQUEST, "this core's model takes no compression profile (only none)"
        )
    rows, cols, size = item.tile_rows, item.tile_cols, rule.image_size
    grid_ok = rows * cols == 1 or (rows * size, cols * size) in rule.canvases
    if not grid_ok or min(item.source_width, item.source_height) < 1:
        raise VisorError(
            Reason.INVALID_REQUEST,
            "an anyres item needs a grid among the rule's pinpoints and its source size",
        )
    return rule.anyres_tokens(rows, cols, item.source_width, item.source_height)


def _with_kinds(turns: tuple[ChatTurn, ...], items: tuple[ItemSpec, ...]) -> list[ChatTurn]:
    """The turns with each of their items shown as a video or an image (in-process callers that
    pass features without items show images)."""
    if not any(item.is_video for item in items):
        return list(turns)
    kinds = iter(VIDEO if item.is_video else IMAGE for item in items)
    return [replace(t, kinds=tuple(itertools.islice(kinds, t.num_images))) for t in turns]
