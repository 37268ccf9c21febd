"""Host callbacks: the allow-list decides which endpoints a request may make
the engine dial (a refused one is never dialled), every callback carries the
grant, a deadline and the method's span, a read follows the host's pages
to the end, and a peer streaming transcript chunks for ever makes the read
fail with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from ctxgate_engine import CallContext, EngineError, ServeArgs
from ctxgate_engine.host import MAX_READ_ENTRIES, HostClient, HostEndpoint, HostPolicy, Refused
from ctxgate_engine.methods import HOST_SERVICE
from ctxgate_engine.pb import host, pb, types
from helpers import assemble_request, deadline_bound, run_async, serving, unary
from probe import Probe


def ip(s: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(s)


async def allowed(p: HostPolicy, endpoint: str, peer: Any) -> bool:
    try:
        await p.check(endpoint, peer, 2.0)
        return True
    except Refused:
        return False


@run_async
async def test_by_default_only_the_calling_peer_is_called_back() -> None:
    p = HostPolicy()
    lo = ip("127.0.0.1")
    for endpoint in ("127.0.0.1:7300", "http://127.0.0.1:7300", "localhost:7300"):
        assert await allowed(p, endpoint, lo), endpoint
    assert await allowed(p, "127.0.0.1:7300", ip("::ffff:127.0.0.1")), "the same address, v4-mapped"
    for endpoint in ("10.1.2.3:7300", "127.0.0.2:7300", "name.invalid:7300", "not an endpoint"):
        assert not await allowed(p, endpoint, lo), endpoint
    assert not await allowed(p, "unix:///run/gw.sock", None), "a unix socket named by a request"
    assert await allowed(p, "127.0.0.1:7300", None), "a caller on the unix socket is local"
    assert not await allowed(p, "10.1.2.3:7300", None)
    c = await p.check("https://localhost:7300", lo, 2.0)
    assert (str(c.dial), c.https, c.server_name) == ("127.0.0.1:7300", True, "localhost")


@run_async
async def test_an_allow_list_is_all_that_is_called_back() -> None:
    p = HostPolicy([HostEndpoint.parse(e) for e in ("10.0.0.5:7300", "unix:///run/gw.sock", "https://gateway:7300")])
    other = ip("192.168.1.1")
    assert await allowed(p, "http://10.0.0.5:7300", other)
    assert await allowed(p, "https://gateway:7300", other)
    assert not await allowed(p, "gateway:7300", other), "the scheme is part of what is listed"
    assert not await allowed(p, "https://10.0.0.5:7300", other)
    assert await allowed(p, "unix:///run/gw.sock", None)
    with pytest.raises(Refused) as e:
        await p.check("127.0.0.1:7300", ip("127.0.0.1"), 2.0)
    assert "--host-allow" in str(e.value), "the peer is not trusted by itself then"


class FakeHost:
    """A Host service: ReadTranscript answers `entries` in one chunk, or
    streams for ever (`forever`: chunks of `per_chunk` entries of `text`),
    or (`paged`) answers `entries` as the gateway does: a page of at most
    1000 entries after the request's cursor, in chunks of 128, the last
    chunk's cursor set when more follow; `stuck`: a page with no entries and
    a cursor to more."""

    def __init__(self) -> None:
        self.entries: list[types.TranscriptEntry] = [types.TranscriptEntry(id="e1")]
        self.forever = False
        self.paged = False
        self.stuck = False
        self.per_chunk = 100
        self.text = ""
        self.sent_chunks = 0
        self.requests: list[tuple[host.ReadTranscriptRequest, float | None, dict[str, Any]]] = []
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(HOST_SERVICE, {
            "ReadTranscript": grpc.unary_stream_rpc_method_handler(
                self.read, request_deserializer=host.ReadTranscriptRequest.FromString,
                response_serializer=host.TranscriptChunk.SerializeToString)}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def read(self, req: host.ReadTranscriptRequest,
                   context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[host.TranscriptChunk]:
        self.requests.append((req, context.time_remaining(), dict(context.invocation_metadata() or ())))
        if self.stuck:
            yield host.TranscriptChunk(next_cursor="e1")
            return
        if self.paged:
            start = next((i + 1 for i, e in enumerate(self.entries) if e.id == req.cursor), 0)
            page = self.entries[start:start + min(req.limit or 1000, 1000)]
            more = start + len(page) < len(self.entries)
            for i in range(0, len(page), 128):
                chunk = page[i:i + 128]
                last = i + 128 >= len(page)
                yield host.TranscriptChunk(entries=chunk, next_cursor=chunk[-1].id if more or not last else "")
            return
        if not self.forever:
            yield host.TranscriptChunk(entries=self.entries)
            return
        entry = types.TranscriptEntry(id="x", message=types.AgentMessage(
            id="x", role=types.ROLE_USER, content=[types.ContentPart(text=self.text)]))
        while True:
            self.sent_chunks += 1
            yield host.TranscriptChunk(entries=[entry] * self.per_chunk)

    def access(self, endpoint: str | None = None) -> types.HostAccess:
        return types.HostAccess(endpoint=endpoint or f"127.0.0.1:{self.port}", grant=types.Grant(
            token="tok", session_id="read", operations=["read_transcript"]))


def read_request(access: types.HostAccess) -> pb.AssembleRequest:
    r = assemble_request("read")
    r.host.CopyFrom(access)
    return r


@run_async
async def test_callbacks_carry_the_grant_the_deadline_and_the_methods_span() -> None:
    fake = FakeHost()
    await fake.server.start()
    engine = Probe()
    async with serving(engine) as (_, channel):
        assemble = unary(channel, "Assemble", pb.AssembleResult)
        trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        await assemble(read_request(fake.access()), timeout=5, metadata=(("traceparent", trace),))
        assert engine.read == ["1 entries"]
        req, left, metadata = fake.requests[0]
        assert (req.grant, req.session_id) == ("tok", "read")
        assert left is not None and 0 < left <= deadline_bound(5), left
        sent = metadata["traceparent"]
        assert sent.split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736", "the caller's trace"
        assert sent == engine.spans[0] and sent.split("-")[2] != "00f067aa0ba902b7", "the method's own span"
        await assemble(read_request(fake.access()))
        _, left, _ = fake.requests[1]
        assert left is not None and 0 < left <= deadline_bound(31), "a call with no deadline: the callback's own"
        access = fake.access()
        access.grant.expires_at_unix_ms = 1
        await assemble(read_request(access))
        assert engine.read[-1] == "FAILED_PRECONDITION: the grant does not allow read_transcript"
        assert len(fake.requests) == 2, "an expired grant makes no call"
    await fake.server.stop(None)


@run_async
async def test_a_host_endpoint_outside_the_allow_list_is_never_dialled() -> None:
    # A canary on another loopback address: any connection to it is a dial.
    dials = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dials
        dials += 1
        writer.close()

    canary = await asyncio.start_server(count, "127.0.0.2", 0)
    foreign = f"127.0.0.2:{canary.sockets[0].getsockname()[1]}"
    fake = FakeHost()
    await fake.server.start()
    for allow, dialled in (([], False), ([HostEndpoint.parse(foreign)], True)):
        engine = Probe()
        async with serving(engine, ServeArgs(host_allow=allow)) as (_, channel):
            await unary(channel, "Assemble", pb.AssembleResult)(read_request(fake.access(foreign)), timeout=5)
            if dialled:
                assert engine.read[0] != "no host" and dials > 0, (engine.read, dials)
            else:
                assert engine.read == ["no host"] and dials == 0, (engine.read, dials)
    canary.close()
    await fake.server.stop(None)


@pytest.mark.parametrize("per_chunk,text,cap", [(100, "", f"{MAX_READ_ENTRIES} entries"),
                                                (1, "x" * (1 << 20), "16777216 bytes")])
@run_async
async def test_a_peer_streaming_for_ever_makes_the_read_resource_exhausted(per_chunk: int, text: str,
                                                                            cap: str) -> None:
    fake = FakeHost()
    fake.forever, fake.per_chunk, fake.text = True, per_chunk, text
    await fake.server.start()
    engine = Probe()
    async with serving(engine) as (_, channel):
        await unary(channel, "Assemble", pb.AssembleResult)(read_request(fake.access()), timeout=30)
    assert engine.read[0].startswith("RESOURCE_EXHAUSTED: "), engine.read
    assert engine.read[0].endswith(f"over the read cap of {cap}"), engine.read
    sent = fake.sent_chunks
    await asyncio.sleep(0.2)
    assert fake.sent_chunks - sent < 64, "the stream was stopped, not drained"
    await fake.server.stop(None)


@run_async
async def test_a_read_follows_the_hosts_pages_to_the_end_in_order() -> None:
    fake = FakeHost()
    fake.paged = True
    fake.entries = [types.TranscriptEntry(id=f"e{i}", seq=i) for i in range(2500)]
    await fake.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{fake.port}")
    client = HostClient(channel, fake.access().grant)
    ctx = CallContext(deadline=time.monotonic() + 10)
    try:
        entries = await client.read_transcript(ctx, visible_only=True)
        assert [e.seq for e in entries] == list(range(2500)), "all of them, in order"
        assert [r.cursor for r, _, _ in fake.requests] == ["", "e999", "e1999"], "three calls, each resuming"
        assert all(r.visible_only and r.limit == 0 for r, _, _ in fake.requests)
        assert all(left is not None and 0 < left <= deadline_bound(10) for _, left, _ in fake.requests), "each within the call's deadline"
        page, cursor = await client.read_transcript_page(ctx, cursor="e999", limit=10)
        assert ([e.id for e in page], cursor) == ([f"e{i}" for i in range(1000, 1010)], "e1009")
        page, cursor = await client.read_transcript_page(ctx, cursor="e2399", limit=500)
        assert (len(page), page[-1].id, cursor) == (100, "e2499", ""), "the last page: nothing follows"
    finally:
        await channel.close()
        await fake.server.stop(None)


@run_async
async def test_a_page_with_no_entries_but_a_cursor_fails_rather_than_loop() -> None:
    fake = FakeHost()
    fake.stuck = True
    await fake.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{fake.port}")
    client = HostClient(channel, fake.access().grant)
    try:
        with pytest.raises(EngineError) as e:
            await client.read_transcript(CallContext(deadline=time.monotonic() + 10))
        code, message, _ = e.value.status()
        assert code == grpc.StatusCode.UNAVAILABLE, code
        assert "no new entries and a cursor" in message, message
        assert len(fake.requests) == 1, "it did not ask again"
    finally:
        await channel.close()
        await fake.server.stop(None)
