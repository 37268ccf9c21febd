//! `ctxgate compact` (and chat's `/compact`): compact a session now,
//! with a progress bar on stderr and the result on stdout.

use ctxgate_proto::gateway as api;
use tokio_stream::StreamExt;

use super::{CliError, Client, Conn, SessionArg, connect};

/// The one line that reports a compaction, in `compact` and in `chat`.
pub(super) fn done_line(d: &api::CompactionDone) -> String {
    if d.compacted {
        format!("[compacted: {} → {} tokens]", d.tokens_before, d.tokens_after)
    } else {
        format!("[not compacted: {}]", d.reason.as_deref().unwrap_or("no reason given"))
    }
}

pub async fn run(conn: &Conn, session: &SessionArg, instructions: Option<String>) -> Result<(), CliError> {
    compact_with(&mut connect(conn).await?, session, instructions).await
}

pub(super) async fn compact_with(
    client: &mut Client,
    session: &SessionArg,
    instructions: Option<String>,
) -> Result<(), CliError> {
    use api::compaction_event::Event;
    let req = api::CompactSessionRequest { session: Some(session.as_ref()), custom_instructions: instructions };
    let mut stream = client.compact(req).await?.into_inner();
    while let Some(e) = stream.next().await {
        match e?.event {
            Some(Event::Started(s)) => {
                eprintln!("Compacting session {:?} ({} tokens)…", session.session, s.tokens_before)
            }
            Some(Event::Progress(p)) => {
                let width = 30;
                let filled = (p.done.min(p.total) * width).checked_div(p.total).unwrap_or(0) as usize;
                eprint!(
                    "\r[{}{}] {}/{} {:<40}",
                    "#".repeat(filled),
                    ".".repeat(width as usize - filled),
                    p.done,
                    p.total,
                    p.message
                );
            }
            Some(Event::Done(d)) => {
                eprintln!();
                println!("{}", done_line(&d));
                return Ok(());
            }
            None => {}
        }
    }
    Err(CliError::CompactionUnfinished)
}
