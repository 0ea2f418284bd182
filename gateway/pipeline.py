"""One request through the gateway: limits -> sniff -> probe -> plan items -> handshake with the
core -> decode misses -> stream tensors -> relay tokens. Plain values in, plain events out.

An animation becomes one item per sampled frame (same content hash, its own frame index); a
`detail=high` image becomes one item of several tiles. Both are planned from headers alone, so the
core is told every item's geometry before any pixel is decoded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from gateway import decode, hedging, limits, metrics, routing, tiling, video
from gateway.core_client import (
    CoreClient,
    CoreFinal,
    CoreRequest,
    CoreUnreachable,
    Geometry,
    ItemHeader,
)
from gateway.pool import Budget, DecodePool
from gateway.probes import ProbeCache
from gateway.sniff import VIDEO, sniff
from gateway.tenants import Tenant
from gateway.types import Ask, Delta, Final
from shared.errors import Reason, VisorError
from shared.hashing import content_hash

T = TypeVar("T")


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


async def _all(work: Sequence[Awaitable[T]]) -> list[T]:
    """Awaits every job; the first refusal cancels the others (a waiting job leaves the queue, a
    running one finishes in the background and its worker serves again). The pool bounds each
    job by the request's deadline and decode budget."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


@dataclass(frozen=True, slots=True)
class Plan:
    """What one media item becomes."""

    media: int  # index into the request's media
    grid: tiling.Grid  # tile grid for every frame of it
    frames: tuple[int, ...]  # sampled frame indices, one core item each


@dataclass(slots=True)
class _Job:
    """What every attempt of one request shares (one attempt per core tried)."""

    tenant: Tenant  # authenticated tenant, with the limits and policy it started with
    request_id: str  # request id
    ask: Ask  # the request
    max_new: int  # max_new_tokens after limits
    profile: str  # compression profile after the tenant's policy
    media: list[bytes]  # every media item, in order
    formats: list[str]  # sniffed format per item
    hashes: list[str]  # content hash per item
    started: float  # arrival (perf_counter)
    timeout: float | None  # seconds from `started`
    plans: dict[int, list[Plan]] = field(default_factory=dict)  # by the core's tile side
    budget: Budget = field(init=False)  # the request's share of the decode pool
    video_limits: dict[str, Any] = field(init=False)  # the tenant's, for the decode workers

    def __post_init__(self) -> None:
        self.budget = Budget(self.tenant.id, self.deadline)
        lim = self.tenant.limits
        self.video_limits = video.VideoLimits(
            lim.max_video_duration_s,
            lim.max_video_streams,
            lim.max_video_frames,
            lim.video_sample_fps,
            lim.max_sampled_frames,
        ).to_json()

    @property
    def deadline(self) -> float | None:
        return self.started + self.timeout if self.timeout is not None else None

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.perf_counter())


class Pipeline:
    def __init__(
        self,
        pool: DecodePool,
        router: routing.Router,
        core_attempt_timeout_s: float = 5.0,
        video_enabled: bool = True,
        core_hedge_after_s: float = 0.2,
    ) -> None:
        self.pool, self.router = pool, router
        self.attempt_timeout_s = core_attempt_timeout_s
        self.hedge_s = core_hedge_after_s
        self.video_enabled = video_enabled
        self.probes = ProbeCache()

    async def generate(
        self,
        tenant: Tenant,
        request_id: str,
        ask: Ask,
        started: float,
        timings: dict[str, float],
        timeout: float | None,
    ) -> AsyncIterator[Delta | Final]:
        """`started` is when the request arrived (perf_counter); `timings` holds `receive`.
        The caller has admitted the request (gateway.quota) before receiving it; `tenant` holds
        the limits and policy the request runs under, whatever a reload does meanwhile."""
        max_new = limits.check_request(tenant.limits, ask)
        profile = limits.check_profile(tenant.policy, ask.profile)
        async for event in self._generate(
            tenant, request_id, ask, max_new, profile, started, timings, timeout
        ):
            yield event

    async def _generate(
        self,
        tenant: Tenant,
        request_id: str,
        ask: Ask,
        max_new: int,
        profile: str,
        started: float,
        timings: dict[str, float],
        timeout: float | None,
    ) -> AsyncIterator[Delta | Final]:
        media = [m for t in ask.turns for m in t.media]
        t0 = time.perf_counter()
        formats = [sniff(m, self.video_enabled) for m in media]
        hashes = [content_hash(m) for m in media]
        if media:
            timings["sniff"] = _ms(t0)
        job = _Job(
            tenant, request_id, ask, max_new, profile, media, formats, hashes, started, timeout
        )
        key = routing.route_key(tenant.id, hashes[0] if hashes else None, request_id)
        failure: VisorError = CoreUnreachable("no core configured")
        # With every core marked down, all attempts share one attempt's time: a hung core (or
        # several) answers the caller within about core_attempt_timeout_s, not its deadline.
        attempts_by = (
            None if self.router.healthy() else time.perf_counter() + self.attempt_timeout_s
        )
        cores = self.router.candidates(key)
        await self._plan_ahead(cores, job, timings)

        def attempt(core: CoreClient, claim: Callable[[], bool]) -> AsyncIterator[Delta | Final]:
            return self._on_core(core, job, timings, attempts_by, claim)

        def failed(core: CoreClient) -> None:
            if job.remaining() == 0.0:  # our deadline, not the core's fault
                raise VisorError(Reason.DEADLINE_EXCEEDED, "the deadline passed")
            self.router.mark_down(core)

        while cores:
            streamed = False
            try:
                answers = hedging.first_to_answer(cores, attempt, self.hedge_s, failed)
                async for event in answers:
                    streamed = streamed or isinstance(event, Delta)
                    yield event
                return
            except CoreUnreachable as err:
                if streamed:  # tokens already reached the client: never answer twice
                    raise
                metrics.CORE_FAILOVERS.inc()
                failure = err
            if job.deadline is not None and time.perf_counter() >= job.deadline:
                raise VisorError(Reason.DEADLINE_EXCEEDED, "the deadline passed")
        raise failure

    async def _plan_ahead(
        self, cores: list[CoreClient], job: _Job, timings: dict[str, float]
    ) -> None:
        """Plans before any attempt when the first core's geometry is known, so that a hedge
        measures the core's handshake, not the probes."""
        geo = cores[0].described if cores else None
        if geo is not None and geo.image_size not in job.plans:
            job.plans[geo.image_size] = await self._plan(job, geo, timings)

    def _attempt_s(self, job: _Job, attempts_by: float | None) -> float:
        """How long one core may take to answer Describe or the cache handshake."""
        limit = self.attempt_timeout_s
        if attempts_by is not None:
            limit = min(limit, max(0.0, attempts_by - time.perf_counter()))
        remaining = job.remaining()
        return limit if remaining is None else min(limit, remaining)

    async def _on_core(
        self,
        core: CoreClient,
        job: _Job,
        timings: dict[str, float],
        attempts_by: float | None,
        claim: Callable[[], bool],
    ) -> AsyncIterator[Delta | Final]:
        """One attempt on one core: its geometry, the plan for it, the handshake, the tokens.
        Describe and the cache reply must come within the attempt timeout (else the core counts
        as unreachable and the next is tried); the tokens then have the request's deadline.
        `claim()` at the cache reply says whether this attempt is the one that goes on."""
        try:
            geo = await core.geometry(self._attempt_s(job, attempts_by))
        except VisorError as err:
            if err.reason is not Reason.DEADLINE_EXCEEDED:
                raise
            raise CoreUnreachable("Describe timed out") from None
        if geo.image_size not in job.plans:  # cores of one deployment share it: plan once
            job.plans[geo.image_size] = await self._plan(job, geo, timings)
        plans = job.plans[geo.image_size]
        items = [(p, f) for p in plans for f in p.frames]
        headers = _headers(job.hashes, geo, items)
        missed: list[int] = []

        async def pixels_for(missing: list[int]) -> list[np.ndarray]:
            if not claim():  # another core answered first
                raise hedging.Lost()
            missed[:] = missing
            return await self._decode(job, geo, items, missing, timings)

        def on_transfer(ms: float) -> None:
            timings["transfer"] = ms

        ask, policy = job.ask, job.tenant.policy
        req = CoreRequest(
            job.tenant.id,
            job.request_id,
            ask.turns,
            replace(ask.params, max_new_tokens=job.max_new),
            headers,
            job.profile,
            _images_per_turn(ask, plans),
            policy.cache_ttl_s,
            policy.no_cache,
        )
        first = True
        handshake_s = self._attempt_s(job, attempts_by)
        events = core.infer(req, job.remaining(), pixels_for, on_transfer, handshake_s)
        async for event in events:
            if isinstance(event, Delta):
                if first and event.text:
                    timings["ttft"], first = _ms(job.started), False
                yield event
            else:
                item_hashes = [h.content_hash for h in headers]
                yield _final(event, item_hashes, set(missed), timings, job.started, first)

    async def _plan(self, job: _Job, geo: Geometry, timings: dict[str, float]) -> list[Plan]:
        lim, ask = job.tenant.limits, job.ask
        budget = tiling.Budget(
            geo.image_size, lim.max_tiles, geo.tokens_per_tile, ask.max_visual_tokens
        )
        # `detail=auto` reads the question being asked (the last user turn), in memory only.
        question = next((t.text for t in reversed(ask.turns) if t.role == "user"), "")
        plans = []
        for index, probe in enumerate(await self._probe(job, timings)):
            w, h = probe.width, probe.height
            grid = tiling.grid_for(ask.detail, w, h, budget, question)
            if job.formats[index] in VIDEO:  # the worker already sampled: one item per sample time
                frames = tuple(range(min(probe.num_frames, lim.max_sampled_frames)))
            else:
                frames = tiling.sample_frames(probe.num_frames, lim.max_sampled_frames)
            plans.append(Plan(index, grid, frames))
        return plans

    async def _probe(self, job: _Job, timings: dict[str, float]) -> list[decode.Probe]:
        """Each item's probe: from the probe cache when these bytes were probed under these
        limits before (no worker job, no `probe` stage), else from one probe job per item."""
        t0 = time.perf_counter()
        lim = job.tenant.limits
        limits = {"max_pixels": lim.max_pixels, "max_side": lim.max_side}
        limits.update(max_frames=lim.max_frames)
        args = [{**limits, "fmt": f, "video": job.video_limits} for f in job.formats]
        keys = [self.probes.key(job.tenant.id, h, a) for h, a in zip(job.hashes, args, strict=True)]
        found = {k: p for k in keys if (p := self.probes.get(k)) is not None}
        todo = {k: (m, a) for k, m, a in zip(keys, job.media, args, strict=True) if k not in found}
        if todo:
            jobs = [self.pool.run("probe", a, m, job.budget) for m, a in todo.values()]
            for k, reply in zip(todo, await _all(jobs), strict=True):
                body = reply.body
                found[k] = decode.Probe(
                    int(body["width"]), int(body["height"]), int(body["num_frames"])
                )
                self.probes.put(k, found[k])
            timings["probe"] = _ms(t0)
        return [found[k] for k in keys]

    async def _decode(
        self,
        job: _Job,
        geo: Geometry,
        items: list[tuple[Plan, int]],
        missing: list[int],
        timings: dict[str, float],
    ) -> list[np.ndarray]:
        """Decodes each media item once, for all of its frames the core lacks."""
        wanted: dict[int, list[int]] = {}
        for i in missing:
            plan, frame = items[i]
            wanted.setdefault(plan.media, []).append(frame)
        grids = {p.media: p.grid for p, _ in items}
        lim = job.tenant.limits
        order = list(wanted)
        jobs = []
        for m in order:
            spec = decode.Spec(
                job.formats[m],
                geo.image_size,
                geo.fill,
                grids[m].rows,
                grids[m].cols,
                tuple(wanted[m]),
                lim.max_pixels,
                lim.max_side,
            )
            args = {**spec.to_json(), "video": job.video_limits}
            jobs.append(self.pool.run("decode", args, job.media[m], job.budget))
        replies = await _all(jobs)
        if replies:
            # One update: each worker decodes, then preprocesses (tracing lays them end to end).
            timings.update(
                image_decode=sum(float(r.body["decode_ms"]) for r in replies),
                preprocess=sum(float(r.body["preprocess_ms"]) for r in replies),
            )
        size = geo.image_size
        for m, r in zip(order, replies, strict=True):
            expected = (grids[m].num_tiles, 3, size, size)
            if len(r.arrays) != len(wanted[m]) or any(a.shape != expected for a in r.arrays):
                # Only a misbehaving (compromised) worker answers with other geometry.
                raise VisorError(Reason.DECODER_CRASHED, "the decoder returned the wrong geometry")
        by_media = {m: list(r.arrays) for m, r in zip(order, replies, strict=True)}
        return [by_media[items[i][0].media].pop(0) for i in missing]


def _headers(
    hashes: list[str], geo: Geometry, items: list[tuple[Plan, int]]
) -> tuple[ItemHeader, ...]:
    """What the core is told about each item: its cache key fields and tensor shape."""
    size = geo.image_size
    return tuple(
        ItemHeader(
            hashes[p.media],
            geo.preprocess_version,
            size,
            p.grid.rows,
            p.grid.cols,
            (p.grid.num_tiles, 3, size, size),
            frame,
        )
        for p, frame in items
    )


def _images_per_turn(ask: Ask, plans: list[Plan]) -> tuple[int, ...]:
    """Core items per turn: a media item counts once per sampled frame."""
    out, index = [], 0
    for turn in ask.turns:
        out.append(sum(len(plans[index + k].frames) for k in range(len(turn.media))))
        index += len(turn.media)
    return tuple(out)


def _final(
    f: CoreFinal,
    hashes: list[str],
    missing: set[int],
    timings: dict[str, float],
    started: float,
    no_text: bool,
) -> Final:
    if no_text:
        timings["ttft"] = _ms(started)
    merged = {**f.timings_ms, **timings}
    cache = tuple((h, i not in missing) for i, h in enumerate(hashes))
    return Final(
        f.text,
        f.text_tokens,
        f.visual_tokens_before,
        f.visual_tokens_after,
        f.output_tokens,
        cache,
        f.core_id,
        f.finish_reason,
        merged,
    )
