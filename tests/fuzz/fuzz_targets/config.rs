//! The gateway's JSON5 config: any text parses and validates to a config or
//! to an error naming a key, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = ctxgate::config::Config::from_text(text, std::path::Path::new("fuzz.json5"));
});
