"""The engine: owns the model and runs every torch call on one worker thread, so that the event
loop never blocks and a cancelled request stops between two tokens."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from core import encoders, metrics
from core.generate import TextStream, sample
from core.model import llava
from core.model.text import KVCache
from core.model.tokenizer import ChatTokenizer
from core.types import CoreInfo, Delta, InferRequest, Result
from shared.errors import Reason, VisorError

PREPROCESS_VERSION = "pp1"
T = TypeVar("T")


@dataclass(slots=True)
class _Sequence:
    """Generation state of one request, touched only on the model thread."""

    cache: KVCache
    stream: TextStream
    gen: torch.Generator
    logits: torch.Tensor


def num_tiles(rows: int, cols: int) -> int:
    """Tiles of a grid: every cell, plus a global thumbnail when there is more than one cell."""
    cells = rows * cols
    return cells + 1 if cells > 1 else cells


class Engine:
    def __init__(
        self,
        model_dir: Path,
        core_id: str,
        num_threads: int = 0,
        encoder: str = "torch",
        artifacts: Path | None = None,
    ) -> None:
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(
                f"no model at {model_dir}: build the demo one with "
                f"`visor model init-demo --out {model_dir}`"
            )
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.model = llava.load(model_dir)
        cfg = self.model.cfg
        self.tokenizer = ChatTokenizer(model_dir, cfg.image_token_id)
        eos = self.tokenizer.tok.token_to_id(self.tokenizer.eos_token)
        self.eos_ids = set(cfg.text.eos_token_id) | ({eos} if eos is not None else set())
        self.max_request_tokens = cfg.text.max_position_embeddings
        self.info = CoreInfo(
            core_id=core_id,
            model_id=model_dir.resolve().name,
            encoder_digest=self.model.encoder_digest(),
            image_size=cfg.vision.image_size,
            tokens_per_tile=cfg.tokens_per_tile,
            preprocess_version=PREPROCESS_VERSION,
            accepted_dtypes=("uint8",),
            image_mean=cfg.image_mean,
            image_std=cfg.image_std,
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="visor-model")
        folder = artifacts or model_dir / ".visor"
        self.encoder = encoders.build(encoder, self.model, folder.expanduser(), num_threads)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs `fn` on the model thread (torch work never runs on the event loop)."""
        return await self._run(fn, *args)

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def check_request(self, req: InferRequest) -> None:
        """Refuses items whose declared geometry is not what this encoder takes."""
        size = self.info.image_size
        for item in req.items:
            tiles = num_tiles(item.tile_rows, item.tile_cols)
            if (
                item.preprocess_version != self.info.preprocess_version
                or item.resolution != size
                or item.dtype not in self.info.accepted_dtypes
                or item.shape != (tiles, 3, size, size)
            ):
                raise VisorError(
                    Reason.INVALID_REQUEST, "item geometry does not match this core's encoder"
                )
        if sum(t.num_images for t in req.turns) != len(req.items):
            raise VisorError(Reason.INVALID_REQUEST, "turns show a different number of items")

    async def generate(
        self,
        req: InferRequest,
        features: list[np.ndarray],
        timings: dict[str, float],
        visual_before: int | None = None,
    ) -> AsyncIterator[Delta | Result]:
        """Streams deltas, then one Result. Closing the iterator early cancels the generation."""
        visual = [int(f.shape[0]) for f in features]
        ids = self.tokenizer.encode_chat(list(req.turns), visual)
        params = req.params
        if len(ids) + params.max_new_tokens > self.max_request_tokens:
            raise VisorError(
                Reason.TOKEN_BUDGET,
                f"request needs more than the {self.max_request_tokens} tokens "
                "one sequence may hold",
            )
        seed = params.seed or int.from_bytes(hashlib.sha256(req.request_id.encode()).digest()[:8])
        queued = time.perf_counter()
        metrics.ACTIVE_GENERATIONS.inc()
        finished = False
        try:
            seq, prefill_ms, started = await self._run(
                self._prefill, ids, features, seed, params.stop
            )
            timings["queue"] = (started - queued) * 1000
            timings["prefill"] = prefill_ms
            t0 = time.perf_counter()
            reason = "length"
            produced = 0
            while produced < params.max_new_tokens:
                token = sample(
                    self._masked(seq.logits, produced, params.min_new_tokens), params, seq.gen
                )
                produced += 1
                metrics.GENERATED_TOKENS.inc()
                if token in self.eos_ids:
                    reason = "stop"
                    break
                delta = seq.stream.push(token)
                if seq.stream.stopped:
                    reason = "stop"
                    yield Delta(delta, 1)
                    break
                yield Delta(delta, 1)
                if produced < params.max_new_tokens:
                    seq.logits = await self._run(self._step, seq, token)
            tail = seq.stream.flush()
            if tail:
                yield Delta(tail, 0)
            timings["generate"] = (time.perf_counter() - t0) * 1000
            finished = True
            yield Result(
                text=seq.stream.text,
                text_tokens=len(ids) - sum(visual),
                visual_tokens_before=sum(visual) if visual_before is None else visual_before,
                visual_tokens_after=sum(visual),
                output_tokens=produced,
                finish_reason=reason,
                timings_ms=timings,
            )
        finally:
            metrics.ACTIVE_GENERATIONS.dec()
            if not finished:
                metrics.CANCELLED_GENERATIONS.inc()

    def _masked(self, logits: torch.Tensor, produced: int, min_new: int) -> torch.Tensor:
        if produced >= min_new:
            return logits
        masked = logits.clone()
        masked[list(self.eos_ids)] = float("-inf")
        return masked

    @torch.inference_mode()
    def _prefill(
        self, ids: list[int], features: list[np.ndarray], seed: int, stop: tuple[str, ...]
    ) -> tuple[_Sequence, float, float]:
        started = time.perf_counter()
        image = torch.from_numpy(np.concatenate(features)).float() if features else None
        embeds = self.model.embed(torch.tensor(ids), image)
        cache = self.model.new_cache()
        logits = self.model.forward_tokens(embeds, cache)
        gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        seq = _Sequence(cache, TextStream(self.tokenizer.decode, stop), gen, logits)
        return seq, (time.perf_counter() - started) * 1000, started

    @torch.inference_mode()
    def _step(self, seq: _Sequence, token: int) -> torch.Tensor:
        embeds = self.model.language_model.embed_tokens(torch.tensor([token]))
        return self.model.forward_tokens(embeds, seq.cache)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
