//! `grpc-timeout` as an engine server reads it: any header value gives a
//! duration or none, never a panic or an overflow.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else { return };
    if let Some(d) = ctxgate_engine_sdk::parse_grpc_timeout(raw) {
        // At most 8 digits of hours.
        assert!(d <= std::time::Duration::from_secs(99_999_999 * 3600));
    }
});
