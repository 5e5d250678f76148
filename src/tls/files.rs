//! Certificates, keys and trust anchors from PEM files, and the rustls configurations
//! built from them. One crypto provider (`ring`) and TLS 1.2/1.3 only.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// PEM files larger than this are refused (a CA bundle of a few hundred certificates is
/// well under it).
const MAX_PEM_FILE: u64 = 4 * 1024 * 1024;

/// Where a system's CA bundle usually is, for `tls://` without `--nats-tls-ca`.
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

const VERSIONS: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

fn read(path: &Path) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.len() > MAX_PEM_FILE {
        return Err(format!(
            "{}: larger than {MAX_PEM_FILE} bytes",
            path.display()
        ));
    }
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Every certificate in a PEM file, in order (leaf first for a chain).
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no CERTIFICATE in the file", path.display()));
    }
    Ok(certs)
}

/// The first private key (PKCS#8, PKCS#1 or SEC1) in a PEM file.
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| format!("{}: no private key: {e}", path.display()))
}

fn roots(path: &Path) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    for cert in certificates(path)? {
        store
            .add(cert)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(store)
}

fn system_roots() -> Result<RootCertStore, String> {
    let from_env = std::env::var_os("SSL_CERT_FILE").map(PathBuf::from);
    let path = from_env
        .into_iter()
        .chain(SYSTEM_BUNDLES.iter().map(PathBuf::from))
        .find(|p| p.is_file())
        .ok_or("no system CA bundle found (set SSL_CERT_FILE or give a CA file)")?;
    let mut store = RootCertStore::empty();
    // A bundle may hold a certificate webpki cannot use; the others still count.
    let (added, _ignored) = store.add_parsable_certificates(certificates(&path)?);
    if added == 0 {
        return Err(format!("{}: no usable CA certificate", path.display()));
    }
    Ok(store)
}

/// The listener's files: a certificate chain and its key, optionally a CA for client
/// certificates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: refuse clients without a certificate (else they are let in and
    /// only a certificate that is presented must verify).
    pub require_client_cert: bool,
}

impl ServerFiles {
    /// Reads the files and builds the configuration new handshakes use.
    pub fn load(&self) -> Result<Arc<rustls::ServerConfig>, String> {
        let chain = certificates(&self.cert)?;
        let key = private_key(&self.key)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)
            .map_err(|e| e.to_string())?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider());
                let verifier = if self.require_client_cert {
                    verifier
                } else {
                    verifier.allow_unauthenticated()
                };
                builder.with_client_cert_verifier(
                    verifier
                        .build()
                        .map_err(|e| format!("{}: {e}", ca.display()))?,
                )
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| format!("{} and {}: {e}", self.cert.display(), self.key.display()))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The NATS connection's files: whom to trust (default: the system's CA bundle) and an
/// optional client certificate for mutual TLS.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl ClientFiles {
    pub fn load(&self) -> Result<Arc<rustls::ClientConfig>, String> {
        let roots = match &self.ca {
            Some(ca) => roots(ca)?,
            None => system_roots()?,
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
        let config = match (&self.cert, &self.key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => builder
                .with_client_auth_cert(certificates(cert)?, private_key(key)?)
                .map_err(|e| format!("{} and {}: {e}", cert.display(), key.display()))?,
            _ => return Err("a client certificate needs both its certificate and its key".into()),
        };
        Ok(Arc::new(config))
    }
}
