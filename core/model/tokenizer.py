"""The checkpoint's tokenizer (`tokenizer.json`) and chat template (Jinja, sandboxed).

Users' text is always plain text: the template is rendered with a marker in place of each turn's
text, only the template's own text may hold special tokens (`<s>`, `</s>`, `<image>`), and the
users' text is tokenised with special-token parsing off. So `</s>` typed by a user is five
characters, not an end of sequence, and `<image>` is text, not an image slot. Runs of text between
the template's special tokens are tokenised whole, as before, so ordinary prompts get the same ids.

Most families' templates put the image token itself where an image goes. A family whose processor
writes more (Gemma 3: the template says `<start_of_image>`, the processor makes that
"\n\n<start_of_image>" + the visual tokens + "<end_of_image>\n\n") gives an `ImageLayout`: its
text replaces each of the template's markers before tokenisation, as the processor does, so the
newlines merge with the text around them into the same ids; it holds the image token once per view.

A family that serves video (Qwen2.5-VL) names its video token: a turn's items are then each an
image or a video (`ChatTurn.kinds`), rendered as the template renders `{"type": "video"}`, and a
video's slot is expanded like an image's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from core.model.config import ModelConfigError

IMAGE_TOKEN = "<image>"
IMAGE, VIDEO = "image", "video"  # what a turn's item is shown as


class ImageLayout(Protocol):
    """A family's image text, for templates that mark an image with more than its token."""

    @property
    def marker(self) -> str:
        """What the chat template emits where an image goes (a special token)."""
        ...

    def text(self, num_views: int) -> str:
        """The prompt text that replaces the marker for an image of `num_views` views, with the
        image token once per view."""
        ...


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str  # "user", "assistant" or "system"
    text: str  # what was said
    num_images: int  # items shown in this turn (images and videos), placed before the text
    kinds: tuple[str, ...] = ()  # per item shown, IMAGE or VIDEO; () = every one an image

    @property
    def items(self) -> tuple[str, ...]:
        """The kind of each item shown, in order."""
        return self.kinds or (IMAGE,) * self.num_images


class ChatTokenizer:
    def __init__(
        self,
        model_dir: Path,
        image_token_id: int,
        layout: ImageLayout | None = None,
        video_token_id: int | None = None,
    ) -> None:
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._plain = Tokenizer.from_str(self.tok.to_str())  # for text that may come from users
        self._plain.encode_special_tokens = True
        added = self.tok.get_added_tokens_decoder().items()
        self._special_ids = {t.content: i for i, t in added if t.special}
        longest_first = sorted(self._special_ids, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        cfg = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token")) or "<s>"
        self.eos_token = _token_text(cfg.get("eos_token")) or "</s>"
        self.add_bos = bool(cfg.get("add_bos_token", True))
        self.bos_id = self.tok.token_to_id(self.bos_token)
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id  # None: the model serves no video
        template = _find_template(model_dir, cfg)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(template)
        self._texts: dict[int, str] = {}  # token_text's answers; at most one per vocabulary id
        self.layout: ImageLayout | None = None
        if layout is not None:
            self._check_layout(layout)
        self.layout = layout

    def _check_layout(self, layout: ImageLayout) -> None:
        """Refuses a layout whose marker is not a special token of this tokenizer, or whose
        text does not hold the image token once per view."""
        ids: list[int] = []
        text: list[str] = []
        self._template(layout.text(2), text, ids, iter(()))
        if layout.marker not in self._special_ids or ids.count(self.image_token_id) != 2:
            raise ModelConfigError(
                f"tokenizer.json lacks the special tokens of the image layout "
                f"({layout.marker!r}, image token id {self.image_token_id})"
            )

    def render(self, turns: list[ChatTurn]) -> str:
        messages = [
            {
                "role": t.role,
                "content": [{"type": k} for k in t.items] + [{"type": "text", "text": t.text}],
            }
            for t in turns
        ]
        return self.template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def encode_prompt(
        self, turns: list[ChatTurn], views_per_image: list[int] | None = None
    ) -> list[int]:
        """Token ids of the rendered conversation, one image token per image slot of the template
        (not expanded: admission counts tokens with it before any image is encoded). With an
        `ImageLayout`, one per view: `views_per_image` (default one each) says how many."""
        marks = [f"\ue000{i}\ue001" for i in range(len(turns))]  # private-use: never in a template
        rendered = self.render([replace(t, text=m) for t, m in zip(turns, marks, strict=True)])
        ids: list[int] = []
        text: list[str] = []  # plain text since the template's last special token
        views = iter(views_per_image or ())
        pos = 0
        for turn, mark in zip(turns, marks, strict=True):
            at = rendered.find(mark, pos)
            if at == -1:
                continue  # the template leaves this turn's text out
            self._template(rendered[pos:at], text, ids, views)
            text.append(turn.text)
            pos = at + len(mark)
        self._template(rendered[pos:], text, ids, views)
        ids += self._plain.encode("".join(text), add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def _template(self, part: str, text: list[str], ids: list[int], views: Iterator[int]) -> None:
        """Adds template text: each image marker laid out (`ImageLayout`), its special tokens
        become their ids, the text between them (with users' text before it) is tokenised as
        plain text."""
        if self.layout is not None:
            pieces = part.split(self.layout.marker)
            laid_out = [pieces[0]]
            for piece in pieces[1:]:
                laid_out += [self.layout.text(next(views, 1)), piece]
            part = "".join(laid_out)
        start = 0
        for found in self._specials.finditer(part):
            text.append(part[start : found.start()])
            ids += self._plain.encode("".join(text), add_special_tokens=False).ids
            ids.append(self._special_ids[found.group()])
            text.clear()
            start = found.end()
        text.append(part[start:])

    def slot_id(self, kind: str) -> int:
        """The token a slot of this kind of item is (KeyError: the model serves no video)."""
        if kind == VIDEO and self.video_token_id is not None:
            return self.video_token_id
        if kind == IMAGE:
            return self.image_token_id
        raise KeyError(kind)

    def is_slot(self, token: int) -> bool:
        """Whether `token` is an image or video slot."""
        return token == self.image_token_id or token == self.video_token_id

    def expand(self, ids: list[int], tokens_per_image: list[int]) -> list[int]:
        """`ids` with each image or video slot repeated to its item's number of visual tokens."""
        out: list[int] = []
        images = iter(tokens_per_image)
        for token in ids:
            out.extend([token] * (next(images, 1) if self.is_slot(token) else 1))
        return out

    def encode_chat(self, turns: list[ChatTurn], tokens_per_image: list[int]) -> list[int]:
        """Token ids of the rendered conversation, each image placeholder expanded to its tokens."""
        return self.expand(self.encode_prompt(turns), tokens_per_image)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tok)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        """One id decoded on its own, special tokens by name (logprob alternatives)."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = str(self.tok.decode([token], skip_special_tokens=False))
        return text


class Detokenizer:
    """Incremental decoding of one output: each token costs one step of `tokenizers`'
    DecodeStream (it holds back an unfinished UTF-8 character), not a decode of every id so far."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self._pending: list[int] = []  # ids of an unfinished character

    def step(self, token: int) -> str:
        """The text `token` completes ("" while a character is unfinished)."""
        piece = self._stream.step(self._tok, token)
        if piece is None:
            self._pending.append(token)
            return ""
        self._pending.clear()
        return str(piece)

    def rest(self) -> str:
        """An unfinished character at the end, as a whole decode shows it (U+FFFD)."""
        return str(self._tok.decode(self._pending, skip_special_tokens=True))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content"))
    return None if value is None else str(value)


def _find_template(model_dir: Path, tok_cfg: dict[str, Any]) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    from_json = _read_json(model_dir / "chat_template.json").get("chat_template")
    template = from_json or tok_cfg.get("chat_template")
    if not template:
        raise FileNotFoundError(f"{model_dir} has no chat template")
    return str(template)
