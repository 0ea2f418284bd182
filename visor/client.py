"""The synchronous client: `Client(target, key).generate(...)` streams an answer's events,
`.ask(...)` returns the `Answer`. Imports no torch, Pillow or numpy.

    with visor.Client("127.0.0.1:50051", key) as client:
        for event in client.generate("What is it?", [png], max_new_tokens=32):
            ...  # Delta(text, num_tokens, logprobs) ..., then Answer(text, usage, timings_ms, ...)

Refusals raise the `visor.errors` class of their reason. Media above `inline_limit` bytes in
total go through GenerateUpload. `timeout` is the deadline of a call, retries and their waits
included; `retry` says which refusals are sent again (see `visor.retry`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from shared.proto import gateway_pb2, gateway_pb2_grpc
from visor import errors, request
from visor.request import Answer, Event, Turn
from visor.retry import Retry


def time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Client:
    """One channel to a gateway, one API key; safe to share between threads."""

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
        self._metadata = (("authorization", f"Bearer {key}"),)
        self._channel = (
            grpc.insecure_channel(target)
            if credentials is None
            else grpc.secure_channel(target, credentials)
        )
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)  # type: ignore[no-untyped-call]

    def generate(
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
    ) -> Iterator[Event]:
        """`Delta`s, then one `Answer`. `params` are GenerationParams fields; `timeout`
        overrides the client's. Stopping early cancels the call."""
        req = request.build(
            prompt,
            media,
            turns=turns,
            detail=detail,
            profile=profile,
            max_visual_tokens=max_visual_tokens,
            **params,
        )
        return self._events(req, self.timeout if timeout is None else timeout)

    def ask(self, prompt: str = "", media: Sequence[bytes] = (), **options: Any) -> Answer:
        """The whole answer at once; takes `generate`'s arguments."""
        *_, last = self.generate(prompt, media, **options)
        assert isinstance(last, Answer)  # _events ends with the Answer or raises
        return last

    def _events(self, req: gateway_pb2.GenerateRequest, timeout: float | None) -> Iterator[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in range(self.retry.max_attempts):
            events = request.Events(req.params.logprobs)
            call = self._call(req, time_left(deadline))
            try:
                for raw in call:
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
                call.cancel()  # ends the call when the caller stops early; no-op once it ended
            time.sleep(wait)
        raise AssertionError("unreachable: the last attempt raises")  # pragma: no cover

    def _call(self, req: gateway_pb2.GenerateRequest, timeout: float | None) -> Any:
        if request.media_bytes(req) > self.inline_limit:
            return self._stub.GenerateUpload(
                request.upload(req), metadata=self._metadata, timeout=timeout
            )
        return self._stub.Generate(req, metadata=self._metadata, timeout=timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
