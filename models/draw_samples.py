"""Draws the sample media in models/samples/ (run once; the outputs are committed).

PYTHONPATH=. python models/draw_samples.py

The still images are the first held-out items of each scenario of the synthetic suite
(`bench/quality/suite.py`, evaluation split, seed 0), so `visor demo` asks the questions the
demo model was evaluated on; questions.json holds each question with its expected answer.
`moving-dot.gif` is an animation for the request-path tests (frame sampling); the demo model was
not trained on several frames, so the demo does not ask about it.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

from bench.quality import suite

OUT = Path(__file__).resolve().parent / "samples"
# file name -> scenario; the names are the ones the tests and README use.
FILES = {
    "shapes.png": "spatial",
    "number.jpg": "ocr",
    "counting.png": "counting",
    "colour.png": "attribute",
}


def moving_dot() -> list[Image.Image]:
    frames = []
    for i in range(6):
        img = Image.new("RGB", (200, 120), "white")
        ImageDraw.Draw(img).ellipse((10 + i * 30, 40, 50 + i * 30, 80), fill=(20, 160, 60))
        frames.append(img)
    return frames


def main() -> None:
    OUT.mkdir(exist_ok=True)
    questions = {}
    for name, scenario in FILES.items():
        it = suite.item(suite.Split.EVAL, 0, 0, scenario)
        if name.endswith(".jpg"):
            it.image.save(OUT / name, quality=90)
        else:
            it.image.save(OUT / name, optimize=True)
        questions[name] = {"question": it.question, "answer": it.answer, "scenario": scenario}
    first, *rest = moving_dot()
    first.save(OUT / "moving-dot.gif", save_all=True, append_images=rest, duration=120, loop=0)
    (OUT / "questions.json").write_text(json.dumps(questions, indent=2) + "\n")


if __name__ == "__main__":
    main()
