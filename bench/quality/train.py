"""`visor model train-demo`: trains the demo LLaVA (ViT + projector + Llama) on the synthetic
suite's training split, on the CPU, and writes it in llava-hf layout.

The prompt goes through the core's own chat template (`ChatTokenizer.encode_chat`), so inference
sees exactly the training format; the loss covers the answer tokens and the end-of-sequence token
only. Two stages: first the tower and projector alone learn the per-patch targets of
`bench.quality.targets` (what is drawn where; the class token's attention on the foreground), then
everything trains on the answers with those targets kept as auxiliary losses, plus three hints at
how to route: head 0 of decoder layer 0 is taught, at each word that names something (the shape
noun; "number"), to look at the visual tokens of what it names; at a spatial question's second
noun, the output of layer 1 is taught the relation (`targets.RelationHead`: which shape is left
of and above the other, and the answer), so that layer 1 brings the first noun's position there;
and head 0 of layer 2 is taught, where each answer starts, to read the question's last naming
word, where all of that now sits. To make the model robust to visual-token compression, most
second-stage batches reach the decoder through one of the compressions the core applies (random,
attention-, entropy- or mixed-rank pruning at a random keep fraction, or 2x2 pooling); the rest
see every token.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from bench.quality import suite, targets, train_detail
from core.model import demo, llava
from core.model.llava import Llava
from core.model.text import Attention, DecoderLayer, _rotate
from core.model.tokenizer import ChatTokenizer, ChatTurn

IGNORE = -100


@dataclass(frozen=True, slots=True)
class TrainConfig:
    # The defaults are the committed models/demo's recipe (27.5 min on the 2-core dev VM).
    seed: int = 0  # weights, data order and augmentation
    steps: int = 3800  # optimiser steps (the schedule's length), both stages
    vision_steps: int = 400  # first stage: the tower and projector on the dense targets alone
    minutes: float = 29.5  # wall-clock cap; training stops early (and says so) past it
    batch_size: int = 32  # sequences per step
    lr: float = 1.5e-3  # peak learning rate
    warmup: int = 150  # linear warm-up steps
    threads: int = 2  # torch intra-op threads
    full_fraction: float = 0.3  # share of batches that keep every visual token
    jpeg_fraction: float = 0.2  # share of images re-encoded as JPEG (robust to lossy uploads)
    dense_weight: float = 1.0  # weight of the per-patch auxiliary loss (see bench.quality.targets)
    importance_weight: float = 0.2  # weight of the class-token attention target
    retrieval_weight: float = 1.0  # weight of the probe head's attention target
    probe_layer: int = 0  # decoder layer whose head 0 looks, at the anchor words, at what they name
    relation_weight: float = 1.0  # weight of the spatial relation target (targets.RelationHead)
    relation_layer: int = 1  # decoder layer whose output the relation target reads
    answer_layer: int = 2  # layer whose head 0, where an answer starts, reads the last anchor word
    questions: int = 4  # questions asked about each training image, its own first
    init: str = ""  # a trained checkpoint to start from (no first stage); "" = a fresh build
    detail_every: int = 3  # every n-th step is a batch of the resolution scenarios (0: none)
    detail_batch: int = 12  # items per such batch (each of up to ten tiles)

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.threads < 1:
            raise ValueError("steps, batch_size and threads must be positive")
        if not (0 < self.lr < 1 and self.minutes > 0 and self.warmup >= 0):
            raise ValueError("lr in (0, 1), minutes > 0, warmup >= 0")
        if not (0 <= self.full_fraction <= 1 and 0 <= self.jpeg_fraction <= 1):
            raise ValueError("fractions must lie in [0, 1]")
        if self.detail_every < 0 or self.detail_batch < 1:
            raise ValueError("detail_every >= 0 and detail_batch >= 1")


def _pixels(items: list[suite.Item], rng: np.random.Generator, jpeg: float) -> torch.Tensor:
    arrays = []
    for it in items:
        img = it.image
        if rng.random() < jpeg:
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=int(rng.integers(60, 96)))
            img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
        arrays.append(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))
    return torch.from_numpy(np.stack(arrays))


def _ranks(values: torch.Tensor) -> torch.Tensor:
    return values.argsort(dim=-1).argsort(dim=-1).float()


def compress(
    feats: torch.Tensor,
    scores: torch.Tensor,
    relevant: torch.Tensor,
    rng: np.random.Generator,
    full: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, H) features -> (B, K, H): one compression for the whole batch, kept tokens in
    raster order, as the core's compression keeps them; `relevant` (B, A, N), masks over the
    tokens (one per anchor word), follows the tokens."""
    b, n, _ = feats.shape
    mode = rng.random()
    if mode < full:
        return feats, relevant
    if mode < full + 0.12:
        side = math.isqrt(n)
        grid = feats.view(b, side, side, -1).permute(0, 3, 1, 2)
        masks = relevant.reshape(-1, 1, side, side).float()
        pooled_rel = F.max_pool2d(masks, 2).reshape(b, relevant.shape[1], -1) > 0
        return F.avg_pool2d(grid, 2).flatten(2).transpose(1, 2), pooled_rel
    keep = max(1, round(n * float(rng.uniform(0.2, 0.9))))
    # Mostly the informed rankings the profiles use; random (the evaluation's baseline) rarely.
    method = int(rng.choice(4, p=[0.1, 0.3, 0.3, 0.3]))
    with torch.no_grad():
        if method == 0:
            score = torch.from_numpy(rng.random((b, n))).float()
        else:
            p = torch.softmax(feats.detach(), dim=-1)
            entropy = -(p * torch.log(p + 1e-12)).sum(-1)
            score = {1: _ranks(scores), 2: _ranks(-entropy)}.get(
                int(method), _ranks(scores) + _ranks(-entropy)
            )
        index = score.topk(keep, dim=-1).indices.sort(dim=-1).values
    kept = feats.gather(1, index[..., None].expand(-1, -1, feats.shape[-1]))
    return kept, relevant.gather(2, index[:, None, :].expand(-1, relevant.shape[1], -1))


def conversation(it: suite.Item, rng: np.random.Generator, most: int) -> list[suite.Question]:
    """The item's own question, then up to `most - 1` more about the same scene: each picks a
    scenario at random among those the scene answers, then a question within it, so the rare
    scenarios are not drowned by the many spatial pairs a busy scene allows."""
    own, *rest = suite.questions(it)
    chosen = [own]
    while rest and len(chosen) < most:
        scenarios = sorted({q.scenario for q in rest})
        pick = scenarios[int(rng.integers(len(scenarios)))]
        pool = [q for q in rest if q.scenario == pick]
        q = pool[int(rng.integers(len(pool)))]
        rest.remove(q)
        chosen.append(q)
    return chosen


def batch_ids(
    tok: ChatTokenizer,
    convs: list[list[suite.Question]],
    num_visual: int,
    eos: int,
    pad: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and labels for conversations about one image each: the first
    turn is exactly the engine's prompt for that question, later turns follow the chat template
    as a resent conversation does; labels are every answer's tokens and eos, else IGNORE."""
    rows, labels = [], []
    for conv in convs:
        turns: list[ChatTurn] = []
        row: list[int] = []
        lab: list[int] = []
        for i, q in enumerate(conv):
            turns.append(ChatTurn("user", q.question, 1 if i == 0 else 0))
            prompt = tok.encode_chat(turns, [num_visual])
            answer = [*tok.tok.encode(" " + q.answer, add_special_tokens=False).ids, eos]
            if prompt[: len(row)] != row:  # the template did not extend the row: stop here
                break
            lab += [IGNORE] * (len(prompt) - len(row)) + answer
            row = prompt + answer
            turns.append(ChatTurn("assistant", q.answer, 0))
        rows.append(row)
        labels.append(lab)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    lab_t = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)], lab_t[i, : len(lb)] = torch.tensor(r), torch.tensor(lb)
    return ids, lab_t


def anchors(it: suite.Item, q: suite.Question) -> list[tuple[str, tuple[int, ...]]]:
    """The words of a question that name what it asks about, in order, each with the parts it
    names: the shape noun (both nouns of a spatial question, each naming its own shape) or, for
    OCR, "number" naming every digit. The retrieval target is taught at these words."""
    if q.scenario == "ocr":
        return [(" number", q.focus)]
    if q.scenario == "spatial":
        return [(" " + it.parts[i].label, (i,)) for i in q.focus]
    label = it.parts[q.focus[0]].label
    return [(f" {label}s" if q.scenario == "counting" else f" {label}", q.focus)]


def _last_anchors(it: suite.Item, conv: list[suite.Question]) -> list[int]:
    """Per question of a conversation, the index (in `anchor_positions`' order) of its last
    anchor word."""
    ends, k = [], 0
    for q in conv:
        k += len(anchors(it, q))
        ends.append(k - 1)
    return ends


def anchor_masks(
    items: list[suite.Item], convs: list[list[suite.Question]], grid: int, patch: int
) -> torch.Tensor:
    """(B, A, grid * grid): per row, the patches each anchor word names, in conversation order;
    rows with fewer anchors are padded with empty masks (which the loss skips)."""
    pairs = zip(items, convs, strict=True)
    named = [[parts for q in conv for _, parts in anchors(it, q)] for it, conv in pairs]
    out = np.zeros((len(items), max(1, max(map(len, named))), grid * grid), dtype=bool)
    for i, (it, row) in enumerate(zip(items, named, strict=True)):
        for j, parts in enumerate(row):
            out[i, j] = targets.focus_mask(it, grid, patch, parts)
    return torch.from_numpy(out)


def anchor_positions(
    tok: ChatTokenizer,
    items: list[suite.Item],
    convs: list[list[suite.Question]],
    ids: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """(B, width): where each anchor word sits in `ids` (searched in order, each after the one
    before), matching `anchor_masks`; -1 where a row has no such anchor."""
    out = torch.full((len(items), width), -1, dtype=torch.long)
    for i, (row, it, conv) in enumerate(zip(ids.tolist(), items, convs, strict=True)):
        at = 0
        for j, (word, _) in enumerate(w for q in conv for w in anchors(it, q)):
            token = tok.tok.encode(word, add_special_tokens=False).ids[-1]
            if token not in row[at:]:
                break  # the conversation was cut short (see batch_ids)
            at = row.index(token, at)
            out[i, j] = at
            at += 1
    return out


def relation_targets(
    items: list[suite.Item], convs: list[list[suite.Question]], width: int
) -> torch.Tensor:
    """(B, width, len(targets.RELATION)): at the anchor index of each spatial question's second
    noun (in `anchor_positions`' order) its `targets.relation_target`, NaN elsewhere."""
    out = torch.full((len(items), width, len(targets.RELATION)), float("nan"))
    for i, (it, conv) in enumerate(zip(items, convs, strict=True)):
        for q, k in zip(conv, _last_anchors(it, conv), strict=True):
            if q.scenario == "spatial":
                out[i, k] = torch.tensor(targets.relation_target(it, q))
    return out


def answer_reads(
    items: list[suite.Item],
    convs: list[list[suite.Question]],
    labels: torch.Tensor,
    where: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per question, (B, Q) each: the position whose logits give its answer's first token, and
    the position of its last anchor word (`where`, from `anchor_positions`), which the answer
    probe is taught to read; -1 for questions cut off or without a found anchor."""
    starts = torch.full((len(items), max(map(len, convs))), -1, dtype=torch.long)
    read = starts.clone()
    before = F.pad(labels, (1, 0), value=IGNORE)[:, :-1]
    first = (labels != IGNORE) & (before == IGNORE)  # an answer's first token
    for i, (it, conv) in enumerate(zip(items, convs, strict=True)):
        at = first[i].nonzero().flatten().tolist()
        for j, k in enumerate(_last_anchors(it, conv)):
            if j < len(at) and int(where[i, k]) >= 0:
                starts[i, j], read[i, j] = at[j] - 1, where[i, k]
    return starts, read


def spatial_reads(
    tok: ChatTokenizer,
    items: list[suite.Item],
    convs: list[list[suite.Question]],
    ids: torch.Tensor,
    where: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per spatial question, in conversation order, (B, S) each: the position of its second
    noun, of its relation word ("left", "right", "above", "below") and of its first noun (from
    `where`, `anchor_positions`' output); -1 for questions cut off."""
    most = max(1, max(sum(q.scenario == "spatial" for q in conv) for conv in convs))
    second = torch.full((len(items), most), -1, dtype=torch.long)
    relation, first = second.clone(), second.clone()
    words = {
        tok.tok.encode(" " + r.split()[0], add_special_tokens=False).ids[0] for r in suite.RELATIONS
    }
    for i, (it, conv) in enumerate(zip(items, convs, strict=True)):
        row = ids[i].tolist()
        n = 0
        for q, k in zip(conv, _last_anchors(it, conv), strict=True):
            if q.scenario != "spatial":
                continue
            a, b = int(where[i, k - 1]), int(where[i, k])
            if a >= 0 and b >= 0:
                word = next(p for p in range(a + 1, b) if row[p] in words)
                first[i, n], relation[i, n], second[i, n] = a, word, b
            n += 1
    return second, relation, first


def _at(positions: torch.Tensor, width: int) -> torch.Tensor:
    """(B, Q) positions (-1: none) -> (B, Q, width) one-hot masks (all False for -1)."""
    return F.one_hot(positions.clamp_min(0), width).bool() & (positions >= 0)[..., None]


@dataclass(frozen=True, slots=True)
class Probe:
    """Which attention to read out: one head of one layer, from Q query positions per row (the
    anchor words; where answers start; spatial questions' second nouns), over some keys (the
    visual tokens; all)."""

    layer: int  # decoder layer
    head: int  # query head
    queries: torch.Tensor  # (B, Q) positions whose attention is read
    keys: slice  # key positions returned


def decoder_logits(
    model: Llava, embeds: torch.Tensor, probes: tuple[Probe, ...] = (), tap: int | None = None
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """The decoder over a (B, T, H) right-padded batch: the same modules and arithmetic as
    `Decoder.forward` for one sequence (causal attention, so padding never reaches a real token).
    Also, per probe, its head's attention probabilities at its queries over its keys; with a tap,
    the (B, T, H) hidden states after decoder layer `tap`."""
    dec = model.language_model
    b, t, _ = embeds.shape
    cos, sin = dec.rotary(torch.arange(t))
    x, tapped = embeds, None
    probs: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(dec.layers):
        assert isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, Attention)
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.split(attn.qkv_proj(h))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        for j, probe in enumerate(probes):
            if probe.layer == i:
                probs[j] = _head_probs(q, k, probe)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=attn.num_kv != attn.num_heads
        )
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i == tap:
            tapped = x
    return model.lm_head(dec.norm(x)), [probs[j] for j in range(len(probes))], tapped


def _head_probs(q: torch.Tensor, k: torch.Tensor, probe: Probe) -> torch.Tensor:
    rows = torch.arange(q.shape[0])[:, None]
    query = q[rows, probe.head, probe.queries]  # (B, Q, d)
    shared = k[:, probe.head // (q.shape[1] // k.shape[1])]  # its key head (grouped-query)
    logits = (query @ shared.transpose(1, 2)) * q.shape[-1] ** -0.5  # (B, Q, T)
    later = torch.arange(k.shape[2])[None, None, :] > probe.queries[..., None]
    probs = torch.softmax(logits.masked_fill(later, float("-inf")), dim=-1)
    return probs[..., probe.keys]  # (B, Q, keys)


def step_loss(
    model: Llava,
    head: targets.DenseHead,
    relation: targets.RelationHead,
    tok: ChatTokenizer,
    items: list[suite.Item],
    rng: np.random.Generator,
    cfg: TrainConfig,
    vision_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's loss, and per item whether every answer token was the argmax (teacher
    forced; a cheap progress signal, not the evaluation). `vision_only`: the dense and
    importance targets alone, without running the decoder (the first stage)."""
    pixels = _pixels(items, rng, cfg.jpeg_fraction)
    feats, scores = model.encode_with_importance(model.normalize(pixels))
    vc = model.cfg.vision
    grid = vc.image_size // vc.patch_size
    dense = torch.from_numpy(
        np.stack([targets.patch_targets(it, grid, vc.patch_size) for it in items])
    )
    aux = cfg.dense_weight * head.loss(feats, dense)
    aux = aux + cfg.importance_weight * targets.importance_loss(scores, dense)
    if vision_only:
        return aux, torch.zeros(len(items), dtype=torch.bool)
    convs = [conversation(it, rng, cfg.questions) for it in items]
    text = model.cfg.text
    eos = text.eos_token_id[0]
    focus = anchor_masks(items, convs, grid, vc.patch_size)
    visual, relevant = compress(feats, scores, focus, rng, cfg.full_fraction)
    ids, labels = batch_ids(tok, convs, visual.shape[1], eos, _pad_id(tok))
    named = anchor_positions(tok, items, convs, ids, focus.shape[1])  # -1: not found
    found = named >= 0
    relevant = relevant & found[..., None]
    where = named.clamp_min(0)
    is_image = ids == model.cfg.image_token_id
    embeds = model.language_model.embed_tokens(ids.masked_fill(is_image, 0))
    embeds = embeds.masked_scatter(
        is_image[..., None], visual.reshape(-1, visual.shape[-1]).to(embeds.dtype)
    )
    first = int(is_image[0].float().argmax())
    starts, read = answer_reads(items, convs, labels, named)
    second, relation_word, first_noun = spatial_reads(tok, items, convs, ids, named)
    everything = slice(None)
    probes = (
        Probe(cfg.probe_layer, 0, where, slice(first, first + visual.shape[1])),
        Probe(cfg.answer_layer, 0, starts.clamp_min(0), everything),
        # At a spatial question's second noun: a head of the anchor's layer reads the relation
        # word, one of the layer the relation target reads reads the first noun.
        Probe(cfg.probe_layer, 2, second.clamp_min(0), everything),
        Probe(cfg.relation_layer, 0, second.clamp_min(0), everything),
    )
    logits, attended, hidden = decoder_logits(model, embeds, probes, cfg.relation_layer)
    assert hidden is not None
    width = ids.shape[1]
    wanted = (relevant, _at(read, width), _at(relation_word, width), _at(first_noun, width))
    for probs, mask in zip(attended, wanted, strict=True):
        aux = aux + cfg.retrieval_weight * targets.retrieval_loss(probs, mask)
    goal = relation_targets(items, convs, focus.shape[1])
    asked = found & ~torch.isnan(goal).all(-1)
    rows = torch.arange(len(items))[:, None].expand_as(where)
    at = hidden[rows[asked], where[asked]]
    aux = aux + cfg.relation_weight * relation.loss(at, goal[asked])
    logits = logits[:, :-1]
    target = labels[:, 1:]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE
    )
    # The first answer (the item's own question, as evaluation asks it): its tokens are the
    # labels before the first eos label, that eos included.
    ends = (target == eos).long()
    own = (target != IGNORE) & ((ends.cumsum(1) - ends) == 0)
    hit = (logits.argmax(-1) == target) | ~own
    return loss + aux, hit.all(dim=1)


def _pad_id(tok: ChatTokenizer) -> int:
    pad = tok.tok.token_to_id("<pad>")
    return int(pad if pad is not None else 0)


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up (at most a tenth of the run), then cosine decay to 5% of the peak."""
    warmup = min(cfg.warmup, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(out: Path, cfg: TrainConfig, log_every: int = 50) -> dict[str, object]:
    """Builds the demo checkpoint at `out` (random init, seeded; or a copy of `cfg.init`), trains
    it, overwrites its weights and records the recipe in config.json's `visor_demo` block."""
    cfg.validate()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    base = _start(out, cfg)
    model = llava.load(out).train()
    tok = ChatTokenizer(out, model.cfg.image_token_id)
    rng = np.random.default_rng([int(suite.Split.TRAIN), cfg.seed, 1 << 30])
    head = targets.DenseHead(model.cfg.text.hidden_size)
    relation = targets.RelationHead(model.cfg.text.hidden_size)
    aux_params = [*head.parameters(), *relation.parameters()]
    params = [*model.parameters(), *aux_params]
    groups = [
        {"params": list(model.parameters()), "scale": 1.0},
        # The throw-away heads start from nothing each run and read a moving target: they
        # learn at ten times the model's rate, or they lag the model they are meant to teach.
        {"params": aux_params, "scale": 10.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    t0, step, running = time.perf_counter(), 0, 0.0
    hits: dict[str, list[bool]] = {s: [] for s in suite.SCENARIOS}
    deadline = t0 + cfg.minutes * 60
    while step < cfg.steps and time.perf_counter() < deadline:
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step) * group["scale"]
        first_stage = not cfg.init and step < min(cfg.vision_steps, cfg.steps // 5)
        if not first_stage and cfg.detail_every and step % cfg.detail_every == cfg.detail_every - 1:
            start = step // cfg.detail_every * cfg.detail_batch
            batch = suite.items_range(
                suite.Split.TRAIN, cfg.seed, start, cfg.detail_batch, suite.DETAIL
            )
            loss, correct = train_detail.detail_loss(
                model, head, tok, batch, rng, cfg.dense_weight, _pad_id(tok)
            )
        else:
            start = step * cfg.batch_size
            batch = suite.items_range(
                suite.Split.TRAIN, cfg.seed, start, cfg.batch_size, suite.SINGLE
            )
            loss, correct = step_loss(model, head, relation, tok, batch, rng, cfg, first_stage)
        if not first_stage:
            for it, ok in zip(batch, correct.tolist(), strict=True):
                hits[it.scenario].append(bool(ok))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        running = 0.98 * running + 0.02 * value if step > 1 else value
        if step % log_every == 0:
            _log(step, cfg.steps, running, hits, time.perf_counter() - t0)
            for name, h in (("dense", head), ("relation", relation)):
                shown = " ".join(f"{k} {v:.3f}" for k, v in h.accuracy.items())
                print(f"  {name} {shown}", flush=True)
    llava.save(model.eval(), out / "model.safetensors")
    return _record(out, cfg, step, (time.perf_counter() - t0) / 60, running, base)


def _start(out: Path, cfg: TrainConfig) -> object:
    """Writes the starting checkpoint at `out`: a fresh build, or a copy of `cfg.init` (then
    returns the init's own recipe, kept in the new one's as `base`)."""
    if not cfg.init:
        demo.build(out, seed=cfg.seed)
        return None
    src = Path(cfg.init)
    base = json.loads((src / "config.json").read_text()).get("visor_demo")
    if src.resolve() != out.resolve():
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)
    return base


def _log(step: int, steps: int, loss: float, hits: dict[str, list[bool]], elapsed: float) -> None:
    acc = " ".join(f"{s} {np.mean(h[-400:]) if h else 0.0:.2f}" for s, h in hits.items())
    print(f"step {step}/{steps} loss {loss:.4f} train-acc {acc} {elapsed / 60:.1f} min", flush=True)


def _record(
    out: Path, cfg: TrainConfig, step: int, minutes: float, loss: float, base: object = None
) -> dict[str, object]:
    """Writes the recipe into config.json's `visor_demo` block and returns it."""
    recipe = {
        "preset": "demo",
        "trained": True,
        "seed": cfg.seed,
        "steps": step,
        "planned_steps": cfg.steps,
        "vision_steps": cfg.vision_steps,
        "batch_size": cfg.batch_size,
        "minutes": round(minutes, 1),
        "threads": cfg.threads,
        "final_loss": round(loss, 4),
        "detail_every": cfg.detail_every,
        "detail_batch": cfg.detail_batch,
        "command": (
            f"visor model train-demo --out {out} --seed {cfg.seed} --steps {cfg.steps} "
            f"--vision-steps {cfg.vision_steps} --minutes {cfg.minutes:g} --threads {cfg.threads}"
            f" --lr {cfg.lr:g} --detail-every {cfg.detail_every}"
            + (f" --init {cfg.init}" if cfg.init else "")
        ),
    }
    if base is not None:
        recipe["base"] = base  # the recipe of the checkpoint this run started from
    config_path = out / "config.json"
    raw = json.loads(config_path.read_text())
    raw["visor_demo"] = recipe
    config_path.write_text(json.dumps(raw, indent=2) + "\n")
    return recipe
