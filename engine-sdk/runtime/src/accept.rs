//! Admitting connections. A listener on a network is open to peers that
//! connect and say nothing: each such connection costs a task and a file
//! descriptor, and enough of them would crowd out the peers that do talk.
//! So every connection starts *pending* — its TLS handshake, then the
//! HTTP/2 connection preface and the frame header of the SETTINGS frame
//! that must follow it ([`plain`], [`tls`]; a listener that speaks HTTP/1,
//! [`plain_any`], waits for the first byte only) — under a short timeout,
//! with a cap per peer and one overall; a new connection over a cap evicts
//! the oldest pending one instead of being refused, so a flood of idle or
//! half-open connects (one that sends `P` and waits, say) never keeps a
//! real client, which is through all of it in milliseconds, from getting
//! in. Established connections are capped per peer and over all peers; one
//! more is closed at once.
//!
//! A peer is its IPv4 address, or its IPv6 /64: one host is given a /64 at
//! least, and counting its addresses one by one would give it 2⁶⁴ caps.
//!
//! The gateway's listeners and the SDK's engine server both serve through
//! [`plain`] or [`tls`]; the gateway's metrics listener through
//! [`plain_any`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

use crate::tls::LiveServerTls;

/// What one listener lets peers hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Established connections one peer may hold; more are closed.
    pub open_per_peer: usize,
    /// Established connections over all peers; more are closed.
    pub open_total: usize,
    /// Pending connections one peer address may have; a new one evicts
    /// that peer's oldest.
    pub pending_per_peer: usize,
    /// Pending connections over all peers; a new one evicts the oldest.
    pub pending_total: usize,
    /// How long a connection may stay pending.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            open_per_peer: 1024,
            open_total: 4096,
            pending_per_peer: 64,
            pending_total: 1024,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// File descriptors a server keeps for what is not a client connection:
/// its store's files, database pool, outbound channels, logs.
pub const DESCRIPTOR_RESERVE: u64 = 512;

impl Limits {
    /// These limits for `listeners` listeners within `descriptors` file
    /// descriptors, [`DESCRIPTOR_RESERVE`] kept: `open_total` and
    /// `pending_total` lowered (pending ones to a fifth of a listener's
    /// share at most) when every listener's connections would not fit, so
    /// a connection flood is refused before the server runs out of
    /// descriptors for its own work. `None` when they fit.
    pub fn fit(&self, descriptors: u64, listeners: usize) -> Option<Self> {
        let share = descriptors.saturating_sub(DESCRIPTOR_RESERVE) / listeners.max(1) as u64;
        let share = usize::try_from(share).unwrap_or(usize::MAX);
        (self.open_total.saturating_add(self.pending_total) > share).then(|| {
            let pending_total = self.pending_total.min(share / 5).max(1);
            let open_total = self.open_total.min(share.saturating_sub(pending_total)).max(1);
            Self { open_total, pending_total, ..*self }
        })
    }

    /// These limits fitted ([`Limits::fit`]) to the descriptor limit,
    /// raised first as far as the system allows ([`crate::descriptors`]),
    /// with a warning when they were lowered.
    pub fn fitted(&self, listeners: usize) -> Self {
        let descriptors = match crate::descriptors::raise() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "the file descriptor limit could not be read; connection caps as configured");
                return *self;
            }
        };
        match self.fit(descriptors, listeners) {
            None => *self,
            Some(fitted) => {
                tracing::warn!(
                    descriptors,
                    open_total = fitted.open_total,
                    pending_total = fitted.pending_total,
                    "connection caps lowered to what the file descriptor limit leaves each listener"
                );
                fitted
            }
        }
    }
}

/// An admitted connection: its slot in the peer's count is given back
/// when it closes. The bytes read to admit it (the HTTP/2 preface) are
/// read again first.
pub struct Admitted<IO> {
    io: IO,
    read: Vec<u8>,
    /// How much of `read` has been read again.
    replayed: usize,
    _slot: OpenSlot,
}

impl<IO: Connected> Connected for Admitted<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.replayed < this.read.len() {
            let rest = &this.read[this.replayed..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.replayed += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// The client connection preface of HTTP/2 (RFC 9113 §3.4)…
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// …which the client must follow with a SETTINGS frame: its 9-byte
/// header, whose fourth byte is the frame type.
const FRAME_HEADER: usize = 9;
const SETTINGS: u8 = 0x4;

/// The plaintext HTTP/2 connections of `tcp` (pending until the preface
/// and the first frame's header have come).
pub fn plain<S>(tcp: S, limits: Limits) -> impl Stream<Item = io::Result<Admitted<TcpStream>>> + Send + 'static
where
    S: Stream<Item = io::Result<TcpStream>> + Send + Unpin + 'static,
{
    admit(tcp, limits, http2_preface)
}

/// The plaintext connections of `tcp` whatever they speak (pending until
/// their first byte): for a listener that serves HTTP/1, whose own header
/// timeout bounds the rest.
pub fn plain_any<S>(tcp: S, limits: Limits) -> impl Stream<Item = io::Result<Admitted<TcpStream>>> + Send + 'static
where
    S: Stream<Item = io::Result<TcpStream>> + Send + Unpin + 'static,
{
    admit(tcp, limits, |conn: TcpStream| async move {
        // A peek, not `readable()`: a new socket may report itself readable
        // before any byte has come.
        conn.peek(&mut [0u8; 1]).await?;
        Ok((conn, Vec::new()))
    })
}

/// The TLS HTTP/2 connections of `tcp` (pending until their handshake is
/// done and the preface has come), each with the configuration current
/// when it was accepted.
pub fn tls<S>(
    tcp: S,
    limits: Limits,
    live: LiveServerTls,
) -> impl Stream<Item = io::Result<Admitted<tokio_rustls::server::TlsStream<TcpStream>>>> + Send + 'static
where
    S: Stream<Item = io::Result<TcpStream>> + Send + Unpin + 'static,
{
    admit(tcp, limits, move |conn: TcpStream| {
        let handshake = live.acceptor().accept(conn);
        async move { http2_preface(handshake.await?).await }
    })
}

/// What a server answers a connection that does not start as HTTP/2 does:
/// its (empty) SETTINGS, then GOAWAY with PROTOCOL_ERROR (RFC 9113 §3.4).
/// A client that is not HTTP/2 learns as much — a TLS client on a
/// plaintext listener reads that it is not TLS — instead of a bare close.
const NOT_HTTP2: [u8; 26] = [
    0, 0, 0, SETTINGS, 0, 0, 0, 0, 0, // SETTINGS, no parameters
    0, 0, 8, 0x7, 0, 0, 0, 0, 0, // GOAWAY, 8 bytes, stream 0
    0, 0, 0, 0, 0, 0, 0, 1, // last stream 0, PROTOCOL_ERROR
];

/// Reads the preface and the first frame's header off `io`: the bytes,
/// to be read again by the server, or an error for anything else as soon
/// as it differs ([`NOT_HTTP2`] answered).
async fn http2_preface<IO: AsyncRead + AsyncWrite + Unpin>(mut io: IO) -> io::Result<(IO, Vec<u8>)> {
    let mut read = vec![0u8; PREFACE.len() + FRAME_HEADER];
    let mut n = 0;
    while n < read.len() {
        match io.read(&mut read[n..]).await? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            got => n += got,
        }
        let preface = n.min(PREFACE.len());
        let settings = n <= PREFACE.len() + 3 || read[PREFACE.len() + 3] == SETTINGS;
        if read[..preface] != PREFACE[..preface] || !settings {
            let _ = io.write_all(&NOT_HTTP2).await;
            let _ = io.shutdown().await;
            // Closed with unread bytes (the rest of a TLS ClientHello), a
            // socket resets, and the peer may lose the answer: read what
            // it sent first, a little and briefly.
            let mut rest = [0u8; 4096];
            let drain = async {
                for _ in 0..16 {
                    if matches!(io.read(&mut rest).await, Ok(0) | Err(_)) {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(Duration::from_millis(500), drain).await;
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not an HTTP/2 connection preface and SETTINGS"));
        }
    }
    Ok((io, read))
}

/// Accepts from `tcp` in a task of its own, establishes each connection
/// in a task of its own (a slow peer holds up no one), and yields the
/// established ones. Ends when the server stops reading it.
fn admit<S, IO, F, Fut>(mut tcp: S, limits: Limits, establish: F) -> impl Stream<Item = io::Result<Admitted<IO>>>
where
    S: Stream<Item = io::Result<TcpStream>> + Send + Unpin + 'static,
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = io::Result<(IO, Vec<u8>)>> + Send + 'static,
    IO: Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let table = Arc::new(Mutex::new(Table::default()));
    tokio::spawn(async move {
        loop {
            let conn = tokio::select! {
                c = tcp.next() => c,
                () = tx.closed() => return,
            };
            let conn = match conn {
                None => return,
                Some(Ok(c)) => c,
                // An accept error (out of file descriptors, say) passes:
                // keep accepting, after a pause rather than a spin.
                Some(Err(e)) => {
                    lock(&table).warn.warn(&format_args!("accepting a connection failed: {e}"));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(peer) = conn.peer_addr().map(|a| peer_of(a.ip())) else { continue };
            let Entered::Pending(pending) = lock(&table).enter(peer, &limits) else { continue };
            let (tx, table, attempt) = (tx.clone(), table.clone(), establish(conn));
            tokio::spawn(async move {
                let outcome = tokio::select! {
                    r = tokio::time::timeout(limits.handshake_timeout, attempt) => r,
                    () = pending.evicted.cancelled() => return lock(&table).leave(pending.id, peer),
                };
                lock(&table).leave(pending.id, peer);
                match outcome {
                    Ok(Ok((io, read))) => {
                        let Some(slot) = OpenSlot::take(&table, peer, &limits) else { return };
                        let _ = tx.send(Ok(Admitted { io, read, replayed: 0, _slot: slot })).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "connection failed before it was established"),
                    Err(_) => tracing::debug!(%peer, "connection not established in time; closed"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The peer `ip` counts against: an IPv4 address (also when connected
/// over an IPv6 socket), or an IPv6 address's /64.
fn peer_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !(u128::MAX >> 64))),
        },
        v4 => v4,
    }
}

/// Which cap one more established connection would pass.
enum OverCap {
    Peer(IpAddr, usize),
    Total(usize),
}

impl std::fmt::Display for OverCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            OverCap::Peer(IpAddr::V6(v6), cap) => write!(f, "{v6}/64 holds {cap} connections; closing its new ones"),
            OverCap::Peer(v4, cap) => write!(f, "{v4} holds {cap} connections; closing its new ones"),
            OverCap::Total(cap) => write!(f, "{cap} connections are open; closing new ones"),
        }
    }
}

fn lock(table: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(|e| e.into_inner())
}

/// Pending and open connections, by peer. A peer's entry lives while it
/// has either, so the map is bounded by the connections themselves.
#[derive(Default)]
struct Table {
    next: u64,
    /// Established connections over all peers.
    open: usize,
    warn: Warner,
    /// Every pending connection, oldest first.
    pending: BTreeMap<u64, (IpAddr, CancellationToken)>,
    peers: HashMap<IpAddr, Peer>,
}

#[derive(Default)]
struct Peer {
    open: usize,
    /// This peer's pending connections, oldest first.
    pending: VecDeque<u64>,
}

struct Pending {
    id: u64,
    evicted: CancellationToken,
}

enum Entered {
    Pending(Pending),
    Refused,
}

impl Table {
    fn enter(&mut self, peer: IpAddr, limits: &Limits) -> Entered {
        if let Some(over) = self.over_cap(peer, limits) {
            self.warn.warn(&over);
            self.forget_if_idle(peer);
            return Entered::Refused;
        }
        let p = self.peers.entry(peer).or_default();
        if p.pending.len() >= limits.pending_per_peer.max(1)
            && let Some(oldest) = p.pending.pop_front()
            && let Some((_, token)) = self.pending.remove(&oldest)
        {
            token.cancel();
        }
        if self.pending.len() >= limits.pending_total.max(1)
            && let Some((oldest, (owner, token))) = self.pending.pop_first()
        {
            token.cancel();
            if let Some(o) = self.peers.get_mut(&owner) {
                o.pending.retain(|&id| id != oldest);
            }
        }
        self.next += 1;
        let (id, evicted) = (self.next, CancellationToken::new());
        self.pending.insert(id, (peer, evicted.clone()));
        self.peers.entry(peer).or_default().pending.push_back(id);
        Entered::Pending(Pending { id, evicted })
    }

    /// Why one more established connection from `peer` is refused, if it is.
    fn over_cap(&self, peer: IpAddr, limits: &Limits) -> Option<OverCap> {
        if self.peers.get(&peer).is_some_and(|p| p.open >= limits.open_per_peer) {
            Some(OverCap::Peer(peer, limits.open_per_peer))
        } else if self.open >= limits.open_total {
            Some(OverCap::Total(limits.open_total))
        } else {
            None
        }
    }

    fn leave(&mut self, id: u64, peer: IpAddr) {
        self.pending.remove(&id);
        if let Some(p) = self.peers.get_mut(&peer) {
            p.pending.retain(|&i| i != id);
        }
        self.forget_if_idle(peer);
    }

    fn forget_if_idle(&mut self, peer: IpAddr) {
        if self.peers.get(&peer).is_some_and(|p| p.open == 0 && p.pending.is_empty()) {
            self.peers.remove(&peer);
        }
    }
}

/// One established connection counted against its peer.
struct OpenSlot {
    table: Arc<Mutex<Table>>,
    peer: IpAddr,
}

impl OpenSlot {
    fn take(table: &Arc<Mutex<Table>>, peer: IpAddr, limits: &Limits) -> Option<Self> {
        let mut t = lock(table);
        if let Some(over) = t.over_cap(peer, limits) {
            t.warn.warn(&over);
            t.forget_if_idle(peer);
            return None;
        }
        t.open += 1;
        t.peers.entry(peer).or_default().open += 1;
        Some(Self { table: table.clone(), peer })
    }
}

impl Drop for OpenSlot {
    fn drop(&mut self) {
        let mut t = lock(&self.table);
        t.open = t.open.saturating_sub(1);
        if let Some(p) = t.peers.get_mut(&self.peer) {
            p.open = p.open.saturating_sub(1);
        }
        t.forget_if_idle(self.peer);
    }
}

/// At most one warning a second.
#[derive(Default)]
struct Warner(Option<tokio::time::Instant>);

impl Warner {
    fn warn(&mut self, what: &dyn std::fmt::Display) {
        if self.0.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            tracing::warn!("{what}");
            self.0 = Some(tokio::time::Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn listen(limits: Limits) -> (std::net::SocketAddr, impl Stream<Item = io::Result<Admitted<TcpStream>>>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        (addr, Box::pin(plain(tokio_stream::wrappers::TcpListenerStream::new(l), limits)))
    }

    /// The preface and an empty SETTINGS frame, as an HTTP/2 client starts.
    fn hello() -> Vec<u8> {
        [&PREFACE[..], &[0, 0, 0, SETTINGS, 0, 0, 0, 0, 0]].concat()
    }

    async fn talker(addr: std::net::SocketAddr) -> TcpStream {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&hello()).await.unwrap();
        s
    }

    /// Whether `s` was closed by the listener within 10 s.
    async fn closed(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), AsyncReadExt::read(s, &mut buf)).await;
        matches!(read, Ok(Ok(0) | Err(_)))
    }

    #[tokio::test]
    async fn idle_connects_are_evicted_and_a_talking_peer_still_gets_in() {
        let limits = Limits { pending_per_peer: 4, pending_total: 8, ..Limits::default() };
        let (addr, mut admitted) = listen(limits).await;
        let mut idle = Vec::new();
        for _ in 0..200 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let _client = talker(addr).await;
        let got = tokio::time::timeout(Duration::from_secs(5), admitted.next()).await;
        assert!(matches!(got, Ok(Some(Ok(_)))), "the talking peer was not admitted behind 200 idle connects");
    }

    /// Per peer and in total alike: a third connection over a cap of two
    /// is closed, and one closed frees its slot.
    #[tokio::test]
    async fn a_connection_over_a_cap_is_closed_and_a_closed_one_frees_its_slot() {
        let caps = [
            ("per peer", Limits { open_per_peer: 2, ..Limits::default() }),
            ("in total", Limits { open_total: 2, ..Limits::default() }),
        ];
        for (cap, limits) in caps {
            let (addr, mut admitted) = listen(limits).await;
            let mut held = Vec::new();
            for _ in 0..2 {
                let c = talker(addr).await;
                held.push((c, admitted.next().await.unwrap().unwrap()));
            }
            let mut third = talker(addr).await;
            let refused = tokio::time::timeout(Duration::from_millis(300), admitted.next()).await;
            assert!(refused.is_err(), "a third connection over a cap of 2 {cap} was admitted");
            assert!(closed(&mut third).await, "a third connection over a cap of 2 {cap} was not closed");
            drop(held.pop());
            let _fourth = talker(addr).await;
            let got = tokio::time::timeout(Duration::from_secs(5), admitted.next()).await;
            assert!(matches!(got, Ok(Some(Ok(_)))), "a closed connection did not free its slot {cap}");
        }
    }

    #[tokio::test]
    async fn a_connection_that_stays_silent_is_closed_after_the_timeout() {
        let limits = Limits { handshake_timeout: Duration::from_millis(200), ..Limits::default() };
        let (addr, _admitted) = listen(limits).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        assert!(closed(&mut silent).await, "the silent connection was not closed");
    }

    /// One byte (or most of the preface) and a wait is not a client: it
    /// stays pending, is never established, and is closed on time.
    #[tokio::test]
    async fn a_connection_that_sends_part_of_the_preface_is_never_established() {
        let limits = Limits { handshake_timeout: Duration::from_millis(300), ..Limits::default() };
        let (addr, mut admitted) = listen(limits).await;
        for sent in [&b"P"[..], &hello()[..30]] {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(sent).await.unwrap();
            let got = tokio::time::timeout(Duration::from_millis(600), admitted.next()).await;
            assert!(got.is_err(), "{} bytes of the preface were admitted", sent.len());
            assert!(closed(&mut s).await, "{} bytes of the preface: not closed after the timeout", sent.len());
        }
    }

    #[tokio::test]
    async fn a_connection_that_speaks_something_else_is_closed_at_once() {
        let (addr, mut admitted) = listen(Limits::default()).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let started = std::time::Instant::now();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
        assert!(read.is_ok(), "an HTTP/1 request on an HTTP/2 listener was not closed");
        assert_eq!(answer, NOT_HTTP2, "it is told, in HTTP/2, that it is not HTTP/2");
        assert!(started.elapsed() < Duration::from_secs(4), "closed only by the timeout");
        let got = tokio::time::timeout(Duration::from_millis(300), admitted.next()).await;
        assert!(got.is_err(), "it was admitted");
    }

    /// The server reads what admission read, then the rest, in order.
    #[tokio::test]
    async fn an_admitted_connection_reads_the_preface_again() {
        let (addr, mut admitted) = listen(Limits::default()).await;
        let mut s = talker(addr).await;
        s.write_all(b"and more").await.unwrap();
        let mut conn = admitted.next().await.unwrap().unwrap();
        let mut got = vec![0u8; hello().len() + 8];
        conn.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [hello(), b"and more".to_vec()].concat());
    }

    #[test]
    fn caps_fit_the_descriptor_limit_and_are_never_raised() {
        let l = Limits { open_total: 4096, pending_total: 1024, ..Limits::default() };
        assert!(l.fit(1 << 20, 3).is_none(), "a high limit leaves them as they are");
        // 1,024 descriptors (a common soft default), two listeners: each gets (1024 - 512) / 2.
        let fitted = l.fit(1024, 2).expect("lowered");
        assert_eq!((fitted.pending_total, fitted.open_total), (51, 256 - 51));
        let fitted = l.fit(DESCRIPTOR_RESERVE + 2 * 5000, 2).expect("lowered");
        assert_eq!((fitted.pending_total, fitted.open_total), (1000, 4000));
        let small = Limits { open_total: 100, ..l };
        let fitted = small.fit(1024, 2).expect("pending lowered");
        assert_eq!((fitted.pending_total, fitted.open_total), (51, 100), "open_total is never raised");
    }

    #[test]
    fn a_peer_is_an_ipv4_address_or_an_ipv6_64() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(peer_of(ip("2001:db8:1:2:aaaa::1")), peer_of(ip("2001:db8:1:2:bbbb::2")));
        assert_eq!(peer_of(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_ne!(peer_of(ip("2001:db8:1:2::1")), peer_of(ip("2001:db8:1:3::1")));
        assert_eq!(peer_of(ip("::ffff:192.0.2.7")), ip("192.0.2.7"));
        assert_ne!(peer_of(ip("192.0.2.7")), peer_of(ip("192.0.2.8")));
    }
}
