"""The paged forward pass, bit for bit: a sequence's logits are exactly the same alone and
batched with others, with its prefill whole or chunked, and with its keys in any blocks. (The
engine-level batch test compares greedy texts, which a ~1e-7 rounding difference rarely flips;
this one sees any difference.)"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from core.model import demo, llava, paged


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> llava.Llava:
    return llava.load(demo.build(tmp_path_factory.mktemp("paged") / "demo"))


def _kv(model: llava.Llava) -> paged.PagedKV:
    t = model.cfg.text
    return paged.PagedKV(t.num_layers, 64, 16, t.num_kv_heads, t.head_dim)


def _embeds(model: llava.Llava, seed: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, model.cfg.text.hidden_size, generator=gen) * 0.5


Step = list[tuple[int, int, int, torch.Tensor]]


def _run(
    model: llava.Llava, kv: paged.PagedKV, steps: list[Step], batch_invariant: bool = True
) -> dict[int, list[torch.Tensor]]:
    """Each step: (seq, start, num_tokens, blocks) chunks; every sequence's embeddings are a
    fixed function of its id (a prefix-sharing sequence's id is its prefix owner's). Returns
    each sequence's logits, in step order."""
    out: dict[int, list[torch.Tensor]] = {}
    for step in steps:
        chunks = [paged.SeqChunk(s, n, blocks, True) for _, s, n, blocks in step]
        embeds = torch.cat([_embeds(model, seq % 100, s + n)[s:] for seq, s, n, _ in step])
        embeds = embeds.to(model.lm_head.weight.dtype)
        logits = paged.forward(model, embeds, chunks, kv, batch_invariant)
        for (seq, *_), row in zip(step, logits, strict=True):
            out.setdefault(seq, []).append(row)
    return out


@pytest.mark.parametrize("gemm", ["as probed", "tiles only"])
def test_logits_are_bitwise_the_same_alone_chunked_and_batched(
    model: llava.Llava, gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if gemm == "tiles only":  # what a machine whose BLAS fails the probe runs
        monkeypatch.setattr(paged, "exact_rows", lambda weight: False)
    a_alone, a_batched = torch.arange(0, 4), torch.tensor([9, 3, 17, 30])
    b, c, d = torch.arange(40, 44), torch.arange(50, 54), torch.arange(60, 63)
    # A: a 37-token prompt, then three decode steps.
    alone = _run(
        model, _kv(model), [[(0, 0, 37, a_alone)]] + [[(0, p, 1, a_alone)] for p in (37, 38, 39)]
    )
    batched = _run(
        model,
        _kv(model),
        [
            [(1, 0, 21, b), (0, 0, 16, a_batched)],  # A's prefill in two chunks, beside B's
            [(1, 21, 1, b), (0, 16, 21, a_batched), (2, 0, 5, c)],
            [(2, 5, 1, c), (0, 37, 1, a_batched), (1, 22, 1, b), (3, 0, 48, d)],  # D: longer than A
            [(0, 38, 1, a_batched)],  # alone again: one row, padded
            [(1, 23, 1, b), (2, 6, 1, c), (0, 39, 1, a_batched)],
        ],
    )
    want = alone[0]
    got = [batched[0][i] for i in (1, 2, 3, 4)]  # A's first chunk asked for logits it does not use
    assert len(got) == len(want) == 4
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max().item():.3g}"


def test_linear_rows_do_not_depend_on_the_other_rows(model: llava.Llava) -> None:
    layer = model.language_model.layers[0].mlp.gate_up_proj
    x = _embeds(model, 7, 300)
    whole = paged.linear(layer, x)
    for lo, hi in ((0, 1), (5, 8), (16, 33), (100, 300)):
        assert torch.equal(paged.linear(layer, x[lo:hi]), whole[lo:hi])


def _random_steps(seed: int) -> tuple[list[Step], list[Step]]:
    """A random workload and the same without prefix reuse. Sequences arrive over the steps
    with prompts of 1..70 tokens, prefill in random chunks (not on tile boundaries) beside other
    sequences' decodes, then decode a few tokens. Sequence 100 + i repeats sequence i's first
    16 or 32 tokens: in the first workload it starts after them, on i's blocks (a prefix hit);
    in the second it computes them into its own blocks."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=gen))  # noqa: E731
    blocks = iter(torch.randperm(64, generator=gen).tolist())  # scattered, as in a real pool
    owners = [(i, rand(1, 70)) for i in range(rand(3, 5))]
    shared = [(100 + i, n + rand(1, 20), 16 * rand(1, 2)) for i, n in owners if n >= 32][:1]
    tables = {seq: [next(blocks) for _ in range(-(-(n + 4) // 16))] for seq, n in owners}
    own = {seq: [next(blocks) for _ in range(-(-(n + 4) // 16))] for seq, n, _ in shared}
    prefixes = {seq: prefix for seq, _, prefix in shared}
    hit_steps: list[Step] = []
    miss_steps: list[Step] = []
    for reuse, steps in ((True, hit_steps), (False, miss_steps)):
        todo = {seq: [0, n, 4] for seq, n in owners}  # done, prompt, decodes left
        table = dict(tables)
        for seq, n, prefix in shared:
            table[seq] = table[seq - 100][: prefix // 16] + own[seq] if reuse else own[seq]
            todo[seq] = [prefix if reuse else 0, n, 4]
        for step in range(200):
            chunks = []
            for k, (seq, (done, n, left)) in enumerate(list(todo.items())):
                if k > step or left == 0:
                    continue
                if reuse and seq in prefixes and todo[seq - 100][0] < prefixes[seq]:
                    continue  # a hit needs its prefix computed (in an earlier step)
                take = min(n - done, rand(1, 40)) if done < n else 1
                chunks.append((seq, done, take, torch.tensor(table[seq])))
            for seq, done, take, _ in chunks:
                n, left = todo[seq][1:]
                todo[seq] = [done + take, n, left - (done + take > n)]
            if chunks:
                steps.append(chunks)
        assert all(left == 0 for _, _, left in todo.values())
    return hit_steps, miss_steps


def _last_logits(out: dict[int, list[torch.Tensor]]) -> dict[int, torch.Tensor]:
    return {seq: torch.stack(rows[-4:]) for seq, rows in out.items()}  # the four decodes


@pytest.mark.parametrize("seed", range(6))
def test_packed_attention_matches_the_per_sequence_path(model: llava.Llava, seed: int) -> None:
    """Fast mode (packed attention, unpadded GEMMs) against the batch-invariant per-sequence
    path on random mixed steps: GQA (the demo model has 4 heads over 2 KV heads), prefill
    chunks of any length beside decodes, and a prefix hit. Tolerance: float32, observed
    differences ~1e-6."""
    assert model.cfg.text.num_kv_heads < model.cfg.text.num_heads
    hit, miss = _random_steps(seed)
    assert any(len(s) > 1 and any(n == 1 for _, _, n, _ in s) for s in hit)  # mixed steps
    packed = _run(model, _kv(model), hit, batch_invariant=False)
    per_sequence = _run(model, _kv(model), hit, batch_invariant=True)
    no_reuse = _run(model, _kv(model), miss, batch_invariant=False)
    assert packed.keys() == per_sequence.keys()
    for seq in packed:
        assert len(packed[seq]) == len(per_sequence[seq])
        for got, want in zip(packed[seq], per_sequence[seq], strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    want = _last_logits(per_sequence)
    for seq, got in _last_logits(no_reuse).items():  # a prefix hit changes nothing
        torch.testing.assert_close(got, want[seq], atol=1e-4, rtol=1e-4)


def test_packed_step_makes_at_most_two_attention_calls() -> None:
    """Decodes share one call and prefill chunks another, whatever the batch; a prefill runs as
    one whole-chunk row (its keys gathered once) unless chunks of unequal length would pad each
    other more than `TILE`-query tiles do."""
    cpu = torch.device("cpu")
    chunks = [paged.SeqChunk(40, 1, torch.arange(3) + 3 * i, True) for i in range(8)]
    chunks.append(paged.SeqChunk(16, 40, torch.arange(30, 34), True))
    meta = paged.step_metadata(chunks, 16, False, cpu)
    assert [(c.num_rows, c.row_queries, c.row_keys) for c in meta.attention] == [
        (8, 1, 48),
        (1, 40, 64),
    ]
    assert meta.positions.tolist() == [40] * 8 + list(range(16, 56))
    assert meta.logits_indices.tolist() == [*range(8), 47]
    assert meta.slot_mapping[:2].tolist() == [2 * 16 + 8, 5 * 16 + 8]
    short = paged.SeqChunk(100, 3, torch.arange(40, 47), False)
    meta = paged.step_metadata([*chunks, short], 16, False, cpu)
    assert [(c.num_rows, c.row_queries) for c in meta.attention] == [(8, 1), (4, 16)]
    assert meta.logits_indices.tolist() == [*range(8), 47]
    assert paged.step_metadata(chunks, 16, True, cpu).attention == ()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_laid_out_weights_give_the_plain_weights_logits(
    tmp_path_factory: pytest.TempPathFactory, dtype: torch.dtype
) -> None:
    """Fast mode on the CPU runs each linear on oneDNN with its weight laid out ahead
    (`pack_linears`); the logits match the plain weights' on random mixed steps (float32:
    observed ~1e-6; bfloat16: both round, to ~1e-2 of the logits' scale)."""
    folder = demo.build(tmp_path_factory.mktemp("packed") / "demo")
    plain, packed = (llava.load(folder).to(dtype) for _ in range(2))
    assert paged.pack_linears(packed) == 4 * packed.cfg.text.num_layers + 1
    assert packed.lm_head.weight.numel() == 0  # the plain copy is gone: same memory
    hit, _ = _random_steps(0)
    t = plain.cfg.text
    kvs = [paged.PagedKV(t.num_layers, 64, 16, t.num_kv_heads, t.head_dim, dtype) for _ in "ab"]
    want = _run(plain, kvs[0], hit, batch_invariant=False)
    got = _run(packed, kvs[1], hit, batch_invariant=False)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for seq, rows in got.items():
        for g, w in zip(rows, want[seq], strict=True):
            torch.testing.assert_close(g, w, atol=tol * float(w.abs().max()), rtol=tol)


def test_a_compiled_cpu_step_writes_small_gemms_as_reductions() -> None:
    """Traced by torch.compile on the CPU (one graph), `linear` of up to `REDUCTION_ROWS` rows
    becomes a reduction inductor emits itself (no GEMM library call); more rows stay one GEMM,
    oneDNN's on the weight as it is. Both give `F.linear`'s values."""
    from torch._inductor.utils import run_and_get_code

    layer = torch.nn.Linear(64, 48)
    step = torch.compile(
        lambda x: paged.linear(layer, x, batch_invariant=False), dynamic=False, fullgraph=True
    )
    rows = paged.REDUCTION_ROWS
    with torch.no_grad():
        for n, reduced in ((1, True), (rows, True), (rows + 1, False)):
            x = torch.randn(n, 64)
            got, code = run_and_get_code(step, x)
            torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
            gemm = re.search(r"extern_kernels\.\w*mm\(|visor\.onednn_linear", "\n".join(code))
            assert (gemm is None) is reduced, n
            if not reduced and torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
                assert "visor.onednn_linear" in gemm.group(0)


def test_an_unpacked_cpu_linear_runs_on_onednn_with_f_linears_values() -> None:
    """Fast mode without laid-out weights (a compiled engine's prefill steps): oneDNN on the
    weight as it is, float32 and bfloat16, with and without a bias."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        pytest.skip("torch built without oneDNN: F.linear is the path")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for bias in (True, False):
            layer = torch.nn.Linear(96, 40, bias=bias).to(dtype)
            x = torch.randn(37, 96, dtype=dtype)
            with torch.no_grad(), _Ops() as ops:
                got = paged.linear(layer, x, batch_invariant=False)
            assert ops.names == ["visor.onednn_linear.default"]
            want = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


class _Ops(TorchDispatchMode):
    """The ops run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
