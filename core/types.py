"""Values that cross the core's boundary (servicer <-> engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.model.tokenizer import ChatTurn
from shared.preprocess import PreprocessRule
from shared.sampling import ResponseFormat, TokenLogprob


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int  # hard cap on generated tokens
    min_new_tokens: int = 0  # end-of-sequence suppressed before this many tokens
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass
    top_k: int = 0  # 0 = no top-k filter
    seed: int = 0  # sampling seed
    stop: tuple[str, ...] = ()  # stop strings, excluded from the output
    logprobs: bool = False  # report each token's logprob
    top_logprobs: int = 0  # alternatives reported per token
    response_format: ResponseFormat | None = None  # what the answer must match; None = free text


@dataclass(frozen=True, slots=True)
class ItemSpec:
    content_hash: str  # hex SHA-256 of the raw bytes
    preprocess_version: str  # gateway preprocessing version
    resolution: int  # tile / view side, or a native token's side, in pixels
    tile_rows: int  # tile grid, crop grid or native height in tokens: rows
    tile_cols: int  # ... and cols
    dtype: str  # wire dtype
    shape: tuple[int, ...]  # (n, 3, H, W) as the rule's kind lays it out (core.proto ItemSpec)
    frame: int = 0  # frame index within an animation or video
    frame_interval_s: float = 0.0  # native: seconds between its sampled frames; 0 = still image
    source_width: int = 0  # the upright source image's width (anyres tiles need it); 0 = unknown
    source_height: int = 0  # ... and height

    @property
    def is_video(self) -> bool:
        """Shown to the model as a video (its frames taken `frame_interval_s` apart)."""
        return self.frame_interval_s > 0


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """The tenant's feature-cache policy, as its gateway states it."""

    ttl_s: float = 0.0  # entries live min(this, [cache] ttl_s); 0 = [cache] ttl_s alone
    no_cache: bool = False  # neither look up nor store this request's features


@dataclass(frozen=True, slots=True)
class InferRequest:
    tenant: str  # authenticated tenant
    request_id: str  # for logs and default seeds
    turns: tuple[ChatTurn, ...]  # the conversation
    params: SamplingParams  # generation controls
    items: tuple[ItemSpec, ...]  # media items in order of appearance
    profile: str  # compression profile
    cache: CachePolicy = CachePolicy()  # the tenant's feature-cache policy


@dataclass(frozen=True, slots=True)
class CoreInfo:
    core_id: str  # reported as served_by
    model_id: str  # checkpoint directory name
    encoder_digest: str  # digest of vision tower + projector weights
    rule: PreprocessRule  # what the gateway must apply
    accepted_dtypes: tuple[str, ...]  # wire dtypes accepted

    @property
    def preprocess_version(self) -> str:
        """The version items carry: the steps' version and the rule's digest."""
        return self.rule.version()

    @property
    def image_size(self) -> int:
        """Tile (tiles) or view (fixed) side; 0 for a native rule."""
        return self.rule.image_size

    @property
    def tokens_per_tile(self) -> int:
        """Visual tokens per tile (tiles) or per view (fixed); 0 for a native rule."""
        return self.rule.tokens_per_tile or self.rule.tokens_per_image

    @property
    def image_mean(self) -> tuple[float, ...]:
        """Normalisation mean (fused into the encoder for uint8)."""
        return self.rule.mean

    @property
    def image_std(self) -> tuple[float, ...]:
        return self.rule.std


@dataclass(frozen=True, slots=True)
class Delta:
    text: str  # new text since the previous delta
    num_tokens: int  # tokens this delta covers
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token covered, when asked for


@dataclass(frozen=True, slots=True)
class Result:
    text: str  # the whole output
    text_tokens: int  # prompt tokens, image tokens excluded
    visual_tokens_before: int  # encoder output tokens
    visual_tokens_after: int  # tokens that reached the LLM
    output_tokens: int  # generated tokens
    finish_reason: str  # "stop" or "length"
    timings_ms: dict[str, float] = field(default_factory=dict)  # core-side stages
