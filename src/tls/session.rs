//! One TLS session as a byte pump: ciphertext from the socket in, plaintext out to the
//! protocol machine above; plaintext from that machine in, ciphertext out to the socket.
//! rustls is sans-IO itself; this adds the bounds the broker needs and nothing else.

use std::io::{self, Read, Write};
use std::sync::Arc;

use rustls::pki_types::ServerName;

/// Ciphertext queued for the socket beyond which no more plaintext is taken: the rest
/// stays in the machine above, inside that machine's own bound.
const MAX_QUEUED_CIPHERTEXT: usize = 64 * 1024;
/// A drained output buffer larger than this is given back, so an idle session holds
/// little.
const KEEP_CAPACITY: usize = 16 * 1024;

/// What the peer did to the session while its bytes were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// Records were taken; the session goes on.
    Open,
    /// The peer sent `close_notify`: no more plaintext will come.
    Closed,
}

#[derive(Debug)]
pub struct TlsSession {
    conn: rustls::Connection,
    out: Vec<u8>,
    out_pos: usize,
}

impl TlsSession {
    /// A client session that verifies the server against `name` (a DNS name or an IP
    /// address, checked against the certificate's SANs).
    pub fn client(config: Arc<rustls::ClientConfig>, name: &str) -> Result<Self, String> {
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| format!("{name:?} is not a valid server name: {e}"))?;
        let conn = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
        Ok(Self::wrap(conn.into()))
    }

    pub fn server(config: Arc<rustls::ServerConfig>) -> Result<Self, String> {
        let conn = rustls::ServerConnection::new(config).map_err(|e| e.to_string())?;
        Ok(Self::wrap(conn.into()))
    }

    fn wrap(mut conn: rustls::Connection) -> Self {
        // Plaintext written before the handshake ends waits inside rustls: bound it.
        conn.set_buffer_limit(Some(MAX_QUEUED_CIPHERTEXT));
        let mut session = TlsSession {
            conn,
            out: Vec::new(),
            out_pos: 0,
        };
        // A client's ClientHello is ready at once.
        session.collect_output();
        session
    }

    pub fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    /// Feeds ciphertext; each piece of plaintext it yields goes to `plain`, in order.
    /// An error is fatal for the session: its alert (if any) is queued in `output()`.
    pub fn receive(
        &mut self,
        mut ciphertext: &[u8],
        scratch: &mut [u8],
        mut plain: impl FnMut(&[u8]),
    ) -> Result<Received, String> {
        let mut state = Received::Open;
        while !ciphertext.is_empty() {
            let taken = match self.conn.read_tls(&mut ciphertext) {
                Ok(n) => n,
                Err(e) => return Err(self.fail(e.to_string())),
            };
            if let Err(e) = self.conn.process_new_packets() {
                return Err(self.fail(e.to_string()));
            }
            if self.drain_plaintext(scratch, &mut plain) {
                state = Received::Closed;
            }
            if taken == 0 {
                break;
            }
        }
        self.collect_output();
        Ok(state)
    }

    /// True when the peer closed the session.
    fn drain_plaintext(&mut self, scratch: &mut [u8], plain: &mut impl FnMut(&[u8])) -> bool {
        loop {
            match self.conn.reader().read(scratch) {
                Ok(0) => return true,
                Ok(n) => plain(scratch.get(..n).unwrap_or_default()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
    }

    fn fail(&mut self, reason: String) -> String {
        self.collect_output();
        reason
    }

    /// Encrypts as much of `plain` as the output bound takes; returns the bytes taken.
    pub fn send(&mut self, plain: &[u8]) -> usize {
        if plain.is_empty() || self.queued() >= MAX_QUEUED_CIPHERTEXT {
            return 0;
        }
        let room = MAX_QUEUED_CIPHERTEXT - self.queued();
        let piece = plain.get(..plain.len().min(room)).unwrap_or(plain);
        let taken = self.conn.writer().write(piece).unwrap_or(0);
        self.collect_output();
        taken
    }

    /// Queues a `close_notify` alert.
    pub fn close(&mut self) {
        self.conn.send_close_notify();
        self.collect_output();
    }

    fn collect_output(&mut self) {
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut self.out) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }

    /// Ciphertext waiting for the socket.
    pub fn output(&self) -> &[u8] {
        self.out.get(self.out_pos..).unwrap_or_default()
    }

    pub fn consume_output(&mut self, n: usize) {
        self.out_pos = (self.out_pos + n).min(self.out.len());
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
            if self.out.capacity() > KEEP_CAPACITY {
                self.out = Vec::new();
            }
        } else if self.out_pos >= KEEP_CAPACITY && self.out_pos * 2 >= self.out.len() {
            self.out.drain(..self.out_pos);
            self.out_pos = 0;
        }
    }

    /// Drops the ciphertext not written yet: the connection is dropped without it.
    pub fn discard_output(&mut self) {
        self.out = Vec::new();
        self.out_pos = 0;
    }

    /// Bytes of ciphertext queued, for the transport's memory accounting.
    pub fn queued(&self) -> usize {
        self.out.len() - self.out_pos
    }

    /// Writes queued ciphertext to `socket` until done or it would block. Returns the
    /// bytes written; `Err` only for a failed socket.
    pub fn write_to(&mut self, socket: &mut impl Write) -> io::Result<usize> {
        let mut written = 0;
        while !self.output().is_empty() {
            match socket.write(self.output()) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "socket took no bytes",
                    ));
                }
                Ok(n) => {
                    written += n;
                    self.consume_output(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

    fn pair() -> (TlsSession, TlsSession) {
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        let cert = params.self_signed(&key).expect("cert");
        let der = CertificateDer::from(cert.der().to_vec());
        let provider = super::super::files::provider();
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![der.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .expect("server config");
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).expect("root");
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        (
            TlsSession::client(Arc::new(client), "localhost").expect("client"),
            TlsSession::server(Arc::new(server)).expect("server"),
        )
    }

    /// Moves ciphertext from `from` to `to`; the plaintext `to` yields.
    fn shuttle(from: &mut TlsSession, to: &mut TlsSession) -> Result<Vec<u8>, String> {
        let bytes = from.output().to_vec();
        from.consume_output(bytes.len());
        let mut plain = Vec::new();
        let mut scratch = [0u8; 1024];
        to.receive(&bytes, &mut scratch, |p| plain.extend_from_slice(p))?;
        Ok(plain)
    }

    #[test]
    fn a_pair_handshakes_and_carries_bytes_both_ways_in_memory() {
        let (mut c, mut s) = pair();
        assert_eq!(
            c.send(b"early"),
            5,
            "plaintext before the handshake waits in rustls"
        );
        let mut got = Vec::new();
        for _ in 0..4 {
            got.extend(shuttle(&mut c, &mut s).expect("to server"));
            shuttle(&mut s, &mut c).expect("to client");
        }
        assert!(!c.is_handshaking() && !s.is_handshaking());
        assert_eq!(got, b"early");
        assert_eq!(s.send(b"reply"), 5);
        assert_eq!(shuttle(&mut s, &mut c).expect("reply"), b"reply");
        c.close();
        let bytes = c.output().to_vec();
        let mut scratch = [0u8; 64];
        assert_eq!(
            s.receive(&bytes, &mut scratch, |_| {}),
            Ok(Received::Closed)
        );
    }

    #[test]
    fn plaintext_is_an_error_with_an_alert_and_output_is_bounded() {
        let (_, mut s) = pair();
        let mut scratch = [0u8; 64];
        let e = s
            .receive(b"GET / HTTP/1.1\r\n\r\n", &mut scratch, |_| {})
            .expect_err("not TLS");
        assert!(!e.is_empty());
        assert!(!s.output().is_empty(), "an alert says why");

        let (mut c, mut s) = pair();
        for _ in 0..4 {
            shuttle(&mut c, &mut s).expect("to server");
            shuttle(&mut s, &mut c).expect("to client");
        }
        let big = vec![7u8; 1 << 20];
        let taken = s.send(&big);
        assert!(taken <= MAX_QUEUED_CIPHERTEXT, "{taken}");
        assert_eq!(s.send(&big), 0, "nothing more while the queue is full");
        assert!(s.queued() <= MAX_QUEUED_CIPHERTEXT + 1024, "{}", s.queued());
    }
}
