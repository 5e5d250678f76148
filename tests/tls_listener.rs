//! The listener with TLS: wss:// and https:// on one port, the plain internal listener,
//! client certificates, bad input on both kinds of port, certificate reload on SIGHUP and
//! origin checks. Real broker processes on a real nats-server; certificates made here.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::amp::{Broker, http_get, open_config};
use common::python::Py;
use common::tls::{self, Pki, TlsStream};
use common::{NatsServer, free_port, wait_until};
use serde_json::{Value, json};
use tungstenite::{ClientRequestBuilder, Message, WebSocket};

const WAIT: Duration = Duration::from_secs(10);

/// A broker whose main listener is TLS (`tls_addr`) and whose `addr` is the plain
/// internal listener the helpers probe `/healthz` on.
fn tls_broker(
    nats: &NatsServer,
    pki: &Pki,
    config: &Value,
    extra: &[&str],
) -> (Broker, SocketAddr) {
    let tls_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let plain: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let (plain_arg, tls_arg) = (plain.to_string(), tls_addr.to_string());
    let (cert, key) = (pki.server.cert_arg(), pki.server.key_arg());
    let mut args = vec![
        "--plain-listen",
        &plain_arg,
        "--listen",
        &tls_arg,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ];
    args.extend_from_slice(extra);
    let broker = Broker::start_at(plain, &nats.url(), config, &args);
    (broker, tls_addr)
}

struct Wss {
    ws: WebSocket<TlsStream>,
}

impl Wss {
    fn connect(addr: SocketAddr, config: std::sync::Arc<rustls::ClientConfig>) -> Wss {
        let stream = tls::connect(addr, config, "localhost").expect("TLS handshake");
        let uri: tungstenite::http::Uri = format!("wss://localhost:{}/amp", addr.port())
            .parse()
            .expect("uri");
        let request = ClientRequestBuilder::new(uri).with_sub_protocol("amp.v1");
        let (ws, _) = tungstenite::client(request, stream).expect("websocket upgrade");
        let mut wss = Wss { ws };
        assert_eq!(wss.next()["op"], "challenge");
        wss
    }

    fn next(&mut self) -> Value {
        loop {
            match self.ws.read().expect("read frame") {
                Message::Text(t) => return serde_json::from_str(t.as_str()).expect("json"),
                Message::Close(c) => panic!("closed: {c:?}"),
                _ => {}
            }
        }
    }

    fn request(&mut self, frame: Value) -> Value {
        let id = frame["id"].clone();
        self.ws
            .send(Message::text(frame.to_string()))
            .expect("send");
        loop {
            let f = self.next();
            if f["re"] == id {
                return f;
            }
        }
    }

    fn login(&mut self, name: &str) {
        let ok = self.request(json!({"op":"hello","id":"h","ns":"acme","name":name,
            "auth":{"type":"token","token":format!("{name}-token")}}));
        assert_eq!(ok["op"], "ok", "{ok}");
    }
}

fn alive(wss: &mut Wss, round: u32) {
    let ok = wss.request(json!({"op":"ping","id":format!("p{round}")}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

/// Bytes until the peer closes (or `WAIT` passes: then `None`).
fn read_until_closed(stream: &mut TcpStream) -> Option<Vec<u8>> {
    stream.set_read_timeout(Some(WAIT)).ok()?;
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Some(all),
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(all),
            Err(_) => return None,
        }
    }
}

#[test]
fn wss_and_https_share_the_tls_port_and_the_plain_listener_serves_internal_use() {
    let pki = Pki::new();
    let nats = NatsServer::start();
    let (broker, tls_addr) = tls_broker(&nats, &pki, &open_config(&["a", "b"]), &[]);
    let client = pki.client_config(false);

    let (status, body) = tls::https_get(tls_addr, client.clone(), "/healthz").expect("https");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, schema) = tls::https_get(tls_addr, client.clone(), "/amp/schema").expect("schema");
    assert_eq!(status, 200);
    assert!(schema.contains("\"$schema\""), "{schema}");
    let (status, metrics) = http_get(broker.addr, "/metrics").expect("plain metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("amp_tls_handshake_failures_total"),
        "{metrics}"
    );
    // With an internal listener, the public one keeps its metrics to itself: they name
    // tenants' capabilities and counts, and `/metrics` asks for no credential.
    let (status, body) = tls::https_get(tls_addr, client.clone(), "/metrics").expect("https");
    assert_eq!(
        (status, body.as_str()),
        (404, "metrics are served on the internal listener\n")
    );

    let mut a = Wss::connect(tls_addr, client.clone());
    let mut b = Wss::connect(tls_addr, client);
    a.login("a");
    b.login("b");
    let sent = a.request(json!({"op":"send","id":"s1","to":"b","body":{"hi":1}}));
    assert_eq!(sent["op"], "ok", "{sent}");
    let msg = b.next();
    assert_eq!(
        (msg["op"].as_str(), msg["from"].as_str()),
        (Some("message"), Some("acme/a"))
    );
    let acked = b.request(json!({"op":"ack","id":"a1","seq":msg["seq"]}));
    assert_eq!(acked["op"], "ok", "{acked}");
    assert!(
        broker
            .log()
            .contains(&format!("listening on wss://{tls_addr}/amp")),
        "{}",
        broker.log()
    );
}

#[test]
fn bad_input_on_either_port_closes_that_connection_only() {
    let pki = Pki::new();
    let nats = NatsServer::start();
    // TLS failures are logged at debug (any scanner causes them; a counter counts them).
    let debug = ["--log-level", "debug"];
    let (broker, tls_addr) = tls_broker(&nats, &pki, &open_config(&["a"]), &debug);
    let mut wss = Wss::connect(tls_addr, pki.client_config(false));
    wss.login("a");
    // A handshake that never finishes: half a ClientHello, then silence. The request head
    // deadline (10 s) ends it; checked last.
    let mut stalled = TcpStream::connect(tls_addr).expect("tcp");
    stalled
        .write_all(&[0x16, 0x03, 0x01, 0x00, 0x80, 0x01])
        .expect("write");
    let stalled_at = std::time::Instant::now();

    // Plaintext HTTP to the TLS port: no HTTP answer, only a TLS alert, then closed.
    let mut plain = TcpStream::connect(tls_addr).expect("tcp");
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    let answer = read_until_closed(&mut plain).expect("closed in time");
    assert!(!answer.starts_with(b"HTTP/"), "{answer:?}");
    alive(&mut wss, 1);

    // A TLS ClientHello to the plain port: closed without an HTTP answer.
    let tcp = TcpStream::connect(broker.addr).expect("tcp");
    tcp.set_read_timeout(Some(WAIT)).expect("timeout");
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    let conn = rustls::ClientConnection::new(pki.client_config(false), name).expect("tls");
    let mut stream = rustls::StreamOwned::new(conn, tcp);
    let handshake = stream.conn.complete_io(&mut stream.sock);
    assert!(handshake.is_err(), "a plain port finished a TLS handshake");
    alive(&mut wss, 2);

    // A truncated record: a record header announcing more than is sent, then EOF.
    let mut cut = TcpStream::connect(tls_addr).expect("tcp");
    cut.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00])
        .expect("write");
    cut.shutdown(std::net::Shutdown::Write).expect("half close");
    assert!(
        read_until_closed(&mut cut).is_some(),
        "truncated record not closed"
    );
    alive(&mut wss, 3);

    // An expired or untrusted certificate is the client's to refuse; a client that
    // trusts another CA refuses this server.
    let other = amp_broker::tls::ClientFiles {
        ca: Some(pki.untrusted_ca.clone()),
        cert: None,
        key: None,
    }
    .load()
    .expect("config");
    let refused = tls::connect(tls_addr, other, "localhost").expect_err("refused");
    assert!(refused.to_string().contains("UnknownIssuer"), "{refused}");
    alive(&mut wss, 4);

    let log = broker.log();
    assert!(
        wait_until(WAIT, || broker
            .log()
            .matches("ws: TLS handshake failed")
            .count()
            >= 2),
        "{log}"
    );
    assert!(
        broker.log().contains("a TLS handshake on a plain listener"),
        "{log}"
    );
    let (_, metrics) = http_get(broker.addr, "/metrics").expect("metrics");
    let failures = metrics
        .lines()
        .find(|l| l.starts_with("amp_tls_handshake_failures_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(failures >= 3.0, "{metrics}");

    stalled
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    let end = stalled.read(&mut buf);
    assert!(
        matches!(end, Ok(0))
            || end
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "a stalled handshake was not closed: {end:?}"
    );
    let took = stalled_at.elapsed();
    assert!(
        took >= Duration::from_secs(8) && took < Duration::from_secs(14),
        "{took:?}"
    );
    alive(&mut wss, 5);
}

#[test]
fn client_certificates_are_verified_and_can_be_required() {
    let pki = Pki::new();
    let nats = NatsServer::start();
    let ca = pki.ca_arg();
    let (_broker, tls_addr) = tls_broker(
        &nats,
        &pki,
        &open_config(&["a"]),
        &["--tls-client-ca", &ca, "--tls-require-client-cert"],
    );
    let (status, _) =
        tls::https_get(tls_addr, pki.client_config(true), "/healthz").expect("with a cert");
    assert_eq!(status, 200);
    let without = tls::https_get(tls_addr, pki.client_config(false), "/healthz");
    assert!(
        without.is_err(),
        "served without a client certificate: {without:?}"
    );

    let untrusted = amp_broker::tls::ClientFiles {
        ca: Some(pki.ca.clone()),
        cert: Some(pki.untrusted.cert.clone()),
        key: Some(pki.untrusted.key.clone()),
    }
    .load()
    .expect("config");
    let refused = tls::https_get(tls_addr, untrusted, "/healthz");
    assert!(
        refused.is_err(),
        "served an untrusted client certificate: {refused:?}"
    );
}

#[test]
fn sighup_reloads_the_certificate_for_new_handshakes_and_keeps_sessions() {
    let pki = Pki::new();
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().expect("dir");
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    std::fs::copy(&pki.server.cert, &cert).expect("copy");
    std::fs::copy(&pki.server.key, &key).expect("copy");
    let (cert_arg, key_arg) = (cert.display().to_string(), key.display().to_string());
    let (broker, tls_addr) = tls_broker(
        &nats,
        &pki,
        &open_config(&["a"]),
        &["--tls-cert", &cert_arg, "--tls-key", &key_arg],
    );
    let client = pki.client_config(false);
    let first = tls::connect(tls_addr, client.clone(), "localhost").expect("tls");
    assert_eq!(tls::peer_leaf(&first), tls::leaf_der(&pki.server.cert));
    let mut session = Wss::connect(tls_addr, client.clone());
    session.login("a");

    std::fs::copy(&pki.server2.cert, &cert).expect("rotate");
    std::fs::copy(&pki.server2.key, &key).expect("rotate");
    broker.signal(libc::SIGHUP);
    assert!(
        wait_until(WAIT, || broker.log().contains("TLS certificate")
            && broker.log().contains("reloaded; new handshakes use it")),
        "{}",
        broker.log()
    );
    let second = tls::connect(tls_addr, client.clone(), "localhost").expect("tls");
    assert_eq!(tls::peer_leaf(&second), tls::leaf_der(&pki.server2.cert));
    alive(&mut session, 1);

    // A bad pair (a key that is not the certificate's) is refused; the running one stays.
    std::fs::copy(&pki.server.key, &key).expect("mismatch");
    broker.signal(libc::SIGHUP);
    assert!(
        wait_until(WAIT, || broker
            .log()
            .contains("TLS certificate not reloaded")),
        "{}",
        broker.log()
    );
    let third = tls::connect(tls_addr, client, "localhost").expect("tls");
    assert_eq!(tls::peer_leaf(&third), tls::leaf_der(&pki.server2.cert));
    alive(&mut session, 2);
}

fn upgrade_status(addr: SocketAddr, origin: Option<&str>) -> u16 {
    let mut s = TcpStream::connect(addr).expect("tcp");
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    let origin = origin
        .map(|o| format!("Origin: {o}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET /amp HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: amp.v1\r\n{origin}\r\n"
    )
    .expect("write");
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).expect("read");
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    head.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[test]
fn origins_outside_the_list_get_403_and_requests_without_one_pass() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a"]);
    config["allowed_origins"] = json!(["https://app.example.com"]);
    let broker = Broker::start_with(
        &nats.url(),
        &config,
        &["--allowed-origin", "https://admin.example.com"],
    );
    assert_eq!(
        upgrade_status(broker.addr, Some("https://app.example.com")),
        101
    );
    assert_eq!(
        upgrade_status(broker.addr, Some("https://ADMIN.example.com/")),
        101
    );
    assert_eq!(
        upgrade_status(broker.addr, Some("https://evil.example.com")),
        403
    );
    assert_eq!(upgrade_status(broker.addr, Some("null")), 403);
    assert_eq!(upgrade_status(broker.addr, None), 101);

    // Without a list: only pages of the broker's own host and port.
    let plain = Broker::start(&nats.url(), &open_config(&["a"]));
    let own = format!("http://{}", plain.addr);
    assert_eq!(upgrade_status(plain.addr, Some(&own)), 101);
    assert_eq!(
        upgrade_status(plain.addr, Some("https://evil.example.com")),
        403
    );
    assert_eq!(upgrade_status(plain.addr, None), 101);
}

#[test]
fn the_readme_session_runs_over_wss_with_python_websockets() {
    let pki = Pki::new();
    let nats = NatsServer::start();
    let (_broker, tls_addr) = tls_broker(&nats, &pki, &open_config(&["alice", "bob"]), &[]);
    let url = format!("wss://localhost:{}/amp", tls_addr.port());
    let py = Py::spawn("wss_session.py", &[&url, &pki.ca_arg(), "acme"]);
    let lines: Vec<String> = (0..7).map(|_| py.line()).collect();
    assert_eq!(
        lines,
        [
            "challenge",
            "ok",
            "challenge",
            "ok",
            "ok",
            "message acme/alice {\"hi\": 1}",
            "ok"
        ]
    );
    assert_eq!(py.line(), "done");
    py.finish();
}
