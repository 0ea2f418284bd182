"""The paged engine for families other than LLaVA, on a tiny random decoder built on the layer
hook (`forward_paged`): multimodal (3, n) rope positions, a sliding-window layer beside a global
one (or only sliding ones, with the blocks behind the window gone), and images seen both ways.
The paged forward pass (fast and batch-invariant modes; random batches, chunked prefill, prefix
hits, decodes beside prefills) against a dense attention written here with its full mask built
explicitly; the scheduler never ends a chunk inside such an image, frees the blocks behind an
all-sliding model's window, and greedy text survives preemption."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.compression import Kept
from core.config import SchedulerConfig
from core.kv_cache import NULL_BLOCK, ImageSpan
from core.model import paged
from core.model.config import TextConfig
from core.model.text import RMSNorm, _rotate
from core.outputs import NewRequestData, RunnerOutput
from core.runner import ModelRunner, prompt_positions
from core.scheduler import Scheduler
from core.sequence import Sequence
from core.types import SamplingParams

HIDDEN, HEADS, KV_HEADS, DIM, VOCAB, IMAGE = 32, 4, 2, 8, 64, 63
SECTIONS = (2, 1, 1)  # rotary frequencies driven by t, h, w (of DIM // 2)
Spans = tuple[tuple[int, int], ...]


class TinyLayer(nn.Module):
    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.sliding_window = window
        self.norm = RMSNorm(HIDDEN, 1e-6)
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM)
        self.o = nn.Linear(HEADS * DIM, HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward_paged(
        self, x: torch.Tensor, rope: Any, attend: Any, linear: Any, extra: Any = None
    ) -> torch.Tensor:
        sizes = [HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM]
        q, k, v = linear(self.qkv, self.norm(x)).split(sizes, -1)
        q, k, v = (t.view(-1, t.shape[1] // DIM, DIM).transpose(0, 1) for t in (q, k, v))
        cos, sin = rope
        x = x + linear(self.o, attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v, 0.3))
        return x + linear(self.down, F.gelu(linear(self.up, x)))


class TinyDecoder(nn.Module):
    def __init__(self, windows: tuple[int | None, ...]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(TinyLayer(w) for w in windows)
        self.norm = RMSNorm(HIDDEN, 1e-6)


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    text: TextConfig
    image_token_id: int = IMAGE


class TinyModel(nn.Module):
    """A family with (t, h, w) rope (an image of grid (1, h, w) takes h*w positions laid out on
    its grid, the text after it resumes past its largest coordinate) or plain 1-D rope."""

    def __init__(self, windows: tuple[int | None, ...], mrope: bool, bidirectional: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.mrope, self.bidirectional_images = mrope, bidirectional
        text = TextConfig(
            "llama",
            VOCAB,
            HIDDEN,
            64,
            len(windows),
            HEADS,
            KV_HEADS,
            DIM,
            1e-6,
            1e4,
            True,
            4096,
            False,
            (),
        )
        self.cfg = TinyConfig(text)
        self.language_model = TinyDecoder(windows)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        half = DIM // 2
        self.inv_freq = 1.0 / (1e4 ** (torch.arange(half, dtype=torch.float32) / half))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        rows = torch.cat([positions[i].expand(n, -1) for i, n in enumerate(SECTIONS)])
        freqs = rows.t().float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def prompt_positions(
        self, ids: list[int], grids: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor | None, int]:
        if not self.mrope:
            return None, 0
        pos, nxt, items, i = [], 0, iter(grids), 0
        while i < len(ids):
            if ids[i] != IMAGE:
                pos.append((nxt, nxt, nxt))
                nxt, i = nxt + 1, i + 1
                continue
            _, h, w = next(items)
            pos += [(nxt, nxt + r, nxt + c) for r in range(h) for c in range(w)]
            nxt, i = nxt + max(h, w), i + h * w
        return torch.tensor(pos).t(), nxt - len(ids)

    def embed(
        self, token_ids: list[int] | torch.Tensor, image: torch.Tensor | None
    ) -> torch.Tensor:
        ids = torch.as_tensor(token_ids)
        out = self.language_model.embed_tokens(torch.where(ids == IMAGE, 0, ids))
        if image is not None:
            out = out.masked_scatter((ids == IMAGE)[:, None], image.to(out.dtype))
        return out

    def encoder_digest(self) -> str:
        return "tiny"


VARIANTS = {
    "mrope+window+global+images": ((7, None), True, True),
    "rope+global+window": ((None, 20), False, False),
    "mrope+all-sliding": ((7, 20), True, False),
}


@dataclasses.dataclass
class Seq:
    ids: list[int]  # the prompt (IMAGE where image tokens sit)
    grids: list[tuple[int, int, int]]  # per image
    embeds: torch.Tensor  # (tokens, hidden): the prompt, then 4 "generated" tokens
    positions: torch.Tensor | None  # rope positions of every token; None = the indices
    spans: Spans  # each image's [start, end)

    @property
    def prompt(self) -> int:
        return len(self.ids)


def dense_logits(model: TinyModel, s: Seq) -> torch.Tensor:
    """Every token's logits with attention written out: scores, the full mask, softmax."""
    n = s.embeds.shape[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    both = torch.zeros(n, n, dtype=torch.bool)
    for a, b in s.spans if model.bidirectional_images else ():
        both[a:b, a:b] = True
    x = s.embeds
    rope = model.rope(torch.arange(n) if s.positions is None else s.positions)
    for layer in model.language_model.layers:
        window = layer.sliding_window
        seen = (j <= i) | both
        mask = seen & (j > i - window) if window is not None else seen

        def attend(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            scale: float,
            mask: torch.Tensor = mask,
        ) -> torch.Tensor:
            k, v = (t.repeat_interleave(HEADS // KV_HEADS, 0) for t in (k, v))
            scores = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, -math.inf)
            return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)

        x = layer.forward_paged(x, rope, attend, lambda m, h: F.linear(h, m.weight, m.bias))
    return model.lm_head(model.language_model.norm(x))


def _spans(ids: list[int]) -> Spans:
    """Runs of image tokens (images never abut here: text follows each)."""
    out, t = [], 0
    while t < len(ids):
        start = t
        while t < len(ids) and ids[t] == IMAGE:
            t += 1
        if t > start:
            out.append((start, t))
        t += t == start
    return tuple(out)


def _sequence(
    model: TinyModel, gen: torch.Generator, owner: Seq | None = None, share: int = 0
) -> Seq:
    """Text and one or two images (grids 1 x h x w, 4..30 tokens), then 4 decode tokens; with an
    `owner`, its first `share` tokens (and the rest of an image crossing there) are the owner's."""
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=gen))  # noqa: E731
    ids, grids, keep = [1] * rand(1, 12), [], 0
    for _ in range(rand(1, 2)):
        h, w = rand(2, 5), rand(2, 6)
        ids += [IMAGE] * (h * w) + [1] * rand(1, 9)
        grids.append((1, h, w))
    if owner is not None:
        keep = max([share] + [b for a, b in owner.spans if a < share])
        head = [g for g, (_, b) in zip(owner.grids, owner.spans, strict=True) if b <= keep]
        ids, grids = owner.ids[:keep] + ids, head + grids
    embeds = torch.randn(len(ids) + 4, HIDDEN, generator=gen) * 0.5
    if owner is not None:
        embeds[:keep] = owner.embeds[:keep]
    positions, delta = model.prompt_positions(ids, grids)
    if positions is not None:
        tail = torch.arange(len(ids), len(ids) + 4) + delta
        positions = torch.cat([positions, tail.expand(3, -1)], dim=1)
    return Seq(ids, grids, embeds, positions, _spans(ids))


def _workload(model: TinyModel, seed: int) -> tuple[dict[int, Seq], dict[int, int]]:
    """3..5 sequences; sequence 100 shares sequence 0's first 16 or 32 tokens (a prefix hit
    that may start inside an image). Returns them and where each starts computing."""
    gen = torch.Generator().manual_seed(seed)
    seqs = {i: _sequence(model, gen) for i in range(int(torch.randint(3, 6, (), generator=gen)))}
    while seqs[0].prompt < 40:
        seqs[0] = _sequence(model, gen)
    share = 16 * int(torch.randint(1, 3, (), generator=gen))
    seqs[100] = _sequence(model, gen, seqs[0], share)
    return seqs, {100: share}


Step = list[tuple[int, int, int]]  # (seq, start, num_tokens)


def _plan(seqs: dict[int, Seq], starts: dict[int, int], seed: int) -> list[Step]:
    """Sequences join one per step; prefill chunks end on tile boundaries, off any image (as the
    scheduler does), beside other sequences' decodes; a prefix hit waits for its owner."""
    gen = torch.Generator().manual_seed(seed + 1000)
    done = {s: starts.get(s, 0) for s in seqs}
    steps: list[Step] = []
    while any(done[s] < seqs[s].embeds.shape[0] for s in seqs):
        step = []
        for k, (sid, seq) in enumerate(seqs.items()):
            at, total = done[sid], seq.embeds.shape[0]
            if k > len(steps) or at >= total or (sid >= 100 and done[sid - 100] < starts[sid]):
                continue
            end = at + 1
            if at < seq.prompt:
                end = min(seq.prompt, (at // 16 + int(torch.randint(1, 3, (), generator=gen))) * 16)
                while any(a < end < b for a, b in seq.spans):
                    end = min(seq.prompt, -(-max(b for a, b in seq.spans if a < end) // 16) * 16)
            step.append((sid, at, end - at))
        for sid, at, n in step:
            done[sid] = at + n
        steps.append(step)
    return steps


GARBAGE = 63  # the block a freed table entry points at: filled with noise before every step


def _run(
    model: TinyModel, seqs: dict[int, Seq], steps: list[Step], invariant: bool, free: bool
) -> dict[tuple[int, int], torch.Tensor]:
    """Logits of each chunk's last token, by (seq, index). Sequence 100 starts on sequence 0's
    blocks. `free`: table entries behind the widest window point at a noise block."""
    kv = paged.PagedKV(len(model.language_model.layers), 64, 16, KV_HEADS, DIM)
    blocks = iter(torch.randperm(GARBAGE, generator=torch.Generator().manual_seed(5)).tolist())
    tables = {
        s: [next(blocks) for _ in range(-(-q.embeds.shape[0] // 16))] for s, q in seqs.items()
    }
    if 100 in seqs and 0 in seqs:
        first = -(-_first_start(steps, 100) // 16)
        tables[100][:first] = tables[0][:first]
    widest = max(w or 0 for w in (layer.sliding_window for layer in model.language_model.layers))
    out = {}
    for step in steps:
        for store in (*kv.keys, *kv.values):
            store[:, GARBAGE] = torch.randn(store[:, GARBAGE].shape) * 100
        chunks = []
        for sid, at, n in step:
            table = list(tables[sid])
            dead = max(0, at - widest + 1) // 16 if free else 0
            table[:dead] = [GARBAGE] * dead
            seq = seqs[sid]
            pos = None if seq.positions is None else seq.positions[:, at : at + n]
            spans = seq.spans if model.bidirectional_images else ()
            chunks.append(paged.SeqChunk(at, n, torch.tensor(table), True, pos, spans))
        embeds = torch.cat([seqs[sid].embeds[at : at + n] for sid, at, n in step])
        logits = paged.forward(model, embeds, chunks, kv, invariant)  # type: ignore[arg-type]
        for (sid, at, n), row in zip(step, logits, strict=True):
            out[(sid, at + n - 1)] = row
    return out


def _first_start(steps: list[Step], sid: int) -> int:
    return next(at for step in steps for s, at, _ in step if s == sid)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", range(4))
def test_paged_forward_matches_dense_attention(variant: str, seed: int) -> None:
    model = TinyModel(*VARIANTS[variant])
    seqs, starts = _workload(model, seed)
    steps = _plan(seqs, starts, seed)
    assert any(len({n > 1 for _, _, n in s}) == 2 for s in steps)  # decodes beside prefills
    free = None not in {layer.sliding_window for layer in model.language_model.layers}
    want = {sid: dense_logits(model, seq) for sid, seq in seqs.items()}
    for invariant in (False, True):
        got = _run(model, seqs, steps, invariant, free)
        for (sid, index), row in got.items():
            torch.testing.assert_close(row, want[sid][index], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", range(3))
def test_batch_invariant_logits_are_bitwise_alone_and_batched(variant: str, seed: int) -> None:
    """Each sequence alone (whole prompt, no prefix hit, then its decodes) against the random
    batched, chunked, prefix-sharing run: the same bits at the prompt's end and every decode."""
    model = TinyModel(*VARIANTS[variant])
    seqs, starts = _workload(model, seed)
    free = None not in {layer.sliding_window for layer in model.language_model.layers}
    batched = _run(model, seqs, _plan(seqs, starts, seed), True, free)
    for sid, seq in seqs.items():
        alone_steps = [[(sid, 0, seq.prompt)]] + [
            [(sid, i, 1)] for i in range(seq.prompt, seq.prompt + 4)
        ]
        alone = _run(model, {sid: seq}, alone_steps, True, free)
        for index in range(seq.prompt - 1, seq.prompt + 4):
            assert torch.equal(alone[(sid, index)], batched[(sid, index)]), (sid, index)


def test_positions_go_into_the_step_per_token() -> None:
    """(3, n) chunks and plain ones share a step: a plain one's t, h and w are its indices; KV
    slots and masks follow the indices, never the rope positions."""
    cpu = torch.device("cpu")
    mm = paged.SeqChunk(0, 4, torch.tensor([3]), True, torch.tensor([[0, 1, 1, 3]] * 3))
    plain = paged.SeqChunk(5, 2, torch.tensor([7]), True)
    meta = paged.step_metadata([mm, plain], 16, False, cpu)
    assert meta.positions.tolist() == [[0, 1, 1, 3, 5, 6]] * 3
    assert meta.slot_mapping.tolist() == [48, 49, 50, 51, 117, 118]
    assert paged.step_metadata([plain], 16, True, cpu).positions.tolist() == [5, 6]
    inside = paged.SeqChunk(0, 4, torch.tensor([3]), True, None, ((2, 6),))
    with pytest.raises(ValueError, match="inside an image"):
        paged.step_metadata([inside], 16, False, cpu)


def _request(
    seq_id: int, model: TinyModel, gen: torch.Generator, n: int
) -> tuple[Sequence, NewRequestData]:
    """A prompt of text around images (their features random), greedy for `n` tokens."""
    seq = _sequence(model, gen)
    params = SamplingParams(max_new_tokens=n, min_new_tokens=n)
    features = tuple(
        np.random.default_rng(seq_id * 10 + k).normal(0, 0.5, (b - a, HIDDEN)).astype(np.float32)
        for k, (a, b) in enumerate(seq.spans)
    )
    spans = tuple(ImageSpan(a, b, bytes([seq_id, k])) for k, (a, b) in enumerate(seq.spans))
    s = Sequence(seq_id, "t", b"salt", list(seq.ids), seq.prompt, spans, params, arrival=0.0)
    new = NewRequestData(
        seq_id, tuple(seq.ids), features, params, seq_id, None, tuple(seq.grids), seq.spans
    )
    return s, new


def _generate(model: TinyModel, num_blocks: int, seed: int) -> tuple[dict[int, list[int]], int]:
    """Four requests through the real scheduler and runner; their generated ids, and how many
    preemptions it took."""
    windows = {layer.sliding_window for layer in model.language_model.layers}
    cfg = SchedulerConfig(max_batch_tokens=48, max_prefill_chunk=32)
    sliding = None if None in windows else max(w for w in windows if w is not None)
    sched = Scheduler(cfg, num_blocks, {0}, 16, model.bidirectional_images, sliding)
    runner = ModelRunner(model, num_blocks, 16, {0})  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(4):
        seq, new = _request(i, model, gen, 24)
        sched.add(seq, new)
        seqs.append(seq)
    while sched.has_work():
        out = sched.schedule()
        for c in out.chunks:
            seq = next(s for s in seqs if s.seq_id == c.seq_id)
            end = c.start + c.num_tokens
            if model.bidirectional_images:
                assert not any(s.start < end < s.end for s in seq.spans), "a chunk cut an image"
        sched.update(out, runner.execute(out))
    return {s.seq_id: s.token_ids[s.num_prompt_tokens :] for s in seqs}, sched.num_preemptions


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_text_is_the_same_after_preemptions(variant: str) -> None:
    """Plenty of blocks against too few for all four at once: preempted requests recompute
    (positions, images seen both ways, windows) and generate the same ids."""
    model = TinyModel(*VARIANTS[variant])
    roomy, none = _generate(model, 60, seed=1)
    assert none == 0
    tight, preempted = _generate(model, 9, seed=1)
    assert preempted > 0
    assert tight == roomy


def test_no_chunk_ends_inside_an_image_the_model_sees_both_ways() -> None:
    """A 50-token image does not fit the 32-token chunk budget: its chunk runs over the budget
    rather than cut it; a causal model's chunks do cut images (the check means something)."""
    spans = ((10, 30), (40, 90))
    ends = {}
    for whole in (True, False):
        sched = Scheduler(
            SchedulerConfig(max_batch_tokens=32, max_prefill_chunk=32), 64, {0}, 16, whole
        )
        params = SamplingParams(max_new_tokens=2)
        images = tuple(ImageSpan(a, b, b"k") for a, b in spans)
        sched.add(
            Sequence(0, "t", b"", [1] * 100, 100, images, params, 0.0),
            NewRequestData(0, (1,) * 100, (), params, 0, None),
        )
        ends[whole] = []
        while sched.has_work():
            out = sched.schedule()
            ends[whole] += [c.start + c.num_tokens for c in out.chunks]
            sched.update(out, RunnerOutput({c.seq_id: 5 for c in out.chunks if c.sample}))
    assert ends[True][:3] == [32, 96, 100]  # 64 would cut (40, 90): over budget to 96
    assert not any(a < e < b for e in ends[True] for a, b in spans)
    assert any(a < e < b for e in ends[False] for a, b in spans)


def test_an_all_sliding_model_frees_the_blocks_behind_its_window() -> None:
    """Window 20: once a sequence is at index i, the blocks wholly before i - 19 return to the
    pool (their entries stand as NULL_BLOCK) and a long generation holds a bounded table."""
    cfg = SchedulerConfig(max_batch_tokens=64, max_prefill_chunk=64)
    sched = Scheduler(cfg, 16, {0}, 16, sliding_window=20)
    params = SamplingParams(max_new_tokens=120, min_new_tokens=120)
    sched.add(
        Sequence(0, "t", b"", [1] * 40, 40, (), params, 0.0),
        NewRequestData(0, (1,) * 40, (), params, 0, None),
    )
    held = []
    while sched.has_work():
        out = sched.schedule()
        sched.update(out, RunnerOutput({0: 5}))
        table = sched.kv.tables.get(0, [])
        held.append(sum(b is not NULL_BLOCK for b in table))
    assert len(held) == 121 and max(held) <= 3  # 160 tokens would take 10 blocks
    assert sched.kv.num_free_blocks == 16


def test_compressed_tokens_keep_their_original_positions() -> None:
    """An image of 3 x 4 tokens of which compression kept 0, 5 and 11: the kept tokens get the
    (t, h, w) they had uncompressed, and the text after it (and every generated token) the
    positions it had after the whole image."""
    model = TinyModel((None,), True, False)
    full = [1, 1] + [IMAGE] * 12 + [1, 1]
    want, delta = model.prompt_positions(full, [(1, 3, 4)])
    assert want is not None
    ids = [1, 1] + [IMAGE] * 3 + [1, 1]
    kept = Kept(12, np.array([0, 5, 11]))
    new = NewRequestData(
        0, tuple(ids), (), SamplingParams(1), 0, None, ((1, 3, 4),), ((2, 5),), (kept,)
    )
    got, got_delta = prompt_positions(model, new)  # type: ignore[arg-type]
    assert got is not None
    assert got.tolist() == want[:, [0, 1, 2, 7, 13, 14, 15]].tolist()
    assert got[:, 2:5].tolist() == [[2, 2, 2], [2, 3, 4], [2, 3, 5]]
    assert len(ids) + got_delta == len(full) + delta  # the first generated token's position
    plain = TinyModel((None,), False, False)  # 1-D rope: contiguous, as before
    assert prompt_positions(plain, new) == (None, 0)  # type: ignore[arg-type]
