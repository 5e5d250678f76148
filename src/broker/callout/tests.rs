use super::*;
use crate::broker::config::Namespace;
use crate::keygen::token_sha256;
use std::time::Duration;

const NOW: u64 = 1_800_000_000;
const NONCE: &str = "cHTn8hGk3u_KAxM9oU3_Lw";

struct World {
    server: KeyPair,
    account: KeyPair,
    nkey_user: KeyPair,
    config: Config,
    callout: Callout,
    start: Instant,
}

fn world() -> World {
    let server = KeyPair::generate(KeyKind::Server).expect("key");
    let account = KeyPair::generate(KeyKind::Account).expect("key");
    let nkey_user = KeyPair::generate(KeyKind::User).expect("key");
    let json = format!(
        r#"{{"namespaces":{{"acme":{{"participants":{{
            "w1":{{"token_sha256":"{}","permissions":{{"publish":["orders.>"],"subscribe":["orders.eu.*"],"send":["w2"]}}}},
            "w2":{{"nkey":"{}","permissions":{{"submit":["render"]}}}}
        }}}}}}}}"#,
        token_sha256("s3cret"),
        nkey_user.public_key()
    );
    let config = Config::parse(json.as_bytes()).expect("config");
    let mut cfg = CalloutConfig::new(account.clone());
    cfg.throttle.address_free_failures = 3;
    cfg.trusted_servers = vec![server.public_key()];
    World {
        server,
        account,
        nkey_user,
        config,
        callout: Callout::new(cfg),
        start: Instant::now(),
    }
}

/// An authorization request as nats-server builds it.
fn request(server: &KeyPair, user_nkey: &str, connect_opts: Value, nonce: bool) -> Vec<u8> {
    request_from(server, user_nkey, connect_opts, nonce, "127.0.0.1")
}

/// The same, from a client at `host` (as the server reports it).
fn request_from(
    server: &KeyPair,
    user_nkey: &str,
    connect_opts: Value,
    nonce: bool,
    host: &str,
) -> Vec<u8> {
    let mut client_info = json!({"host": host, "id": 7, "kind": "Client", "type": "nats"});
    if nonce {
        client_info["nonce"] = json!(NONCE);
    }
    let claims = json!({
        "sub": "ACALLOUTISSUER",
        "aud": AUTH_REQUEST_AUDIENCE,
        "iat": NOW,
        "exp": NOW + 2,
        "nats": {
            "server_id": {"name": "A", "host": "0.0.0.0", "id": "NSERVERID", "version": "2.15.1"},
            "user_nkey": user_nkey,
            "client_info": client_info,
            "connect_opts": connect_opts,
            "type": "authorization_request",
            "version": 2,
        },
    });
    let Value::Object(claims) = claims else {
        unreachable!("a JSON object literal")
    };
    jwt::encode(&claims, server).expect("encode").into_bytes()
}

/// A callout without throttling history that pins the world's server key.
fn fresh(w: &World) -> Callout {
    let mut cfg = CalloutConfig::new(w.account.clone());
    cfg.trusted_servers = vec![w.server.public_key()];
    Callout::new(cfg)
}

/// A request with these claims changed (`Value::Null` removes one), re-signed by `signer`.
fn request_with(signer: &KeyPair, changes: &[(&str, Value)]) -> Vec<u8> {
    let user = KeyPair::generate(KeyKind::User).expect("key").public_key();
    let base = request(
        signer,
        &user,
        json!({"user": "acme/w1", "pass": "s3cret"}),
        true,
    );
    let text = std::str::from_utf8(&base).expect("utf-8");
    let mut claims = jwt::decode(text).expect("decode").claims;
    for (name, value) in changes {
        if value.is_null() {
            claims.remove(*name);
        } else {
            claims.insert(name.to_string(), value.clone());
        }
    }
    jwt::encode(&claims, signer).expect("encode").into_bytes()
}

fn sign_nonce(key: &KeyPair, nonce: &str) -> String {
    URL_SAFE_NO_PAD.encode(key.sign(nonce.as_bytes()))
}

impl World {
    fn ask(&mut self, connect_opts: Value) -> (Reply, String) {
        self.ask_at(connect_opts, Duration::ZERO)
    }

    fn ask_at(&mut self, connect_opts: Value, after: Duration) -> (Reply, String) {
        self.ask_from("127.0.0.1", connect_opts, after)
    }

    fn ask_from(&mut self, host: &str, connect_opts: Value, after: Duration) -> (Reply, String) {
        let user = KeyPair::generate(KeyKind::User).expect("key").public_key();
        let payload = request_from(&self.server, &user, connect_opts, true, host);
        let reply = self
            .callout
            .handle(&self.config, None, &payload, self.start + after, NOW);
        (reply, user)
    }
}

/// Decodes a response and returns (its `nats` claims, the verified user JWT's claims).
fn response(w: &World, reply: &Reply, user: &str) -> (Value, Option<Claims>) {
    let text = std::str::from_utf8(&reply.payload).expect("utf-8");
    let decoded = jwt::decode(text).expect("signed response");
    assert_eq!(decoded.issuer.encode(), w.account.public_key());
    assert_eq!(
        decoded.subject(),
        Some(user),
        "sub is the server's user key"
    );
    assert_eq!(decoded.claims["aud"], json!("NSERVERID"));
    let nats = decoded.claims["nats"].clone();
    assert_eq!(nats["type"], json!("authorization_response"));
    let user_claims = nats["jwt"].as_str().map(|j| {
        let v = scoped_jwt::verify_user(j, &w.account.public_key(), NOW).expect("user jwt");
        assert_eq!(v.user_key.encode(), user);
        v.claims
    });
    (nats, user_claims)
}

fn authorized(reply: &Reply) -> Option<&str> {
    match &reply.outcome {
        Outcome::Authorized { participant } => Some(participant),
        _ => None,
    }
}

fn assert_refused(w: &World, reply: &Reply, user: &str, why: &str) {
    assert!(
        matches!(reply.outcome, Outcome::Refused { .. }),
        "{why}: {:?}",
        reply.outcome
    );
    let (nats, jwt) = response(w, reply, user);
    assert_eq!(nats["error"], json!("authentication failed"), "{why}");
    assert!(jwt.is_none(), "{why}");
}

/// A `hello` JWT of `acme/<name>` as configured in `acme`, valid 600 s from `iat`.
fn hello_jwt(account: &KeyPair, acme: &Namespace, name: &str, iat: u64) -> String {
    scoped_jwt::hello_jwt(
        account,
        "acme",
        name,
        &acme.participants[name],
        acme.topics.max_subscriptions_per_participant,
        iat,
        600,
        Some(&[]),
    )
    .expect("jwt")
}

#[test]
fn user_and_password_token_authorizes_with_the_scoped_user_jwt() {
    let mut w = world();
    for user in ["acme/w1", "acme.w1"] {
        let (reply, key) = w.ask(json!({"user": user, "pass": "s3cret", "protocol": 1}));
        assert_eq!(authorized(&reply), Some("acme/w1"));
        let (_, claims) = response(&w, &reply, &key);
        let claims = claims.expect("a user jwt");
        assert_eq!(claims["aud"], json!("$G"));
        assert_eq!(claims["name"], json!("acme/w1"));
        assert_eq!(claims["nats"]["pub"], json!({"deny": [">"]}));
        assert_eq!(
            claims["nats"]["sub"]["allow"],
            json!(["_INBOX_acme_w1.>", "amp.acme.topic.orders.eu.*"])
        );
        assert_eq!(claims["nats"]["subs"], json!(1024));
        assert_eq!(claims["exp"], json!(NOW + 3600));
    }
}

#[test]
fn wrong_token_unknown_participant_and_no_credential_are_refused_alike() {
    let mut w = world();
    let cases = [
        (json!({"user": "acme/w1", "pass": "s3cret!"}), "wrong token"),
        (
            json!({"user": "acme/nobody", "pass": "s3cret"}),
            "unknown participant",
        ),
        (
            json!({"user": "other/w1", "pass": "s3cret"}),
            "unknown namespace",
        ),
        (
            json!({"user": "acme/w2", "pass": "s3cret"}),
            "token for an nkey participant",
        ),
        (json!({"user": "w1", "pass": "s3cret"}), "not ns/name"),
        (json!({"auth_token": "guess"}), "unknown token"),
        (json!({}), "no credential"),
    ];
    for (opts, why) in cases {
        // A fresh broker each time, so throttling does not mask the check.
        w.callout = fresh(&w);
        let (reply, key) = w.ask(opts);
        assert_refused(&w, &reply, &key, why);
    }
}

#[test]
fn auth_token_alone_finds_its_participant() {
    let mut w = world();
    let (reply, _) = w.ask(json!({"auth_token": "s3cret"}));
    assert_eq!(authorized(&reply), Some("acme/w1"));
}

#[test]
fn nkey_must_sign_this_connections_nonce() {
    let mut w = world();
    let nkey = w.nkey_user.public_key();
    let good = sign_nonce(&w.nkey_user, NONCE);
    let (reply, key) = w.ask(json!({"nkey": nkey, "sig": good}));
    assert_eq!(authorized(&reply), Some("acme/w2"));
    let (_, claims) = response(&w, &reply, &key);
    assert_eq!(
        claims.expect("jwt")["nats"]["sub"]["allow"][0],
        json!("_INBOX_acme_w2.>")
    );
    // Standard base64 with padding, as some clients send it.
    let std_sig = STANDARD.encode(w.nkey_user.sign(NONCE.as_bytes()));
    let (reply, _) = w.ask(json!({"nkey": nkey, "sig": std_sig}));
    assert_eq!(authorized(&reply), Some("acme/w2"));

    let replayed = sign_nonce(&w.nkey_user, "an-older-nonce");
    let stranger = KeyPair::generate(KeyKind::User).expect("key");
    let cases = [
        (
            json!({"nkey": nkey, "sig": replayed}),
            "signature over another nonce",
        ),
        (
            json!({"nkey": nkey, "sig": sign_nonce(&stranger, NONCE)}),
            "signature by another key",
        ),
        (
            json!({"nkey": nkey, "sig": "bm90IGEgc2lnbmF0dXJl"}),
            "garbage signature",
        ),
        (json!({"nkey": nkey}), "no signature"),
        (
            json!({"nkey": stranger.public_key(), "sig": sign_nonce(&stranger, NONCE)}),
            "unknown nkey",
        ),
    ];
    for (opts, why) in cases {
        w.callout = fresh(&w);
        let (reply, key) = w.ask(opts);
        assert_refused(&w, &reply, &key, why);
    }
}

#[test]
fn a_jwt_from_hello_authenticates_with_its_signature_or_as_bearer() {
    let mut w = world();
    let acme = w.config.namespaces["acme"].clone();
    let nkey_jwt = hello_jwt(&w.account, &acme, "w2", NOW - 10);
    let bearer_jwt = hello_jwt(&w.account, &acme, "w1", NOW - 10);
    let sig = sign_nonce(&w.nkey_user, NONCE);
    let (reply, _) = w.ask(json!({"jwt": nkey_jwt, "sig": sig}));
    assert_eq!(authorized(&reply), Some("acme/w2"));
    let (reply, _) = w.ask(json!({"jwt": bearer_jwt}));
    assert_eq!(authorized(&reply), Some("acme/w1"));
    // In configuration mode the server drops `jwt`; a bearer JWT comes as the token.
    let (reply, _) = w.ask(json!({"auth_token": bearer_jwt}));
    assert_eq!(authorized(&reply), Some("acme/w1"));

    let expired = hello_jwt(&w.account, &acme, "w2", NOW - 700);
    let foreign_account = KeyPair::generate(KeyKind::Account).expect("key");
    let foreign = hello_jwt(&foreign_account, &acme, "w1", NOW);
    let mut parts: Vec<String> = bearer_jwt.split('.').map(str::to_string).collect();
    let mut claims: Value =
        serde_json::from_slice(&URL_SAFE_NO_PAD.decode(&parts[1]).expect("b64")).expect("json");
    claims["name"] = json!("acme/w2");
    parts[1] = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).expect("json"));
    let tampered = parts.join(".");
    let cases = [
        (
            json!({"jwt": nkey_jwt}),
            "non-bearer jwt without a signature",
        ),
        (
            json!({"jwt": nkey_jwt, "sig": sign_nonce(&w.nkey_user, "old")}),
            "jwt with an old nonce's signature",
        ),
        (json!({"jwt": expired, "sig": sig}), "expired jwt"),
        (json!({"jwt": foreign}), "jwt from another issuer"),
        (json!({"jwt": tampered}), "tampered jwt"),
        (json!({"jwt": "eyJ.not.ajwt"}), "malformed jwt"),
    ];
    for (opts, why) in cases {
        w.callout = fresh(&w);
        let (reply, key) = w.ask(opts);
        assert_refused(&w, &reply, &key, why);
    }
}

#[test]
fn requests_not_from_a_server_or_stale_or_encrypted_get_an_empty_reply() {
    let w = world();
    let user = KeyPair::generate(KeyKind::User).expect("key").public_key();
    let opts = json!({"user": "acme/w1", "pass": "s3cret"});
    let mut callout = fresh(&w);
    let mut ask = |payload: Vec<u8>, headers: Option<&HeaderMap>, unix: u64| {
        callout.handle(&w.config, headers, &payload, w.start, unix)
    };
    let good = request(&w.server, &user, opts.clone(), false);
    assert!(matches!(
        ask(good.clone(), None, NOW).outcome,
        Outcome::Authorized { .. }
    ));

    // In the second `exp` names (NOW + 2: the deadline rounded down) it is still answered.
    let user2 = KeyPair::generate(KeyKind::User).expect("key").public_key();
    let late_but_awaited = request(&w.server, &user2, opts.clone(), false);
    assert!(matches!(
        ask(late_but_awaited, None, NOW + 2).outcome,
        Outcome::Authorized { .. }
    ));

    let by_account = request(&w.account, &user, opts.clone(), false);
    // The server waits through the second `exp` names; the one after, it has given up.
    let stale = ask(good.clone(), None, NOW + 3);
    let mut xkey = HeaderMap::new();
    xkey.insert(SERVER_XKEY_HEADER, "XABC").expect("header");
    let bad_user = request(&w.server, "not-a-key", opts.clone(), false);
    let cases = [
        (ask(by_account, None, NOW), "signed by an account"),
        (stale, "expired request"),
        (ask(good.clone(), Some(&xkey), NOW), "encrypted"),
        (ask(b"garbage".to_vec(), None, NOW), "garbage"),
        (ask(vec![0xff, 0xfe], None, NOW), "not utf-8"),
        (ask(bad_user, None, NOW), "bad user_nkey"),
    ];
    for (reply, why) in cases {
        assert!(
            matches!(reply.outcome, Outcome::BadRequest { .. }),
            "{why}: {:?}",
            reply.outcome
        );
        assert!(reply.payload.is_empty(), "{why}");
    }

    let mut pinned = CalloutConfig::new(w.account.clone());
    pinned.trusted_servers = vec![
        KeyPair::generate(KeyKind::Server)
            .expect("key")
            .public_key(),
    ];
    let reply = Callout::new(pinned).handle(&w.config, None, &good, w.start, NOW);
    assert!(
        matches!(reply.outcome, Outcome::BadRequest { .. }),
        "untrusted server"
    );
}

#[test]
fn repeated_failures_from_a_host_are_throttled_even_with_the_right_token() {
    let mut w = world();
    for _ in 0..4 {
        let (reply, key) = w.ask(json!({"user": "acme/w1", "pass": "guess"}));
        assert_refused(&w, &reply, &key, "wrong token");
    }
    let (reply, key) = w.ask(json!({"user": "acme/w1", "pass": "s3cret"}));
    assert_refused(&w, &reply, &key, "throttled");
    assert!(matches!(&reply.outcome, Outcome::Refused { reason, .. } if reason == "throttled"));
    // After the delay the right token gets in again.
    let (reply, _) = w.ask_at(
        json!({"user": "acme/w1", "pass": "s3cret"}),
        Duration::from_secs(2),
    );
    assert_eq!(authorized(&reply), Some("acme/w1"));
}

#[test]
fn a_request_signed_by_an_unpinned_server_key_is_refused() {
    let w = world();
    let stranger = KeyPair::generate(KeyKind::Server).expect("key");
    let mut callout = fresh(&w);
    let reply = callout.handle(&w.config, None, &request_with(&stranger, &[]), w.start, NOW);
    assert!(
        matches!(&reply.outcome, Outcome::BadRequest { reason } if reason.contains("untrusted server")),
        "{:?}",
        reply.outcome
    );
    assert!(reply.payload.is_empty());
    let reply = callout.handle(&w.config, None, &request_with(&w.server, &[]), w.start, NOW);
    assert!(
        matches!(reply.outcome, Outcome::Authorized { .. }),
        "{:?}",
        reply.outcome
    );
}

#[test]
fn without_pins_only_servers_the_broker_has_met_are_trusted() {
    let w = world();
    let mut callout = Callout::new(CalloutConfig::new(w.account.clone()));
    let ask =
        |c: &mut Callout| c.handle(&w.config, None, &request_with(&w.server, &[]), w.start, NOW);
    assert!(
        matches!(ask(&mut callout).outcome, Outcome::BadRequest { .. }),
        "nothing met yet"
    );
    callout.learn_server("not a key");
    callout.learn_server(&w.account.public_key());
    assert!(
        matches!(ask(&mut callout).outcome, Outcome::BadRequest { .. }),
        "only server keys are learned"
    );
    callout.learn_server(&w.server.public_key());
    assert!(matches!(
        ask(&mut callout).outcome,
        Outcome::Authorized { .. }
    ));
}

#[test]
fn a_request_without_exp_or_expiring_far_ahead_is_refused() {
    let w = world();
    let mut callout = fresh(&w);
    let cases = [
        (
            request_with(&w.server, &[("exp", Value::Null)]),
            "without exp",
        ),
        (
            request_with(&w.server, &[("exp", json!("soon"))]),
            "without exp",
        ),
        (
            request_with(&w.server, &[("exp", json!(NOW + MAX_REQUEST_AHEAD_S + 1))]),
            "expires more than 300 s ahead",
        ),
    ];
    for (payload, why) in cases {
        let reply = callout.handle(&w.config, None, &payload, w.start, NOW);
        assert!(
            matches!(&reply.outcome, Outcome::BadRequest { reason } if reason.contains(why)),
            "{why}: {:?}",
            reply.outcome
        );
        assert!(reply.payload.is_empty(), "{why}");
    }
    let at_limit = request_with(&w.server, &[("exp", json!(NOW + MAX_REQUEST_AHEAD_S))]);
    let reply = callout.handle(&w.config, None, &at_limit, w.start, NOW);
    assert!(
        matches!(reply.outcome, Outcome::Authorized { .. }),
        "{:?}",
        reply.outcome
    );
}

#[test]
fn a_replayed_request_is_refused_until_and_after_it_expires() {
    let w = world();
    let mut callout = fresh(&w);
    let payload = request_with(&w.server, &[]);
    let first = callout.handle(&w.config, None, &payload, w.start, NOW);
    assert!(
        matches!(first.outcome, Outcome::Authorized { .. }),
        "{:?}",
        first.outcome
    );
    let again = callout.handle(&w.config, None, &payload, w.start, NOW + 1);
    assert!(
        matches!(&again.outcome, Outcome::BadRequest { reason } if reason.contains("replayed")),
        "{:?}",
        again.outcome
    );
    assert!(again.payload.is_empty());
    // Through the second `exp` names the server still waits, and the id is remembered.
    callout.prune(w.start, NOW + 2);
    let last_second = callout.handle(&w.config, None, &payload, w.start, NOW + 2);
    assert!(
        matches!(&last_second.outcome, Outcome::BadRequest { reason } if reason.contains("replayed")),
        "{:?}",
        last_second.outcome
    );
    // Once expired it is refused as expired, and its id is forgotten.
    let late = callout.handle(&w.config, None, &payload, w.start, NOW + 3);
    assert!(
        matches!(&late.outcome, Outcome::BadRequest { reason } if reason.contains("expired")),
        "{:?}",
        late.outcome
    );
    callout.prune(w.start, NOW + 3);
    assert!(callout.seen.is_empty());
}

#[test]
fn remembered_request_ids_are_bounded() {
    let w = world();
    let mut callout = fresh(&w);
    for i in 0..MAX_REMEMBERED_REQUESTS {
        callout
            .remember(&format!("id{i}"), NOW + 2, NOW)
            .expect("room");
    }
    let full = callout.remember("one-more", NOW + 2, NOW);
    assert!(full.is_err_and(|e| e.contains("too many")));
    // Expired ids make room again.
    callout
        .remember("one-more", NOW + 5, NOW + 3)
        .expect("room after expiry");
    assert_eq!(callout.seen.len(), 1);
}

#[test]
fn an_unknown_nkey_costs_the_same_signature_check_as_a_known_one() {
    let w = world();
    let stranger = KeyPair::generate(KeyKind::User).expect("key").public_key();
    let known = w.nkey_user.public_key();
    let bad_sig = sign_nonce(&w.nkey_user, "an-older-nonce");
    let time = |nkey: &str| {
        let user = KeyPair::generate(KeyKind::User).expect("key").public_key();
        let payload = request(
            &w.server,
            &user,
            json!({"nkey": nkey, "sig": bad_sig}),
            true,
        );
        let mut callout = fresh(&w);
        let t = Instant::now();
        std::hint::black_box(callout.handle(&w.config, None, &payload, w.start, NOW));
        t.elapsed()
    };
    let measure = || {
        let (mut unknown, mut wrong) = (Vec::new(), Vec::new());
        for _ in 0..31 {
            unknown.push(time(&stranger));
            wrong.push(time(&known));
        }
        // The fastest of each: other work on the machine only ever adds time, so the
        // minimum is the cost itself (a median moved with the load of parallel tests).
        (
            unknown.iter().min().copied().unwrap_or_default(),
            wrong.iter().min().copied().unwrap_or_default(),
        )
    };
    // Without the check an unknown key skips one of the three Ed25519 operations
    // (request verify, nonce verify, response signature): about 0.6 of the time, in
    // every measurement. A loaded machine (parallel crypto-heavy tests) has put single
    // measurements out of the loose bound either way, so one of three must be in it.
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (u, k) = measure();
        let ratio = u.as_secs_f64() / k.as_secs_f64();
        if (0.85..1.5).contains(&ratio) {
            return;
        }
        seen.push(format!("unknown {u:?} vs known {k:?}"));
    }
    panic!("an unknown nkey is refused faster or slower than a known one: {seen:?}");
}

#[test]
fn a_hello_jwt_stops_working_when_its_participants_credential_changes() {
    // The operator rotated a leaked token and reloaded; the sessions it opened closed.
    // The JWT a hello had handed out with it went on logging into NATS until it
    // expired, and each login had the callout issue a fresh hour.
    let mut w = world();
    let acme = w.config.namespaces["acme"].clone();
    let bearer_jwt = hello_jwt(&w.account, &acme, "w1", NOW - 10);
    let (reply, _) = w.ask(json!({"auth_token": bearer_jwt}));
    assert_eq!(authorized(&reply), Some("acme/w1"));
    if let Some(p) = w
        .config
        .namespaces
        .get_mut("acme")
        .and_then(|n| n.participants.get_mut("w1"))
        .map(std::sync::Arc::make_mut)
    {
        p.token_sha256 = Some(token_sha256("rotated"));
    }
    w.callout = fresh(&w);
    let (reply, _) = w.ask(json!({"auth_token": bearer_jwt}));
    assert_eq!(
        authorized(&reply),
        None,
        "the old credential's JWT still logs in"
    );
    // An NKey participant's too, when its key changes.
    let nkey_jwt = hello_jwt(&w.account, &acme, "w2", NOW - 10);
    if let Some(p) = w
        .config
        .namespaces
        .get_mut("acme")
        .and_then(|n| n.participants.get_mut("w2"))
        .map(std::sync::Arc::make_mut)
    {
        p.nkey = None;
        p.token_sha256 = Some(token_sha256("now-a-token"));
    }
    w.callout = fresh(&w);
    let sig = sign_nonce(&w.nkey_user, NONCE);
    let (reply, _) = w.ask(json!({"jwt": nkey_jwt, "sig": sig}));
    assert_eq!(authorized(&reply), None, "the old key's JWT still logs in");
}

#[test]
fn a_jwt_issued_for_a_hello_jwt_ends_when_that_one_does() {
    // A `hello` JWT (600 s) issued 595 s ago: five seconds left. It was exchanged for a
    // fresh full hour, and that hour's JWT for another just before it ended.
    let mut w = world();
    let acme = w.config.namespaces["acme"].clone();
    let old = hello_jwt(&w.account, &acme, "w1", NOW - 595);
    let (reply, user) = w.ask(json!({"auth_token": old}));
    assert_eq!(authorized(&reply), Some("acme/w1"));
    let (_, claims) = response(&w, &reply, &user);
    let exp = claims.expect("user jwt")["exp"].as_u64().expect("exp");
    assert_eq!(exp, NOW + 5);
    // A password login gets the configured lifetime.
    w.config.callout.jwt_ttl_s = 120;
    let (reply, user) = w.ask(json!({"user": "acme/w1", "pass": "s3cret"}));
    assert_eq!(authorized(&reply), Some("acme/w1"), "{:?}", reply.outcome);
    let (_, claims) = response(&w, &reply, &user);
    assert_eq!(claims.expect("user jwt")["exp"].as_u64(), Some(NOW + 120));
}

#[test]
fn failures_in_a_participants_name_do_not_lock_its_proofs_out() {
    // Someone without any credential connects to NATS as `acme/w2` and `acme/w1` with
    // made-up passwords, each from five hosts, emptying both participants' buckets. Their
    // proofs (w2's signature of this connection's nonce, w1's JWT from `hello`) are no
    // guesses: from a sixth host they are accepted, as `hello` accepts an NKey proof.
    let mut w = world();
    w.callout = fresh(&w);
    for (name, net) in [("acme/w1", 1), ("acme/w2", 2)] {
        for host in 1..=5 {
            for _ in 0..5 {
                let (reply, _) = w.ask_from(
                    &format!("198.51.{net}.{host}"),
                    json!({"user": name, "pass": "x"}),
                    Duration::ZERO,
                );
                assert_eq!(authorized(&reply), None);
            }
        }
    }
    let sixth = "192.0.2.6";
    let sig = sign_nonce(&w.nkey_user, NONCE);
    let nkey = w.nkey_user.public_key();
    let (reply, _) = w.ask_from(sixth, json!({"nkey": nkey, "sig": sig}), Duration::ZERO);
    assert_eq!(authorized(&reply), Some("acme/w2"), "{:?}", reply.outcome);
    let acme = w.config.namespaces["acme"].clone();
    let bearer = hello_jwt(&w.account, &acme, "w1", NOW - 10);
    let (reply, _) = w.ask_from(sixth, json!({"auth_token": bearer}), Duration::ZERO);
    assert_eq!(authorized(&reply), Some("acme/w1"), "{:?}", reply.outcome);
    // A token is a guess: from an address w1 never logged in from, it waits for the
    // bucket, as in `hello`, whichever way it comes.
    for opts in [
        json!({"user": "acme/w1", "pass": "s3cret"}),
        json!({"auth_token": "s3cret"}),
    ] {
        let (reply, _) = w.ask_from("192.0.2.7", opts, Duration::ZERO);
        assert!(
            matches!(&reply.outcome, Outcome::Refused { reason, .. } if reason == "throttled"),
            "{:?}",
            reply.outcome
        );
    }
}

/// (SHA-256 hashes, Ed25519 operations) the callout did on this thread so far.
fn work() -> (u32, u32) {
    super::WORK.with(|w| w.get())
}

#[test]
fn a_throttled_token_guess_costs_no_hash() {
    // One host guesses tokens as fast as it can connect. Past its free failures it
    // waits; its guesses meanwhile were hashed all the same (and an `auth_token` one
    // compared with every participant's), only to be refused as throttled.
    let mut w = world();
    for (host, guess) in [
        ("192.0.2.1", json!({"user": "acme/w1", "pass": "guess"})),
        ("192.0.2.2", json!({"auth_token": "guess"})),
    ] {
        let (hashes, _) = work();
        for _ in 0..50 {
            let (reply, _) = w.ask_from(host, guess.clone(), Duration::ZERO);
            assert_eq!(authorized(&reply), None);
        }
        let hashed = work().0 - hashes;
        // Three free failures, and the one after which the address waits.
        assert_eq!(hashed, 4, "50 guesses from {host} hashed {hashed} times");
    }
}

#[test]
fn past_the_request_budget_a_request_costs_nothing_and_gets_an_empty_reply() {
    // Every NATS connect is a request, and each answered one costs up to five Ed25519
    // operations: connecting in a loop took the broker's whole event loop.
    let mut w = world();
    w.config.callout.max_requests_per_s = 5;
    for second in 0..3u64 {
        let payloads: Vec<Vec<u8>> = (0..15)
            .map(|_| {
                let user = KeyPair::generate(KeyKind::User).expect("key").public_key();
                let opts = json!({"user": "acme/w1", "pass": "s3cret"});
                request(&w.server, &user, opts, true)
            })
            .collect();
        let (hashes, signatures) = work();
        let at = w.start + Duration::from_secs(second);
        let replies: Vec<Reply> = payloads
            .iter()
            .map(|p| w.callout.handle(&w.config, None, p, at, NOW))
            .collect();
        let (hashed, signed) = (work().0 - hashes, work().1 - signatures);
        // Per request within the budget: the request's signature, the user JWT's and
        // the response's.
        assert!(
            signed <= 5 * 3 && hashed <= 5,
            "second {second}: 15 requests cost {signed} Ed25519 operations and {hashed} hashes, with a budget of 5 requests"
        );
        let answered = replies.iter().filter(|r| authorized(r).is_some()).count();
        assert_eq!(answered, 5, "second {second}");
        for reply in replies.iter().filter(|r| authorized(r).is_none()) {
            assert_eq!(reply.outcome, Outcome::Shed);
            assert!(reply.payload.is_empty());
        }
    }
}

#[test]
fn a_client_host_that_is_no_address_is_throttled_all_the_same() {
    // A request whose client host is empty or not an IP address (nats-server reports
    // what it has) was neither checked nor counted: guessing from there was unlimited.
    let mut w = world();
    for host in ["", "not-an-address"] {
        w.callout = fresh(&w);
        for _ in 0..6 {
            let (reply, _) = w.ask_from(
                host,
                json!({"user": "acme/w1", "pass": "guess"}),
                Duration::ZERO,
            );
            assert_eq!(authorized(&reply), None);
        }
        let (reply, _) = w.ask_from(
            host,
            json!({"user": "acme/w1", "pass": "s3cret"}),
            Duration::ZERO,
        );
        assert!(
            matches!(&reply.outcome, Outcome::Refused { reason, .. } if reason == "throttled"),
            "host {host:?}: {:?}",
            reply.outcome
        );
    }
}
