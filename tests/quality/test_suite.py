"""The synthetic suite: deterministic by seed, answers consistent with the scene, and training and
evaluation streams that never share an item."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from bench.quality import suite
from bench.quality.suite import Split


def _digest(it: suite.Item) -> str:
    return hashlib.sha256(it.image.tobytes() + it.question.encode()).hexdigest()


def test_items_are_deterministic_by_seed() -> None:
    a = suite.items(Split.EVAL, 3, 12)
    b = suite.items(Split.EVAL, 3, 12)
    assert [_digest(x) for x in a] == [_digest(x) for x in b]
    assert [x.answer for x in a] == [x.answer for x in b]
    other = suite.items(Split.EVAL, 4, 12)
    assert {_digest(x) for x in a}.isdisjoint(_digest(x) for x in other)


def test_training_and_evaluation_never_share_an_item() -> None:
    # The same (seed, index) in both splits, and overlapping seeds: still no common item.
    train = {_digest(x) for seed in (0, 1) for x in suite.items(Split.TRAIN, seed, 200)}
    held_out = {_digest(x) for seed in (0, 1) for x in suite.items(Split.EVAL, seed, 200)}
    assert len(train) == 400 and len(held_out) == 400
    assert train.isdisjoint(held_out)


def test_every_scenario_appears_with_plausible_answers() -> None:
    items = suite.items(Split.EVAL, 0, 400)
    by = {s: [x for x in items if x.scenario == s] for s in suite.SCENARIOS}
    assert all(len(v) == 100 for v in by.values())
    assert {x.answer for x in by["spatial"]} == {"yes", "no"}
    assert {x.answer for x in by["attribute"]} <= set(suite.COLOURS)
    assert {int(x.answer) for x in by["counting"]} == set(range(1, suite.MAX_COUNT + 1))
    assert len({x.answer for x in by["ocr"]}) > 50  # the numbers vary, 0..99
    yes = np.mean([x.answer == "yes" for x in by["spatial"]])
    assert 0.3 < yes < 0.7  # no answer prior to exploit


@pytest.mark.parametrize("scenario", suite.SCENARIOS)
def test_scenes_are_encoder_sized_rgb(scenario: str) -> None:
    it = suite.item(Split.EVAL, 0, 0, scenario)
    assert it.scenario == scenario
    assert it.image.size == (suite.SIZE, suite.SIZE) and it.image.mode == "RGB"
    assert it.png()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attribute_answer_is_the_colour_drawn() -> None:
    for i in range(20):
        it = suite.item(Split.EVAL, 0, i, "attribute")
        pixels = np.asarray(it.image).reshape(-1, 3)
        assert (pixels == suite.COLOURS[it.answer]).all(axis=1).sum() > 100
