"""Draws the sample media in models/samples/ (run once; the outputs are committed).

python models/draw_samples.py
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

OUT = Path(__file__).resolve().parent / "samples"


def shapes() -> Image.Image:
    img = Image.new("RGB", (320, 240), "white")
    d = ImageDraw.Draw(img)
    d.ellipse((30, 70, 130, 170), fill=(220, 30, 30))
    d.rectangle((190, 70, 290, 170), fill=(30, 60, 220))
    return img


def number() -> Image.Image:
    img = Image.new("RGB", (256, 160), (250, 245, 230))
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=96)
    d.text((128, 80), "42", fill="black", font=font, anchor="mm")
    return img


def moving_dot() -> list[Image.Image]:
    frames = []
    for i in range(6):
        img = Image.new("RGB", (200, 120), "white")
        ImageDraw.Draw(img).ellipse((10 + i * 30, 40, 50 + i * 30, 80), fill=(20, 160, 60))
        frames.append(img)
    return frames


def main() -> None:
    OUT.mkdir(exist_ok=True)
    shapes().save(OUT / "shapes.png", optimize=True)
    number().save(OUT / "number.jpg", quality=90)
    first, *rest = moving_dot()
    first.save(OUT / "moving-dot.gif", save_all=True, append_images=rest, duration=120, loop=0)
    questions = {
        "shapes.png": "Is the red circle left of the blue square?",
        "number.jpg": "What number is written?",
        "moving-dot.gif": "What colour is the moving dot?",
    }
    (OUT / "questions.json").write_text(json.dumps(questions, indent=2) + "\n")


if __name__ == "__main__":
    main()
