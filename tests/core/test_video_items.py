"""Videos as core items (Qwen2.5-VL): a turn's items are images or videos (`ChatTurn.kinds`),
rendered as transformers renders the same conversation with Qwen's template and expanded slot by
slot; admission shows an item that declares a frame interval as a video where the model serves
video, and refuses frames without timing or a video for a model that serves none; the interval
is part of the feature-cache key."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import SchedulerConfig
from core.input_processor import InputProcessor
from core.model.tokenizer import IMAGE, VIDEO, ChatTokenizer, ChatTurn
from core.structured import GrammarCompiler
from core.types import CoreInfo, InferRequest, ItemSpec, SamplingParams
from shared.errors import Reason, VisorError
from shared.hashing import FeatureKey
from shared.preprocess import PreprocessRule
from tests.family_checkpoints import QWEN_TEMPLATE, qwen_tokenizer

transformers = pytest.importorskip("transformers")
NATIVE = PreprocessRule(
    "native", (0.5,) * 3, (0.5,) * 3, "bicubic", patch_size=14, merge_size=2,
    temporal_patch_size=2, min_pixels=3136, max_pixels=1003520,
)  # fmt: skip
PROMPT = "How many are there?"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen's tokenizer and template, saved as transformers saves them."""
    out = tmp_path_factory.mktemp("qwen-tok")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=qwen_tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = QWEN_TEMPLATE
    fast.save_pretrained(out)
    return out


def _chat(qwen_dir: Path, video: bool = True) -> ChatTokenizer:
    tok = qwen_tokenizer()
    image, video_id = tok.token_to_id("<|image_pad|>"), tok.token_to_id("<|video_pad|>")
    return ChatTokenizer(qwen_dir, image, None, video_id if video else None)


def test_turn_kinds_render_as_transformers_renders_them(qwen_dir: Path) -> None:
    chat = _chat(qwen_dir)
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(qwen_dir)
    kinds = (VIDEO, IMAGE, VIDEO)
    content = [{"type": k} for k in kinds] + [{"type": "text", "text": PROMPT}]
    messages = [{"role": "user", "content": content}]
    want = fast.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    got = chat.encode_prompt([ChatTurn("user", PROMPT, 3, kinds)])
    assert got == want
    video, image = chat.video_token_id, chat.image_token_id
    assert [i for i in got if chat.is_slot(i)] == [video, image, video]
    # Expansion repeats each slot's own token, in order.
    expanded = chat.expand(got, [3, 2, 4])
    assert [i for i in expanded if chat.is_slot(i)] == [video] * 3 + [image] * 2 + [video] * 4
    # No kinds: every item an image, as before.
    plain = chat.encode_prompt([ChatTurn("user", PROMPT, 2)])
    assert [i for i in plain if chat.is_slot(i)] == [image, image]
    assert ChatTurn("user", PROMPT, 2).items == (IMAGE, IMAGE)


def _inputs(chat: ChatTokenizer) -> InputProcessor:
    info = CoreInfo("c", "qwen", "d", NATIVE, ("uint8",))
    grammars = GrammarCompiler(chat.tok.to_str(), chat.tok.get_vocab_size(), {0}, 4)
    return InputProcessor(chat, info, SchedulerConfig(), 100_000, grammars)


def _item(frames: int, interval: float) -> ItemSpec:
    shape = (frames, 3, 56, 84)  # 2 x 3 merged tokens per temporal patch
    return ItemSpec("0" * 64, NATIVE.version(), 28, 2, 3, "uint8", shape, 0, interval)


def _req(*items: ItemSpec) -> InferRequest:
    turns = (ChatTurn("user", PROMPT, len(items)),)
    return InferRequest("t", "r", turns, SamplingParams(4), items, "none")


def test_an_item_with_a_frame_interval_is_admitted_as_a_video(qwen_dir: Path) -> None:
    chat = _chat(qwen_dir)
    ids, counts, slots = _inputs(chat).check(_req(_item(4, 0.5), _item(1, 0.0), _item(3, 1.0)))
    # t = ceil(frames / 2) temporal patches of 2 x 3 tokens each.
    assert counts == (12, 6, 12) and slots == (1, 1, 1)
    video, image = chat.video_token_id, chat.image_token_id
    assert [i for i in ids if chat.is_slot(i)] == [video, image, video]


def _refused(inputs: InputProcessor, item: ItemSpec) -> str:
    with pytest.raises(VisorError) as err:
        inputs.check(_req(item))
    assert err.value.reason == Reason.INVALID_REQUEST
    return err.value.message


def test_frames_without_timing_or_a_video_the_model_cannot_see_are_refused(
    qwen_dir: Path,
) -> None:
    with_video = _inputs(_chat(qwen_dir))
    assert "frame_interval_s" in _refused(with_video, _item(4, 0.0))
    for wrong in (-1.0, float("nan"), float("inf"), 1e9):
        assert "frame_interval_s" in _refused(with_video, _item(4, wrong))
    # Qwen3-VL (timestamps in the prompt) and LLaVA name no video token: still images only.
    without = _inputs(_chat(qwen_dir, video=False))
    message = _refused(without, _item(4, 0.5))
    assert "still images only" in message and "max_sampled_frames" in message
    assert _inputs(_chat(qwen_dir, video=False)).check(_req(_item(1, 0.0)))[1] == (6,)


def test_the_frame_interval_is_part_of_the_cache_key() -> None:
    key = FeatureKey("t", "h", "e", "d", "v", 28, 2, 3, 0, (4, 3, 56, 84))
    still = FeatureKey("t", "h", "e", "d", "v", 28, 2, 3, 0, (4, 3, 56, 84), 0.0)
    slow = FeatureKey("t", "h", "e", "d", "v", 28, 2, 3, 0, (4, 3, 56, 84), 1.0)
    fast = FeatureKey("t", "h", "e", "d", "v", 28, 2, 3, 0, (4, 3, 56, 84), 0.5)
    assert key.encode() == still.encode()  # a still image's key is what it was
    assert len({still.encode(), slow.encode(), fast.encode()}) == 3
