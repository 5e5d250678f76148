//! Authentication against real nats-server: user/password, token, NKey, JWT creds, and
//! refused credentials.

mod common;

use amp_broker::jwt;
use amp_broker::nats::{Client, Error, Options, creds};
use amp_broker::nkeys::{KeyKind, KeyPair};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(5);

/// Proves the connection is usable: a round trip through a subscription.
fn assert_round_trip(c: &mut Client) {
    let sid = c.subscribe("auth.check", None).expect("sub");
    c.publish("auth.check", None, None, b"ok").expect("pub");
    let msg = c.next_message(sid, WAIT).expect("pump").expect("message");
    assert_eq!(msg.payload, b"ok");
}

#[test]
fn user_and_password_from_options_or_url_are_accepted() {
    let server = common::NatsServer::with_config(
        "authorization { users = [ {user: alice, password: \"p@ss word\"} ] }",
    );
    let mut c =
        Client::connect(Options::new(&server.url()).with_user_password("alice", "p@ss word"))
            .expect("connect with options");
    assert!(c.connection().server_info().expect("info").auth_required);
    assert_round_trip(&mut c);

    let url = format!("nats://alice:p%40ss%20word@{}", server.addr());
    let mut c = Client::connect(Options::new(&url)).expect("connect with URL credentials");
    assert_round_trip(&mut c);
}

#[test]
fn wrong_password_is_refused_with_an_authorization_error() {
    let server = common::NatsServer::with_config(
        "authorization { users = [ {user: alice, password: right} ] }",
    );
    let err = Client::connect(Options::new(&server.url()).with_user_password("alice", "wrong"))
        .expect_err("refused");
    assert_eq!(err, Error::Authorization("Authorization Violation".into()));
    assert!(err.to_string().contains("Authorization Violation"), "{err}");
    let err = Client::connect(Options::new(&server.url())).expect_err("no credentials");
    assert!(matches!(err, Error::Authorization(_)), "{err:?}");
}

#[test]
fn token_from_options_or_url_is_accepted_and_a_wrong_one_refused() {
    let server = common::NatsServer::with_config("authorization { token: \"t0k3n\" }");
    let mut c = Client::connect(Options::new(&server.url()).with_token("t0k3n")).expect("token");
    assert_round_trip(&mut c);
    let url = format!("nats://t0k3n@{}", server.addr());
    let mut c = Client::connect(Options::new(&url)).expect("token in URL");
    assert_round_trip(&mut c);
    let err = Client::connect(Options::new(&server.url()).with_token("nope")).expect_err("wrong");
    assert!(matches!(err, Error::Authorization(_)), "{err:?}");
}

#[test]
fn nkey_signs_the_nonce_and_an_unknown_key_is_refused() {
    let user = KeyPair::generate(KeyKind::User).expect("key");
    let server = common::NatsServer::with_config(&format!(
        "authorization {{ users = [ {{nkey: {}}} ] }}",
        user.public_key()
    ));
    let mut c = Client::connect(
        Options::new(&server.url())
            .with_nkey_seed(&user.seed())
            .expect("seed"),
    )
    .expect("nkey accepted");
    assert_round_trip(&mut c);

    let stranger = KeyPair::generate(KeyKind::User).expect("key");
    let err = Client::connect(
        Options::new(&server.url())
            .with_nkey_seed(&stranger.seed())
            .expect("seed"),
    )
    .expect_err("unknown key");
    assert!(matches!(err, Error::Authorization(_)), "{err:?}");
}

#[test]
fn creds_file_authenticates_in_operator_mode() {
    let (server, account) = common::operator_mode_server();
    let user = KeyPair::generate(KeyKind::User).expect("user");
    let user_jwt = jwt::encode(
        &jwt::user_claims(&user.public_key(), "test-user", None),
        &account,
    )
    .expect("user jwt");
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("user.creds");
    std::fs::write(&path, creds::format(&user_jwt, &user.seed())).expect("write creds");

    let mut c = Client::connect(
        Options::new(&server.url())
            .with_credentials_file(&path)
            .expect("creds file"),
    )
    .expect("creds accepted");
    assert_round_trip(&mut c);
}

#[test]
fn creds_signed_by_an_untrusted_account_are_refused() {
    let (server, _account) = common::operator_mode_server();
    let rogue = KeyPair::generate(KeyKind::Account).expect("rogue account");
    let user = KeyPair::generate(KeyKind::User).expect("user");
    let user_jwt =
        jwt::encode(&jwt::user_claims(&user.public_key(), "u", None), &rogue).expect("user jwt");
    let err = Client::connect(
        Options::new(&server.url())
            .with_credentials(&creds::format(&user_jwt, &user.seed()))
            .expect("creds text"),
    )
    .expect_err("refused");
    assert!(matches!(err, Error::Authorization(_)), "{err:?}");
}

#[test]
fn malformed_creds_file_is_a_credentials_error_before_connecting() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("bad.creds");
    std::fs::write(&path, "not a creds file").expect("write");
    let err = Options::new("nats://127.0.0.1:1")
        .with_credentials_file(&path)
        .expect_err("malformed");
    assert!(matches!(err, Error::Credentials(_)), "{err:?}");
    let err = Options::new("nats://127.0.0.1:1")
        .with_credentials_file(dir.path().join("missing.creds"))
        .expect_err("missing");
    assert!(err.to_string().contains("missing.creds"), "{err}");
}
