//! What an engine answers, as the gateway checks it before use: the first
//! byte picks the reply type, the rest is its protobuf body (for a status,
//! the `grpc-status-details-bin` bytes of a history gap). Checks answer Ok
//! or a violation, never panic.
#![no_main]

use ctxgate_proto::pb;
use ctxgate_proto::validate::result as v;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Some((&kind, body)) = data.split_first() else { return };
    match kind % 5 {
        0 => {
            if let Ok(i) = pb::EngineInfo::decode(body) {
                let _ = v::info(&i);
            }
        }
        1 => {
            if let Ok(r) = pb::AssembleResult::decode(body) {
                let requested = body.len() % 7;
                let _ = v::assemble(&r, requested);
            }
        }
        2 => {
            if let Ok(r) = pb::CommitTurnResult::decode(body) {
                let _ = v::commit_turn(&r);
            }
        }
        3 => {
            if let Ok(r) = pb::MaintainResult::decode(body) {
                let _ = v::maintain(&r);
            }
        }
        _ => {
            let status = tonic::Status::with_details(
                tonic::Code::FailedPrecondition,
                "history_gap",
                bytes::Bytes::copy_from_slice(body),
            );
            let _ = ctxgate_proto::history::gap_of(&status);
        }
    }
});
