//! The auth callout against a real nats-server: the server is configured with
//! `auth_callout`, the broker's callout handler answers `$SYS.REQ.USER.AUTH` over the
//! crate's own NATS client (authenticated as the callout's auth user), and participants
//! connect with the official Python client, nats-py. Each may subscribe to the topics its
//! permissions allow, publishes nowhere directly (writes go through the broker) and gets
//! permission violations elsewhere; wrong credentials are refused. tests/access_matrix.rs
//! holds the full matrix of what the scoped JWT allows, against the broker binary.

mod common;

use amp_broker::broker::callout::{AUTH_CALLOUT_SUBJECT, Callout, CalloutConfig, Outcome};
use amp_broker::broker::config::Config;
use amp_broker::broker::scoped_jwt;
use amp_broker::keygen::token_sha256;
use amp_broker::nats::{Client, Options};
use amp_broker::nkeys::{KeyKind, KeyPair};
use common::python::Py;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const WAIT: Duration = Duration::from_secs(15);

fn unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

struct Setup {
    server: common::NatsServer,
    broker: KeyPair,
    account: KeyPair,
    w2: KeyPair,
    config: Config,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    stop: Arc<AtomicBool>,
    service: Option<JoinHandle<()>>,
    dir: tempfile::TempDir,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.service.take() {
            let _ = h.join();
        }
    }
}

fn setup() -> Setup {
    let broker = KeyPair::generate(KeyKind::User).expect("key");
    let account = KeyPair::generate(KeyKind::Account).expect("key");
    let w2 = KeyPair::generate(KeyKind::User).expect("key");
    let server = common::NatsServer::with_config(&format!(
        r#"
authorization {{
  timeout: 3
  users: [ {{ nkey: "{broker}" }} ]
  auth_callout {{
    issuer: "{issuer}"
    auth_users: [ "{broker}" ]
  }}
}}
"#,
        broker = broker.public_key(),
        issuer = account.public_key()
    ));
    let config = Config::parse(
        json!({"namespaces": {"acme": {"participants": {
            "w1": {"token_sha256": token_sha256("s3cret"), "permissions": {
                "publish": ["orders.eu.*"], "subscribe": ["orders.>"], "send": ["w2"]}},
            "w2": {"nkey": w2.public_key(), "permissions": {
                "submit": ["render"], "serve": ["render"], "subscribe": ["news.*"]}},
        }}}})
        .to_string()
        .as_bytes(),
    )
    .expect("config");

    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = mpsc::channel();
    let service = {
        let url = server.url();
        let seed = broker.seed();
        let issuer = account.clone();
        let config = config.clone();
        let outcomes = outcomes.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let options = Options::new(&url).with_nkey_seed(&seed).expect("seed");
            let mut client = Client::connect(options).expect("the auth user connects");
            let sid = client
                .subscribe(AUTH_CALLOUT_SUBJECT, None)
                .expect("subscribe");
            client.flush(WAIT).expect("flush");
            let _ = ready_tx.send(());
            let mut callout = Callout::new(CalloutConfig::new(issuer));
            // Unpinned, the callout trusts the servers its own connection has met.
            if let Some(info) = client.connection().server_info() {
                callout.learn_server(&info.server_id);
            }
            while !stop.load(Ordering::SeqCst) {
                let Ok(Some(msg)) = client.next_message(sid, Duration::from_millis(100)) else {
                    continue;
                };
                let reply = callout.handle(
                    &config,
                    msg.headers.as_ref(),
                    &msg.payload,
                    Instant::now(),
                    unix_s(),
                );
                if let Some(to) = &msg.reply {
                    client
                        .publish(to, None, None, &reply.payload)
                        .expect("reply");
                    client.flush(WAIT).expect("flush");
                }
                if let Ok(mut o) = outcomes.lock() {
                    o.push(reply.outcome);
                }
            }
        })
    };
    ready_rx
        .recv_timeout(WAIT)
        .expect("callout service subscribed");
    Setup {
        server,
        broker,
        account,
        w2,
        config,
        outcomes,
        stop,
        service: Some(service),
        dir: tempfile::tempdir().expect("tempdir"),
    }
}

/// What the Python participant saw.
#[derive(Debug)]
struct Run {
    connected: bool,
    error: String,
    errors: Vec<String>,
    received: Vec<String>,
    /// What an unrestricted observer saw of the participant's publishes.
    observed: Vec<String>,
}

impl Run {
    fn violation(&self, kind: &str, subject: &str) -> bool {
        let needle = format!("{kind} to \"{subject}\"").to_lowercase();
        self.errors
            .iter()
            .any(|e| e.to_lowercase().contains(&needle))
    }
}

impl Setup {
    fn observer(&self) -> Client {
        let options = Options::new(&self.server.url())
            .with_nkey_seed(&self.broker.seed())
            .expect("seed");
        Client::connect(options).expect("observer connects")
    }

    /// Runs the Python participant `acme/<name>` with `credential` (nats-py connect
    /// options), making it subscribe to `subscribe` and publish to `publish`; the observer
    /// then publishes one message to each of `subscribe`.
    fn run(&self, name: &str, credential: Value, subscribe: &[&str], publish: &[&str]) -> Run {
        let mut observer = self.observer();
        let watch = observer.subscribe("amp.>", None).expect("subscribe");
        let watch_pulls = observer
            .subscribe("$JS.API.CONSUMER.MSG.NEXT.>", None)
            .expect("subscribe");
        observer.flush(WAIT).expect("flush");
        let done = &format!("_INBOX_acme_{name}.done");
        let mut spec = json!({
            "url": self.server.url(),
            "subscribe": subscribe,
            "publish": publish.iter().map(|s| [*s, "from python"]).collect::<Vec<_>>(),
            "done": done,
        });
        if let (Some(spec), Some(cred)) = (spec.as_object_mut(), credential.as_object()) {
            spec.extend(cred.clone());
        }
        let py = Py::spawn("access_probe.py", &[&spec.to_string()]);
        assert_eq!(py.line(), "READY");
        for subject in subscribe.iter().filter(|s| !s.contains(['*', '>'])) {
            observer
                .publish(subject, None, None, b"from observer")
                .expect("publish");
        }
        observer.publish(done, None, None, b"").expect("publish");
        observer.flush(WAIT).expect("flush");
        let result = py.line();
        py.finish();
        let mut observed = Vec::new();
        for sid in [watch, watch_pulls] {
            while let Ok(Some(msg)) = observer.next_message(sid, Duration::from_millis(200)) {
                if msg.payload == b"from python" {
                    observed.push(msg.subject);
                }
            }
        }
        let v: Value = serde_json::from_str(&result).expect("json result");
        // Errors are strings; received messages are {subject, data}.
        let strings = |key: &str| -> Vec<String> {
            v[key]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().or(s["subject"].as_str()))
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default()
        };
        Run {
            connected: v["connected"].as_bool().unwrap_or(false),
            error: v["error"].as_str().unwrap_or("").to_string(),
            errors: strings("errors"),
            received: strings("received"),
            observed,
        }
    }

    fn write(&self, name: &str, text: &str) -> String {
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.to_string_lossy().into_owned()
    }

    fn creds(&self, jwt: &str, seed: &str) -> String {
        self.write(
            "participant.creds",
            &format!(
                "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
                 -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
            ),
        )
    }

    fn outcomes(&self) -> Vec<Outcome> {
        self.outcomes.lock().map(|o| o.clone()).unwrap_or_default()
    }
}

#[test]
fn a_token_participant_subscribes_where_allowed_and_publishes_nowhere() {
    let s = setup();
    let writes = [
        "amp.acme.topic.orders.eu.created",
        "amp.acme.topic.orders.us.created",
        "amp.acme.inbox.w2",
        "amp.acme.inbox.w3",
        "amp.acme.job.render",
    ];
    let run = s.run(
        "w1",
        json!({"user": "acme/w1", "password": "s3cret"}),
        &[
            "amp.acme.topic.orders.eu.x",
            "amp.acme.topic.news.today",
            "amp.acme.inbox.w1",
            "amp.acme.topic.>",
        ],
        &writes,
    );
    assert!(run.connected, "{run:?}");
    // Even where its permissions let it write over WebSocket: the broker stamps the sender.
    assert!(run.observed.is_empty(), "{run:?}");
    for subject in writes {
        assert!(run.violation("publish", subject), "{subject}: {run:?}");
    }
    assert_eq!(run.received, ["amp.acme.topic.orders.eu.x"], "{run:?}");
    for subject in [
        "amp.acme.topic.news.today",
        "amp.acme.inbox.w1",
        "amp.acme.topic.>",
    ] {
        assert!(run.violation("subscription", subject), "{subject}: {run:?}");
    }
    assert!(s.outcomes().contains(&Outcome::Authorized {
        participant: "acme/w1".into()
    }));
}

#[test]
fn a_bare_token_authenticates_too() {
    let s = setup();
    let run = s.run(
        "w1",
        json!({"token": "s3cret"}),
        &["amp.acme.topic.orders.eu.x"],
        &["amp.acme.inbox.w2"],
    );
    assert!(run.connected, "{run:?}");
    assert_eq!(run.received, ["amp.acme.topic.orders.eu.x"], "{run:?}");
    assert!(run.violation("publish", "amp.acme.inbox.w2"), "{run:?}");
}

#[test]
fn an_nkey_participant_signs_the_server_nonce_and_gets_its_own_lanes() {
    let s = setup();
    let seed = s.write("w2.nk", &s.w2.seed());
    let run = s.run(
        "w2",
        json!({"nkeys_seed": seed}),
        &["amp.acme.topic.news.today", "amp.acme.topic.orders.eu.x"],
        &["amp.acme.job.render", "amp.acme.topic.news.today"],
    );
    assert!(run.connected, "{run:?}");
    assert!(run.observed.is_empty(), "{run:?}");
    assert!(run.violation("publish", "amp.acme.job.render"), "{run:?}");
    assert!(
        run.violation("publish", "amp.acme.topic.news.today"),
        "{run:?}"
    );
    assert_eq!(run.received, ["amp.acme.topic.news.today"], "{run:?}");
    assert!(
        run.violation("subscription", "amp.acme.topic.orders.eu.x"),
        "{run:?}"
    );
}

#[test]
fn a_token_participants_jwt_from_hello_is_a_bearer_token() {
    let s = setup();
    let p = &s.config.namespaces["acme"].participants["w1"];
    let jwt =
        scoped_jwt::hello_jwt(&s.account, "acme", "w1", p, 1024, unix_s(), 600, None).expect("jwt");
    // nats-server drops a client's `jwt` outside operator mode, so it travels as the token.
    let run = s.run(
        "w1",
        json!({"token": jwt}),
        &["amp.acme.topic.orders.eu.x"],
        &["amp.acme.inbox.w2"],
    );
    assert!(run.connected, "{run:?} {:?}", s.outcomes());
    assert_eq!(run.received, ["amp.acme.topic.orders.eu.x"], "{run:?}");
    assert!(run.violation("publish", "amp.acme.inbox.w2"), "{run:?}");
}

#[test]
fn wrong_credentials_are_refused() {
    let s = setup();
    let stranger = KeyPair::generate(KeyKind::User).expect("key");
    let p = s.config.namespaces["acme"].participants["w2"].clone();
    let expired = scoped_jwt::hello_jwt(
        &s.account,
        "acme",
        "w2",
        &p,
        1024,
        unix_s() - 700,
        600,
        None,
    )
    .expect("jwt");
    let foreign = KeyPair::generate(KeyKind::Account).expect("key");
    let forged =
        scoped_jwt::hello_jwt(&foreign, "acme", "w2", &p, 1024, unix_s(), 600, None).expect("jwt");
    let stranger_seed = s.write("stranger.nk", &stranger.seed());
    // Not a bearer token: without a nonce signature by w2's key it proves nothing.
    let nkey_jwt = scoped_jwt::hello_jwt(&s.account, "acme", "w2", &p, 1024, unix_s(), 600, None)
        .expect("jwt");
    let w1 = s.config.namespaces["acme"].participants["w1"].clone();
    let expired_bearer = scoped_jwt::hello_jwt(
        &s.account,
        "acme",
        "w1",
        &w1,
        1024,
        unix_s() - 700,
        600,
        None,
    )
    .expect("jwt");
    let forged_bearer =
        scoped_jwt::hello_jwt(&foreign, "acme", "w1", &w1, 1024, unix_s(), 600, None).expect("jwt");
    let mut tampered: Vec<String> =
        scoped_jwt::hello_jwt(&s.account, "acme", "w1", &w1, 1024, unix_s(), 600, None)
            .expect("jwt")
            .split('.')
            .map(str::to_string)
            .collect();
    tampered[2] = tampered[2].chars().rev().collect();
    let tampered = tampered.join(".");
    let cases = [
        (
            json!({"user": "acme/w1", "password": "wrong"}),
            "wrong password",
        ),
        (
            json!({"user": "acme/ghost", "password": "s3cret"}),
            "unknown participant",
        ),
        (json!({"token": "wrong"}), "wrong token"),
        (json!({"nkeys_seed": stranger_seed}), "unknown nkey"),
        (
            json!({"user_credentials": s.creds(&expired, &s.w2.seed())}),
            "creds with an expired jwt",
        ),
        (
            json!({"user_credentials": s.creds(&forged, &s.w2.seed())}),
            "creds from another account",
        ),
        (json!({"token": nkey_jwt}), "non-bearer jwt as a token"),
        (json!({"token": expired_bearer}), "expired bearer jwt"),
        (
            json!({"token": forged_bearer}),
            "bearer jwt from another account",
        ),
        (
            json!({"token": tampered}),
            "bearer jwt with a tampered signature",
        ),
    ];
    for (credential, why) in cases {
        let run = s.run("w1", credential, &[], &[]);
        assert!(!run.connected, "{why}: {run:?}");
        assert!(run.error.contains("Authorization"), "{why}: {run:?}");
    }
    let refused = s
        .outcomes()
        .iter()
        .filter(|o| matches!(o, Outcome::Refused { .. }))
        .count();
    assert_eq!(refused, 10, "{:?}", s.outcomes());
}
