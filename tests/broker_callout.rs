//! The broker binary as the NATS auth callout: nats-server asks it who a connecting client
//! is, and a participant connecting straight to NATS gets its scoped JWT: it may read its
//! topics, and every write goes through the broker.

mod common;

use std::time::Duration;

use amp_broker::broker::scoped_jwt;
use amp_broker::nats::{Client as NatsClient, Event, Options, creds};
use amp_broker::nkeys::{KeyKind, KeyPair};
use common::amp::{CalloutServer, Client, metric, open_config};
use serde_json::json;

#[test]
fn the_broker_answers_the_auth_callout_and_hello_returns_a_scoped_jwt() {
    let callout = CalloutServer::start();
    let (nats, account) = (&callout.nats, &callout.account);
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["participants"]["a"]["permissions"]["publish"] =
        json!(["orders.*"]);
    let broker = callout.broker(&config, &[]);

    let mut c = Client::connect(&broker);
    let ok = c.request(
        json!({"op":"hello","ns":"acme","name":"a","auth":{"type":"token","token":"a-token"}}),
    );
    let jwt = ok["jwt"].as_str().expect("hello returns a JWT");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    scoped_jwt::verify_user(jwt, &account.public_key(), now)
        .expect("signed by the issuing account");

    let participant = Options::new(&nats.url()).with_user_password("acme/a", "a-token");
    let mut direct = NatsClient::connect(participant).expect("the callout admits the participant");
    // Allowed over WebSocket, but on NATS the broker would not stamp the sender.
    direct
        .publish("amp.acme.topic.orders.eu", None, None, b"{}")
        .expect("publish");
    let mut violation = None;
    let _ = direct.run_until(Duration::from_secs(5), |event| {
        if let Event::ServerError(text) = event {
            violation = Some(text.clone());
            return true;
        }
        false
    });
    let violation = violation.expect("a permission violation for the direct publish");
    assert!(
        violation.contains("Permissions Violation")
            && violation.contains("amp.acme.topic.orders.eu"),
        "{violation}"
    );

    let wrong = Options::new(&nats.url()).with_user_password("acme/a", "nope");
    assert!(
        NatsClient::connect(wrong).is_err(),
        "a wrong credential is refused"
    );
    assert!(
        broker
            .log()
            .lines()
            .any(|l| l.contains("participant=acme/a") && l.contains("auth callout refused")),
        "{}",
        broker.log()
    );
}

/// A request as nats-server builds it, signed by `server` (for a forged one).
fn forged_request(server: &KeyPair, user: &str, pass: &str) -> Vec<u8> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let user_nkey = KeyPair::generate(KeyKind::User).expect("key").public_key();
    let claims = json!({
        "sub": user_nkey, "aud": "nats-authorization-request", "iat": now, "exp": now + 2,
        "nats": {
            "server_id": {"name": "forged", "host": "0.0.0.0", "id": server.public_key()},
            "user_nkey": user_nkey,
            "client_info": {"host": "127.0.0.1", "id": 99, "kind": "Client", "type": "client"},
            "connect_opts": {"user": user, "pass": pass, "protocol": 1},
            "type": "authorization_request", "version": 2,
        },
    });
    let serde_json::Value::Object(claims) = claims else {
        unreachable!("an object literal")
    };
    amp_broker::jwt::encode(&claims, server)
        .expect("encode")
        .into_bytes()
}

#[test]
fn the_callout_answers_only_requests_signed_by_the_pinned_server_key() {
    let callout = CalloutServer::start();
    let (nats, broker_key) = (&callout.nats, &callout.broker_key);
    // An operator learns the key to pin from the server's INFO: its server_id is the
    // server's public NKey, the `iss` of every callout request it signs.
    let options = Options::new(&nats.url())
        .with_nkey_seed(&broker_key.seed())
        .expect("seed");
    let mut probe = NatsClient::connect(options).expect("connects");
    let server_key = probe
        .connection()
        .server_info()
        .map(|info| info.server_id.clone())
        .expect("INFO");
    assert!(
        server_key.starts_with('N') && server_key.len() == 56,
        "{server_key}"
    );

    let participant = || Options::new(&nats.url()).with_user_password("acme/a", "a-token");
    let other_key = KeyPair::generate(KeyKind::Server)
        .expect("key")
        .public_key();
    let mut wrong_pin = callout.broker(&open_config(&["a"]), &["--callout-server-key", &other_key]);
    assert!(
        NatsClient::connect(participant()).is_err(),
        "a broker pinned to another server key does not answer this server"
    );
    assert!(
        wrong_pin
            .log()
            .contains(&format!("request signed by untrusted server {server_key}")),
        "{}",
        wrong_pin.log()
    );
    wrong_pin.kill();

    let _pinned = callout.broker(&open_config(&["a"]), &["--callout-server-key", &server_key]);
    NatsClient::connect(participant()).expect("the pinned server's requests are answered");

    // nats-server itself refuses client publishes on the callout subject, so forged and
    // replayed requests (refused by the broker too, see callout/tests.rs) cannot come
    // from a client of this server.
    let forged = forged_request(
        &KeyPair::generate(KeyKind::Server).expect("key"),
        "acme/a",
        "a-token",
    );
    probe
        .publish("$SYS.REQ.USER.AUTH", Some("_INBOX.forged"), None, &forged)
        .expect("publish");
    let mut violation = None;
    let _ = probe.run_until(Duration::from_secs(5), |event| {
        if let Event::ServerError(text) = event {
            violation = Some(text.clone());
            return true;
        }
        false
    });
    assert!(
        violation.is_some_and(
            |v| v.contains("Permissions Violation") && v.contains("$SYS.REQ.USER.AUTH")
        ),
        "nats-server refuses a client's publish on the callout subject"
    );
}

#[test]
fn brokers_sharing_the_callout_answer_each_connect_once() {
    // Brokers with the same issuer on one server each got every request and each did
    // all its work (signatures checked and made), the server taking whichever answer
    // came first. In a queue group each request goes to one of them.
    let callout = CalloutServer::start();
    let config = open_config(&["a"]);
    let brokers = [callout.broker(&config, &[]), callout.broker(&config, &[])];
    let authorized = |b: &common::amp::Broker| {
        metric(b, "amp_callout_requests_total{outcome=\"authorized\"}").unwrap_or(0.0)
    };
    let connect = || {
        let options = Options::new(&callout.nats.url()).with_user_password("acme/a", "a-token");
        NatsClient::connect(options).expect("the callout admits the participant");
    };
    // Until both have answered one, so both are subscribed.
    let mut connects = 0;
    while brokers.iter().any(|b| authorized(b) == 0.0) {
        assert!(
            connects < 100,
            "one broker answered none of {connects} connects"
        );
        connect();
        connects += 1;
    }
    for _ in 0..20 {
        connect();
        connects += 1;
    }
    let answered = || brokers.iter().map(authorized).sum::<f64>();
    assert!(
        common::wait_until(Duration::from_secs(10), || answered()
            >= f64::from(connects)),
        "{} answers to {connects} connects",
        answered()
    );
    assert_eq!(
        answered(),
        f64::from(connects),
        "answers to {connects} connects"
    );
}

/// `acme` with token participant `a`, whose subscriptions are capped at `cap`.
fn capped_config(cap: usize) -> serde_json::Value {
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["topics"] = json!({
        "max_subscriptions_per_session": cap,
        "max_subscriptions_per_participant": cap,
    });
    config
}

/// Subscribes `n` times under the reply prefix of `acme/a` and returns the server's
/// refusals, lower case (nats-server has spelled them both ways).
fn subscribe_under_own_prefix(direct: &mut NatsClient, n: usize) -> Vec<String> {
    for i in 0..n {
        direct
            .subscribe(&format!("_INBOX_acme_a.own.{i}"), None)
            .expect("subscribe");
    }
    // The server answers every SUB before the flush's PONG.
    direct.flush(Duration::from_secs(5)).expect("flush");
    direct
        .take_events()
        .into_iter()
        .filter_map(|event| match event {
            Event::ServerError(text) => Some(text.to_lowercase()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_hello_jwt_holds_its_connection_to_the_participant_subscription_cap() {
    // Over WebSocket a participant holds at most `max_subscriptions_per_participant`
    // subscriptions; its NATS connection was unlimited (`"subs": -1`) on the shared
    // server, where its reply prefix `_INBOX_<ns>_<name>.>` takes any number of subjects.
    // nats-server applies a user JWT's limits when the client presents it: an
    // operator-mode server that trusts the issuing account.
    const CAP: usize = 8;
    let (server, account) = common::operator_mode_server();
    let dir = tempfile::tempdir().expect("dir");
    let broker_user = KeyPair::generate(KeyKind::User).expect("key");
    let broker_jwt = amp_broker::jwt::encode(
        &amp_broker::jwt::user_claims(&broker_user.public_key(), "broker", None),
        &account,
    )
    .expect("jwt");
    let (creds, seed) = (
        dir.path().join("broker.creds"),
        dir.path().join("issuer.seed"),
    );
    std::fs::write(&creds, creds::format(&broker_jwt, &broker_user.seed())).expect("write");
    std::fs::write(&seed, account.seed()).expect("write");
    let (creds, seed) = (creds.display().to_string(), seed.display().to_string());
    let broker = common::amp::Broker::start_with(
        &server.url(),
        &capped_config(CAP),
        &["--nats-creds", &creds, "--issuer-seed-file", &seed],
    );
    let mut c = Client::connect(&broker);
    let ok = c.request(
        json!({"op":"hello","ns":"acme","name":"a","auth":{"type":"token","token":"a-token"}}),
    );
    let jwt = ok["jwt"].as_str().expect("hello returns a JWT");
    // A token participant's JWT is a bearer token: the seed signs nothing that counts.
    let any_seed = KeyPair::generate(KeyKind::User).expect("key").seed();
    let options = Options::new(&server.url())
        .with_credentials(&creds::format(jwt, &any_seed))
        .expect("creds")
        .with_inbox_prefix("_INBOX_acme_a");
    let mut direct = NatsClient::connect(options).expect("the hello JWT admits the participant");
    assert_eq!(
        subscribe_under_own_prefix(&mut direct, CAP + 1),
        ["maximum subscriptions exceeded"],
        "subscription {} of a cap of {CAP}",
        CAP + 1
    );
    assert!(direct.is_connected(), "the server keeps the connection");
}

#[test]
fn nats_server_applies_no_limit_of_a_user_jwt_from_the_callout() {
    // The callout's JWT carries the same `subs` as `hello`'s, but nats-server 2.15.1 takes
    // only its permissions: it drops the client's JWT before it applies user limits
    // (README "Direct NATS access"). Should a release apply them, this fails and the
    // README's caveat goes.
    const CAP: usize = 8;
    let callout = CalloutServer::start();
    let _broker = callout.broker(&capped_config(CAP), &[]);
    let options = Options::new(&callout.nats.url())
        .with_user_password("acme/a", "a-token")
        .with_inbox_prefix("_INBOX_acme_a");
    let mut direct = NatsClient::connect(options).expect("the callout admits the participant");
    assert_eq!(
        subscribe_under_own_prefix(&mut direct, CAP + 1),
        Vec::<String>::new()
    );
}
