"""The asyncio client: the same API as `visor.client.Client`, with `generate` an async iterator
and `ask` awaitable.

    async with visor.AsyncClient("127.0.0.1:50051", key) as client:
        async for event in client.generate("What is it?", [png]):
            ...
        answer = await client.ask("And now?", [png])
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from shared.proto import gateway_pb2, gateway_pb2_grpc
from visor import errors, request
from visor.client import time_left
from visor.request import Answer, Event, Turn
from visor.retry import Retry


class AsyncClient:
    """One grpc.aio channel to a gateway, one API key; use it from one event loop (the channel
    opens on first use, in the loop that uses it)."""

    def __init__(
        self,
        target: str,
        key: str,
        *,
        timeout: float | None = 60.0,
        retry: Retry = Retry(),  # noqa: B008 - frozen, so one shared default is safe
        inline_limit: int = request.INLINE_LIMIT,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.timeout, self.retry, self.inline_limit = timeout, retry, inline_limit
        self._target, self._credentials = target, credentials
        self._metadata = (("authorization", f"Bearer {key}"),)
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def generate(
        self,
        prompt: str = "",
        media: Sequence[bytes] = (),
        *,
        turns: Sequence[Turn] = (),
        detail: str = "auto",
        profile: str = "",
        max_visual_tokens: int = 0,
        timeout: float | None = None,
        **params: Any,
    ) -> AsyncGenerator[Event, None]:
        """`Delta`s, then one `Answer`. `params` are GenerationParams fields; `timeout`
        overrides the client's. Closing the iterator early (`contextlib.aclosing`) cancels the
        call."""
        req = request.build(
            prompt,
            media,
            turns=turns,
            detail=detail,
            profile=profile,
            max_visual_tokens=max_visual_tokens,
            **params,
        )
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in range(self.retry.max_attempts):
            events = request.Events(req.params.logprobs)
            call = self._call(req, time_left(deadline))
            try:
                async for raw in call:
                    yield events.read(raw)
                    if events.answer is not None:
                        return
                raise errors.InternalError("the stream ended without a final event")
            except grpc.RpcError as exc:
                err = errors.from_rpc_error(exc)
                wait = self.retry.wait_s(err, attempt, events.num_events, time_left(deadline))
                if wait is None:
                    raise err from None
            finally:
                call.cancel()
            await asyncio.sleep(wait)

    async def ask(self, prompt: str = "", media: Sequence[bytes] = (), **options: Any) -> Answer:
        """The whole answer at once; takes `generate`'s arguments."""
        async with contextlib.aclosing(self.generate(prompt, media, **options)) as events:
            async for event in events:
                if isinstance(event, Answer):
                    return event
        raise AssertionError("unreachable: generate ends with the Answer or raises")

    def _call(self, req: gateway_pb2.GenerateRequest, timeout: float | None) -> Any:
        if self._stub is None:
            self._channel = (
                grpc.aio.insecure_channel(self._target)
                if self._credentials is None
                else grpc.aio.secure_channel(self._target, self._credentials)
            )
            self._stub = gateway_pb2_grpc.GatewayStub(self._channel)  # type: ignore[no-untyped-call]
        if request.media_bytes(req) > self.inline_limit:
            return self._stub.GenerateUpload(
                request.upload(req), metadata=self._metadata, timeout=timeout
            )
        return self._stub.Generate(req, metadata=self._metadata, timeout=timeout)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
