//! TLS settings from PEM files, the one way every ctxgate program reads
//! them (the SDK server and its host callbacks, the gateway, the CLIs): a
//! file that cannot be read is an error naming the option it came from.
//! Servers accept TLS themselves ([`LiveServerTls`]) so that a reload can
//! replace the certificate while they serve.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// Why TLS settings could not be made; every variant names the option
/// (flag or config key) that gave the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{option} {}: {source}", path.display())]
    Read { option: String, path: PathBuf, source: std::io::Error },
    #[error("{option} {} holds no PEM certificate", path.display())]
    NoCertificate { option: String, path: PathBuf },
    #[error("{option} {} holds no PEM private key", path.display())]
    NoKey { option: String, path: PathBuf },
    /// A file that reads but does not make the settings (a CA that is not
    /// one, a key that does not match its certificate).
    #[error("{options}: {detail}")]
    Invalid { options: String, detail: String },
    /// The settings themselves (a protocol version, a channel's URI).
    #[error("{0}")]
    Settings(String),
}

/// Errors inside a sentence-returning caller read as their sentence.
impl From<TlsError> for String {
    fn from(e: TlsError) -> Self {
        e.to_string()
    }
}

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

    pub fn read(&self) -> Result<Vec<u8>, TlsError> {
        std::fs::read(self.path).map_err(|source| TlsError::Read {
            option: self.option.to_owned(),
            path: self.path.to_owned(),
            source,
        })
    }
}

/// A client: trusts `ca` (default: the public web roots) and presents the
/// `identity` certificate and key when given (mTLS).
pub fn client(ca: Option<Pem<'_>>, identity: Option<(Pem<'_>, Pem<'_>)>) -> Result<ClientTlsConfig, TlsError> {
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

/// Where a client's trust and identity come from, each file with the
/// option (config key) that named it, and the name the server's
/// certificate must carry (default: the host dialled).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientFiles {
    pub ca: Option<(String, PathBuf)>,
    pub identity: Option<((String, PathBuf), (String, PathBuf))>,
    pub server_name: Option<String>,
}

/// The client configuration `files` describe, read now.
pub fn client_config(files: &ClientFiles) -> Result<ClientTlsConfig, TlsError> {
    fn pem((option, path): &(String, PathBuf)) -> Pem<'_> {
        Pem::new(option, path)
    }
    let mut tls = client(files.ca.as_ref().map(pem), files.identity.as_ref().map(|(c, k)| (pem(c), pem(k))))?;
    if let Some(name) = &files.server_name {
        tls = tls.domain_name(name.clone());
    }
    Ok(tls)
}

/// Builds a channel's TLS from `tls` once, so that a key that is not one,
/// or does not match its certificate, is said at start.
pub fn check_client(tls: ClientTlsConfig) -> Result<(), String> {
    tonic::transport::Endpoint::from_static("https://engine.invalid")
        .tls_config(tls)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// `(cert, key)` as PEMs when both are given (clap makes them go together).
pub fn pair<'a>(
    cert: Option<&'a PathBuf>,
    key: Option<&'a PathBuf>,
    options: (&'a str, &'a str),
) -> Option<(Pem<'a>, Pem<'a>)> {
    Some((Pem::new(options.0, cert?), Pem::new(options.1, key?)))
}

/// Where a server's certificate, key and (for mTLS) client CA come from,
/// each with the option that named it, and the names a client's
/// certificate must carry one of (none: any client the CA signed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerFiles {
    pub cert: (String, PathBuf),
    pub key: (String, PathBuf),
    pub client_ca: Option<(String, PathBuf)>,
    pub client_names: Vec<String>,
}

fn read_named((option, path): &(String, PathBuf)) -> Result<Vec<u8>, TlsError> {
    Pem::new(option, path).read()
}

/// The rustls server configuration `files` describe, read now: HTTP/2
/// only (gRPC), the client CA's certificates required when given. Every
/// mistake is a sentence naming its option.
pub fn server_config(files: &ServerFiles) -> Result<rustls::ServerConfig, TlsError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = |named: &(String, PathBuf)| -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let pem = read_named(named)?;
        let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem).filter_map(Result::ok).collect();
        if certs.is_empty() {
            return Err(TlsError::NoCertificate { option: named.0.clone(), path: named.1.clone() });
        }
        Ok(certs)
    };
    let chain = certs(&files.cert)?;
    let key = PrivateKeyDer::from_pem_slice(&read_named(&files.key)?)
        .map_err(|_| TlsError::NoKey { option: files.key.0.clone(), path: files.key.1.clone() })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Settings(e.to_string()))?;
    let invalid = |(option, path): &(String, PathBuf), e: &dyn std::fmt::Display| TlsError::Invalid {
        options: format!("{option} {}", path.display()),
        detail: e.to_string(),
    };
    let builder = match &files.client_ca {
        // Names to check with no CA to check them against would serve anyone.
        None if !files.client_names.is_empty() => {
            return Err(TlsError::Settings("--tls-client-name needs --tls-client-ca".into()));
        }
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs(ca)? {
                roots.add(c).map_err(|e| invalid(ca, &e))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| invalid(ca, &e))?;
            if files.client_names.is_empty() {
                builder.with_client_cert_verifier(verifier)
            } else {
                builder.with_client_cert_verifier(Arc::new(NamedClients::new(verifier, &files.client_names)?))
            }
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| TlsError::Invalid {
        options: format!("{} and {}", files.cert.0, files.key.0),
        detail: e.to_string(),
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Why `name` cannot be a `--tls-client-name`, if it cannot: it must be a
/// DNS name (letters, digits, `-` and `.`), matched exactly, so no
/// wildcard and no IP address (every SDK applies this rule).
pub fn client_name_problem(name: &str) -> Option<String> {
    let dns = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    let ip = name.parse::<std::net::IpAddr>().is_ok();
    (!dns || ip).then(|| {
        format!(
            "--tls-client-name {name:?}: expected a DNS name (matched exactly against a DNS subjectAltName \
             of the client's certificate; no wildcard, no IP address)"
        )
    })
}

/// A client verifier that, past the CA's checks, requires the client's
/// certificate to carry one of `names` as a DNS subjectAltName, exactly
/// (ASCII case aside; a wildcard the certificate presents matches nothing):
/// an engine serves the gateway, not every holder of a certificate from the
/// deployment's CA. The handshake fails otherwise.
#[derive(Debug)]
struct NamedClients {
    inner: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    names: Vec<String>,
}

impl NamedClients {
    fn new(inner: Arc<dyn rustls::server::danger::ClientCertVerifier>, names: &[String]) -> Result<Self, TlsError> {
        if let Some(problem) = names.iter().find_map(|n| client_name_problem(n)) {
            return Err(TlsError::Settings(problem));
        }
        Ok(Self { inner, names: names.to_vec() })
    }
}

impl rustls::server::danger::ClientCertVerifier for NamedClients {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &rustls_pki_types::CertificateDer<'_>,
        intermediates: &[rustls_pki_types::CertificateDer<'_>],
        now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self.inner.verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|_| rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding))?;
        if cert.valid_dns_names().any(|d| self.names.iter().any(|n| d.eq_ignore_ascii_case(n))) {
            Ok(verified)
        } else {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }

    fn requires_raw_public_keys(&self) -> bool {
        self.inner.requires_raw_public_keys()
    }
}

/// A server's TLS that a reload (SIGHUP) can replace while it serves:
/// connections accepted afterwards use the new certificate, those open
/// keep theirs. Cheap to clone.
#[derive(Clone)]
pub struct LiveServerTls {
    current: Arc<RwLock<(ServerFiles, Arc<rustls::ServerConfig>)>>,
}

impl std::fmt::Debug for LiveServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveServerTls").field("files", &self.files()).finish()
    }
}

impl LiveServerTls {
    /// Reads `files` now (a mistake is a sentence naming its option).
    pub fn new(files: ServerFiles) -> Result<Self, TlsError> {
        let config = Arc::new(server_config(&files)?);
        Ok(Self { current: Arc::new(RwLock::new((files, config))) })
    }

    pub fn files(&self) -> ServerFiles {
        self.current.read().unwrap_or_else(|e| e.into_inner()).0.clone()
    }

    /// Reads `files` (the same or new paths) and serves them from now on;
    /// on a mistake the running certificate stays and the sentence is
    /// returned.
    pub fn reload(&self, files: ServerFiles) -> Result<(), TlsError> {
        let config = Arc::new(server_config(&files)?);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = (files, config);
        Ok(())
    }

    fn config(&self) -> Arc<rustls::ServerConfig> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).1.clone()
    }

    /// An acceptor with the configuration current now (connections
    /// accepted after a reload use the new certificate).
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config())
    }
}

#[cfg(test)]
mod tests {
    use super::client_name_problem;

    #[test]
    fn a_client_name_is_a_dns_name_without_wildcard_or_address() {
        for good in ["gateway", "gateway-openclaw", "ctxgate.svc.cluster.local", "GATEWAY"] {
            assert_eq!(client_name_problem(good), None, "{good}");
        }
        for bad in ["", "*.example", "*", "127.0.0.1", "::1", "gate way", "a..b", ".gateway", "gateway."] {
            let problem = client_name_problem(bad).expect(bad);
            assert!(problem.contains("expected a DNS name"), "{problem}");
        }
    }
}
