//! TLS for a client of the control plane over TCP: the PEM files it reads
//! (the daemon's CA, its own certificate and key), shared with the daemon's
//! side (`pdstor_daemon::api::tls`), and the client configuration.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The crypto provider (ring), the one the build carries.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every certificate in a PEM file.
pub fn certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading certificates from {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing the PEM certificates in {}", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

/// Reads the private key in a PEM file.
pub fn key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).with_context(|| format!("reading a PEM private key from {}", path.display()))
}

/// A root store holding every certificate of `path`.
pub fn roots(path: &Path) -> anyhow::Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(path)? {
        roots.add(c).with_context(|| format!("adding a CA certificate from {}", path.display()))?;
    }
    Ok(roots)
}

/// The client side of mutual TLS: the daemon's CA, and this client's
/// certificate and key when it has them.
pub fn client_config(ca: &Path, cert: Option<(&Path, &Path)>) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = roots(ca).map_err(|e| format!("{e:#}"))?;
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match cert {
        Some((cert_file, key_file)) => {
            let chain = certs(cert_file).map_err(|e| format!("{e:#}"))?;
            let private = key(key_file).map_err(|e| format!("{e:#}"))?;
            builder.with_client_auth_cert(chain, private).map_err(|e| format!("using {}: {e}", cert_file.display()))?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}
