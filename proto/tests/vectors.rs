//! The shared validation vectors (`proto/testdata/`) against this crate's
//! validation: every request and result is accepted or refused exactly as
//! the vector says, with the status code and the field path.

#![allow(clippy::unwrap_used)] // a test fails loudly

use ctxgate_proto::pb;
use ctxgate_proto::validate;
use serde_json::Value;

fn load(file: &str) -> Vec<Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join(file);
    let Value::Array(cases) = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap() else {
        panic!("{file} holds an array");
    };
    cases
}

/// Expands `{"$repeat": s, "times": n, "then"?: t}` into its string.
fn expand(v: Value) -> Value {
    match v {
        Value::Object(mut o) if o.contains_key("$repeat") => {
            let s = o.remove("$repeat").unwrap();
            let n = o.remove("times").and_then(|n| n.as_u64()).unwrap() as usize;
            let then = o.remove("then").map(|t| t.as_str().unwrap().to_owned()).unwrap_or_default();
            Value::String(s.as_str().unwrap().repeat(n) + &then)
        }
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, expand(v))).collect()),
        Value::Array(a) => Value::Array(a.into_iter().map(expand).collect()),
        other => other,
    }
}

fn decode<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(expand(v.clone())).unwrap()
}

fn request(method: &str, v: &Value) -> validate::Result {
    use validate::request as r;
    match method {
        "Bootstrap" => r::bootstrap(&decode::<pb::BootstrapRequest>(v)),
        "Ingest" => r::ingest(&decode::<pb::IngestRequest>(v)),
        "IngestBatch" => r::ingest_batch(&decode::<pb::IngestBatchRequest>(v)),
        "Assemble" => r::assemble(&decode::<pb::AssembleRequest>(v)),
        "Compact" => r::compact(&decode::<pb::CompactRequest>(v)),
        "AfterTurn" => r::after_turn(&decode::<pb::AfterTurnRequest>(v)),
        "CommitTurn" => r::commit_turn(&decode::<pb::CommitTurnRequest>(v)),
        "Maintain" => r::maintain(&decode::<pb::MaintainRequest>(v)),
        "PrepareSubagentSpawn" => r::prepare_subagent_spawn(&decode::<pb::PrepareSubagentSpawnRequest>(v)),
        "RollbackSubagentSpawn" => r::rollback_subagent_spawn(&decode::<pb::RollbackSubagentSpawnRequest>(v)),
        "OnSubagentEnded" => r::on_subagent_ended(&decode::<pb::OnSubagentEndedRequest>(v)),
        "ForgetSession" => r::forget_session(&decode::<pb::ForgetSessionRequest>(v)),
        "CallTool" => r::call_tool(&decode::<pb::CallToolRequest>(v)),
        other => panic!("no request check for {other}"),
    }
}

fn result(method: &str, v: &Value, request_messages: usize) -> validate::Result {
    use validate::result as r;
    match method {
        "GetInfo" => r::info(&decode::<pb::EngineInfo>(v)),
        "Assemble" => r::assemble(&decode::<pb::AssembleResult>(v), request_messages),
        "CommitTurn" => r::commit_turn(&decode::<pb::CommitTurnResult>(v)),
        "Maintain" => r::maintain(&decode::<pb::MaintainResult>(v)),
        "CallTool" => r::call_tool(&decode::<pb::CallToolResult>(v)),
        other => panic!("no result check for {other}"),
    }
}

/// Where the vector and `got` disagree; `None` when they agree.
fn disagreement(case: &Value, got: validate::Result) -> Option<String> {
    let name = case["name"].as_str().unwrap();
    let expect = &case["expect"];
    match (got, expect["ok"].as_bool().unwrap_or(false)) {
        (Ok(()), true) => None,
        (Ok(()), false) => Some(format!("{name}: accepted, the vector refuses it ({expect})")),
        (Err(v), true) => Some(format!("{name}: refused ({v}), the vector accepts it")),
        (Err(v), false) => {
            let code = match tonic::Status::from(v.clone()).code() {
                tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
                tonic::Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
                other => panic!("{name}: a violation maps to {other:?}"),
            };
            let same = code == expect["code"] && v.field == expect["field"];
            (!same).then(|| format!("{name}: refused as {code} at {:?} ({v}), the vector says {expect}", v.field))
        }
    }
}

#[test]
fn every_request_vector_is_accepted_or_refused_as_it_says() {
    let cases = load("requests.json");
    assert!(cases.len() >= 40, "the vectors are all there");
    let problems: Vec<String> =
        cases.iter().filter_map(|c| disagreement(c, request(c["method"].as_str().unwrap(), &c["request"]))).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_result_vector_is_accepted_or_refused_as_it_says() {
    let cases = load("results.json");
    assert!(cases.len() >= 30, "the vectors are all there");
    let problems: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            let n = c["requestMessages"].as_u64().unwrap_or(0) as usize;
            disagreement(c, result(c["method"].as_str().unwrap(), &c["result"], n))
        })
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_budget_vector_keeps_what_it_says() {
    let cases = load("budget.json");
    assert!(cases.len() >= 10, "the vectors are all there");
    let problems: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            let messages: Vec<pb::AgentMessage> = decode(&c["messages"]);
            let (kept, tokens) = ctxgate_proto::estimate::fit_budget(&messages, c["budget"].as_u64());
            let kept: Vec<&str> = kept.iter().map(|m| m.id.as_str()).collect();
            let want: Vec<&str> = c["kept"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
            let want_tokens = c["estimatedTokens"].as_u64().unwrap();
            (kept != want || tokens != want_tokens).then(|| {
                format!("{}: kept {kept:?} ({tokens} tokens), the vector says {want:?} ({want_tokens})", c["name"])
            })
        })
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
