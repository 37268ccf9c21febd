//! Certificates the TLS tests make: a CA, and leaves it signs for
//! servers, clients or both (one expired, on request).

#![allow(clippy::unwrap_used)] // test support fails loudly by design

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};

use crate::write_file;

/// A CA that signs what the test needs.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Self { pem: cert.pem(), issuer: Issuer::new(p, key) }
    }

    /// [`Ca::leaf`] written to `dir/name.crt` and `dir/name.key`.
    pub fn leaf_files(
        &self,
        dir: &Path,
        name: &str,
        names: &[&str],
        server: bool,
        expired: bool,
    ) -> (PathBuf, PathBuf) {
        let (crt, key) = self.leaf(names, server, expired);
        (write_file(dir, &format!("{name}.crt"), &crt), write_file(dir, &format!("{name}.key"), &key))
    }

    /// A leaf for `names` that serves and is a client too.
    pub fn leaf_both(&self, names: &[&str]) -> (String, String) {
        self.signed(names, vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth], false)
    }

    /// A leaf for `names`, as server or client; `expired`: valid in 2020 only.
    pub fn leaf(&self, names: &[&str], server: bool, expired: bool) -> (String, String) {
        let usage = if server { ExtendedKeyUsagePurpose::ServerAuth } else { ExtendedKeyUsagePurpose::ClientAuth };
        self.signed(names, vec![usage], expired)
    }

    fn signed(&self, names: &[&str], usages: Vec<ExtendedKeyUsagePurpose>, expired: bool) -> (String, String) {
        let mut p = CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).unwrap();
        p.extended_key_usages = usages;
        if expired {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(2020, 1, 2);
        }
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}
