//! Certificates made at test time (rcgen) and TLS clients for the tests: a CA, a server
//! certificate for 127.0.0.1/localhost, a client certificate, an expired one, one for
//! another host and one from a CA nobody trusts.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use amp_broker::tls::{ClientFiles, ServerFiles};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::{ClientConnection, StreamOwned};

pub type TlsStream = StreamOwned<ClientConnection, TcpStream>;

struct Issuer {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn ca(name: &str) -> Issuer {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).expect("self-signed CA");
    Issuer { cert, key }
}

/// A certificate and key in PEM files.
#[derive(Debug, Clone)]
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pair {
    pub fn cert_arg(&self) -> String {
        self.cert.display().to_string()
    }
    pub fn key_arg(&self) -> String {
        self.key.display().to_string()
    }
}

pub struct Pki {
    dir: tempfile::TempDir,
    pub ca: PathBuf,
    /// For 127.0.0.1, ::1 and localhost.
    pub server: Pair,
    /// The same names, another key: what a rotation installs.
    pub server2: Pair,
    pub client: Pair,
    pub expired: Pair,
    /// For `elsewhere.example` only.
    pub wrong_host: Pair,
    /// Signed by a CA nobody trusts (`untrusted_ca`).
    pub untrusted: Pair,
    pub untrusted_ca: PathBuf,
}

impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().expect("pki dir");
        let root = ca("amp test CA");
        let other = ca("untrusted CA");
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).expect("write pem");
            path
        };
        let leaf = |name: &str, issuer: &Issuer, sans: &[&str], client: bool, expired: bool| {
            let key = KeyPair::generate().expect("leaf key");
            let mut params =
                CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                    .expect("leaf params");
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![if client {
                ExtendedKeyUsagePurpose::ClientAuth
            } else {
                ExtendedKeyUsagePurpose::ServerAuth
            }];
            if expired {
                params.not_before = rcgen::date_time_ymd(2020, 1, 1);
                params.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
            let cert = params
                .signed_by(&key, &issuer.cert, &issuer.key)
                .expect("sign leaf");
            Pair {
                cert: write(&format!("{name}.pem"), &cert.pem()),
                key: write(&format!("{name}-key.pem"), &key.serialize_pem()),
            }
        };
        let names = ["127.0.0.1", "::1", "localhost"];
        Pki {
            ca: write("ca.pem", &root.cert.pem()),
            server: leaf("server", &root, &names, false, false),
            server2: leaf("server2", &root, &names, false, false),
            client: leaf("client", &root, &["amp-client"], true, false),
            expired: leaf("expired", &root, &names, false, true),
            wrong_host: leaf("wrong-host", &root, &["elsewhere.example"], false, false),
            untrusted: leaf("untrusted", &other, &names, false, false),
            untrusted_ca: write("untrusted-ca.pem", &other.cert.pem()),
            dir,
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn ca_arg(&self) -> String {
        self.ca.display().to_string()
    }

    /// A client trusting this PKI's CA, with the client certificate when `with_cert`.
    pub fn client_config(&self, with_cert: bool) -> Arc<rustls::ClientConfig> {
        ClientFiles {
            ca: Some(self.ca.clone()),
            cert: with_cert.then(|| self.client.cert.clone()),
            key: with_cert.then(|| self.client.key.clone()),
        }
        .load()
        .expect("client config")
    }

    /// nats-server `tls {}` block lines for a pair, plus `extra` (verify, handshake_first).
    pub fn nats_tls_block(&self, pair: &Pair, extra: &str) -> String {
        format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  {extra}\n}}\n",
            pair.cert.display(),
            pair.key.display(),
            self.ca.display()
        )
    }

    pub fn server_files(&self, pair: &Pair) -> ServerFiles {
        ServerFiles {
            cert: pair.cert.clone(),
            key: pair.key.clone(),
            client_ca: None,
            require_client_cert: false,
        }
    }
}

/// A finished TLS handshake with `addr`, verifying the server as `name`.
pub fn connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    name: &str,
) -> std::io::Result<TlsStream> {
    let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    let name =
        rustls::pki_types::ServerName::try_from(name.to_string()).map_err(std::io::Error::other)?;
    let conn = ClientConnection::new(config, name).map_err(std::io::Error::other)?;
    let mut stream = StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        stream.conn.complete_io(&mut stream.sock)?;
    }
    // TLS 1.3 client certificates are judged after the client's last flight: a refused
    // one shows on the first read, which a probe write brings about.
    stream.flush()?;
    Ok(stream)
}

/// An HTTPS GET: status and body, or the error that stopped it.
pub fn https_get(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    path: &str,
) -> Result<(u16, String), String> {
    let mut stream = connect(addr, config, "127.0.0.1").map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut text = String::new();
    match stream.read_to_string(&mut text) {
        Ok(_) => {}
        // The broker closes after its response, with or without close_notify.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !text.is_empty() => {}
        Err(e) => return Err(e.to_string()),
    }
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no HTTP status in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// The leaf certificate the server presented.
pub fn peer_leaf(stream: &TlsStream) -> Vec<u8> {
    stream
        .conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default()
}

/// The DER of the first certificate in a PEM file.
pub fn leaf_der(path: &Path) -> Vec<u8> {
    amp_broker::tls::files::certificates(path)
        .expect("pem")
        .first()
        .map(|c| c.to_vec())
        .unwrap_or_default()
}
