//! NATS over TLS against real nats-servers with a `tls {}` block: verification of the
//! server (CA, expiry, host name), mutual TLS, TLS first, no downgrade; and the broker on
//! `tls://` doing sends, jobs and the registry, reconnecting over TLS after a restart.

mod common;

use std::time::Duration;

use amp_broker::nats::{Client, Error, Options};
use amp_broker::tls::ClientFiles;
use common::amp::{Broker, http_get};
use common::jobs::{config, login, login_serving};
use common::tls::{Pair, Pki};
use common::{NatsServer, wait_until};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

fn tls_server(pki: &Pki, pair: &Pair, extra: &str) -> NatsServer {
    NatsServer::with_config(&pki.nats_tls_block(pair, extra))
}

fn tls_url(server: &NatsServer) -> String {
    format!("tls://127.0.0.1:{}", server.port)
}

fn options(url: &str, files: ClientFiles) -> Options {
    let mut o = Options::new(url).with_tls(files.load().expect("client TLS"));
    o.connect_timeout = Duration::from_secs(3);
    o
}

fn trusting(pki: &Pki) -> ClientFiles {
    ClientFiles {
        ca: Some(pki.ca.clone()),
        ..ClientFiles::default()
    }
}

fn with_client_cert(pki: &Pki) -> ClientFiles {
    ClientFiles {
        ca: Some(pki.ca.clone()),
        cert: Some(pki.client.cert.clone()),
        key: Some(pki.client.key.clone()),
    }
}

fn round_trip(client: &mut Client) {
    let sid = client.subscribe("tls.echo", None).expect("sub");
    client.flush(WAIT).expect("flush");
    client
        .publish("tls.echo", None, None, b"over tls")
        .expect("pub");
    let msg = client
        .next_message(sid, WAIT)
        .expect("next")
        .expect("a message");
    assert_eq!(msg.payload, b"over tls");
}

fn refused(o: Options) -> String {
    match Client::connect(o) {
        Ok(_) => panic!("connected where it must be refused"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_client_upgrades_after_info_and_verifies_the_server() {
    let pki = Pki::new();
    let good = tls_server(&pki, &pki.server, "");
    let mut client = Client::connect(options(&tls_url(&good), trusting(&pki))).expect("tls://");
    assert!(client.connection().is_tls());
    round_trip(&mut client);
    // The same server by name (DNS SAN) and through a TLS configuration with nats://.
    let by_name = format!("nats://localhost:{}", good.port);
    let mut named = Client::connect(options(&by_name, trusting(&pki))).expect("by name");
    round_trip(&mut named);

    let other_ca = ClientFiles {
        ca: Some(pki.untrusted_ca.clone()),
        ..ClientFiles::default()
    };
    let e = refused(options(&tls_url(&good), other_ca));
    assert!(e.contains("UnknownIssuer"), "{e}");

    let expired = tls_server(&pki, &pki.expired, "");
    let e = refused(options(&tls_url(&expired), trusting(&pki)));
    assert!(e.contains("certificate expired"), "{e}");

    let wrong_host = tls_server(&pki, &pki.wrong_host, "");
    let e = refused(options(&tls_url(&wrong_host), trusting(&pki)));
    assert!(e.contains("not valid for name"), "{e}");
}

#[test]
fn plaintext_servers_are_never_a_downgrade_and_tls_servers_need_tls() {
    let pki = Pki::new();
    let plain = NatsServer::start();
    let e = match Client::connect(options(&tls_url(&plain), trusting(&pki))) {
        Err(Error::Tls(e)) => e,
        other => panic!("expected a TLS refusal, got {other:?}"),
    };
    assert!(e.contains("offers no TLS"), "{e}");

    let tls = tls_server(&pki, &pki.server, "");
    let e = match Client::connect(Options::new(&tls.url())) {
        Err(Error::Tls(e)) => e,
        other => panic!("expected a TLS refusal, got {other:?}"),
    };
    assert!(e.contains("requires TLS"), "{e}");
}

#[test]
fn mutual_tls_needs_the_client_certificate() {
    let pki = Pki::new();
    let server = tls_server(&pki, &pki.server, "verify: true");
    let mut client =
        Client::connect(options(&tls_url(&server), with_client_cert(&pki))).expect("mTLS");
    round_trip(&mut client);
    let e = refused(options(&tls_url(&server), trusting(&pki)));
    assert!(e.contains("TLS"), "{e}");
}

#[test]
fn tls_first_servers_are_met_with_tls_first() {
    let pki = Pki::new();
    let server = tls_server(&pki, &pki.server, "handshake_first: true");
    let mut o = options(&tls_url(&server), trusting(&pki));
    o.tls_handshake_first = true;
    let mut client = Client::connect(o).expect("TLS first");
    round_trip(&mut client);
}

#[test]
fn the_broker_on_tls_sends_runs_jobs_and_keeps_its_registry_and_reconnects_over_tls() {
    let pki = Pki::new();
    let mut nats = tls_server(&pki, &pki.server, "verify: true");
    let (ca, cert, key) = (pki.ca_arg(), pki.client.cert_arg(), pki.client.key_arg());
    let broker = Broker::start_with(
        &tls_url(&nats),
        &config(&["app", "w1"], 30, 5000),
        &[
            "--nats-tls-ca",
            &ca,
            "--nats-tls-cert",
            &cert,
            "--nats-tls-key",
            &key,
        ],
    );
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);

    let who = app.request(json!({"op":"who","job":"render"}));
    assert_eq!(who["op"], "ok", "{who}");
    let sent = app.request(json!({"op":"send","to":"w1","body":"hi"}));
    assert_eq!(sent["op"], "ok", "{sent}");
    assert_eq!(w1.next_op("message", WAIT).expect("message")["body"], "hi");
    let r = app.request(json!({"op":"submit","job":"render","task":"T1","body":1}));
    assert_eq!(r["op"], "ok", "{r}");
    assert_eq!(w1.next_op("offer", WAIT).expect("offer")["task"], "T1");
    assert_eq!(w1.request(json!({"op":"claim","task":"T1"}))["op"], "ok");
    assert_eq!(
        w1.request(json!({"op":"complete","task":"T1","result":2}))["op"],
        "ok"
    );
    let done = app.next_op("message", WAIT).expect("task_result");
    assert_eq!(done["body"]["state"], "completed", "{done}");

    nats.restart();
    assert!(
        wait_until(Duration::from_secs(20), || broker
            .log()
            .matches("NATS connection up")
            .count()
            >= 2
            && http_get(broker.addr, "/healthz").is_some_and(|(s, _)| s == 200)),
        "{}",
        broker.log()
    );
    let again = app.request(json!({"op":"send","to":"w1","body":"after restart"}));
    assert_eq!(again["op"], "ok", "{again}");
    let m = w1.next_op("message", WAIT).expect("message after restart");
    assert_eq!(m["body"], "after restart");
}
