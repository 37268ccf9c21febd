//! `ctxgate chat`: one message with -m, or an interactive loop with
//! `/compact`, `/new`, `/reset` and `/quit`; a turn's events rendered as
//! they stream (model text on stdout, the rest on stderr).

use std::io::{BufRead, Write};

use ctxgate_proto::gateway as api;
use tokio_stream::StreamExt;

use super::compact::{compact_with, done_line};
use super::{CliError, Client, Conn, SessionArg, connect};

pub async fn run(conn: &Conn, session: &SessionArg, one: Option<String>) -> Result<(), CliError> {
    let mut client = connect(conn).await?;
    if let Some(m) = one {
        return turn(&mut client, session, m).await;
    }
    eprintln!(
        "Chatting in session {:?} (agent {}). Commands: /compact [instructions], /new, /reset, /quit.",
        session.session, session.agent
    );
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let _ = std::io::stderr().flush();
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            return Ok(());
        }
        let line = line.trim();
        let result = match line.split_once(' ').map_or((line, ""), |(a, b)| (a, b.trim())) {
            ("", _) => continue,
            ("/quit" | "/exit", _) => return Ok(()),
            ("/compact", rest) => compact_with(&mut client, session, (!rest.is_empty()).then(|| rest.to_owned())).await,
            ("/new", _) => client
                .new_session(session.as_ref())
                .await
                .map(|r| eprintln!("New session {}.", r.into_inner().session_id))
                .map_err(CliError::from),
            ("/reset", _) => client
                .reset_session(session.as_ref())
                .await
                .map(|r| eprintln!("Session reset; new session {}.", r.into_inner().session_id))
                .map_err(CliError::from),
            _ => turn(&mut client, session, line.to_owned()).await,
        };
        if let Err(e) = result {
            eprintln!("{e}");
        }
    }
}

/// `text` on one line, at most `max` characters.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max { flat } else { flat.chars().take(max).collect::<String>() + "…" }
}

async fn turn(client: &mut Client, session: &SessionArg, message: String) -> Result<(), CliError> {
    use api::turn_event::Event;
    let req =
        api::RunTurnRequest { session: Some(session.as_ref()), message, system_prompt: None, ..Default::default() };
    let mut stream = client.run_turn(req).await?.into_inner();
    let mut out = std::io::stdout();
    while let Some(e) = stream.next().await {
        match e?.event {
            Some(Event::ModelDelta(d)) => {
                let _ = write!(out, "{}", d.text);
                let _ = out.flush();
            }
            Some(Event::CompactionStarted(c)) => eprintln!("[compacting ({}), {} tokens]", c.trigger, c.tokens_before),
            Some(Event::CompactionDone(d)) => eprintln!("{}", done_line(&d)),
            Some(Event::Warning(w)) => eprintln!("[warning] {}", w.message),
            Some(Event::ToolCalled(t)) => eprintln!("[tool] {} {}", t.name, one_line(&t.arguments_json, 120)),
            Some(Event::ToolAnswered(t)) => {
                let what = if t.is_error { "error" } else { "result" };
                eprintln!("[tool {what}] {}: {}", t.name, one_line(&t.text, 160));
            }
            Some(Event::Completed(_)) => {
                let _ = writeln!(out);
                return Ok(());
            }
            Some(Event::Failed(f)) => {
                let _ = writeln!(out);
                return Err(CliError::TurnFailed(f.message));
            }
            _ => {}
        }
    }
    Err(CliError::TurnUnanswered)
}
