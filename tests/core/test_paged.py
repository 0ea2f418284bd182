"""The paged forward pass, bit for bit: a sequence's logits are exactly the same alone and
batched with others, with its prefill whole or chunked, and with its keys in any blocks. (The
engine-level batch test compares greedy texts, which a ~1e-7 rounding difference rarely flips;
this one sees any difference.)"""

from __future__ import annotations

import pytest
import torch

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


def _run(
    model: llava.Llava, kv: paged.PagedKV, steps: list[list[tuple[int, int, int, torch.Tensor]]]
) -> dict[int, list[torch.Tensor]]:
    """Each step: (seq, start, num_tokens, blocks) chunks; every sequence's embeddings are a
    fixed function of its id. Returns each sequence's logits, in step order."""
    out: dict[int, list[torch.Tensor]] = {}
    for step in steps:
        chunks = [paged.SeqChunk(s, n, blocks, True) for _, s, n, blocks in step]
        embeds = torch.cat([_embeds(model, seq, s + n)[s:] for seq, s, n, _ in step])
        logits = paged.forward(model, embeds, chunks, kv)
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
    b, c = torch.arange(40, 44), torch.arange(50, 54)
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
            [(2, 5, 1, c), (0, 37, 1, a_batched), (1, 22, 1, b)],
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
    layer = model.language_model.layers[0].mlp.gate_proj
    x = _embeds(model, 7, 300)
    whole = paged.linear(layer, x)
    for lo, hi in ((0, 1), (5, 8), (16, 33), (100, 300)):
        assert torch.equal(paged.linear(layer, x[lo:hi]), whole[lo:hi])
