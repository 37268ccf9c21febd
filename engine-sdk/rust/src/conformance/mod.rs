//! The conformance kit: a black-box suite any engine, in any language, can
//! be run against (`ctxgate-conformance --endpoint URL`), in the spirit of
//! csi-sanity. Each case talks to the engine over real gRPC and reports
//! pass, fail or skip with a reason.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ctxgate_proto::Method;
use serde::Serialize;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use crate::pb::{self, context_engine_client::ContextEngineClient};
use crate::testkit::msg;
use ctxgate_runtime::{connect, engine_client};

mod cases;
mod tools;

/// How to run the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// `http://HOST:PORT`, `https://HOST:PORT` (with `tls`) or `unix:///PATH`.
    pub endpoint: String,
    /// A case that takes longer fails as hung.
    pub case_timeout: Duration,
    /// For an `https://` endpoint: what to trust and present.
    pub tls: Option<tonic::transport::ClientTlsConfig>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(tag = "outcome", content = "reason", rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    pub name: &'static str,
    #[serde(flatten)]
    pub outcome: Outcome,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub endpoint: String,
    pub cases: Vec<CaseReport>,
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
}

impl Report {
    /// One line per case, then `N passed, N failed, N skipped`.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for c in &self.cases {
            let line = match &c.outcome {
                Outcome::Pass => format!("pass  {}", c.name),
                Outcome::Fail(r) => format!("FAIL  {}: {r}", c.name),
                Outcome::Skip(r) => format!("skip  {}: {r}", c.name),
            };
            out.push_str(&line);
            out.push('\n');
        }
        out.push_str(&format!("{} passed, {} failed, {} skipped\n", self.passed, self.failed, self.skipped));
        out
    }

    pub fn outcome_of(&self, name: &str) -> Option<&Outcome> {
        self.cases.iter().find(|c| c.name == name).map(|c| &c.outcome)
    }
}

/// A case fails with a reason.
pub(super) type CaseResult = Result<Outcome, String>;
type CaseFn = for<'a> fn(&'a Kit) -> Pin<Box<dyn Future<Output = CaseResult> + Send + 'a>>;

macro_rules! case {
    ($name:literal, $f:ident) => {
        ($name, (|kit| Box::pin(cases::$f(kit))) as CaseFn)
    };
}

macro_rules! tool_case {
    ($name:literal, $f:ident) => {
        ($name, (|kit| Box::pin(tools::$f(kit))) as CaseFn)
    };
}

/// Every case, in the order they run.
pub const CASES: &[(&str, CaseFn)] = &[
    case!("health.check", health_check),
    case!("health.watch", health_watch),
    case!("reflection.lists_services", reflection_lists_services),
    case!("info.valid", info_valid),
    case!("info.id_not_reserved", info_id_not_reserved),
    case!("info.implemented_methods_match_behaviour", info_methods_match),
    case!("ingest.idempotent_by_message_id", ingest_idempotent),
    case!("assemble.answers_with_estimate", assemble_estimate),
    case!("assemble.keeps_message_order", assemble_order),
    case!("assemble.keeps_tool_pairs_under_budget", assemble_tool_pairs),
    case!("compact.stream_ends_with_one_terminal_event", compact_stream_shape),
    case!("commit_turn.committed_then_duplicate", commit_turn_idempotent),
    case!("forget_session.forgets_what_it_held", forget_session_forgets),
    case!("delta.assembles_from_the_cursor", delta_from_cursor),
    case!("delta.unknown_cursor_is_a_history_gap", delta_gap),
    case!("delta.resend_after_a_gap_is_accepted", delta_resend),
    case!("subagent.prepare_then_rollback_twice", subagent_rollback),
    tool_case!("tools.declared_valid", declared_valid),
    tool_case!("tools.unknown_tool_is_an_error_result", unknown_tool_is_an_error_result),
    tool_case!("tools.each_declared_tool_answers", each_declared_tool_answers),
    tool_case!("tools.deadline_and_cancel_leave_engine_healthy", deadline_and_cancel_leave_engine_healthy),
    case!("cancel.mid_flight_leaves_engine_healthy", cancel_mid_flight),
    case!("deadline.one_ms_leaves_engine_healthy", deadline_one_ms),
    case!("malformed.missing_session_id", malformed_missing_session),
    case!("malformed.missing_message", malformed_missing_message),
    case!("malformed.unknown_role", malformed_unknown_role),
    case!("malformed.tool_result_without_call_id", malformed_tool_result),
    case!("malformed.oversized_content", malformed_oversized),
];

/// Runs every case against `opts.endpoint`.
pub async fn run(opts: &Options) -> Result<Report, ctxgate_runtime::endpoint::BadEndpoint> {
    let channel = match (opts.endpoint.strip_prefix("https://"), &opts.tls) {
        (Some(address), Some(tls)) => {
            let bad = || ctxgate_runtime::endpoint::BadEndpoint { input: opts.endpoint.clone() };
            ctxgate_runtime::endpoint::tls_channel(&address.parse()?, tls.clone()).map_err(|_| bad())?
        }
        _ => connect(&opts.endpoint)?,
    };
    let mut kit = Kit { engine: engine_client(channel.clone()), channel, info: None };
    kit.info =
        kit.engine.clone().get_info(timed(pb::GetInfoRequest {}, opts.case_timeout)).await.ok().map(|r| r.into_inner());
    let mut cases = Vec::with_capacity(CASES.len());
    for (name, f) in CASES {
        let outcome = match tokio::time::timeout(opts.case_timeout, f(&kit)).await {
            Ok(Ok(o)) => o,
            Ok(Err(reason)) => Outcome::Fail(reason),
            Err(_) => Outcome::Fail(format!("no answer within {:?} (hung)", opts.case_timeout)),
        };
        cases.push(CaseReport { name, outcome });
    }
    let count = |f: fn(&Outcome) -> bool| cases.iter().filter(|c| f(&c.outcome)).count();
    Ok(Report {
        endpoint: opts.endpoint.clone(),
        passed: count(|o| matches!(o, Outcome::Pass)),
        failed: count(|o| matches!(o, Outcome::Fail(_))),
        skipped: count(|o| matches!(o, Outcome::Skip(_))),
        cases,
    })
}

/// What every case shares: the channel, the engine client, and the engine's
/// info when GetInfo answered.
pub struct Kit {
    channel: Channel,
    engine: ContextEngineClient<Channel>,
    info: Option<pb::EngineInfo>,
}

/// Per-call deadline inside a case; the case timeout bounds the whole case.
pub(super) const CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) fn timed<T>(msg: T, timeout: Duration) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(timeout);
    r
}

pub(super) fn req<T>(msg: T) -> Request<T> {
    timed(msg, CALL_TIMEOUT)
}

pub(super) fn session(case: &str) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("conformance-{case}-{nanos}")
}

pub(super) fn describe(s: &Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

pub(super) fn ensure(cond: bool, reason: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(reason()) }
}

impl Kit {
    fn client(&self) -> ContextEngineClient<Channel> {
        self.engine.clone()
    }

    fn info(&self) -> Result<&pb::EngineInfo, String> {
        self.info.as_ref().ok_or_else(|| "GetInfo did not answer".to_owned())
    }

    fn implements(&self, method: Method) -> bool {
        self.info.as_ref().is_some_and(|i| method.listed_in(&i.implemented_methods))
    }

    /// The engine still answers GetInfo and reports SERVING.
    async fn still_healthy(&self, after: &str) -> Result<(), String> {
        self.client()
            .get_info(req(pb::GetInfoRequest {}))
            .await
            .map_err(|s| format!("after {after}, GetInfo failed: {}", describe(&s)))?;
        let status = HealthClient::new(self.channel.clone())
            .check(req(HealthCheckRequest { service: String::new() }))
            .await
            .map_err(|s| format!("after {after}, health Check failed: {}", describe(&s)))?
            .into_inner()
            .status;
        ensure(status == ServingStatus::Serving as i32, || format!("after {after}, health is {status}, not SERVING"))
    }

    /// Ingests `messages` one by one into `session_id`.
    async fn ingest_all(&self, session_id: &str, messages: &[pb::AgentMessage]) -> Result<(), String> {
        for m in messages {
            let r = pb::IngestRequest {
                session_id: session_id.into(),
                session_key: Some(session_id.into()),
                message: Some(m.clone()),
                is_heartbeat: false,
            };
            self.client().ingest(req(r)).await.map_err(|s| format!("Ingest {} failed: {}", m.id, describe(&s)))?;
        }
        Ok(())
    }

    /// Ingests `history` into a fresh session and assembles it under `budget`.
    async fn seeded_assemble(
        &self,
        case: &str,
        history: &[pb::AgentMessage],
        budget: Option<u64>,
    ) -> Result<pb::AssembleResult, String> {
        let session_id = session(case);
        self.ingest_all(&session_id, history).await?;
        let r = assemble_request(&session_id, history.to_vec(), budget);
        Ok(self.client().assemble(req(r)).await.map_err(|s| describe(&s))?.into_inner())
    }

    /// A malformed request must get `want` and leave the engine answering.
    async fn expect_code<T: std::fmt::Debug>(
        &self,
        what: &str,
        got: Result<tonic::Response<T>, Status>,
        want: Code,
    ) -> CaseResult {
        match got {
            Ok(_) => return Err(format!("{what}: accepted, expected {want:?}")),
            Err(s) if s.code() == want => {}
            Err(s) => return Err(format!("{what}: got {}, expected {want:?}", describe(&s))),
        }
        self.still_healthy(what).await?;
        Ok(Outcome::Pass)
    }
}

/// A conversation of `turns` user/assistant/tool exchanges with tool pairs.
pub(super) fn history(turns: usize, tool_text_len: usize) -> Vec<pb::AgentMessage> {
    let mut out = Vec::new();
    for t in 0..turns {
        out.push(msg::user(&format!("u{t}"), &format!("Turn {t}: please read file_{t}.rs and summarise it.")));
        out.push(msg::tool_call(&format!("c{t}"), &format!("call-{t}"), "read_file"));
        out.push(msg::tool_result(
            &format!("r{t}"),
            &format!("call-{t}"),
            &format!("fn f{t}() {{}}\n{}", "x".repeat(tool_text_len)),
        ));
        out.push(msg::assistant(&format!("a{t}"), &format!("file_{t}.rs defines f{t}.")));
    }
    out
}

pub(super) fn assemble_request(
    session_id: &str,
    messages: Vec<pb::AgentMessage>,
    budget: Option<u64>,
) -> pb::AssembleRequest {
    pb::AssembleRequest {
        session_id: session_id.into(),
        session_key: Some(session_id.into()),
        messages,
        token_budget: budget,
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------
