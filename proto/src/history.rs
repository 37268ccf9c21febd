//! DELTA history delivery's one typed error: the `history_gap` status
//! detail, a `HistoryGap` packed as an Any in a google.rpc.Status
//! (`grpc-status-details-bin`), so engines in any language can use their
//! standard rich-error helpers.

use prost::Message as _;
use tonic::{Code, Status};

use crate::pb;

/// The Any type URL of [`pb::HistoryGap`].
pub const HISTORY_GAP_TYPE_URL: &str = "type.googleapis.com/contextengine.v1.HistoryGap";

/// FAILED_PRECONDITION carrying a HistoryGap: "I do not hold the cursor";
/// `held` is what the engine does hold, when it knows.
pub fn gap_status(held: Option<pb::HistoryCursor>) -> Status {
    let message = "history gap: the engine does not hold the cursor; resend the history";
    let details = pb::RpcStatus {
        code: Code::FailedPrecondition as i32,
        message: message.into(),
        details: vec![pb::AnyDetail {
            type_url: HISTORY_GAP_TYPE_URL.into(),
            value: pb::HistoryGap { held }.encode_to_vec(),
        }],
    };
    Status::with_details(Code::FailedPrecondition, message, details.encode_to_vec().into())
}

/// The HistoryGap a status carries, if it is one (FAILED_PRECONDITION with
/// the typed detail; the message text is never looked at).
pub fn gap_of(s: &Status) -> Option<pb::HistoryGap> {
    if s.code() != Code::FailedPrecondition || s.details().is_empty() {
        return None;
    }
    let status = pb::RpcStatus::decode(s.details()).ok()?;
    let any = status.details.iter().find(|d| d.type_url == HISTORY_GAP_TYPE_URL)?;
    pb::HistoryGap::decode(any.value.as_slice()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_round_trips_and_plain_preconditions_are_not_gaps() {
        let held = pb::HistoryCursor { message_id: "m7".into(), seq: 7, message_count: 7, tokens: 70 };
        let s = gap_status(Some(held.clone()));
        assert_eq!(gap_of(&s).and_then(|g| g.held), Some(held));
        assert!(gap_of(&Status::failed_precondition("history gap")).is_none(), "text is not a detail");
        assert!(gap_of(&Status::internal("x")).is_none());
    }
}
