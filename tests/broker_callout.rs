//! The broker binary as the NATS auth callout: nats-server asks it who a connecting client
//! is, and a participant connecting straight to NATS gets its scoped JWT: it may read its
//! topics, and every write goes through the broker.

mod common;

use std::time::Duration;

use amp_broker::broker::scoped_jwt;
use amp_broker::nats::{Client as NatsClient, Event, Options};
use amp_broker::nkeys::{KeyKind, KeyPair};
use common::amp::{Broker, Client, open_config};
use serde_json::json;

#[test]
fn the_broker_answers_the_auth_callout_and_hello_returns_a_scoped_jwt() {
    let broker_key = KeyPair::generate(KeyKind::User).expect("key");
    let account = KeyPair::generate(KeyKind::Account).expect("key");
    let nats = common::NatsServer::with_config(&format!(
        "authorization {{\n  users: [ {{ nkey: \"{b}\" }} ]\n  auth_callout {{\n    issuer: \"{a}\"\n    auth_users: [ \"{b}\" ]\n  }}\n}}\n",
        b = broker_key.public_key(),
        a = account.public_key()
    ));
    let dir = tempfile::tempdir().expect("dir");
    let broker_seed = dir.path().join("broker.seed");
    let issuer_seed = dir.path().join("issuer.seed");
    std::fs::write(&broker_seed, broker_key.seed()).expect("write");
    std::fs::write(&issuer_seed, account.seed()).expect("write");
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["participants"]["a"]["permissions"]["publish"] =
        json!(["orders.*"]);
    let broker = Broker::start_with(
        &nats.url(),
        &config,
        &[
            "--nats-nkey",
            &broker_seed.display().to_string(),
            "--issuer-seed-file",
            &issuer_seed.display().to_string(),
        ],
    );

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
            .contains("auth callout refused participant=acme/a"),
        "{}",
        broker.log()
    );
}
