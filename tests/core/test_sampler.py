"""The step's batched sampler (`core.generate.Sampler`, every row at once on the device) against
the per-sequence reference (`core.generate.sample`, with the runner's old EOS hold): the same
token for every row, greedy exactly argmax, a seeded row's token the same whatever its
batch-mates and its place among them, logprobs as `logprobs_of` reports them, and draws that
follow the distribution asked for.

Exact equality with the stream of the per-sequence sampler before this change (torch.multinomial
on a per-request CPU generator) is impossible by design: a generator's stream depends on how many
draws it made before and on the device, which is what a batched, on-device sampler cannot keep.
The noise is counter-based instead (`gumbel`: a hash of the request's seed, its token count and
the token id), and these tests pin reproducibility."""

from __future__ import annotations

import math
import random

import pytest
import torch

from core.device import gpu_kv_budget, upload
from core.generate import (
    SampledRow,
    Sampler,
    SampleRow,
    gumbel,
    logprobs_of,
    noise_key,
    sample,
)
from core.types import SamplingParams

CPU = torch.device("cpu")
VOCAB = 300
EOS = {2, 7}


def _batched(rows: list[SampleRow], raw: torch.Tensor, masked: torch.Tensor) -> list[SampledRow]:
    controls = upload(Sampler.inputs(rows), CPU)
    return Sampler(VOCAB, EOS, CPU).sample(raw, masked, rows, controls)


def _reference(row: SampleRow, logits: torch.Tensor) -> int:
    """The runner's per-sequence path before the batched sampler: EOS held below
    min_new_tokens unless a grammar allows nothing else, then `sample` (-1 where it raises)."""
    if row.hold_eos:
        held = logits.clone()
        held[sorted(EOS)] = float("-inf")
        if not row.constrained or bool(torch.isfinite(held).any()):
            logits = held
    try:
        return sample(logits, row.params, row.key)
    except ValueError:
        return -1


def _random_step(
    rng: random.Random, n: int, top_ks: tuple[int, ...] = (0, 0, 1, 5, 50, VOCAB, 1000)
) -> tuple[list[SampleRow], torch.Tensor, torch.Tensor]:
    rows, masked_rows = [], []
    raw = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    raw *= rng.choice([0.5, 3.0, 10.0])
    for i in range(n):
        params = SamplingParams(
            max_new_tokens=8,
            temperature=rng.choice([0.0, 1e-6, 0.3, 1.0, 2.0, 100.0]),
            top_k=rng.choice(top_ks),
            top_p=rng.choice([0.0, 1.0, 1.0, 0.95, 0.5, 0.05]),
            logprobs=rng.random() < 0.5,
            top_logprobs=rng.choice([0, 1, 5, 20]),
        )
        constrained = rng.random() < 0.3
        row = raw[i].clone()
        if constrained:  # a grammar's mask: a random subset, sometimes nothing but EOS
            allowed = torch.rand(VOCAB, generator=torch.Generator().manual_seed(i)) < 0.2
            if rng.random() < 0.3:
                allowed = torch.zeros(VOCAB, dtype=torch.bool)
                allowed[sorted(EOS)] = True
            row = row.masked_fill(~allowed, float("-inf"))
        masked_rows.append(row)
        key = noise_key(rng.randrange(1 << 64), rng.randrange(100))
        rows.append(SampleRow(params, key, rng.random() < 0.4, constrained))
    return rows, raw, torch.stack(masked_rows)


@pytest.mark.parametrize("seed", range(12))
def test_batched_sampling_equals_the_per_sequence_reference(seed: int) -> None:
    rng = random.Random(seed)
    # From seed 8 on, every row has a top-k: the sampler draws among the top tokens only.
    top_ks = (1, 5, 50, 299) if seed >= 8 else (0, 0, 1, 5, 50, VOCAB, 1000)
    rows, raw, masked = _random_step(rng, rng.randrange(1, 40), top_ks)
    got = _batched(rows, raw, masked)
    want = [_reference(row, masked[i]) for i, row in enumerate(rows)]
    assert [g.token for g in got] == want
    for i, row in enumerate(rows):  # greedy rows: exactly argmax (of the EOS-held logits)
        if row.params.temperature < 1e-5 and not row.hold_eos:
            assert got[i].token == int(torch.argmax(masked[i]))


@pytest.mark.parametrize("seed", range(4))
def test_a_rows_token_does_not_depend_on_its_batch(seed: int) -> None:
    rng = random.Random(100 + seed)
    rows, raw, masked = _random_step(rng, 24)
    together = [g.token for g in _batched(rows, raw, masked)]
    alone = [_batched([r], raw[i : i + 1], masked[i : i + 1])[0].token for i, r in enumerate(rows)]
    order = list(range(len(rows)))
    rng.shuffle(order)
    shuffled = _batched([rows[i] for i in order], raw[order], masked[order])
    assert together == alone
    assert [shuffled[order.index(i)].token for i in range(len(rows))] == together


def test_logprobs_come_from_the_raw_logits() -> None:
    rng = random.Random(7)
    rows, raw, masked = _random_step(rng, 30)
    for row, got, logits in zip(rows, _batched(rows, raw, masked), raw, strict=True):
        if not row.params.logprobs or got.token < 0:
            assert got.logprobs is None
            continue
        want = logprobs_of(logits, got.token, row.params.top_logprobs)
        assert got.logprobs is not None
        assert got.logprobs.top_ids == want.top_ids
        assert got.logprobs.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert got.logprobs.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-6)


def test_a_row_without_a_finite_logit_fails_alone() -> None:
    raw = torch.randn(3, VOCAB)
    raw[1] = float("-inf")
    raw[2, 5] = float("nan")
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    rows = [SampleRow(params, noise_key(1, i), False, False) for i in range(3)]
    got = [g.token for g in _batched(rows, raw, raw)]
    assert got[1] == got[2] == -1 and 0 <= got[0] < VOCAB


def test_draws_follow_the_distribution_asked_for() -> None:
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5] + [-1e4] * (VOCAB - 5)])
    draws = 4000
    cases = [
        (SamplingParams(max_new_tokens=1, temperature=0.7), None),
        (SamplingParams(max_new_tokens=1, temperature=1.0, top_k=2), 2),
        (SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.8), None),
    ]
    for params, k in cases:
        rows = [SampleRow(params, noise_key(11, n), False, False) for n in range(draws)]
        batch = logits.expand(draws, -1)
        tokens = [g.token for g in _batched(rows, batch, batch)]
        probs = torch.softmax(logits[0, :5] / params.temperature, -1)
        if k is not None:
            probs = torch.where(probs >= probs.topk(k).values[-1], probs, 0.0)
        if params.top_p < 1:
            ranked, order = probs.sort(descending=True)
            ranked = torch.where(ranked.cumsum(-1) - ranked >= params.top_p, 0.0, ranked)
            probs = torch.zeros(5).scatter(0, order, ranked)
        probs /= probs.sum()
        for token in range(5):
            seen = tokens.count(token) / draws
            p = float(probs[token])
            assert abs(seen - p) <= 4 * math.sqrt(p * (1 - p) / draws) + 1e-9, (params, token)


def test_gumbel_noise_is_keyed_by_row() -> None:
    keys = torch.tensor([noise_key(5, 0), noise_key(5, 1), noise_key(5, 0)])
    noise = gumbel(keys, torch.arange(1000))
    some = torch.tensor([[5, 900, 17]] * 3)  # a row's noise for an id does not depend on the rest
    assert torch.equal(gumbel(keys, some), noise[:, [5, 900, 17]])
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert torch.isfinite(noise).all()
    # Gumbel(0, 1): mean is the Euler-Mascheroni constant, variance pi^2 / 6.
    assert abs(float(noise.mean()) - 0.5772) < 0.06
    assert abs(float(noise.var()) - math.pi**2 / 6) < 0.15


def test_the_kv_cache_gets_what_the_weights_leave_of_the_fraction() -> None:
    gib = 1 << 30
    # 80 GiB device, 14 GiB of weights in use: 0.9 of it is 72 GiB, 58 of which are left.
    assert gpu_kv_budget(66 * gib, 80 * gib, 0.9) == 58 * gib
    assert gpu_kv_budget(66 * gib, 80 * gib, 1.0) == 66 * gib
    assert gpu_kv_budget(6 * gib, 80 * gib, 0.9) == 0  # the weights already take past 0.9
