//! Every engine request an SDK server decodes and validates before engine
//! code runs: the first byte picks the request type, the rest is its
//! protobuf body. Validation must answer Ok or a violation, never panic.
#![no_main]

use ctxgate_proto::pb;
use ctxgate_proto::validate::request as v;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn check<M: Message + Default>(body: &[u8], validate: impl Fn(&M) -> ctxgate_proto::validate::Result) {
    if let Ok(m) = M::decode(body) {
        let _ = validate(&m);
        // What the gateway sends is re-encodable to the same size.
        assert_eq!(m.encode_to_vec().len(), m.encoded_len());
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, body)) = data.split_first() else { return };
    match kind % 13 {
        0 => check::<pb::BootstrapRequest>(body, v::bootstrap),
        1 => check::<pb::IngestRequest>(body, v::ingest),
        2 => check::<pb::IngestBatchRequest>(body, v::ingest_batch),
        3 => check::<pb::AssembleRequest>(body, v::assemble),
        4 => check::<pb::CompactRequest>(body, v::compact),
        5 => check::<pb::AfterTurnRequest>(body, v::after_turn),
        6 => check::<pb::CommitTurnRequest>(body, v::commit_turn),
        7 => check::<pb::MaintainRequest>(body, v::maintain),
        8 => check::<pb::PrepareSubagentSpawnRequest>(body, v::prepare_subagent_spawn),
        9 => check::<pb::RollbackSubagentSpawnRequest>(body, v::rollback_subagent_spawn),
        10 => check::<pb::OnSubagentEndedRequest>(body, v::on_subagent_ended),
        11 => check::<pb::ForgetSessionRequest>(body, v::forget_session),
        _ => check::<pb::AssembleRequest>(body, |r| ctxgate_proto::validate::messages(&r.messages, "messages")),
    }
});
