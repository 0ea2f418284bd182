"""`visor model train-demo`: the batched training forward is the engine's forward, the training
format is the engine's chat format, and a short run writes a loadable llava-hf checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from bench.quality import suite, train
from core.model import demo, llava
from core.model.tokenizer import ChatTokenizer, ChatTurn


def test_batched_training_forward_matches_the_engine_path(tmp_path: Path) -> None:
    out = demo.build(tmp_path / "m", seed=3)
    model = llava.load(out)
    tok = ChatTokenizer(out, model.cfg.image_token_id)
    items = suite.items(suite.Split.TRAIN, 0, 3)
    size = model.cfg.vision.image_size
    pixels = torch.from_numpy(
        np.stack([np.asarray(it.image, dtype=np.uint8).transpose(2, 0, 1) for it in items])
    )
    assert pixels.shape[-1] == size
    with torch.no_grad():
        feats = model.encode_images(model.normalize(pixels))
        eos = model.cfg.text.eos_token_id[0]
        convs = [train.conversation(it, np.random.default_rng(i), 3) for i, it in enumerate(items)]
        assert all(c[0].question == it.question for c, it in zip(convs, items, strict=True))
        ids, labels = train.batch_ids(tok, convs, feats.shape[1], eos, 0)
        is_image = ids == model.cfg.image_token_id
        embeds = model.language_model.embed_tokens(ids.masked_fill(is_image, 0))
        embeds = embeds.masked_scatter(is_image[..., None], feats.reshape(-1, feats.shape[-1]))
        batched, _, _ = train.decoder_logits(model, embeds)
        for i, it in enumerate(items):
            prompt = tok.encode_chat([ChatTurn("user", it.question, 1)], [feats.shape[1]])
            # The prompt is exactly what the engine builds; the labels start right after it.
            assert ids[i, : len(prompt)].tolist() == prompt
            assert (labels[i, : len(prompt)] == train.IGNORE).all()
            assert labels[i, len(prompt)] != train.IGNORE
            single = model.forward_tokens(
                model.embed(torch.tensor(prompt), feats[i]), model.new_cache()
            )
            torch.testing.assert_close(batched[i, len(prompt) - 1], single, atol=1e-4, rtol=1e-4)
            # Every answer of the conversation is labelled: its tokens and an eos each.
            assert int((labels[i] == eos).sum()) == len(convs[i])


def test_anchor_words_are_found_and_name_their_shapes(tmp_path: Path) -> None:
    out = demo.build(tmp_path / "m", seed=0)
    tok = ChatTokenizer(out, llava.load(out).cfg.image_token_id)
    items = suite.items(suite.Split.TRAIN, 1, 12, scenarios=suite.SINGLE)
    convs = [train.conversation(it, np.random.default_rng(i), 4) for i, it in enumerate(items)]
    grid, patch = 8, suite.CELL
    masks = train.anchor_masks(items, convs, grid, patch)
    ids, _ = train.batch_ids(tok, convs, grid * grid, 2, 0)
    where = train.anchor_positions(tok, items, convs, ids, masks.shape[1])
    for i, (it, conv) in enumerate(zip(items, convs, strict=True)):
        named = [(word, parts) for q in conv for word, parts in train.anchors(it, q)]
        assert (where[i, : len(named)] >= 0).all() and (where[i, len(named) :] == -1).all()
        for j, (word, parts) in enumerate(named):
            assert tok.tok.decode([int(ids[i, where[i, j]])]) == word  # the naming word itself
            cells = {
                int((p.box[1] + p.box[3]) / 2 // patch) * grid
                + int((p.box[0] + p.box[2]) / 2 // patch)
                for p in (it.parts[k] for k in parts)
            }
            assert {int(c) for c in masks[i, j].nonzero()} >= cells  # its shapes' own cells
            if it.parts[parts[0]].order == 0:  # a shape noun names shapes of that kind only
                assert {it.parts[k].label for k in parts} == {word.strip().removesuffix("s")}
        assert not masks[i, len(named) :].any()
    # Where each answer starts, the answer probe reads the question's last anchor word.
    labels = train.batch_ids(tok, convs, grid * grid, 2, 0)[1]
    starts, read = train.answer_reads(items, convs, labels, where)
    for i, (it, conv) in enumerate(zip(items, convs, strict=True)):
        answers = [tok.tok.encode(" " + q.answer, add_special_tokens=False).ids for q in conv]
        for j, q in enumerate(conv):
            assert int(labels[i, starts[i, j] + 1]) == answers[j][0]  # predicts its first token
            assert tok.tok.decode([int(ids[i, read[i, j]])]) == train.anchors(it, q)[-1][0]
            assert read[i, j] < starts[i, j]
        assert (starts[i, len(conv) :] == -1).all()
    # A spatial question's second noun reads its relation word and its first noun.
    second, relation, first = train.spatial_reads(tok, items, convs, ids, where)
    asked = 0
    for i, (it, conv) in enumerate(zip(items, convs, strict=True)):
        spatial = [q for q in conv if q.scenario == "spatial"]
        for n, q in enumerate(spatial):
            (word_a, _), (word_b, _) = train.anchors(it, q)
            words = [tok.tok.decode([int(ids[i, p[i, n]])]) for p in (first, relation, second)]
            assert words[0] == word_a and words[2] == word_b
            assert words[1].strip() in {r.split()[0] for r in suite.RELATIONS}
            assert f"{words[1]} " in f" {q.question} "
            assert first[i, n] < relation[i, n] < second[i, n]
            asked += 1
        assert (second[i, len(spatial) :] == -1).all()
    assert asked >= 3


def test_relation_targets_sit_at_the_second_noun_and_agree_with_the_answer() -> None:
    items = suite.items(suite.Split.TRAIN, 2, 40, scenarios=suite.SINGLE)
    convs = [train.conversation(it, np.random.default_rng(i), 4) for i, it in enumerate(items)]
    goal = train.relation_targets(items, convs, 16)
    seen = 0
    for i, (it, conv) in enumerate(zip(items, convs, strict=True)):
        marked = {int(k) for k in (~torch.isnan(goal[i]).all(-1)).nonzero()}
        second, k = set(), 0
        for q in conv:
            k += len(train.anchors(it, q))
            if q.scenario != "spatial":
                continue
            second.add(k - 1)
            left, above, yes = goal[i, k - 1].tolist()
            assert yes == float(q.answer == "yes")
            axis = 0 if "left of" in q.question or "right of" in q.question else 1
            sign = (left, above)[axis]  # the asked axis is always 40 px apart: defined
            first_is_less = sign == 1.0
            wanted = " left of " in q.question or " above " in q.question
            assert (first_is_less == wanted) == (q.answer == "yes")
            seen += 1
        assert marked == second
    assert seen >= 10


def test_a_short_training_run_writes_a_trained_llava_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "trained"
    cmd = [sys.executable, "-m", "visor.cli", "model", "train-demo", "--out", str(out)]
    done = subprocess.run(
        [*cmd, "--steps", "3", "--seed", "5"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    recipe = json.loads(done.stdout.strip().splitlines()[-1])
    assert recipe["trained"] is True and recipe["steps"] == 3 and recipe["seed"] == 5
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["visor_demo"] == recipe
    trained, untrained = llava.load(out), llava.load(demo.build(tmp_path / "init", seed=5))
    assert trained.encoder_digest() != untrained.encoder_digest()  # the weights moved
    assert not any(name.startswith("aux") for name in trained.state_dict())  # head discarded


def test_resolution_batches_hold_the_gateways_tiles_and_the_engines_prompt(tmp_path: Path) -> None:
    from bench.quality import train_detail

    out = demo.build(tmp_path / "m", seed=3)
    model = llava.load(out)
    tok = ChatTokenizer(out, model.cfg.image_token_id)
    fine = suite.item(suite.Split.TRAIN, 0, 0, "fine_detail")
    compare = suite.item(suite.Split.TRAIN, 0, 1, "compare")
    size, patch = model.cfg.vision.image_size, model.cfg.vision.patch_size
    fill = (0, 0, 0)
    tiles, grid = train_detail.tiles(fine.image, "auto", fine.question, size, fill)
    assert tiles.shape == (5, 3, size, size) and (grid.rows, grid.cols) == (2, 2)
    for img in compare.images:  # a colour question: one tile each at `auto`
        assert train_detail.tiles(img, "auto", compare.question, size, fill)[0].shape[0] == 1
    # The dense targets of the grid's cells mark the digits where the cells show them.
    dense = train_detail.cell_targets(fine, grid, size, patch)
    marked = {(c, t) for c, t in zip(*np.nonzero(dense[..., 5]), strict=True)}  # the digit head
    assert len({c for c, _ in marked}) == 1 and len(marked) >= 2
    counts = [[5 * 64], [64, 64]]
    ids, labels = train_detail._rows(tok, [fine, compare], counts, 2, 0)
    for row, it, n in zip(ids.tolist(), (fine, compare), counts, strict=True):
        prompt = tok.encode_chat([ChatTurn("user", it.question, len(it.images))], n)
        assert row[: len(prompt)] == prompt
        assert row.count(model.cfg.image_token_id) == sum(n)
    assert bool((labels[0] != train_detail.IGNORE).any())


def test_init_continues_a_trained_checkpoint(tmp_path: Path) -> None:
    start = demo.build(tmp_path / "start", seed=5)
    base = json.loads((start / "config.json").read_text()).get("visor_demo")
    out = tmp_path / "tuned"
    cmd = [sys.executable, "-m", "visor.cli", "model", "train-demo", "--out", str(out)]
    args = ["--init", str(start), "--steps", "2", "--detail-every", "1", "--lr", "1e-3"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    recipe = json.loads(done.stdout.strip().splitlines()[-1])
    assert recipe["steps"] == 2 and recipe["detail_every"] == 1 and recipe["base"] == base
    assert f"--init {start}" in str(recipe["command"])
    assert (out / "tokenizer.json").read_bytes() == (start / "tokenizer.json").read_bytes()
    assert llava.load(out).encoder_digest() != llava.load(start).encoder_digest()
