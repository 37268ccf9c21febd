//! The deterministic extractive summariser: the same five safeguard
//! headings a model summary carries (Decisions, Open TODOs,
//! Constraints/Rules, Pending user asks, Exact identifiers) plus the files
//! read and modified, filled from the text alone. The gateway's built-in
//! compaction uses it with the offline model, and engines use it to
//! summarise locally when the host has no model: same input, same summary.

use std::collections::BTreeMap;

use crate::pb::{AgentMessage, Role, content_part::Part};

/// The safeguard headings every summary carries, in order.
pub const HEADINGS: [&str; 5] =
    ["## Decisions", "## Open TODOs", "## Constraints/Rules", "## Pending user asks", "## Exact identifiers"];
pub const FILES_READ: &str = "## Files read";
pub const FILES_MODIFIED: &str = "## Files modified";
/// Hard cap on a summary's length (characters).
pub const SUMMARY_CAP: usize = 16_000;

/// A message's text as a model would read it (tool calls and results
/// rendered inline).
pub fn message_text(m: &AgentMessage) -> String {
    m.content
        .iter()
        .filter_map(|p| match &p.part {
            Some(Part::Text(t)) => Some(t.clone()),
            Some(Part::ToolCall(c)) => Some(format!("[tool call {} {}({})]", c.id, c.name, c.arguments_json)),
            Some(Part::ToolResult(r)) => Some(format!("[tool result for {}]\n{}", r.tool_call_id, r.text)),
            Some(Part::Image(i)) => Some(format!("[image {}]", i.uri)),
            Some(Part::Thinking(_)) | None => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn role_name(role: i32) -> &'static str {
    match Role::try_from(role) {
        Ok(Role::System) => "system",
        Ok(Role::Assistant) => "assistant",
        Ok(Role::Tool) => "tool",
        _ => "user",
    }
}

/// Sections of a summary by heading, in the order of [`HEADINGS`] then
/// the file lists; lines are kept verbatim.
type Sections = BTreeMap<&'static str, Vec<String>>;

const ALL_SECTIONS: [&str; 7] =
    [HEADINGS[0], HEADINGS[1], HEADINGS[2], HEADINGS[3], HEADINGS[4], FILES_READ, FILES_MODIFIED];

fn parse_sections(summary: &str) -> Sections {
    let mut out = Sections::new();
    let mut current: Option<&'static str> = None;
    for line in summary.lines() {
        if let Some(h) = ALL_SECTIONS.iter().find(|h| line.trim() == **h) {
            current = Some(h);
            continue;
        }
        if let (Some(h), false) = (current, line.trim().is_empty()) {
            out.entry(h).or_default().push(line.trim().to_owned());
        }
    }
    out
}

/// Per-section line limits, newest lines kept: sized so the whole summary
/// stays under [`SUMMARY_CAP`].
fn limit(section: &str) -> usize {
    match section {
        s if s == HEADINGS[4] => 200,
        s if s == FILES_READ || s == FILES_MODIFIED => 40,
        _ => 12,
    }
}

fn push_unique(lines: &mut Vec<String>, line: String) {
    if let Some(i) = lines.iter().position(|l| *l == line) {
        lines.remove(i);
    }
    lines.push(line);
}

fn snippet(text: &str, max: usize) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        return flat;
    }
    let mut s: String = flat.chars().take(max).collect();
    s.push('…');
    s
}

/// Sentences of `text`: split after . ! ? when whitespace follows (so
/// `docs/api.md` and `v1.2` stay whole), and on newlines.
fn sentences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let next_is_space = chars.peek().is_none_or(|(_, n)| n.is_whitespace());
        let end = match c {
            '\n' => Some(i),
            '.' | '!' | '?' if next_is_space => Some(i + c.len_utf8()),
            _ => None,
        };
        if let Some(end) = end {
            out.push(text[start..end].trim());
            start = end;
        }
    }
    out.push(text[start..].trim());
    out.retain(|s| s.len() > 3);
    out
}

fn any_of(s: &str, words: &[&str]) -> bool {
    let lower = s.to_lowercase();
    words.iter().any(|w| lower.contains(w))
}

/// Words that must survive a summary verbatim: paths, file names,
/// snake_case and dotted names, ids mixing letters and digits, long numbers.
pub fn identifiers(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for raw in text.split(|c: char| {
        c.is_whitespace() || matches!(c, ',' | ';' | '(' | ')' | '"' | '\'' | '`' | '[' | ']' | '{' | '}' | '<' | '>')
    }) {
        let w = raw.trim_end_matches(['.', ':', '!', '?']).trim_start_matches(['#', '@']);
        let has_alpha = w.chars().any(char::is_alphabetic);
        let has_digit = w.chars().any(|c| c.is_ascii_digit());
        let looks = w.len() >= 3
            && w.len() <= 100
            && (w.contains('/')
                || w.contains('_')
                || (w.contains('.') && has_alpha && !w.ends_with('.'))
                || (has_alpha && has_digit)
                || (w.len() >= 4 && w.chars().all(|c| c.is_ascii_digit())));
        if looks && !out.iter().any(|o| o == w) {
            out.push(w.to_owned());
        }
    }
    out
}

/// File paths from tool calls, split into read and modified by tool name.
fn files_touched(messages: &[AgentMessage]) -> (Vec<String>, Vec<String>) {
    let (mut read, mut modified) = (Vec::new(), Vec::new());
    for m in messages {
        for p in &m.content {
            let Some(Part::ToolCall(c)) = &p.part else { continue };
            let args: serde_json::Value = serde_json::from_str(&c.arguments_json).unwrap_or_default();
            let Some(path) = ["path", "file", "file_path", "filename"].iter().find_map(|k| args.get(k)?.as_str())
            else {
                continue;
            };
            let name = c.name.to_lowercase();
            let target =
                if ["write", "edit", "create", "patch", "delete", "move", "rename"].iter().any(|w| name.contains(w)) {
                    &mut modified
                } else {
                    &mut read
                };
            push_unique(target, format!("- {path}"));
        }
    }
    (read, modified)
}

/// The extractive summary: each safeguard section takes the sentences that
/// match it (decisions, todos, rules, user asks), identifiers are collected
/// exactly, and the previous summary's sections are folded in, newest last.
pub fn extractive(previous: Option<&str>, messages: &[AgentMessage]) -> String {
    let mut s = previous.map(parse_sections).unwrap_or_default();
    let mut add = |h: &'static str, line: String| push_unique(s.entry(h).or_default(), line);
    for m in messages {
        let text = message_text(m);
        for id in identifiers(&text) {
            add(HEADINGS[4], format!("- {id}"));
        }
        let user = m.role == Role::User as i32;
        let assistant = m.role == Role::Assistant as i32;
        for sentence in sentences(&text) {
            let line = format!("- {}", snippet(sentence.trim_end_matches('.'), 200));
            if assistant
                && any_of(
                    sentence,
                    &["decid", "decision", "we will", "i will", "chose", "going with", "agreed", "settled on"],
                )
            {
                add(HEADINGS[0], line.clone());
            }
            if any_of(sentence, &["todo", "need to", "next step", "still have to", "remaining", "follow up", "later"]) {
                add(HEADINGS[1], line.clone());
            }
            // Rules come from the people and the system, not from the model's echo.
            if !assistant
                && any_of(
                    sentence,
                    &["must", "never", "always", "do not", "don't", "only use", "required", "not allowed"],
                )
            {
                add(HEADINGS[2], line.clone());
            }
            if user
                && (sentence.ends_with('?')
                    || any_of(sentence, &["please", "can you", "could you", "i want", "i need"]))
            {
                add(HEADINGS[3], line);
            }
        }
    }
    let (read, modified) = files_touched(messages);
    for f in read {
        add(FILES_READ, f);
    }
    for f in modified {
        add(FILES_MODIFIED, f);
    }
    // The latest user request is unresolved when nothing answered it yet.
    if let Some(last) = messages.last().filter(|m| m.role == Role::User as i32) {
        add(HEADINGS[3], format!("- latest request: {}", snippet(&message_text(last), 400)));
    }
    render(&s)
}

fn render(s: &Sections) -> String {
    let mut out = String::new();
    for h in ALL_SECTIONS {
        let lines = s.get(h).map(Vec::as_slice).unwrap_or_default();
        if lines.is_empty() && !HEADINGS.contains(&h) {
            continue;
        }
        out.push_str(h);
        out.push('\n');
        let keep = lines.len().saturating_sub(limit(h));
        if lines.is_empty() {
            out.push_str("- (none)\n");
        }
        for l in &lines[keep..] {
            out.push_str(l);
            out.push('\n');
        }
        out.push('\n');
    }
    cap(out)
}

/// Cuts a summary to [`SUMMARY_CAP`] characters on a line boundary.
pub fn cap(s: String) -> String {
    if s.chars().count() <= SUMMARY_CAP {
        return s;
    }
    let mut out = String::new();
    for line in s.lines() {
        if out.chars().count() + line.chars().count() + 1 > SUMMARY_CAP {
            break;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::ContentPart;

    fn m(role: Role, text: &str) -> AgentMessage {
        AgentMessage {
            id: "x".into(),
            role: role as i32,
            content: vec![ContentPart { part: Some(Part::Text(text.into())) }],
            ..Default::default()
        }
    }

    #[test]
    fn fills_every_heading_and_keeps_identifiers() {
        let msgs = [
            m(Role::User, "Please fix bug JIRA-4411 in src/parser.rs. You must never touch main_loop."),
            m(Role::Assistant, "I decided to rewrite parse_header first. TODO: add tests later."),
            m(Role::User, "Can you also bump version 2024.1?"),
        ];
        let s = extractive(None, &msgs);
        for h in HEADINGS {
            assert!(s.contains(h), "{h} missing in {s}");
        }
        for id in ["JIRA-4411", "src/parser.rs", "main_loop", "parse_header", "2024.1"] {
            assert!(s.contains(id), "{id} missing in {s}");
        }
        assert!(s.contains("latest request: Can you also bump version 2024.1?"), "{s}");
        assert_eq!(s, extractive(None, &msgs), "deterministic");
    }

    #[test]
    fn sentences_keep_dotted_names_whole() {
        assert_eq!(
            sentences("Review docs/api.md now. Then v1.2! Done?\nok"),
            ["Review docs/api.md now.", "Then v1.2!", "Done?"]
        );
    }

    #[test]
    fn folding_keeps_the_previous_summary() {
        let first = extractive(None, &[m(Role::User, "deploy to cluster eu-west-1 please")]);
        let second = extractive(Some(&first), &[m(Role::User, "and then check svc_gateway")]);
        assert!(second.contains("eu-west-1") && second.contains("svc_gateway"), "{second}");
        assert_eq!(second.matches("## Decisions").count(), 1);
    }
}
