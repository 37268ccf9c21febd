//! Text from peers — engines, model providers, clients — made safe to log
//! and to pass on: capped, with control characters (newlines, ANSI escapes)
//! escaped so a peer cannot forge log lines or repaint a terminal, and URLs
//! stripped of credentials.

/// `s` in at most `max` bytes, control characters escaped (`\n`,
/// `\u{1b}`), ending in `...` when it was cut.
pub fn capped(s: &str, max: usize) -> String {
    const CUT: &str = "...";
    // Escaped, up to one character past the cap (enough to know it was cut).
    let mut out = String::with_capacity(s.len().min(max + 16));
    for c in s.chars() {
        if out.len() > max {
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if out.len() <= max {
        return out;
    }
    let mut end = max.saturating_sub(CUT.len());
    while !out.is_char_boundary(end) {
        end -= 1;
    }
    out.truncate(end);
    if max >= CUT.len() {
        out.push_str(CUT);
    }
    out
}

/// A URL as it may be shown: scheme, host, port and path; never its user,
/// password, query or fragment (where API keys hide).
pub fn url(u: &str) -> String {
    match reqwest::Url::parse(u) {
        Ok(mut parsed) => {
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.set_query(None);
            parsed.set_fragment(None);
            parsed.to_string()
        }
        Err(_) => "(a URL that does not parse)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_long_text_cut() {
        assert_eq!(capped("ok\nFAKE LOG LINE\u{1b}[31m", 100), "ok\\nFAKE LOG LINE\\u{1b}[31m");
        assert_eq!(capped("abcdefgh", 6), "abc...");
        assert_eq!(capped("abcdef", 6), "abcdef", "what fits is whole");
        assert!(capped(&"é".repeat(100), 64).len() <= 64, "bytes, whatever the characters");
    }

    #[test]
    fn a_url_loses_its_credentials_and_query() {
        assert_eq!(
            url("https://user:secret@api.example.com:8443/v1/chat?api-key=sk-123#frag"),
            "https://api.example.com:8443/v1/chat"
        );
        assert!(!url("not a url sk-123").contains("sk-123"));
    }
}
