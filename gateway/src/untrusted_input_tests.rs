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

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

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
