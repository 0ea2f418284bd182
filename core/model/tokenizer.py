"""The checkpoint's tokenizer (`tokenizer.json`) and chat template (Jinja, sandboxed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

IMAGE_TOKEN = "<image>"


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str  # "user", "assistant" or "system"
    text: str  # what was said
    num_images: int  # images shown in this turn, placed before the text


class ChatTokenizer:
    def __init__(self, model_dir: Path, image_token_id: int) -> None:
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token")) or "<s>"
        self.eos_token = _token_text(cfg.get("eos_token")) or "</s>"
        self.add_bos = bool(cfg.get("add_bos_token", True))
        self.bos_id = self.tok.token_to_id(self.bos_token)
        self.image_token_id = image_token_id
        template = _find_template(model_dir, cfg)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(template)

    def render(self, turns: list[ChatTurn]) -> str:
        messages = [
            {
                "role": t.role,
                "content": [{"type": "image"}] * t.num_images + [{"type": "text", "text": t.text}],
            }
            for t in turns
        ]
        return self.template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def encode_chat(self, turns: list[ChatTurn], tokens_per_image: list[int]) -> list[int]:
        """Token ids of the rendered conversation, each image placeholder expanded to its tokens."""
        text = self.render(turns)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        out: list[int] = []
        images = iter(tokens_per_image)
        for token in ids:
            if token == self.image_token_id:
                out.extend([self.image_token_id] * next(images, 1))
            else:
                out.append(token)
        return out

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


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
