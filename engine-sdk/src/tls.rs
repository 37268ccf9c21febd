//! TLS settings from PEM files, the one way every ctxgate program reads
//! them (the SDK server and its host callbacks, the gateway, the CLIs): a
//! file that cannot be read is an error naming the option it came from.

use std::path::Path;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A PEM file and the option (flag or config key) that named it.
#[derive(Debug, Clone, Copy)]
pub struct Pem<'a> {
    pub option: &'a str,
    pub path: &'a Path,
}

impl<'a> Pem<'a> {
    pub fn new(option: &'a str, path: &'a Path) -> Self {
        Self { option, path }
    }

    pub fn read(&self) -> Result<Vec<u8>, String> {
        std::fs::read(self.path).map_err(|e| format!("{} {}: {e}", self.option, self.path.display()))
    }
}

/// A client: trusts `ca` (default: the public web roots) and presents the
/// `identity` certificate and key when given (mTLS).
pub fn client(ca: Option<Pem<'_>>, identity: Option<(Pem<'_>, Pem<'_>)>) -> Result<ClientTlsConfig, String> {
    let mut tls = ClientTlsConfig::new();
    tls = match ca {
        Some(ca) => tls.ca_certificate(Certificate::from_pem(ca.read()?)),
        None => tls.with_webpki_roots(),
    };
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert.read()?, key.read()?));
    }
    Ok(tls)
}

/// A server with `cert` and `key`; with `client_ca`, only clients that CA
/// signed (mTLS).
pub fn server(cert: Pem<'_>, key: Pem<'_>, client_ca: Option<Pem<'_>>) -> Result<ServerTlsConfig, String> {
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(cert.read()?, key.read()?));
    if let Some(ca) = client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(ca.read()?));
    }
    Ok(tls)
}

/// `(cert, key)` as PEMs when both are given (clap makes them go together).
pub fn pair<'a>(
    cert: Option<&'a std::path::PathBuf>,
    key: Option<&'a std::path::PathBuf>,
    options: (&'a str, &'a str),
) -> Option<(Pem<'a>, Pem<'a>)> {
    Some((Pem::new(options.0, cert?), Pem::new(options.1, key?)))
}
