"""One request through the gateway: limits -> sniff -> probe -> plan items -> handshake with the
core -> decode misses -> stream tensors -> relay tokens. Plain values in, plain events out.

An animation becomes one item per sampled frame (same content hash, its own frame index), or,
under a native rule, one item of its frames that the core shows as a video of the seconds
between them; a `detail=high` image becomes one item of several tiles. Both are planned from
headers alone, so the core is told every item's geometry before any pixel is decoded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from gateway import decode, hedging, limits, metrics, routing, tiling, video
from gateway.config import LimitsConfig
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
from shared.preprocess import PreprocessRule

T = TypeVar("T")

# Byte work (hashing, assembling uploads) below this size runs on the event loop; larger runs on a
# thread, where it cannot delay other requests' turns: 18 MB take ~10 ms to hash or to copy into
# fresh pages here, and both hashlib and bytes.join let go of the GIL for buffers this large.
ON_LOOP_BYTES = 1 << 20


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
    # For every frame: the tile grid (tiles), the pan-and-scan crop grid (fixed), or the resized
    # size in merged tokens (native); with the rule, it gives each item's shape.
    grid: tiling.Grid
    frames: tuple[int, ...]  # sampled frame indices
    stacked: bool = False  # all frames are one core item (native), else one item each
    interval_s: float = 0.0  # stacked: mean seconds between its frames (a video); 0 = a still
    width: int = 0  # the upright source's width (an anyres core counts tokens by it)
    height: int = 0  # ... and height

    @property
    def items(self) -> tuple[tuple[int, ...], ...]:
        """The frames of each core item this media item becomes."""
        return (self.frames,) if self.stacked else tuple((f,) for f in self.frames)


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
    plans: dict[str, list[Plan]] = field(default_factory=dict)  # by the core's version
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
        self.hedge = hedging.HedgeDelay(core_hedge_after_s)
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
        if sum(map(len, media)) < ON_LOOP_BYTES:
            hashes = [content_hash(m) for m in media]
        else:  # hashlib lets go of the GIL: other requests' handshakes go on meanwhile
            hashes = await asyncio.to_thread(lambda: [content_hash(m) for m in media])
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
                # A core being checked out of turn (it let a hedge win) may be hung: ask the
                # next core at once too.
                hedge_s = 0.0 if self.router.suspected(cores[0]) else self.hedge()
                answers = hedging.first_to_answer(
                    cores, attempt, hedge_s, failed, self.router.suspect
                )
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
        if geo is not None and geo.preprocess_version not in job.plans:
            job.plans[geo.preprocess_version] = await self._plan(job, geo, timings)

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
        if geo.preprocess_version not in job.plans:  # a deployment's cores share it: plan once
            job.plans[geo.preprocess_version] = await self._plan(job, geo, timings)
        plans = job.plans[geo.preprocess_version]
        items = [(p, frames) for p in plans for frames in p.items]
        headers = _headers(job.hashes, geo, items)
        missed: list[int] = []

        async def pixels_for(missing: list[int]) -> list[np.ndarray]:
            if not claim():  # another core answered first
                raise hedging.Lost()
            took = time.perf_counter() - asked
            self.hedge.observe(took)
            timings["handshake"] = took * 1000
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
        asked = time.perf_counter()
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
        """Each item's geometry under the core's rule within the tenant's limits."""
        lim, ask = job.tenant.limits, job.ask
        rule = bounded_rule(geo.rule, lim)
        # `detail=auto` reads the question being asked (the last user turn), in memory only.
        question = next((t.text for t in reversed(ask.turns) if t.role == "user"), "")
        probes = await self._probe(job, timings)
        return [
            plan_media(
                i,
                p,
                job.formats[i] in VIDEO,
                ask.detail,
                rule,
                lim,
                question,
                ask.max_visual_tokens,
            )
            for i, p in enumerate(probes)
        ]

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
                    int(body["width"]),
                    int(body["height"]),
                    int(body["num_frames"]),
                    tuple(float(s) for s in body["starts_s"]),
                )
                self.probes.put(k, found[k])
            timings["probe"] = _ms(t0)
        return [found[k] for k in keys]

    async def _decode(
        self,
        job: _Job,
        geo: Geometry,
        items: list[tuple[Plan, tuple[int, ...]]],
        missing: list[int],
        timings: dict[str, float],
    ) -> list[np.ndarray]:
        """Decodes each media item once, for all of its frames the core lacks."""
        wanted: dict[int, list[int]] = {}
        for i in missing:
            plan, frames = items[i]
            wanted.setdefault(plan.media, []).extend(frames)
        grids = {p.media: p.grid for p, _ in items}
        lim = job.tenant.limits
        rule = bounded_rule(geo.rule, lim)
        order = list(wanted)
        jobs = []
        for m in order:
            frames = tuple(wanted[m])
            spec = decode_spec(job.formats[m], grids[m], frames, rule, geo.fill, lim)
            args = {**spec.to_json(), "video": job.video_limits}
            jobs.append(self.pool.run("decode", args, job.media[m], job.budget))
        replies = await _all(jobs)
        if replies:
            # One update: each worker decodes, then preprocesses (tracing lays them end to end).
            timings.update(
                image_decode=sum(float(r.body["decode_ms"]) for r in replies),
                preprocess=sum(float(r.body["preprocess_ms"]) for r in replies),
            )
        for m, r in zip(order, replies, strict=True):
            expected = rule.item_shape(grids[m].rows, grids[m].cols)  # one frame's
            if len(r.arrays) != len(wanted[m]) or any(a.shape != expected for a in r.arrays):
                # Only a misbehaving (compromised) worker answers with other geometry.
                raise VisorError(Reason.DECODER_CRASHED, "the decoder returned the wrong geometry")
        by_media = {m: list(r.arrays) for m, r in zip(order, replies, strict=True)}
        out = []
        for i in missing:
            plan, frames = items[i]
            arrays = [by_media[plan.media].pop(0) for _ in frames]
            out.append(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))
        return out


def bounded_rule(rule: PreprocessRule, lim: LimitsConfig) -> PreprocessRule:
    """The core's rule within the tenant's limits (a limit tightens the rule, never loosens):
    native frames of at most max_pixels, at most max_tiles pan-and-scan crops."""
    return rule.bounded(lim.max_pixels, lim.max_tiles + 1)


def plan_media(
    index: int,
    probe: decode.Probe,
    is_video: bool,
    detail: str,
    rule: PreprocessRule,
    lim: LimitsConfig,
    question: str = "",
    max_visual_tokens: int = 0,
) -> Plan:
    """What one media item becomes under `rule`, from its header alone: at most
    max_sampled_frames frames (a native item keeps whole temporal patches of them, and is a
    video of the mean time between them, or its first frame alone where its frames have no
    timing), and the tile grid, native size or crop grid of each (`detail`, the question's intent
    and `max_visual_tokens` choose it; gateway.tiling)."""
    w, h = probe.width, probe.height
    wanted = min(probe.num_frames, lim.max_sampled_frames)
    if rule.kind == "native":
        wanted = rule.native_frames(wanted)
    # A video's worker samples by time: its frames are sample numbers.
    frames = tuple(range(wanted)) if is_video else tiling.sample_frames(probe.num_frames, wanted)
    interval = 0.0
    if rule.kind == "native":
        interval = _interval(probe.starts_s, frames)
        frames = frames if interval > 0 else frames[:1]  # e.g. MPO: its primary image
        grid = tiling.native_grid(detail, w, h, rule, question, max_visual_tokens)
    elif rule.kind == "fixed":
        grid = tiling.views_grid(detail, w, h, rule, question, max_visual_tokens)
    else:
        budget = tiling.Budget(
            rule.image_size, lim.max_tiles, rule.tokens_per_tile, max_visual_tokens
        )
        if rule.pinpoints:
            grid = tiling.anyres_grid(detail, w, h, rule, budget, question)
        else:
            grid = tiling.grid_for(detail, w, h, budget, question)
    return Plan(index, grid, frames, rule.kind == "native", interval, w, h)


def _interval(starts_s: tuple[float, ...], frames: tuple[int, ...]) -> float:
    """Mean seconds between `frames` (0 for one frame, or frames without timing)."""
    if len(frames) < 2 or len(starts_s) <= frames[-1]:
        return 0.0
    return max(0.0, (starts_s[frames[-1]] - starts_s[frames[0]]) / (len(frames) - 1))


def decode_spec(
    fmt: str,
    grid: tiling.Grid,
    frames: tuple[int, ...],
    rule: PreprocessRule,
    fill: tuple[int, int, int],
    lim: LimitsConfig,
) -> decode.Spec:
    """The worker's job for `frames` of one media item planned under `rule` (a tiles rule with
    pinpoints is laid out as LLaVA-OneVision's processor does, padding with the mean truncated
    to uint8 as it does)."""
    if rule.pinpoints:
        r, g, b = (int(m * 255) for m in rule.mean)
        fill = (r, g, b)
    return decode.Spec(
        fmt,
        rule.image_size,
        fill,
        grid.rows,
        grid.cols,
        frames,
        lim.max_pixels,
        lim.max_side,
        "anyres" if rule.pinpoints else rule.kind,
        rule.resample,
        grid.cols * rule.factor,
        grid.rows * rule.factor,
    )


def _headers(
    hashes: list[str], geo: Geometry, items: list[tuple[Plan, tuple[int, ...]]]
) -> tuple[ItemHeader, ...]:
    """What the core is told about each item: its cache key fields and tensor shape."""
    rule = geo.rule
    return tuple(
        ItemHeader(
            hashes[p.media],
            geo.preprocess_version,
            rule.resolution,
            p.grid.rows,
            p.grid.cols,
            rule.item_shape(p.grid.rows, p.grid.cols, len(frames)),
            frames[0],
            p.interval_s,
            p.width,
            p.height,
        )
        for p, frames in items
    )


def _images_per_turn(ask: Ask, plans: list[Plan]) -> tuple[int, ...]:
    """Core items per turn: a media item counts once per core item (per sampled frame, or once
    for a native item that stacks its frames)."""
    out, index = [], 0
    for turn in ask.turns:
        out.append(sum(len(plans[index + k].items) for k in range(len(turn.media))))
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
