"""Decode-only steps at padded static shapes (core/cuda_graphs.py).

On the CPU the padded static-buffer path runs eagerly (graphs are CUDA's): against the plain fast
path on the tiny decoders of test_paged_masks.py (1-D and (t, h, w) rope, sliding windows, images
seen both ways) at batch sizes that need padding rows and prefix lengths that need padded keys,
the logits agree within 1e-5 (float32; the padded GEMMs and SDPA calls have more rows and keys, so
the last bits may differ), and the padding rows write only the scratch block. Through the real
scheduler and runner, greedy text is the same with the path on as off. Without a GPU, a
fake-tensor trace on device "cuda" checks that every static buffer lives there and the step
copies its indices to the device once; with one, captured graphs replay as the eager path."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from core.config import CoreConfig, SchedulerConfig
from core.cuda_graphs import Buckets, DecodeGraphs, PaddedDecode, Shape, decode_shape
from core.model import paged
from core.model.config import parse
from core.model.llava import Llava
from core.runner import ModelRunner
from core.scheduler import Scheduler
from shared.config import ConfigError, build
from tests.core.test_encoder_device import _fake_on_cuda
from tests.core.test_llm_device import ATEN, CUDA, GEMMS, LLAVA_15_7B_TEXT, _getitem, _Trace
from tests.core.test_paged_masks import DIM, HIDDEN, KV_HEADS, VARIANTS, VOCAB, TinyModel, _request
from tests.helpers import run_in_child

BLOCK = 16
NUM_BLOCKS = 128  # the KV-cache manager's; block 128 is the padding rows' scratch
BUCKETS = Buckets.for_limits(32, BLOCK, 512)
CPU = torch.device("cpu")


def _kv(model: TinyModel, device: torch.device = CPU) -> paged.PagedKV:
    """Every block (the scratch one too) full of noise: what a padding row must never touch."""
    layers = len(model.language_model.layers)
    kv = paged.PagedKV(layers, NUM_BLOCKS + 1, BLOCK, KV_HEADS, DIM, device=device)
    gen = torch.Generator().manual_seed(0)
    for store in (*kv.keys, *kv.values):
        store.copy_(torch.randn(store.shape, generator=gen))
    return kv


def _clone(kv: paged.PagedKV) -> paged.PagedKV:
    copy = paged.PagedKV(0, 1, kv.block_size, 1, 1)
    copy.keys, copy.values = [t.clone() for t in kv.keys], [t.clone() for t in kv.values]
    return copy


def _decode_batch(
    model: TinyModel, size: int, seed: int
) -> tuple[list[paged.SeqChunk], torch.Tensor]:
    """`size` decodes, each of a sequence holding 1..70 tokens on its own random blocks; with
    (t, h, w) rope every other one carries (3, 1) positions (the others are text-only requests:
    None), and where the model sees images both ways each has an image before its token."""
    gen = torch.Generator().manual_seed(seed)
    free = iter(torch.randperm(NUM_BLOCKS, generator=gen).tolist())
    chunks = []
    for i in range(size):
        start = int(torch.randint(1, 71, (), generator=gen))
        table = torch.tensor([next(free) for _ in range(start // BLOCK + 1)])
        positions = None
        if model.mrope and i % 2:
            positions = torch.tensor([[start + 3], [start + 5], [start + 4]])
        spans = ((0, (start + 1) // 2),) if model.bidirectional_images else ()
        chunks.append(paged.SeqChunk(start, 1, table, True, positions, spans))
    return chunks, torch.randn(size, HIDDEN, generator=gen) * 0.5


def _slots(store: torch.Tensor) -> torch.Tensor:
    return store.view(store.shape[0], -1, store.shape[-1])


def test_buckets_and_which_steps_they_serve() -> None:
    buckets = Buckets.for_limits(64, 16, 8192)
    assert buckets.batches == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets.keys == tuple(16 << i for i in range(10))
    odd = Buckets.for_limits(20, 16, 1000)
    assert odd.batches == (1, 2, 4, 8, 16, 20) and odd.keys[-2:] == (512, 1008)
    decode = [paged.SeqChunk(s, 1, torch.tensor([0, 1]), True) for s in (3, 20, 16)]
    assert decode_shape(decode, odd) == Shape(4, 32, 0)  # 3 rows -> 4; 21 keys -> 32
    assert decode_shape(decode * 6, odd) == Shape(20, 32, 0)  # 18 rows -> the largest, 20
    assert decode_shape(decode[:1] * 17, odd) == Shape(20, 16, 0)
    assert decode_shape(decode[:1] * 21, odd) is None  # past the largest batch
    far = paged.SeqChunk(1008, 1, torch.tensor([0]), True)
    assert decode_shape([far], odd) is None  # past the largest key bucket
    mrope = paged.SeqChunk(3, 1, torch.tensor([0]), True, torch.tensor([[7], [8], [9]]))
    assert decode_shape([decode[0], mrope], odd) == Shape(2, 16, 3)
    prefill = paged.SeqChunk(0, 2, torch.tensor([0]), True)
    silent = paged.SeqChunk(3, 1, torch.tensor([0]), False)  # a prompt token that samples nothing
    inside = paged.SeqChunk(3, 1, torch.tensor([0]), True, None, ((2, 6),))
    beside = paged.SeqChunk(7, 1, torch.tensor([0]), True, None, ((2, 6),))
    for step in ([decode[0], prefill], [silent], [inside]):
        assert decode_shape(step, odd) is None
    assert decode_shape([beside], odd) == Shape(1, 16, 0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("size", [3, 5, 17])
def test_padded_decode_matches_the_fast_path(variant: str, size: int) -> None:
    model = TinyModel(*VARIANTS[variant])
    chunks, embeds = _decode_batch(model, size, seed=size)
    kv = _kv(model)
    before, plain = _clone(kv), _clone(kv)
    want = paged.forward(model, embeds, chunks, plain, batch_invariant=False)  # type: ignore[arg-type]
    graphs = DecodeGraphs(model, kv, BUCKETS, capture=False)  # type: ignore[arg-type]
    got = graphs.run(embeds, chunks)
    assert got is not None and got.shape == want.shape == (size, VOCAB)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    rows = {3: 4, 5: 8, 17: 24}[size]
    keys = next(k for k in (16, 32, 64, 128) if k > max(c.start for c in chunks))
    assert graphs.shapes == (Shape(rows, keys, 3 if model.mrope else 0),)
    new = sorted(int(c.blocks[c.start // BLOCK]) * BLOCK + c.start % BLOCK for c in chunks)
    scratch = NUM_BLOCKS * BLOCK
    for old, ours, theirs in zip(
        (*before.keys, *before.values), (*kv.keys, *kv.values), (*plain.keys, *plain.values),
        strict=True,
    ):  # fmt: skip
        old, ours, theirs = _slots(old), _slots(ours), _slots(theirs)
        changed = (old != ours).any(-1).any(0).nonzero().flatten().tolist()
        # Only the live rows' new slots, and the scratch block's first slot (the padding rows').
        assert changed == [*new, scratch]
        torch.testing.assert_close(ours[:, new], theirs[:, new], atol=1e-5, rtol=1e-5)


def _generate(model: TinyModel, graphs: bool) -> tuple[dict[int, list[int]], ModelRunner]:
    """Six greedy requests through the real scheduler and a fast-mode runner, the padded
    decode path on or off."""
    windows = {layer.sliding_window for layer in model.language_model.layers}
    sliding = None if None in windows else max(w for w in windows if w is not None)
    cfg = SchedulerConfig(max_batch_tokens=64, max_prefill_chunk=32)
    sched = Scheduler(cfg, 60, {0}, 16, model.bidirectional_images, sliding)
    buckets = Buckets.for_limits(sched.max_num_seqs, 16, 60 * 16)
    padded = PaddedDecode(buckets, cuda_graphs=True, compile=False) if graphs else None
    runner = ModelRunner(model, 60, 16, {0}, False, padded)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(7)
    seqs = []
    for i in range(6):
        seq, new = _request(i, model, gen, 12)
        sched.add(seq, new)
        seqs.append(seq)
    while sched.has_work():
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    return {s.seq_id: s.token_ids[s.num_prompt_tokens :] for s in seqs}, runner


@pytest.mark.parametrize("variant", ["mrope+window+global+images", "rope+global+window"])
def test_greedy_text_is_the_same_with_the_padded_decode_path(variant: str) -> None:
    model = TinyModel(*VARIANTS[variant])
    plain, _ = _generate(model, graphs=False)
    padded, runner = _generate(model, graphs=True)
    assert runner.graphs is not None and runner.kv.keys[0].shape[1] == 61  # + the scratch block
    assert runner.graphs.num_steps >= 10  # the decodes of all six, then of the last ones
    assert {s.rows for s in runner.graphs.shapes} >= {8}  # six decodes padded to eight rows
    assert padded == plain


def test_the_padded_path_needs_the_fast_mode() -> None:
    model = TinyModel(*VARIANTS["rope+global+window"])
    with pytest.raises(ValueError, match="batch_invariant"):
        ModelRunner(model, 8, 16, {0}, True, PaddedDecode(BUCKETS, True, False))  # type: ignore[arg-type]


def test_a_compiled_step_gives_the_eager_logits() -> None:
    """torch.compile (inductor, CPU) of four steps over three buckets, one with more rows than
    become reductions: the eager padded path's logits and keys (inductor fuses differently:
    within 1e-5), each bucket one graph (a graph break runs the rest of the step eagerly)."""
    model = TinyModel(*VARIANTS["mrope+window+global+images"])
    kv = _kv(model)
    eager_kv = _clone(kv)
    eager = DecodeGraphs(model, eager_kv, BUCKETS, capture=False)  # type: ignore[arg-type]
    graphs = DecodeGraphs(model, kv, BUCKETS, capture=False, compile=True)  # type: ignore[arg-type]
    counters = torch._dynamo.utils.counters
    counters.clear()
    for size, seed in ((3, 3), (3, 4), (3, 3), (paged.REDUCTION_ROWS + 2, 5)):
        chunks, embeds = _decode_batch(model, size, seed)
        want, got = eager.run(embeds, chunks), graphs.run(embeds, chunks)
        assert want is not None and got is not None and graphs.compiled
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(graphs.shapes) == 3
    assert graphs.shapes[-1].rows > paged.REDUCTION_ROWS
    assert not counters["graph_break"], dict(counters["graph_break"])
    for ours, theirs in zip(
        (*kv.keys, *kv.values), (*eager_kv.keys, *eager_kv.values), strict=True
    ):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_buckets_compile_past_dynamos_default_limit_on_the_model_thread() -> None:
    """Dynamo's settings are per thread, and the engine compiles on its model thread: the
    recompile limit that lets every bucket compile is set there, not only where the runner was
    built (else dynamo runs each bucket past the 8th eagerly, with a warning on stderr)."""
    model = TinyModel(*VARIANTS["rope+global+window"])
    graphs = DecodeGraphs(model, _kv(model), BUCKETS, capture=False, compile=True)  # type: ignore[arg-type]
    seen: list[int] = []

    def model_thread() -> None:
        chunks, embeds = _decode_batch(model, 2, 5)
        assert graphs.run(embeds, chunks) is not None and graphs.compiled
        seen.append(torch._dynamo.config.recompile_limit)

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert seen == [len(BUCKETS.batches) * len(BUCKETS.keys) * 2]


_COPY = torch.Tensor.copy_


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`dst.copy_(src)` into a fake CUDA tensor: the Python binding opens a CUDA device guard
    first, which a torch without CUDA cannot; the op itself runs as it would on a GPU."""
    if isinstance(dst, FakeTensor) and dst.device.type == "cuda":
        return torch.ops.aten.copy_.default(dst, src, non_blocking)  # type: ignore[no-any-return]
    return _COPY(dst, src, non_blocking)


class _HostCopies(_Trace):
    """The trace of test_llm_device.py, plus what a torch without CUDA cannot make: a host
    tensor copied into a fake CUDA buffer (recorded as a host-to-device copy, values absent)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        dst, src = (*args, None, None)[:2]
        if (
            func is ATEN.copy_.default
            and isinstance(dst, FakeTensor)
            and not isinstance(src, FakeTensor)
        ):
            if self.recording:
                self.ops.append((str(func), {"cpu"}, [("cuda", dst.dtype, tuple(dst.shape))]))
            return dst
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_the_static_buffers_live_on_cuda() -> None:
    """`static_buffers_on_fake_cuda`, in a child process: its `Tensor.__getitem__` stand-in
    cannot be undone in this one."""
    assert "static buffers ok" in run_in_child(
        "tests.core.test_cuda_graphs.static_buffers_on_fake_cuda"
    )


def static_buffers_on_fake_cuda() -> None:
    """A 7B-shaped decoder on fake CUDA tensors: three decodes padded to four rows."""
    with torch.device("meta"):
        model = Llava(parse(LLAVA_15_7B_TEXT, {}))
    torch.Tensor.__getitem__ = _getitem  # type: ignore[method-assign,assignment]
    torch.Tensor.copy_ = _copy  # type: ignore[method-assign,assignment]
    with FakeTensorMode(allow_non_fake_inputs=False), _HostCopies() as trace:
        _fake_on_cuda(model.language_model, torch.bfloat16)
        _fake_on_cuda(model.lm_head, torch.bfloat16)
        with torch.device(CUDA):
            model.language_model.rotary.reset_buffers()
        kv = paged.PagedKV(32, 65, 16, 32, 128, torch.bfloat16, CUDA)
        graphs = DecodeGraphs(model, kv, Buckets.for_limits(32, 16, 1024), capture=False)  # type: ignore[arg-type]
        starts = ((40, 0), (9, 4), (61, 8))  # (index of the new token, first block)
        chunks = [paged.SeqChunk(s, 1, torch.arange(b, b + 4), True) for s, b in starts]
        embeds = torch.empty(3, 4096, dtype=torch.bfloat16, device=CUDA)
        trace.recording = True
        logits = graphs.run(embeds, chunks)
    assert logits is not None and logits.shape == (3, 32064)
    assert (logits.device, logits.dtype) == (CUDA, torch.float32)
    assert graphs.shapes == (Shape(4, 64, 0),)
    static = [v for v in vars(graphs).values() if isinstance(v, torch.Tensor)]
    static += [t for s in graphs._steps.values() for t in (s.flat, s.embeds)]
    assert len(static) == 5 and {t.device for t in static} == {CUDA}
    ops = trace.ops
    sent = [op for op, ins, made in ops if ins == {"cpu"} and any(m[0] == "cuda" for m in made)]
    assert sent == ["aten.copy_.default"]  # the step's indices, in one copy
    assert not any(op == "aten._local_scalar_dense.default" for op, _, _ in ops)
    assert not any("cuda" in ins and any(m[0] != "cuda" for m in made) for _, ins, made in ops)
    gemm = [m for op, _, made in ops if op.startswith(GEMMS) for m in made]
    assert len(gemm) >= 32 * 4 + 1 and {(m[0], m[1], m[2][0]) for m in gemm} == {
        ("cuda", torch.bfloat16, 4)
    }  # every GEMM runs on the four padded rows
    writes = [made for op, _, made in ops if op.startswith("aten.index_copy")]
    assert len(writes) == 2 * 32
    print("static buffers ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to capture graphs")
@pytest.mark.parametrize("variant", VARIANTS)
def test_captured_graphs_replay_as_the_eager_fast_path(variant: str) -> None:
    """Two buckets captured, each replayed with new data (3 and 4 decodes share one)."""
    device = torch.device("cuda")
    model = TinyModel(*VARIANTS[variant]).to(device)
    model.inv_freq = model.inv_freq.to(device)
    kv = _kv(model, device)
    graphs = DecodeGraphs(model, kv, BUCKETS, capture=True)  # type: ignore[arg-type]
    for size, seed in ((3, 1), (4, 2), (17, 3), (3, 4), (20, 5)):
        chunks, embeds = _decode_batch(model, size, seed)
        plain = _clone(kv)
        want = paged.forward(model, embeds.to(device), chunks, plain, False)  # type: ignore[arg-type]
        got = graphs.run(embeds.to(device), chunks)
        assert got is not None
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert {s.rows for s in graphs.shapes} == {4, 24}
    assert all(s.graph is not None for s in graphs._steps.values())


def test_the_config_key_and_its_override() -> None:
    assert build(CoreConfig, "core", {}, {}).cuda_graphs is True
    assert build(CoreConfig, "core", {"core": {"cuda_graphs": False}}, {}).cuda_graphs is False
    env = {"VISOR_CORE_CUDA_GRAPHS": "false"}
    assert build(CoreConfig, "core", {"core": {"cuda_graphs": True}}, env).cuda_graphs is False
    with pytest.raises(ConfigError, match="VISOR_CORE_CUDA_GRAPHS must be true or false"):
        build(CoreConfig, "core", {}, {"VISOR_CORE_CUDA_GRAPHS": "sometimes"})
    with pytest.raises(ConfigError, match=r"\[core\] cuda_graphs must be of type bool"):
        build(CoreConfig, "core", {"core": {"cuda_graphs": "yes"}}, {})
    assert build(CoreConfig, "core", {}, {}).compile is False
    assert build(CoreConfig, "core", {}, {"VISOR_CORE_COMPILE": "on"}).compile is True
