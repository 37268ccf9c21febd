"""The engine's side of the `Host` service (`engine-sdk/rust/src/host.rs`):
callbacks into the gateway, authorised by the grant that came with the
current call, and the host allow-list that decides which endpoints a
request may make the engine dial."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass

import grpc
import grpc.aio

from .context import CallContext
from .endpoint import BadEndpoint, Endpoint
from .errors import (
    DeadlineExceeded,
    EngineError,
    HostError,
    NotGranted,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from .limits import MAX_GRPC_MESSAGE_BYTES
from .methods import HOST_SERVICE
from .pb import host, types
from .trace import HEADER

log = logging.getLogger("ctxgate_engine.host")

READ_TRANSCRIPT = "read_transcript"
LLM_COMPLETE = "llm_complete"
# A read_transcript collects at most this much over all its pages: a peer that
# streams or pages for ever cannot exhaust the engine's memory.
MAX_READ_BYTES = 16 * 1024 * 1024
MAX_READ_ENTRIES = 20_000
# The deadline of a callback made during a call that has none.
DEFAULT_CALLBACK_SECONDS = 30.0
# Host endpoints remembered at most (more means something sends many: start over).
MAX_HOST_CHANNELS = 64

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class HostEndpoint:
    """A host endpoint as requests and `--host-allow` name it: `http://`,
    `https://` (TLS) or bare `HOST:PORT`, or `unix:///PATH`."""

    https: bool
    endpoint: Endpoint
    # The host as written (the TLS server name: `localhost` stays a name).
    host: str

    @staticmethod
    def parse(s: str) -> HostEndpoint:
        https = s.startswith("https://")
        rest = s[len("https://"):] if https else s
        endpoint = Endpoint.parse(rest)
        bare = rest.removeprefix("http://").rstrip("/")
        name = bare.rpartition(":")[0] if ":" in bare else bare
        return HostEndpoint(https, endpoint, name.strip("[]"))

    def __str__(self) -> str:
        if self.endpoint.unix is not None or not self.https:
            return str(self.endpoint)
        return f"https://{self.endpoint}"


@dataclass(frozen=True)
class Checked:
    """A host endpoint the policy allows: the address to dial (checked, never
    a name resolved again later) and how."""

    dial: Endpoint
    https: bool
    server_name: str


class Refused(Exception):
    """Why a host endpoint is not called (the engine then works without host
    callbacks for that call)."""


def canonical(ip: Address) -> Address:
    """The same address however it is written (`::ffff:127.0.0.1` is 127.0.0.1)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def parse_peer(peer: str) -> Address | None:
    """The IP address of a grpcio peer string (`ipv4:1.2.3.4:5`,
    `ipv6:[::1]:5`); None for a unix socket (a local process)."""
    kind, _, rest = peer.partition(":")
    try:
        if kind == "ipv4":
            return ipaddress.IPv4Address(rest.rpartition(":")[0])
        if kind == "ipv6":
            return ipaddress.IPv6Address(rest.rpartition(":")[0].strip("[]").split("%")[0])
    except ValueError:
        return None
    return None


class HostPolicy:
    """Which host endpoints an engine calls back. A request names its host
    endpoint, and whoever reaches the engine's port can send a request: an
    engine that dialled whatever it was told could be made to connect
    anywhere and hand over the grant. So an endpoint is called only when it
    is on the allow-list (`--host-allow`) or, with no list, when it is the
    address of the peer that made the call (a name is resolved once, and the
    address that matched is dialled); a caller on a unix socket is a local
    process, so loopback endpoints are its. A unix socket named by a request
    is never dialled unless listed."""

    def __init__(self, allow: list[HostEndpoint] | None = None) -> None:
        self.allow = list(allow or [])

    async def check(self, endpoint: str, peer: Address | None, within: float) -> Checked:
        """Where to dial `endpoint` for a call from `peer` (None: a unix
        socket), or `Refused`."""
        try:
            h = HostEndpoint.parse(endpoint)
        except BadEndpoint:
            raise Refused(f"host endpoint {endpoint} is not a valid endpoint") from None
        if self.allow:
            if not any(a.https == h.https and a.endpoint == h.endpoint for a in self.allow):
                raise Refused(f"host endpoint {endpoint} is not on this engine's --host-allow list")
            return Checked(h.endpoint, h.https, h.host)
        e = h.endpoint
        if e.unix is not None:
            raise Refused(f"host endpoint {endpoint} is a unix socket named by a request; "
                          "only --host-allow can name one")
        candidates: list[Address] = []
        if e.ip is not None:
            candidates = [e.ip]
        else:
            try:
                infos = await asyncio.wait_for(
                    asyncio.get_running_loop().getaddrinfo(e.host, e.port, type=socket.SOCK_STREAM),
                    timeout=min(within, 2.0))
                for info in infos:
                    candidates.append(ipaddress.ip_address(str(info[4][0]).split("%")[0]))
            except (OSError, asyncio.TimeoutError, ValueError):
                candidates = []
        for a in candidates:
            if (peer is None and a.is_loopback) or (peer is not None and canonical(a) == canonical(peer)):
                return Checked(Endpoint(host=str(a), port=e.port, ip=a), h.https, h.host)
        who = "a local process on a unix socket" if peer is None else str(peer)
        raise Refused(f"host endpoint {endpoint} is not the calling peer ({who}); "
                      f"start the engine with --host-allow {endpoint} to trust it")


@dataclass(frozen=True)
class HostTls:
    """What to trust and present calling back https:// host endpoints."""

    ca: bytes | None = None
    key: bytes | None = None
    cert: bytes | None = None


CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    # Keepalive no more often than every 5 minutes, never on an idle
    # connection: what gRPC servers accept by default.
    ("grpc.keepalive_time_ms", 300_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
]


class HostChannels:
    """Channels to host endpoints, shared by all calls of one server; only to
    endpoints the policy allows."""

    def __init__(self, policy: HostPolicy, tls: HostTls | None = None) -> None:
        self.policy = policy
        self.tls = tls or HostTls()
        self._channels: dict[tuple[str, bool, str], grpc.aio.Channel] = {}

    def _open(self, c: Checked) -> grpc.aio.Channel:
        if not c.https:
            return grpc.aio.insecure_channel(c.dial.grpc_target(), options=CHANNEL_OPTIONS)
        creds = grpc.ssl_channel_credentials(root_certificates=self.tls.ca, private_key=self.tls.key,
                                             certificate_chain=self.tls.cert)
        # Dialled by address, verified by the name the endpoint was written with.
        options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", c.server_name)]
        return grpc.aio.secure_channel(c.dial.grpc_target(), creds, options=options)

    async def client(self, access: types.HostAccess | None, peer: Address | None, within: float) -> HostClient | None:
        """A client for `access` from `peer`, or None when the call carries no
        usable grant or names an endpoint the policy refuses (logged)."""
        if access is None or not access.grant.token:
            return None
        try:
            checked = await self.policy.check(access.endpoint, peer, within)
        except Refused as refused:
            log.warning("host callbacks refused for this call: %s", refused)
            return None
        key = (str(checked.dial), checked.https, checked.server_name)
        channel = self._channels.get(key)
        if channel is None:
            if len(self._channels) >= MAX_HOST_CHANNELS:
                self._channels.clear()
            channel = self._channels[key] = self._open(checked)
        return HostClient(channel, access.grant)


def _host_error(ctx: CallContext, operation: str, e: grpc.aio.AioRpcError) -> EngineError:
    """A callback that failed because the engine call's own deadline passed is
    that deadline, not a host fault."""
    left = ctx.remaining()
    if left is not None and left <= 0:
        return DeadlineExceeded()
    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        return Unimplemented(operation)
    return HostError(operation, e.code())


class _Read:
    """What one read took so far, over all its pages, against the caps."""

    def __init__(self) -> None:
        self.entries: list[types.TranscriptEntry] = []
        self.size = 0

    def take(self, op: str, chunk: host.TranscriptChunk) -> None:
        self.size += chunk.ByteSize()
        self.entries.extend(chunk.entries)
        if len(self.entries) > MAX_READ_ENTRIES:
            raise ResourceExhausted(f"host callback {op}: the transcript is over the read cap of "
                                    f"{MAX_READ_ENTRIES} entries")
        if self.size > MAX_READ_BYTES:
            raise ResourceExhausted(f"host callback {op}: the transcript is over the read cap of "
                                    f"{MAX_READ_BYTES} bytes")


class HostClient:
    """Calls the gateway back during one engine call. Every request carries
    the grant token, the call's remaining deadline (DEFAULT_CALLBACK_SECONDS
    when it has none) and the method's span as its trace parent."""

    def __init__(self, channel: grpc.aio.Channel, grant: types.Grant) -> None:
        self._grant = grant
        self._read = channel.unary_stream(
            f"/{HOST_SERVICE}/ReadTranscript",
            request_serializer=host.ReadTranscriptRequest.SerializeToString,
            response_deserializer=host.TranscriptChunk.FromString)
        self._llm = channel.unary_unary(
            f"/{HOST_SERVICE}/LlmComplete",
            request_serializer=host.LlmCompleteRequest.SerializeToString,
            response_deserializer=host.LlmCompleteResult.FromString)

    def allows(self, operation: str) -> bool:
        """Whether the grant allows `operation` and has not expired."""
        expires = self._grant.expires_at_unix_ms
        return operation in self._grant.operations and (expires == 0 or expires > time.time() * 1000)

    @property
    def session_id(self) -> str:
        """The session the grant is scoped to."""
        return self._grant.session_id

    @staticmethod
    def _bounds(ctx: CallContext) -> tuple[float, tuple[tuple[str, str], ...]]:
        left = ctx.remaining()
        metadata = ((HEADER, str(ctx.span)),) if ctx.span is not None else ()
        return (DEFAULT_CALLBACK_SECONDS if left is None else left), metadata

    async def read_transcript(self, ctx: CallContext, visible_only: bool = False) -> list[types.TranscriptEntry]:
        """The grant's session's transcript (or only its visible history),
        collected page by page: the host answers one page a call, and the
        last chunk's cursor asks for the next. At most MAX_READ_ENTRIES
        entries and MAX_READ_BYTES over all pages, else RESOURCE_EXHAUSTED
        naming the cap; each page is bounded by the call's remaining deadline
        (DEFAULT_CALLBACK_SECONDS when it has none)."""
        read = _Read()
        cursor = ""
        while True:
            cursor = await self._read_page(ctx, visible_only, cursor, 0, read)
            if not cursor:
                return read.entries

    async def read_transcript_page(self, ctx: CallContext, visible_only: bool = False, cursor: str = "",
                                   limit: int = 0) -> tuple[list[types.TranscriptEntry], str]:
        """One page: at most `limit` entries (0: as many as the host sends at
        once) after `cursor` ("": from the start), and the cursor of the next
        page ("": nothing follows). For sessions longer than the read caps;
        one page is capped as `read_transcript` is."""
        read = _Read()
        next_cursor = await self._read_page(ctx, visible_only, cursor, limit, read)
        return read.entries, next_cursor

    async def _read_page(self, ctx: CallContext, visible_only: bool, cursor: str, limit: int, read: _Read) -> str:
        """One ReadTranscript call into `read`; the last chunk's cursor."""
        op = "ReadTranscript"
        if not self.allows(READ_TRANSCRIPT):
            raise NotGranted(READ_TRANSCRIPT)
        ctx.check()
        timeout, metadata = self._bounds(ctx)
        req = host.ReadTranscriptRequest(grant=self._grant.token, session_id=self._grant.session_id,
                                         cursor=cursor, visible_only=visible_only, limit=limit)
        call = self._read(req, timeout=timeout, metadata=metadata)
        before = len(read.entries)
        last = ""
        try:
            async for chunk in call:
                ctx.check()
                read.take(op, chunk)
                last = chunk.next_cursor
        except grpc.aio.AioRpcError as e:
            raise _host_error(ctx, op, e) from None
        finally:
            call.cancel()  # a no-op once the stream ended; stops a peer that goes on
        # A page that says more follows must have moved past `cursor`, or
        # following it would ask for the same page again.
        if last and (len(read.entries) == before or last == cursor):
            raise Unavailable(f"host callback {op}: the host sent a page with no new entries and a cursor "
                              "to more; stopped rather than read the same page again")
        return last

    async def llm_complete(self, ctx: CallContext, req: host.LlmCompleteRequest) -> host.LlmCompleteResult:
        """One completion from the host's model. Cancelling the call (the
        engine call's task) cancels the callback: the host sees it."""
        if not self.allows(LLM_COMPLETE):
            raise NotGranted(LLM_COMPLETE)
        sent = host.LlmCompleteRequest()
        sent.CopyFrom(req)
        sent.grant = self._grant.token
        timeout, metadata = self._bounds(ctx)
        try:
            return await self._llm(sent, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise _host_error(ctx, "LlmComplete", e) from None
