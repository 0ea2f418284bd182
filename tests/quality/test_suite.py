"""The synthetic suite: deterministic by seed, answers consistent with the scene, and training and
evaluation streams that never share an item."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image

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
    items = suite.items(Split.EVAL, 0, 600)
    by = {s: [x for x in items if x.scenario == s] for s in suite.SCENARIOS}
    assert all(len(v) == 100 for v in by.values())
    assert {x.answer for x in by["compare"]} == {"yes", "no"}
    assert 0.3 < np.mean([x.answer == "yes" for x in by["compare"]]) < 0.7
    assert {len(x.answer) for x in by["fine_detail"]} == {2}
    assert len({x.answer for x in by["fine_detail"]}) > 50
    assert {x.answer for x in by["spatial"]} == {"yes", "no"}
    assert {x.answer for x in by["attribute"]} <= set(suite.COLOURS)
    assert {int(x.answer) for x in by["counting"]} == set(range(1, suite.MAX_COUNT + 1))
    assert len({x.answer for x in by["ocr"]}) > 50  # the numbers vary, 0..99
    yes = np.mean([x.answer == "yes" for x in by["spatial"]])
    assert 0.3 < yes < 0.7  # no answer prior to exploit


@pytest.mark.parametrize("scenario", suite.SINGLE)
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


def test_things_sit_one_per_cell() -> None:
    # The layout the demo tower's 28 px patches rely on: every shape and digit inside one cell,
    # no two in the same cell.
    for i in range(60):
        it = suite.item(Split.EVAL, 1, i)
        cells = []
        for p in it.parts:
            x0, y0, x1, y1 = p.box
            assert x0 // suite.CELL == (x1 - 1) // suite.CELL, (it.question, p)
            assert y0 // suite.CELL == (y1 - 1) // suite.CELL, (it.question, p)
            cells.append((x0 // suite.CELL, y0 // suite.CELL))
        assert len(set(cells)) == len(cells)


def test_extra_questions_agree_with_the_scene() -> None:
    for i in range(80):
        it = suite.item(Split.TRAIN, 2, i)
        qs = suite.questions(it)
        assert (qs[0].question, qs[0].answer) == (it.question, it.answer)
        assert len({q.question for q in qs}) == len(qs)
        shapes = [p for p in it.parts if not p.order]
        for q in qs[1:]:
            named = [it.parts[j] for j in q.focus]
            if q.scenario == "counting":
                kind = q.question.split()[2][:-1]  # "How many circles are there?"
                assert int(q.answer) == sum(p.label == kind for p in shapes) == len(named)
            elif q.scenario == "attribute":
                assert [p.colour for p in named] == [q.answer]
                assert sum(p.label == named[0].label for p in shapes) == 1
            else:
                a, b = named
                assert (
                    f"{a.colour} {a.label}" in q.question and f"{b.colour} {b.label}" in q.question
                )
                relation = next(r for r in suite.RELATIONS if f" {r} " in q.question)
                axis, sign = suite.RELATIONS[relation]
                ca, cb = ((p.box[axis] + p.box[axis + 2]) / 2 for p in (a, b))
                assert (q.answer == "yes") == (ca * sign > cb * sign)


def test_resolution_scenarios_are_large_and_deterministic() -> None:
    for scenario, images in (("fine_detail", 1), ("compare", 2)):
        a, b = (suite.item(Split.EVAL, 5, 7, scenario) for _ in range(2))
        assert a.scenario == scenario and len(a.images) == len(a.pngs()) == images
        assert all(img.size == (suite.LARGE, suite.LARGE) for img in a.images)
        assert a.pngs() == b.pngs() and (a.question, a.answer) == (b.question, b.answer)
        other = suite.item(Split.TRAIN, 5, 7, scenario)
        assert other.pngs() != a.pngs()
    # The rotation reaches them, and the four encoder-sized scenarios keep their own rotation.
    assert [suite.item(Split.EVAL, 0, i).scenario for i in range(6)] == list(suite.SCENARIOS)
    single = suite.item(Split.EVAL, 0, 4, scenarios=suite.SINGLE)
    assert single.scenario == "counting"


def test_fine_detail_digits_are_legible_only_on_the_grid() -> None:
    """Its digits, at full size in a 2 x 2 grid's cells, span most of a 28 px token, as the
    `ocr` scenario's do; fitted into one 224 px tile they shrink to under 8 px, a quarter of
    a token each."""
    size = suite.SIZE
    for i in range(40):
        it = suite.item(Split.EVAL, 3, i, "fine_detail")
        digits = [p for p in it.parts if p.order]
        assert "".join(p.label for p in digits) == it.answer
        for p in digits:
            x0, y0, x1, y1 = p.box
            assert 9 <= y1 - y0 <= 16  # full size: half a token or more
            assert (y1 - y0) * size / suite.LARGE < 8  # one tile: under 8 px high
            # No cell of the 2 x 2 grid cuts a digit: each lies inside one quadrant.
            assert x0 // size == (x1 - 1) // size and y0 // size == (y1 - 1) // size
        # One tile: both digits fit within one token's width (they shared one in the 2 x 2
        # grid's thumbnail), where the grid gives each its own.
        (a0, *_), (_, _, b1, _) = (p.box for p in digits)
        assert (b1 - a0) * size / suite.LARGE <= suite.CELL
        assert len({p.box[0] // suite.CELL for p in digits}) == 2


def test_compare_answer_matches_the_colours_drawn() -> None:
    for i in range(20):
        it = suite.item(Split.EVAL, 0, i, "compare")
        kind = it.question.split()[2]  # "Is the <kind> the same colour in both images?"
        assert kind in suite.SHAPES and "same colour" in it.question
        colours = []
        for img in it.images:
            small = np.asarray(img.resize((suite.SIZE, suite.SIZE), Image.Resampling.NEAREST))
            present = {
                name for name, rgb in suite.COLOURS.items()
                if (small.reshape(-1, 3) == rgb).all(axis=1).sum() > 30
            }  # fmt: skip
            colours.append(present)
        # The asked shape's colour is in both scenes exactly when the answer is yes (the
        # others in a scene never share the asked shape's colour).
        if it.answer == "yes":
            assert colours[0] & colours[1]
