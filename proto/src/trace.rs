//! W3C Trace Context (`traceparent`) as it crosses ctxgate: a client's
//! turn, every engine call made for it, and every callback an engine makes
//! during that call share one trace id; each hop sends its own span id as
//! the parent. The header is validated (an invalid one starts a new trace,
//! as the W3C spec says) and never longer than 55 characters.

use std::fmt;
use std::hash::{BuildHasher, Hasher};

/// The gRPC metadata key (lowercase, as HTTP/2 carries it).
pub const HEADER: &str = "traceparent";

/// One `traceparent`: version 00, a trace id, the sender's span id, flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub flags: u8,
}

fn hex_into(s: &str, out: &mut [u8]) -> Option<()> {
    if s.len() != out.len() * 2 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(())
}

/// Eight random bytes (a span id: unique enough, not a secret).
fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    for chunk in out.chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        let bytes = h.finish().to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    if out.iter().all(|b| *b == 0) {
        out[0] = 1;
    }
    out
}

impl TraceParent {
    /// Parses a header value; `None` for anything but a valid version-00
    /// header with non-zero ids (lowercase hex, as the spec requires).
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.trim().split('-');
        let (version, trace, parent, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() {
            return None;
        }
        let mut t = Self { trace_id: [0; 16], parent_id: [0; 8], flags: 0 };
        hex_into(trace, &mut t.trace_id)?;
        hex_into(parent, &mut t.parent_id)?;
        let mut f = [0u8; 1];
        hex_into(flags, &mut f)?;
        t.flags = f[0];
        if t.trace_id.iter().all(|b| *b == 0) || t.parent_id.iter().all(|b| *b == 0) {
            return None;
        }
        Some(t)
    }

    /// A new trace (sampled), for a turn whose client sent none.
    pub fn root() -> Self {
        Self { trace_id: random_bytes(), parent_id: random_bytes(), flags: 1 }
    }

    /// The same trace with a new span id: what this hop sends onwards.
    pub fn child(&self) -> Self {
        Self { parent_id: random_bytes(), ..*self }
    }

    /// The trace id, as 32 hex digits (log fields).
    pub fn trace_id_hex(&self) -> String {
        self.trace_id.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for b in self.trace_id {
            write!(f, "{b:02x}")?;
        }
        f.write_str("-")?;
        for b in self.parent_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_headers_round_trip_and_invalid_ones_are_refused() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceParent::parse(s).unwrap();
        assert_eq!(t.to_string(), s);
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let c = t.child();
        assert_eq!((c.trace_id, c.flags), (t.trace_id, t.flags));
        assert_ne!(c.parent_id, t.parent_id, "a new span id");
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
            "00-é€f92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad:?}");
        }
        let r = TraceParent::root();
        assert_eq!(TraceParent::parse(&r.to_string()), Some(r));
    }
}
