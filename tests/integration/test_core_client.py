"""The gateway's core client against a real gRPC server on loopback that ends the Infer call
while the gateway is still sending tensors: the caller gets a refusal read from the call's status,
never an exception of the write itself (which would surface as the gateway's own INTERNAL)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np

from gateway.core_client import CoreClient, CoreRequest, ItemHeader
from gateway.types import Params, Turn
from shared.errors import Reason, VisorError
from shared.proto import core_pb2, core_pb2_grpc
from shared.status import to_status
from tests.conftest import free_port


class _RefusesMidTransfer(core_pb2_grpc.CoreServicer):
    async def Infer(
        self,
        request_iterator: AsyncIterator[core_pb2.CoreMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[core_pb2.CoreEvent]:
        messages = aiter(request_iterator)
        await anext(messages)  # the header
        yield core_pb2.CoreEvent(cache=core_pb2.CacheReply(held=[False]))
        await anext(messages)  # the first tensor chunk: refuse while more are on their way
        await context.abort_with_status(to_status(VisorError(Reason.OVERLOADED, "busy")))


async def _infer_against_refusing_core() -> VisorError:
    server = grpc.aio.server()
    core_pb2_grpc.add_CoreServicer_to_server(_RefusesMidTransfer(), server)  # type: ignore[no-untyped-call]
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    client = CoreClient(address, core_token="t")
    shape = (1, 3, 224, 224)
    item = ItemHeader("0" * 64, "pp1", 224, 1, 1, shape)
    req = CoreRequest("dev", "r1", (Turn("user", "hi", (b"",)),), Params(8), (item,), "none")
    # 16 MiB of pixels: many chunks, so the refusal lands while the client is still writing.
    pixels = [np.zeros((64, 3, 224, 224), np.uint8)]

    async def pixels_for(missing: list[int]) -> list[np.ndarray]:
        return pixels

    try:
        async for _ in client.infer(req, 10.0, pixels_for, lambda ms: None, 5.0):
            pass
    except VisorError as err:
        return err
    finally:
        await client.close()
        await server.stop(None)
    raise AssertionError("the call was not refused")


def test_a_core_that_refuses_during_the_transfer_is_reported_with_its_status() -> None:
    err = asyncio.run(_infer_against_refusing_core())
    # gRPC races the server's status against the client's pending writes: the client reads
    # either that status or a reset stream ("Internal error from Core", INTERNAL), both of them
    # the call's own outcome.
    assert err.reason in (Reason.OVERLOADED, Reason.INTERNAL), err
