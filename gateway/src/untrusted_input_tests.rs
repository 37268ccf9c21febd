//! Property tests over untrusted input: whatever bytes a client or an
//! engine sends, decoding and validating them never panics, and what
//! validation accepts is within the contract's limits.

use ctxgate_proto::pb::{self, AgentMessage, ContentPart, content_part::Part};
use ctxgate_proto::{history, limits, validate};
use proptest::prelude::*;
use prost::Message as _;

fn part() -> impl Strategy<Value = ContentPart> {
    let text = ".{0,64}";
    prop_oneof![
        text.prop_map(|t| ContentPart { part: Some(Part::Text(t)) }),
        (text, text, text).prop_map(|(id, name, args)| ContentPart {
            part: Some(Part::ToolCall(pb::ToolCall { id, name, arguments_json: args }))
        }),
        (text, text, text, any::<bool>()).prop_map(|(id, name, out, e)| ContentPart {
            part: Some(Part::ToolResult(pb::ToolResult { tool_call_id: id, tool_name: name, text: out, is_error: e }))
        }),
        Just(ContentPart { part: None }),
    ]
}

fn message() -> impl Strategy<Value = AgentMessage> {
    (
        ".{0,300}",
        -2i32..8,
        proptest::collection::vec(part(), 0..4),
        proptest::collection::btree_map(".{0,8}", ".{0,8}", 0..3),
    )
        .prop_map(|(id, role, content, metadata)| AgentMessage {
            id,
            role,
            content,
            metadata: metadata.into_iter().collect(),
            ..Default::default()
        })
}

pub(crate) fn usage_count() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(u64::MAX),
        Just(limits::MAX_USAGE_TOKENS),
        Just(limits::MAX_USAGE_TOKENS + 1),
        any::<u64>(),
        0..10_000u64
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A peer's usage counts, u64::MAX among them, through every sum a turn
    /// makes of them: validation refuses what is over the limit, the
    /// estimate clamps, and no sum overflows (debug builds would panic) or
    /// wraps below what a single message claims.
    #[test]
    fn usage_counts_never_overflow_a_sum(counts in proptest::collection::vec(usage_count(), 0..64)) {
        let messages: Vec<AgentMessage> = counts
            .iter()
            .enumerate()
            .map(|(i, n)| AgentMessage {
                id: format!("m{i}"),
                role: pb::Role::Assistant as i32,
                usage: Some(pb::Usage { output_tokens: Some(*n), total_tokens: Some(*n), ..Default::default() }),
                ..Default::default()
            })
            .collect();
        for (m, n) in messages.iter().zip(&counts) {
            prop_assert_eq!(validate::message(m, "m").is_ok(), *n <= limits::MAX_USAGE_TOKENS);
        }
        let total = ctxgate_proto::estimate::messages_tokens(&messages);
        let largest = counts.iter().map(|n| (*n).min(limits::MAX_USAGE_TOKENS)).max().unwrap_or(0);
        prop_assert!(total >= largest, "the total wrapped below one message's count");
    }

    /// Engine replies and requests as raw bytes: decode, then validate.
    #[test]
    fn arbitrary_bytes_never_panic_the_decoders_or_the_checks(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        if let Ok(r) = pb::AssembleResult::decode(bytes.as_slice()) {
            let _ = validate::result::assemble(&r, 3);
        }
        if let Ok(r) = pb::MaintainResult::decode(bytes.as_slice()) {
            let _ = validate::result::maintain(&r);
        }
        if let Ok(r) = pb::CommitTurnResult::decode(bytes.as_slice()) {
            let _ = validate::result::commit_turn(&r);
        }
        if let Ok(i) = pb::EngineInfo::decode(bytes.as_slice()) {
            let _ = validate::result::info(&i);
        }
        if let Ok(r) = pb::CommitTurnRequest::decode(bytes.as_slice()) {
            let _ = validate::request::commit_turn(&r);
        }
        if let Ok(r) = pb::AssembleRequest::decode(bytes.as_slice()) {
            let _ = validate::request::assemble(&r);
        }
        // A status whose details are garbage is simply not a gap.
        let s = tonic::Status::with_details(tonic::Code::FailedPrecondition, "x", bytes.clone().into());
        let _ = history::gap_of(&s);
    }

    /// Messages a client or an engine builds: the checks never panic, and
    /// an accepted message is within the content and id limits.
    #[test]
    fn accepted_messages_are_within_the_limits(list in proptest::collection::vec(message(), 0..6)) {
        for (i, m) in list.iter().enumerate() {
            let field = format!("messages[{i}]");
            let accepted = validate::message(m, &field).is_ok();
            let by_client = crate::core::check_client_message(m, &field).is_ok();
            if accepted {
                prop_assert!(validate::content_bytes(m) <= limits::MAX_MESSAGE_CONTENT_BYTES);
                prop_assert!(!m.id.trim().is_empty() && m.id.len() <= limits::MAX_ID_BYTES);
            }
            if by_client {
                prop_assert!(m.metadata.len() <= 64);
            }
        }
        let _ = validate::messages(&list, "messages");
        let _ = validate::tool_pairs(&list, "messages");
    }
}
