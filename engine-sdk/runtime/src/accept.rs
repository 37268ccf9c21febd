//! Admitting connections. A listener on a network is open to peers that
//! connect and say nothing: each such connection costs a task and a file
//! descriptor, and enough of them would crowd out the peers that do talk.
//! So every connection starts *pending* (its TLS handshake, or for
//! plaintext the wait for its first byte) under a short timeout, with a cap
//! per peer address and one overall; a new connection over a cap evicts
//! the oldest pending one instead of being refused, so a flood of idle
//! connects never keeps a real client, which finishes its handshake in
//! milliseconds, from getting in. Established connections are capped per
//! peer address; one more is closed at once.
//!
//! The gateway's listeners and the SDK's engine server both serve through
//! [`plain`] or [`tls`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

use crate::tls::LiveServerTls;

/// What one listener lets peers hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Established connections one peer address may hold; more are closed.
    pub open_per_peer: usize,
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
            pending_per_peer: 64,
            pending_total: 1024,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// An admitted connection: its slot in the peer's count is given back
/// when it closes.
pub struct Admitted<IO> {
    io: IO,
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
        Pin::new(&mut self.io).poll_read(cx, buf)
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

/// The plaintext connections of `tcp` (pending until their first byte).
pub fn plain<S>(tcp: S, limits: Limits) -> impl Stream<Item = io::Result<Admitted<TcpStream>>> + Send + 'static
where
    S: Stream<Item = io::Result<TcpStream>> + Send + Unpin + 'static,
{
    admit(tcp, limits, |conn: TcpStream| async move {
        // A peek, not `readable()`: a new socket may report itself readable
        // before any byte has come.
        conn.peek(&mut [0u8; 1]).await?;
        Ok(conn)
    })
}

/// The TLS connections of `tcp` (pending until their handshake is done),
/// each with the configuration current when it was accepted.
pub fn tls<S>(
    tcp: S,
    limits: Limits,
    live: LiveServerTls,
) -> impl Stream<Item = io::Result<Admitted<tokio_rustls::server::TlsStream<TcpStream>>>> + Send + 'static
where
    S: Stream<Item = io::Result<TcpStream>> + Send + Unpin + 'static,
{
    admit(tcp, limits, move |conn: TcpStream| live.acceptor().accept(conn))
}

/// Accepts from `tcp` in a task of its own, establishes each connection
/// in a task of its own (a slow peer holds up no one), and yields the
/// established ones. Ends when the server stops reading it.
fn admit<S, IO, F, Fut>(mut tcp: S, limits: Limits, establish: F) -> impl Stream<Item = io::Result<Admitted<IO>>>
where
    S: Stream<Item = io::Result<TcpStream>> + Send + Unpin + 'static,
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = io::Result<IO>> + Send + 'static,
    IO: Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let table = Arc::new(Mutex::new(Table::default()));
    tokio::spawn(async move {
        let mut warn = Warner::default();
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
                    warn.warn(&format_args!("accepting a connection failed: {e}"));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(peer) = conn.peer_addr().map(|a| canonical(a.ip())) else { continue };
            let pending = match lock(&table).enter(peer, &limits) {
                Entered::Refused => {
                    warn.warn(&format_args!("{peer} holds {} connections; closing its new ones", limits.open_per_peer));
                    continue;
                }
                Entered::Pending(p) => p,
            };
            let (tx, table, attempt) = (tx.clone(), table.clone(), establish(conn));
            tokio::spawn(async move {
                let outcome = tokio::select! {
                    r = tokio::time::timeout(limits.handshake_timeout, attempt) => r,
                    () = pending.evicted.cancelled() => return lock(&table).leave(pending.id, peer),
                };
                lock(&table).leave(pending.id, peer);
                match outcome {
                    Ok(Ok(io)) => {
                        let Some(slot) = OpenSlot::take(&table, peer, &limits) else { return };
                        let _ = tx.send(Ok(Admitted { io, _slot: slot })).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "connection failed before it was established"),
                    Err(_) => tracing::debug!(%peer, "connection not established in time; closed"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// An IPv4 peer connected over an IPv6 socket is the IPv4 peer.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
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
        let p = self.peers.entry(peer).or_default();
        if p.open >= limits.open_per_peer {
            return Entered::Refused;
        }
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
        let p = t.peers.entry(peer).or_default();
        if p.open >= limits.open_per_peer {
            t.forget_if_idle(peer);
            return None;
        }
        p.open += 1;
        Some(Self { table: table.clone(), peer })
    }
}

impl Drop for OpenSlot {
    fn drop(&mut self) {
        let mut t = lock(&self.table);
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
    use tokio::io::AsyncWriteExt;

    async fn listen(limits: Limits) -> (std::net::SocketAddr, impl Stream<Item = io::Result<Admitted<TcpStream>>>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        (addr, Box::pin(plain(tokio_stream::wrappers::TcpListenerStream::new(l), limits)))
    }

    async fn talker(addr: std::net::SocketAddr) -> TcpStream {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"x").await.unwrap();
        s
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

    #[tokio::test]
    async fn a_peer_over_its_open_connections_is_closed_and_a_closed_one_frees_its_slot() {
        let limits = Limits { open_per_peer: 2, ..Limits::default() };
        let (addr, mut admitted) = listen(limits).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let _c = talker(addr).await;
            held.push((_c, admitted.next().await.unwrap().unwrap()));
        }
        let _third = talker(addr).await;
        let refused = tokio::time::timeout(Duration::from_millis(300), admitted.next()).await;
        assert!(refused.is_err(), "a third connection from the same peer was admitted");
        drop(held.pop());
        let _fourth = talker(addr).await;
        let got = tokio::time::timeout(Duration::from_secs(5), admitted.next()).await;
        assert!(matches!(got, Ok(Some(Ok(_)))), "a closed connection did not free its slot");
    }

    #[tokio::test]
    async fn a_connection_that_stays_silent_is_closed_after_the_timeout() {
        let limits = Limits { handshake_timeout: Duration::from_millis(200), ..Limits::default() };
        let (addr, _admitted) = listen(limits).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read(&mut silent, &mut buf))
            .await
            .expect("the silent connection was not closed")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed: end of stream");
    }
}
