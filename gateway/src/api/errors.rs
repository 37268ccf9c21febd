//! What every error response gets at the boundary, on both listeners:
//!
//! - RESOURCE_EXHAUSTED for a request over a decode limit (tonic answers
//!   OUT_OF_RANGE; the contract says RESOURCE_EXHAUSTED for every size
//!   limit);
//! - an error id, as `ctxgate-error-id` metadata, and one log line with the
//!   same id, the method, the code and the (escaped, capped) message — so a
//!   client quoting the id finds the line. Where a mapping kept the detail
//!   from the client (a store or model failure), it logged the detail under
//!   an id first ([`hidden`]), and that id is the one the client gets.
//!
//! Only tonic's decode-limit error is rewritten (matched by its message): a
//! reply over the encode limit stays OUT_OF_RANGE, the gateway's fault. Errors before a stream's first message
//! are in the headers of a trailers-only response; errors after it (a
//! DriveTurn message over the limit), in the trailers: both are rewritten
//! and tagged.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::codegen::http::{self, HeaderMap, HeaderValue};

/// How tonic's decoder words a request message over the limit.
const DECODE_LIMIT: &str = "decoded message length too large";

/// The metadata key of an error id.
pub const ERROR_ID: &str = "ctxgate-error-id";

use crate::core::new_error_id as new_id;

/// `status` for a client, its `detail` logged (at ERROR) under a fresh id
/// the status carries: for failures whose detail must not reach the client.
pub fn hidden(mut status: Status, what: &str, detail: &dyn std::fmt::Display) -> Status {
    let id = new_id();
    tracing::error!(error_id = %id, detail = %crate::peer_text::capped(&detail.to_string(), 2_000), "{what}");
    if let Ok(v) = id.parse() {
        status.metadata_mut().insert(ERROR_ID, v);
    }
    status
}

/// The layer: see the module docs. Its log lines are budgeted: a peer
/// that sends thousands of refused calls a second costs a line a call only
/// up to [`LINES_PER_SECOND`]; the rest are counted, and the next line
/// says how many went unlogged. Each listener has its own layer, and
/// calls refused as UNAUTHENTICATED a budget of their own: a flood from
/// whoever lacks the token, or on the other listener, does not silence
/// the errors of the callers that have it.
#[derive(Clone, Default)]
pub struct ErrorResponses {
    lines: Arc<Budgets>,
}

#[derive(Default)]
struct Budgets {
    unauthenticated: std::sync::Mutex<LogBudget>,
    others: std::sync::Mutex<LogBudget>,
}

impl Budgets {
    /// [`LogBudget::take`] from the budget a `code` answer is logged in.
    fn take(&self, code: tonic::Code) -> Option<u64> {
        let budget = if code == tonic::Code::Unauthenticated { &self.unauthenticated } else { &self.others };
        budget.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Error lines logged one by one per second, at most.
pub const LINES_PER_SECOND: u32 = 100;

#[derive(Default)]
struct LogBudget {
    second: Option<tokio::time::Instant>,
    logged: u32,
    unlogged: u64,
}

impl LogBudget {
    /// Whether to log one more line now, and how many went unlogged
    /// before it.
    fn take(&mut self) -> Option<u64> {
        let now = tokio::time::Instant::now();
        if self.second.is_none_or(|s| now.duration_since(s) >= std::time::Duration::from_secs(1)) {
            self.second = Some(now);
            self.logged = 0;
        }
        if self.logged >= LINES_PER_SECOND {
            self.unlogged += 1;
            return None;
        }
        self.logged += 1;
        Some(std::mem::take(&mut self.unlogged))
    }
}

impl<S> tower::Layer<S> for ErrorResponses {
    type Service = Tagging<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Tagging { inner, lines: self.lines.clone() }
    }
}

#[derive(Clone)]
pub struct Tagging<S> {
    inner: S,
    lines: Arc<Budgets>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, ReqBody> tower::Service<http::Request<ReqBody>> for Tagging<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let call =
            Call { method: Arc::from(crate::peer_text::capped(req.uri().path(), 128)), lines: self.lines.clone() };
        let answered = self.inner.call(req);
        Box::pin(async move {
            let mut response = answered.await?;
            oversized_is_resource_exhausted(response.headers_mut());
            call.tag(response.headers_mut());
            Ok(response.map(|body| tonic::body::Body::new(Trailers { inner: body, call })))
        })
    }
}

/// The status code in `headers`, from `grpc-status` alone: the message is
/// percent-decoded only where it is read (most refusals of a flood are
/// neither rewritten nor logged).
fn code_of(headers: &HeaderMap) -> Option<tonic::Code> {
    // tonic's own reading of it: anything but "0"–"16" is UNKNOWN.
    headers.get("grpc-status").map(|v| tonic::Code::from_bytes(v.as_bytes()))
}

fn oversized_is_resource_exhausted(headers: &mut HeaderMap) {
    // A request over the decode limit only: tonic answers a reply over its
    // encode limit OUT_OF_RANGE too, and that is no client's excess.
    let over = code_of(headers) == Some(tonic::Code::OutOfRange)
        && Status::from_header_map(headers).is_some_and(|s| s.message().contains(DECODE_LIMIT));
    if over {
        headers.insert("grpc-status", HeaderValue::from(tonic::Code::ResourceExhausted as i32));
    }
}

/// The call a response answers, for its log line.
struct Call {
    method: Arc<str>,
    lines: Arc<Budgets>,
}

impl Call {
    /// An error status in `headers` gets an id (the one a mapping set, or
    /// a fresh one) and, within the budget, a log line.
    fn tag(&self, headers: &mut HeaderMap) {
        let Some(code) = code_of(headers).filter(|c| *c != tonic::Code::Ok) else { return };
        let id = match headers.get(ERROR_ID).and_then(|v| v.to_str().ok()) {
            Some(id) => id.to_owned(),
            None => {
                let id = new_id();
                if let Ok(v) = HeaderValue::from_str(&id) {
                    headers.insert(ERROR_ID, v);
                }
                id
            }
        };
        let Some(unlogged) = self.lines.take(code) else { return };
        let method = &*self.method;
        let status = Status::from_header_map(headers);
        let message = crate::peer_text::capped(status.as_ref().map_or("", Status::message), 300);
        match code {
            tonic::Code::Internal | tonic::Code::Unknown | tonic::Code::DataLoss | tonic::Code::Unavailable => {
                tracing::warn!(error_id = %id, method, ?code, message, unlogged, "call failed")
            }
            _ => tracing::info!(error_id = %id, method, ?code, message, unlogged, "call refused"),
        }
    }
}

/// A response body whose trailers (a stream's final status) get tagged.
struct Trailers {
    inner: tonic::body::Body,
    call: Call,
}

impl http_body::Body for Trailers {
    type Data = tonic::codegen::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(mut frame))) = polled {
            if let Some(trailers) = frame.trailers_mut() {
                // A stream's request message over the limit ends it here.
                oversized_is_resource_exhausted(trailers);
                self.call.tag(trailers);
            }
            return Poll::Ready(Some(Ok(frame)));
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_gets_an_id_once_and_an_oversized_request_resource_exhausted() {
        let status = |m: &str| {
            let mut h = HeaderMap::new();
            Status::out_of_range(m).add_header(&mut h).unwrap();
            oversized_is_resource_exhausted(&mut h);
            h
        };
        // A reply over the encode limit is the gateway's, not the client's.
        let mut h =
            status("Error, encoded message length too large: found 17000000 bytes, the limit is: 16777216 bytes");
        assert_eq!(h["grpc-status"], (tonic::Code::OutOfRange as i32).to_string().as_str());
        h = status("Error, decoded message length too large: found 20971542 bytes, the limit is: 16777216 bytes");
        assert_eq!(h["grpc-status"], (tonic::Code::ResourceExhausted as i32).to_string().as_str());
        let call = Call { method: Arc::from("/m"), lines: Arc::default() };
        call.tag(&mut h);
        let id = h[ERROR_ID].to_str().unwrap().to_owned();
        assert_eq!(id.len(), 16);
        call.tag(&mut h);
        assert_eq!(h[ERROR_ID], id.as_str(), "an id a mapping set is kept");
        let mut ok = HeaderMap::new();
        ok.insert("grpc-status", HeaderValue::from(0));
        call.tag(&mut ok);
        assert!(!ok.contains_key(ERROR_ID), "success has no error id");
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_errors_costs_a_bounded_number_of_lines_and_says_how_many_it_skipped() {
        let mut budget = LogBudget::default();
        let logged = (0..1_000).filter(|_| budget.take().is_some()).count();
        assert_eq!(logged, LINES_PER_SECOND as usize);
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        assert_eq!(budget.take(), Some(1_000 - u64::from(LINES_PER_SECOND)), "the next line counts the skipped");
        assert_eq!(budget.take(), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_without_the_token_leaves_the_other_errors_their_lines() {
        let budgets = Budgets::default();
        for _ in 0..1_000 {
            budgets.take(tonic::Code::Unauthenticated);
        }
        assert_eq!(budgets.take(tonic::Code::Unauthenticated), None, "its own budget is spent");
        assert_eq!(budgets.take(tonic::Code::InvalidArgument), Some(0), "a caller's refusal is still logged");
    }
}
