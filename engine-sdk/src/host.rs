//! The engine's side of the `Host` service: callbacks into the gateway,
//! authorised by the grant that came with the current call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio_stream::StreamExt;
use tonic::transport::Channel;

use crate::endpoint::{Endpoint, channel};
use crate::limits::MAX_GRPC_MESSAGE_BYTES;
use crate::pb::{self, host_client::HostClient as RawHostClient};
use crate::{CallContext, EngineError};

/// Host operations a grant can allow.
pub const READ_TRANSCRIPT: &str = "read_transcript";
pub const LLM_COMPLETE: &str = "llm_complete";

/// Calls the gateway back during one engine call. Built by the server from
/// the request's `HostAccess`; every request carries the grant token and is
/// bounded by the engine call's own deadline.
#[derive(Clone, Debug)]
pub struct HostClient {
    client: RawHostClient<Channel>,
    grant: pb::Grant,
}

impl HostClient {
    /// Whether the grant allows `operation` and has not expired.
    pub fn allows(&self, operation: &str) -> bool {
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        self.grant.operations.iter().any(|o| o == operation)
            && (self.grant.expires_at_unix_ms == 0 || self.grant.expires_at_unix_ms > now_ms)
    }

    /// The session the grant is scoped to.
    pub fn session_id(&self) -> &str {
        &self.grant.session_id
    }

    /// The whole transcript of the grant's session (or only its visible
    /// history), collected from the stream.
    pub async fn read_transcript(
        &self,
        ctx: &CallContext,
        visible_only: bool,
    ) -> Result<Vec<pb::TranscriptEntry>, EngineError> {
        const OP: &str = "ReadTranscript";
        if !self.allows(READ_TRANSCRIPT) {
            return Err(EngineError::NotGranted(READ_TRANSCRIPT));
        }
        let req = pb::ReadTranscriptRequest {
            grant: self.grant.token.clone(),
            session_id: self.grant.session_id.clone(),
            visible_only,
            ..Default::default()
        };
        let host_err = |status| host_error(ctx, OP, status);
        let mut stream = self.client.clone().read_transcript(bounded(ctx, req)).await.map_err(host_err)?.into_inner();
        let mut entries = Vec::new();
        while let Some(chunk) = stream.next().await {
            ctx.check()?;
            entries.extend(chunk.map_err(host_err)?.entries);
        }
        Ok(entries)
    }

    /// One completion from the host's model.
    pub async fn llm_complete(
        &self,
        ctx: &CallContext,
        mut req: pb::LlmCompleteRequest,
    ) -> Result<pb::LlmCompleteResult, EngineError> {
        if !self.allows(LLM_COMPLETE) {
            return Err(EngineError::NotGranted(LLM_COMPLETE));
        }
        req.grant = self.grant.token.clone();
        let mut client = self.client.clone();
        let call = client.llm_complete(bounded(ctx, req));
        // Dropping the call on cancellation resets the stream: the host sees it.
        tokio::select! {
            r = call => r.map(tonic::Response::into_inner).map_err(|status| host_error(ctx, "LlmComplete", status)),
            _ = ctx.cancellation().cancelled() => Err(EngineError::Cancelled),
        }
    }
}

/// A callback that failed because the engine call's own deadline passed is
/// that deadline, not a host fault: the engine must not go on as if the
/// host had merely refused.
fn host_error(ctx: &CallContext, operation: &'static str, status: tonic::Status) -> EngineError {
    if ctx.remaining().is_some_and(|left| left.is_zero()) {
        EngineError::DeadlineExceeded
    } else if status.code() == tonic::Code::Unimplemented {
        // The host does not offer it (e.g. no model for summaries): the
        // engine does the work itself.
        EngineError::Unimplemented(operation)
    } else {
        EngineError::Host { operation, status }
    }
}

fn bounded<T>(ctx: &CallContext, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Some(left) = ctx.remaining() {
        req.set_timeout(left);
    }
    req
}

/// Channels to host endpoints, shared by all calls of one server so each
/// call does not open a new connection.
#[derive(Default, Debug)]
pub(crate) struct HostChannels {
    channels: Mutex<HashMap<String, Channel>>,
}

impl HostChannels {
    /// A client for `access`, or `None` when the call carries no usable grant.
    pub(crate) fn client(self: &Arc<Self>, access: Option<&pb::HostAccess>) -> Option<HostClient> {
        let access = access?;
        let grant = access.grant.clone().filter(|g| !g.token.is_empty())?;
        let endpoint: Endpoint = access.endpoint.parse().ok()?;
        let channel = {
            let mut map = self.channels.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(access.endpoint.clone()).or_insert_with(|| channel(&endpoint)).clone()
        };
        let client = RawHostClient::new(channel)
            .max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES);
        Some(HostClient { client, grant })
    }
}
