//! Mutual TLS for the control plane over TCP (`serve --listen host:port
//! --tls-cert --tls-key --tls-client-ca [--tls-crl]`): the daemon proves
//! itself with its certificate; a client proves who it is with a certificate
//! the client CA signed and no CRL revokes, whose names (subject CN, DNS
//! names) the config maps to a tenant. Every file is read again on a reload
//! (`reload`), so a certificate can be renewed or revoked without a restart.
//!
//! A client that presents no certificate completes the handshake and is
//! answered 401 `unauthenticated` on every step; one whose certificate the CA
//! did not sign, or a CRL revokes, or that has expired, is refused in the
//! handshake with the TLS alert that says which.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer};

use pdstor_client::tls::{certs, key, provider};

/// The daemon's TLS files.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Its certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA that signs client certificates (PEM).
    pub client_ca: PathBuf,
    /// Revocation lists of the CAs that issue client certificates (PEM or
    /// DER); with any, a client certificate whose revocation status none of
    /// them gives is refused. The client's own certificate is checked, not
    /// the intermediates above it.
    pub crls: Vec<PathBuf>,
}

impl TlsFiles {
    /// Every file, for the reload watcher.
    pub fn paths(&self) -> Vec<&Path> {
        let mut all = vec![self.cert.as_path(), self.key.as_path(), self.client_ca.as_path()];
        all.extend(self.crls.iter().map(PathBuf::as_path));
        all
    }
}

/// The server side as loaded: the handshake's configuration, and its client
/// certificate verifier (which also judges a kept-alive connection's
/// certificate again after a reload).
#[derive(Clone)]
pub struct ServerTls {
    /// What each handshake uses.
    pub config: Arc<rustls::ServerConfig>,
    /// The client CA and the CRLs, as the handshake checks them.
    pub verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
}

/// The server side: the daemon's certificate, client certificates verified
/// against the client CA and the CRLs (optional, so a client without one is
/// answered 401). Reads every file; any failure names its file.
pub fn server_config(files: &TlsFiles) -> anyhow::Result<ServerTls> {
    let cas = certs(&files.client_ca)?;
    let mut roots = rustls::RootCertStore::empty();
    for c in &cas {
        roots.add(c.clone()).with_context(|| format!("adding a CA certificate from {}", files.client_ca.display()))?;
    }
    let mut crls = Vec::new();
    for path in &files.crls {
        crls.extend(revocation_lists(path)?);
    }
    check_coverage(&files.client_ca, &cas, &crls, &files.crls);
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .with_crls(crls)
        // A stolen key is a client's: its certificate is what a CRL revokes.
        // Checking the intermediates too would refuse every client of a CA
        // whose parent's list the operator did not give.
        .only_check_end_entity_revocation()
        .allow_unauthenticated()
        .build()
        .with_context(|| format!("building the client certificate verifier from {}", files.client_ca.display()))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("choosing TLS versions")?
        .with_client_cert_verifier(verifier.clone())
        .with_single_cert(certs(&files.cert)?, key(&files.key)?)
        .with_context(|| format!("using {} with {}", files.cert.display(), files.key.display()))?;
    Ok(ServerTls { config: Arc::new(config), verifier })
}

/// Every CRL in `path`: PEM blocks, or one DER list (as CAs publish them).
pub fn revocation_lists(path: &Path) -> anyhow::Result<Vec<CertificateRevocationListDer<'static>>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading the CRL {}", path.display()))?;
    let lists: Vec<CertificateRevocationListDer<'static>> = if bytes.starts_with(b"-----BEGIN") {
        CertificateRevocationListDer::pem_slice_iter(&bytes)
            .collect::<Result<_, _>>()
            .with_context(|| format!("parsing the PEM CRLs in {}", path.display()))?
    } else {
        vec![CertificateRevocationListDer::from(bytes)]
    };
    if lists.is_empty() {
        bail!("{} holds no CRL (a PEM X509 CRL block, or a DER CRL)", path.display());
    }
    for (i, der) in lists.iter().enumerate() {
        let (_, crl) = x509_parser::parse_x509_crl(der.as_ref())
            .map_err(|e| anyhow::anyhow!("CRL #{} in {} does not parse: {e}", i + 1, path.display()))?;
        let stale = crl.next_update().is_some_and(|next| next < x509_parser::time::ASN1Time::now());
        if stale {
            tracing::warn!(
                crl = %path.display(),
                issuer = %crl.issuer(),
                "the CRL is past its next update: it still revokes what it lists, but ask its CA for the newer one"
            );
        }
    }
    Ok(lists)
}

/// Warns of each client CA no CRL comes from: with CRLs given, the client
/// certificates it issues itself are refused (their revocation status is
/// unknown).
fn check_coverage(ca: &Path, cas: &[CertificateDer<'_>], crls: &[CertificateRevocationListDer<'_>], files: &[PathBuf]) {
    if crls.is_empty() {
        return;
    }
    let subjects: Vec<String> = cas
        .iter()
        .filter_map(|c| x509_parser::parse_x509_certificate(c.as_ref()).ok().map(|(_, x)| x.subject().to_string()))
        .collect();
    let issuers: Vec<String> = crls
        .iter()
        .filter_map(|c| x509_parser::parse_x509_crl(c.as_ref()).ok().map(|(_, l)| l.issuer().to_string()))
        .collect();
    for s in subjects.iter().filter(|s| !issuers.contains(s)) {
        tracing::warn!(
            client_ca = %ca.display(),
            ca = %s,
            crls = ?files,
            "no --tls-crl comes from this client CA: every client certificate it issues itself is refused (unknown revocation status); add its CRL"
        );
    }
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
