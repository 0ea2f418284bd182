"""The synthetic task suite: rendered scenes (shapes with colours, sizes and positions; rendered
numbers) and templated questions in six scenarios, each answered by a short string. Four ask about
one encoder-sized scene; two are where resolution matters: `fine_detail` (a small number in a large
image: one tile shrinks its digits below legibility, a grid keeps them) and `compare` (two large
images, one question about both).

Every item is a pure function of (split, seed, index): its random stream is seeded with the
split's domain tag as the first word of the seed sequence, so a training item and an evaluation
item can never share a stream, whatever seeds either side picks (`Split` is the only way in).
"""

from __future__ import annotations

import enum
import io
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SINGLE = ("counting", "ocr", "spatial", "attribute")  # one encoder-sized scene each
DETAIL = ("fine_detail", "compare")  # large images, where the tile grid matters
SCENARIOS = SINGLE + DETAIL
SIZE = 224  # the demo encoder's input side: scenes need no resize on the way in
LARGE = 2 * SIZE  # the side of the two resolution scenarios' images: a 2 x 2 grid at scale 1
SMALL_FONT = (
    18,
    22,
)  # fine_detail's digit font sizes (px, end exclusive): ~6 px glyphs on one tile
GRID = 8  # scenes are laid out on GRID x GRID cells, one thing per cell
CELL = SIZE // GRID  # 28 px: the demo tower's patch, so each shape or digit owns one token
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 180),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
MAX_COUNT = 5
RELATIONS = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}


class Split(enum.IntEnum):
    """The domain tag that keeps training and evaluation streams apart."""

    TRAIN = 1
    EVAL = 2


@dataclass(frozen=True, slots=True)
class Shape:
    kind: str  # one of SHAPES
    colour: str  # a key of COLOURS
    x: int  # centre, pixels
    y: int  # centre, pixels
    r: int  # half the side / radius, pixels


@dataclass(frozen=True, slots=True)
class Part:
    """One drawn thing, for dense training targets."""

    label: str  # a shape kind (one of SHAPES) or one digit character
    colour: str  # a key of COLOURS; "" for text
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels
    order: int  # text: the character's place from the left (1, 2); shapes: 0


@dataclass(frozen=True, slots=True)
class Item:
    scenario: str  # one of SCENARIOS
    question: str  # what the user asks
    answer: str  # the expected short answer
    image: Image.Image  # the rendered scene: SIZE x SIZE RGB (LARGE x LARGE for DETAIL)
    parts: tuple[Part, ...] = ()  # what was drawn where (in `image`)
    focus: tuple[int, ...] = ()  # indices into `parts` the question is about
    more: tuple[Image.Image, ...] = ()  # further images the question is about (`compare`)

    @property
    def images(self) -> tuple[Image.Image, ...]:
        return (self.image, *self.more)

    def png(self) -> bytes:
        return self.pngs()[0]

    def pngs(self) -> tuple[bytes, ...]:
        out = []
        for img in self.images:
            buf = io.BytesIO()
            img.save(buf, "PNG")
            out.append(buf.getvalue())
        return tuple(out)


def item(
    split: Split,
    seed: int,
    index: int,
    scenario: str | None = None,
    scenarios: tuple[str, ...] = SCENARIOS,
) -> Item:
    """The `index`-th item of `split` under `seed`; `scenarios` rotate unless one is named."""
    rng = np.random.default_rng([int(split), seed, index])
    chosen = scenario or scenarios[index % len(scenarios)]
    return _BUILDERS[chosen](rng)


def items(
    split: Split,
    seed: int,
    n: int,
    scenario: str | None = None,
    scenarios: tuple[str, ...] = SCENARIOS,
) -> list[Item]:
    return [item(split, seed, i, scenario, scenarios) for i in range(n)]


def _background(rng: np.random.Generator) -> Image.Image:
    shade = tuple(int(v) for v in rng.integers(225, 256, 3))
    return Image.new("RGB", (SIZE, SIZE), shade)


def _place(rng: np.random.Generator, radii: list[int]) -> list[tuple[int, int]]:
    """Centres for shapes of the given radii: each in its own cell, jittered inside it."""
    cells = rng.choice(GRID * GRID, len(radii), replace=False)
    out = []
    for cell, r in zip(cells, radii, strict=True):
        row, col = divmod(int(cell), GRID)
        slack = CELL // 2 - r - 1
        dx, dy = (int(v) for v in rng.integers(-slack, slack + 1, 2))
        out.append((col * CELL + CELL // 2 + dx, row * CELL + CELL // 2 + dy))
    return out


def _draw(img: Image.Image, shapes: list[Shape]) -> Image.Image:
    d = ImageDraw.Draw(img)
    for s in shapes:
        box = (s.x - s.r, s.y - s.r, s.x + s.r, s.y + s.r)
        fill = COLOURS[s.colour]
        if s.kind == "circle":
            d.ellipse(box, fill=fill)
        elif s.kind == "square":
            d.rectangle(box, fill=fill)
        else:
            d.polygon([(s.x, s.y - s.r), (s.x - s.r, s.y + s.r), (s.x + s.r, s.y + s.r)], fill=fill)
    return img


def _shapes(rng: np.random.Generator, kinds: list[str], colours: list[str]) -> list[Shape]:
    radii = [int(rng.integers(8, 13)) for _ in kinds]
    centres = _place(rng, radii)
    return [
        Shape(k, c, x, y, r) for k, c, (x, y), r in zip(kinds, colours, centres, radii, strict=True)
    ]


def _parts(shapes: list[Shape]) -> tuple[Part, ...]:
    return tuple(
        Part(s.kind, s.colour, (s.x - s.r, s.y - s.r, s.x + s.r, s.y + s.r), 0) for s in shapes
    )


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return str(options[int(rng.integers(len(options)))])


def _counting(rng: np.random.Generator) -> Item:
    target = _pick(rng, SHAPES)
    count = int(rng.integers(1, MAX_COUNT + 1))
    others = [k for k in SHAPES if k != target]
    kinds = [target] * count + [_pick(rng, others) for _ in range(int(rng.integers(0, 3)))]
    colours = [_pick(rng, list(COLOURS)) for _ in kinds]
    shapes = _shapes(rng, kinds, colours)
    img = _draw(_background(rng), shapes)
    focus = tuple(range(count))  # the targets come first
    question = f"How many {target}s are there?"
    return Item("counting", question, str(count), img, _parts(shapes), focus)


@lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _ocr(rng: np.random.Generator) -> Item:
    """A number 0..99 on one row of cells, a digit per cell, dark ink in one size."""
    number = int(rng.integers(0, 100))
    img = _background(rng)
    text = str(number)
    size = int(rng.integers(22, 27))
    font = _font(size)
    ink = tuple(int(v) for v in rng.integers(0, 90, 3))
    row = int(rng.integers(GRID))
    start = int(rng.integers(GRID - len(text) + 1))
    draw = ImageDraw.Draw(img)
    parts = []
    for i, ch in enumerate(text):
        x = (start + i) * CELL + CELL // 2 + int(rng.integers(-2, 3))
        y = row * CELL + CELL // 2 + int(rng.integers(-2, 3))
        draw.text((x, y), ch, fill=ink, font=font, anchor="mm")
        x0, y0, x1, y1 = (int(v) for v in draw.textbbox((x, y), ch, font=font, anchor="mm"))
        parts.append(Part(ch, "", (x0, y0, x1, y1), i + 1))
    return Item("ocr", "What number is written?", text, img, tuple(parts), tuple(range(len(text))))


def _spatial(rng: np.random.Generator) -> Item:
    """Two shapes of different kind and colour, clearly apart along the asked axis."""
    kinds = list(rng.choice(SHAPES, 2, replace=False))
    colours = list(rng.choice(list(COLOURS), 2, replace=False))
    relation = _pick(rng, list(RELATIONS))
    axis, _ = RELATIONS[relation]
    while True:
        shapes = _shapes(rng, [str(k) for k in kinds], [str(c) for c in colours])
        a, b = ((s.x, s.y)[axis] for s in shapes)
        if abs(a - b) >= 40:
            break
    first, second = shapes
    sign = RELATIONS[relation][1]
    truth = (first.x, first.y)[axis] * sign > (second.x, second.y)[axis] * sign
    img = _draw(_background(rng), shapes)
    question = f"Is the {first.colour} {first.kind} {relation} the {second.colour} {second.kind}?"
    return Item("spatial", question, "yes" if truth else "no", img, _parts(shapes), (0, 1))


def _attribute(rng: np.random.Generator) -> Item:
    """Two or three shapes of different kinds; the question names one kind."""
    kinds = [str(k) for k in rng.choice(SHAPES, int(rng.integers(2, 4)), replace=False)]
    colours = [str(c) for c in rng.choice(list(COLOURS), len(kinds), replace=False)]
    shapes = _shapes(rng, kinds, colours)
    index = int(rng.integers(len(shapes)))
    asked = shapes[index]
    img = _draw(_background(rng), shapes)
    question = f"What colour is the {asked.kind}?"
    return Item("attribute", question, asked.colour, img, _parts(shapes), (index,))


def _fine_detail(rng: np.random.Generator) -> Item:
    """A two-digit number in small print (SMALL_FONT) in a LARGE x LARGE scene, laid out like
    `ocr` on the scene's 16 x 16 cells, inside one quadrant so that no grid cell cuts it: each
    digit owns one 28 px cell (one token) in a 2 x 2 grid, a quarter of one in a single tile."""
    number = int(rng.integers(10, 100))
    img = Image.new("RGB", (LARGE, LARGE), tuple(int(v) for v in rng.integers(225, 256, 3)))
    font = _font(int(rng.integers(*SMALL_FONT)))
    ink = tuple(int(v) for v in rng.integers(0, 90, 3))
    half = LARGE // CELL // 2
    row = int(rng.integers(2 * half))
    start = int(rng.integers(2)) * half + int(rng.integers(half - 1))
    draw = ImageDraw.Draw(img)
    parts = []
    for i, ch in enumerate(str(number)):
        x = (start + i) * CELL + CELL // 2 + int(rng.integers(-2, 3))
        y = row * CELL + CELL // 2 + int(rng.integers(-2, 3))
        draw.text((x, y), ch, fill=ink, font=font, anchor="mm")
        x0, y0, x1, y1 = (int(v) for v in draw.textbbox((x, y), ch, font=font, anchor="mm"))
        parts.append(Part(ch, "", (x0, y0, x1, y1), i + 1))
    question = "What small number is written?"
    return Item("fine_detail", question, str(number), img, tuple(parts), (0, 1))


def _large(img: Image.Image) -> Image.Image:
    """A SIZE scene as a LARGE photo of it: one tile sees the scene as drawn, a grid at 2x."""
    return img.resize((LARGE, LARGE), Image.Resampling.NEAREST)


def _compare(rng: np.random.Generator) -> Item:
    """Two LARGE scenes of two or three shapes of different kinds; the asked kind is in both,
    of the same colour in half of the items."""
    kind = _pick(rng, SHAPES)
    others = [k for k in SHAPES if k != kind]
    first = _pick(rng, list(COLOURS))
    same = bool(rng.integers(2))
    asked = (first, first if same else _pick(rng, [c for c in COLOURS if c != first]))
    scenes = []
    for colour in asked:
        kinds = [
            kind,
            *(str(k) for k in rng.choice(others, int(rng.integers(1, 3)), replace=False)),
        ]
        rest = [c for c in COLOURS if c != colour]
        colours = [colour, *(str(c) for c in rng.choice(rest, len(kinds) - 1, replace=False))]
        scenes.append(_large(_draw(_background(rng), _shapes(rng, kinds, colours))))
    question = f"Is the {kind} the same colour in both images?"
    return Item("compare", question, "yes" if same else "no", scenes[0], more=(scenes[1],))


_BUILDERS = {
    "counting": _counting,
    "ocr": _ocr,
    "spatial": _spatial,
    "attribute": _attribute,
    "fine_detail": _fine_detail,
    "compare": _compare,
}


def items_range(
    split: Split, seed: int, start: int, n: int, scenarios: tuple[str, ...] = SCENARIOS
) -> list[Item]:
    """Items `start` .. `start + n - 1` (training walks the stream batch by batch)."""
    return [item(split, seed, i, None, scenarios) for i in range(start, start + n)]


@dataclass(frozen=True, slots=True)
class Question:
    scenario: str  # one of SCENARIOS
    question: str
    answer: str
    focus: tuple[int, ...]  # indices into the item's parts


def questions(it: Item) -> list[Question]:
    """Every templated question the item's scene answers without ambiguity, the item's own
    first (training asks several about one image; evaluation asks only the item's own)."""
    own = Question(it.scenario, it.question, it.answer, it.focus)
    shapes = [(i, p) for i, p in enumerate(it.parts) if not p.order]
    out = [own]
    for kind in SHAPES:
        of_kind = [i for i, p in shapes if p.label == kind]
        if of_kind:
            out.append(
                Question(
                    "counting", f"How many {kind}s are there?", str(len(of_kind)), tuple(of_kind)
                )
            )
        if len(of_kind) == 1:
            colour = it.parts[of_kind[0]].colour
            out.append(Question("attribute", f"What colour is the {kind}?", colour, tuple(of_kind)))
    names = [(p.colour, p.label) for _, p in shapes]
    unique = [(i, p) for i, p in shapes if names.count((p.colour, p.label)) == 1]
    for (i, a), (j, b) in ((x, y) for x in unique for y in unique if x[0] != y[0]):
        for relation, (axis, sign) in RELATIONS.items():
            pa, pb = centre(a)[axis], centre(b)[axis]
            if abs(pa - pb) >= 40:
                q = f"Is the {a.colour} {a.label} {relation} the {b.colour} {b.label}?"
                out.append(Question("spatial", q, "yes" if pa * sign > pb * sign else "no", (i, j)))
    seen: set[str] = set()
    return [q for q in out if not (q.question in seen or seen.add(q.question))]


def centre(p: Part) -> tuple[float, float]:
    x0, y0, x1, y1 = p.box
    return (x0 + x1) / 2, (y0 + y1) / 2
