//! `ctxgate-conformance --endpoint URL [--json]`: run the conformance kit
//! against a running engine. Exits 0 when no case failed.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ctxgate_engine_sdk::conformance::{Options, run};
use ctxgate_runtime::tls;

#[derive(Parser, Debug)]
#[command(version, about = "Check a context engine against the ctxgate contract")]
struct Args {
    /// The engine: http://HOST:PORT or unix:///PATH.
    #[arg(long)]
    endpoint: String,
    /// Print the report as JSON instead of one line per case.
    #[arg(long)]
    json: bool,
    /// A case taking longer than this fails as hung.
    #[arg(long, default_value_t = 10_000)]
    case_timeout_ms: u64,
    /// For an https:// engine: the CA (PEM) its certificate must chain to
    /// (default: the public web roots).
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
    /// A client certificate and key (PEM), for an engine that requires one.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

impl Args {
    fn tls(&self) -> Result<Option<tonic::transport::ClientTlsConfig>, tls::TlsError> {
        if !self.endpoint.starts_with("https://") {
            return Ok(None);
        }
        let ca = self.tls_ca.as_deref().map(|p| tls::Pem::new("--tls-ca", p));
        let identity = tls::pair(self.tls_cert.as_ref(), self.tls_key.as_ref(), ("--tls-cert", "--tls-key"));
        tls::client(ca, identity).map(Some)
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let tls = match args.tls() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ctxgate-conformance: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = Options { endpoint: args.endpoint, case_timeout: Duration::from_millis(args.case_timeout_ms), tls };
    let report = match run(&opts).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ctxgate-conformance: {e}");
            return ExitCode::from(2);
        }
    };
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("ctxgate-conformance: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        print!("{}", report.to_text());
    }
    if report.failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
