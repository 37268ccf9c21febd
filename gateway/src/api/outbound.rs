//! Event streams to clients: bounded, in order, and never blocking the turn
//! that produces them. A client that reads slowly slows only its own
//! stream: while it is behind, events wait in a small backlog where model
//! text is merged, progress is dropped (later progress or the end
//! supersedes it), and the rest is kept up to a cap. A client so far behind
//! that the cap is reached loses its call (RESOURCE_EXHAUSTED, and the work
//! behind it is cancelled).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// What an event may become while the client is behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backlog {
    /// Must arrive (counted against the cap).
    Keep,
    /// May be folded into the event before it (`merge`).
    Merge,
    /// May be skipped: a later event supersedes it.
    Drop,
}

pub trait Event: Send + 'static {
    fn backlog(&self) -> Backlog;
    /// Folds `next` into `self`; gives it back when they do not fold (the
    /// default: nothing folds).
    fn merge(&mut self, next: Self) -> Option<Self>
    where
        Self: Sized,
    {
        Some(next)
    }
}

type Item<T> = Result<T, Status>;

struct Queue<T> {
    /// The client's stream; taken (so the stream ends) after an error is
    /// sent or once every producer is gone and the backlog is out.
    tx: Option<mpsc::Sender<Item<T>>>,
    items: VecDeque<Item<T>>,
    /// The flusher holds an item (the stream had no room for it).
    sending: bool,
    /// Nothing more is accepted: the stream ended or the client left.
    closed: bool,
    /// Every producer handle is gone.
    finished: bool,
}

struct Inner<T> {
    queue: Mutex<Queue<T>>,
    wake: Notify,
    drained: Notify,
    max_backlog: usize,
    /// Fired when the client falls too far behind.
    on_overflow: CancellationToken,
}

impl<T> Inner<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<T>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Marks the stream finished when the last producer handle goes.
struct Producers<T>(Arc<Inner<T>>);

impl<T> Drop for Producers<T> {
    fn drop(&mut self) {
        self.0.lock().finished = true;
        self.0.wake.notify_one();
    }
}

/// The sending side of one client stream (cheap to clone).
pub struct Outbound<T> {
    inner: Arc<Inner<T>>,
    _producers: Arc<Producers<T>>,
}

impl<T> Clone for Outbound<T> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), _producers: self._producers.clone() }
    }
}

impl<T: Event> Outbound<T> {
    /// A stream with `capacity` events in flight and `max_backlog` kept
    /// events waiting behind them; `on_overflow` is cancelled if the client
    /// falls further behind. The stream ends after an error, or once every
    /// handle is dropped and the backlog is delivered.
    pub fn new(capacity: usize, max_backlog: usize, on_overflow: CancellationToken) -> (Self, ReceiverStream<Item<T>>) {
        let (tx, rx) = mpsc::channel(capacity);
        let inner = Arc::new(Inner {
            queue: Mutex::new(Queue {
                tx: Some(tx),
                items: VecDeque::new(),
                sending: false,
                closed: false,
                finished: false,
            }),
            wake: Notify::new(),
            drained: Notify::new(),
            max_backlog,
            on_overflow,
        });
        tokio::spawn(flush(inner.clone()));
        let producers = Arc::new(Producers(inner.clone()));
        (Self { inner, _producers: producers }, ReceiverStream::new(rx))
    }

    /// Queues an event; never waits.
    pub fn push(&self, event: T) {
        self.enqueue(Ok(event), false);
    }

    /// Queues an event that must arrive (never dropped or merged).
    pub fn push_kept(&self, event: T) {
        self.enqueue(Ok(event), true);
    }

    /// Ends the stream with `status` after what is queued.
    pub fn fail(&self, status: Status) {
        self.enqueue(Err(status), true);
    }

    fn enqueue(&self, item: Item<T>, kept: bool) {
        let mut q = self.inner.lock();
        if q.closed {
            return;
        }
        let ends = item.is_err();
        let kept = kept || ends;
        let backlog = match (&item, kept) {
            (Ok(e), false) => e.backlog(),
            _ => Backlog::Keep,
        };
        if q.items.is_empty() && !q.sending {
            let Some(tx) = &q.tx else { return };
            match tx.try_send(item) {
                Ok(()) => {
                    if ends {
                        q.closed = true;
                        q.tx = None;
                        self.inner.wake.notify_one();
                    }
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    q.closed = true;
                    q.tx = None;
                    self.inner.wake.notify_one();
                    return;
                }
                Err(mpsc::error::TrySendError::Full(item)) => {
                    if backlog != Backlog::Drop {
                        q.closed = ends;
                        q.items.push_back(item);
                        self.inner.wake.notify_one();
                    }
                    return;
                }
            }
        }
        let item = match (backlog, item, q.items.back_mut()) {
            (Backlog::Drop, _, _) => return,
            (Backlog::Merge, Ok(e), Some(Ok(last))) => match last.merge(e) {
                None => return,
                Some(e) => Ok(e),
            },
            (_, item, _) => item,
        };
        // Events that must arrive (a turn's end, an answer, an error) are
        // never refused: at most a few per call.
        if !kept && q.items.len() >= self.inner.max_backlog {
            // Too far behind: the call ends (the error replaces the backlog
            // it gives up), and the work behind it stops.
            q.items.clear();
            q.items
                .push_back(Err(Status::resource_exhausted("the client does not read its events: the call was ended")));
            q.closed = true;
            self.inner.on_overflow.cancel();
        } else {
            q.closed = ends;
            q.items.push_back(item);
        }
        self.inner.wake.notify_one();
    }

    /// Waits until everything queued so far has been handed to the client's
    /// stream (its buffer had room). False if the client went away.
    pub async fn drained(&self) -> bool {
        loop {
            let notified = self.inner.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let q = self.inner.lock();
                if q.items.is_empty() && !q.sending {
                    return q.tx.as_ref().is_some_and(|t| !t.is_closed());
                }
            }
            notified.await;
        }
    }
}

/// Moves the backlog into the client's stream as it makes room.
async fn flush<T>(inner: Arc<Inner<T>>) {
    loop {
        let next = {
            let mut q = inner.lock();
            match (q.items.pop_front(), q.tx.clone()) {
                (Some(item), Some(tx)) => {
                    q.sending = true;
                    Some((item, tx))
                }
                (_, tx) => {
                    q.items.clear();
                    q.sending = false;
                    let done = tx.is_none() || q.finished || q.closed;
                    if done {
                        q.tx = None;
                    }
                    drop(q);
                    inner.drained.notify_waiters();
                    if done {
                        return;
                    }
                    None
                }
            }
        };
        match next {
            Some((item, tx)) => {
                let ends = item.is_err();
                let sent = tx.send(item).await.is_ok();
                drop(tx);
                let mut q = inner.lock();
                q.sending = false;
                if !sent || ends {
                    q.closed = true;
                    q.items.clear();
                    q.tx = None;
                    drop(q);
                    inner.drained.notify_waiters();
                    return;
                }
            }
            None => inner.wake.notified().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    #[derive(Debug, PartialEq)]
    enum E {
        Text(String),
        Progress(u32),
        Mark(u32),
    }

    impl Event for E {
        fn backlog(&self) -> Backlog {
            match self {
                E::Text(_) => Backlog::Merge,
                E::Progress(_) => Backlog::Drop,
                E::Mark(_) => Backlog::Keep,
            }
        }

        fn merge(&mut self, next: Self) -> Option<Self> {
            match (self, next) {
                (E::Text(a), E::Text(b)) => {
                    a.push_str(&b);
                    None
                }
                (_, next) => Some(next),
            }
        }
    }

    #[tokio::test]
    async fn a_slow_reader_gets_everything_in_order_merged_and_never_blocks_the_producer() {
        let stop = CancellationToken::new();
        let (out, mut rx) = Outbound::<E>::new(2, 8, stop.clone());
        // Nobody reads while the producer runs: it never waits.
        out.push(E::Mark(0));
        for i in 0..1000 {
            out.push(E::Text(format!("{i} ")));
            out.push(E::Progress(i));
        }
        out.push(E::Mark(1));
        let mut got = Vec::new();
        let drained = out.drained();
        tokio::pin!(drained);
        loop {
            tokio::select! {
                e = rx.next() => got.push(e.unwrap().unwrap()),
                ok = &mut drained => { assert!(ok); break; }
            }
        }
        while let Ok(Some(e)) = tokio::time::timeout(std::time::Duration::from_millis(50), rx.next()).await {
            got.push(e.unwrap());
        }
        assert_eq!(got.first(), Some(&E::Mark(0)));
        assert_eq!(got.last(), Some(&E::Mark(1)));
        let text: String =
            got.iter().filter_map(|e| if let E::Text(t) = e { Some(t.as_str()) } else { None }).collect();
        let want: String = (0..1000).map(|i| format!("{i} ")).collect();
        assert_eq!(text, want, "no text lost, in order");
        assert!(got.len() < 100, "merged while behind: {} events", got.len());
        assert!(!stop.is_cancelled());
    }

    #[tokio::test]
    async fn a_client_too_far_behind_loses_the_call() {
        let stop = CancellationToken::new();
        let (out, mut rx) = Outbound::<E>::new(1, 3, stop.clone());
        for i in 0..10 {
            out.push(E::Mark(i));
        }
        assert!(stop.is_cancelled(), "the work behind the call is stopped");
        let mut last = None;
        while let Some(item) = rx.next().await {
            last = Some(item);
        }
        assert_eq!(last.unwrap().unwrap_err().code(), tonic::Code::ResourceExhausted);
    }
}
