//! Mutual TLS for the control plane over TCP (`serve --listen host:port
//! --tls-cert --tls-key --tls-client-ca`): the daemon proves itself with its
//! certificate; a client proves who it is with a certificate the client CA
//! signed, whose names (subject CN, DNS names) the config maps to a tenant.
//!
//! A client that presents no certificate completes the handshake and is
//! answered 401 `unauthenticated` on every step; one whose certificate the CA
//! did not sign is refused in the handshake.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::CertificateDer;

pub use pdstor_client::tls::{certs, key, provider, roots};

/// The daemon's TLS files.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Its certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA that signs client certificates (PEM).
    pub client_ca: PathBuf,
}

/// The server side: the daemon's certificate, client certificates verified
/// against the client CA (optional, so a client without one is answered 401).
pub fn server_config(files: &TlsFiles) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let roots = Arc::new(roots(&files.client_ca)?);
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider())
        .allow_unauthenticated()
        .build()
        .context("building the client certificate verifier")?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("choosing TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(&files.cert)?, key(&files.key)?)
        .with_context(|| format!("using {} with {}", files.cert.display(), files.key.display()))?;
    Ok(Arc::new(config))
}

/// The names a verified client certificate carries: its subject's common
/// names, then its DNS subject alternative names.
pub fn names(cert: &CertificateDer<'_>) -> Vec<String> {
    let Ok((_, x509)) = x509_parser::parse_x509_certificate(cert.as_ref()) else { return Vec::new() };
    let mut names: Vec<String> =
        x509.subject().iter_common_name().filter_map(|cn| cn.as_str().ok().map(str::to_owned)).collect();
    if let Ok(Some(san)) = x509.subject_alternative_name() {
        for n in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                names.push((*d).to_owned());
            }
        }
    }
    names
}
