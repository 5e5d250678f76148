//! MIG v0.1 over NATS (README "MIG over NATS", mig-nats.md): nats-py as the MIG client on a
//! real nats-server whose auth callout is the broker, AMP workers over WebSocket.
//! TLS on the NATS side is not used yet; it comes with the TLS work on `src/nats`.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use amp_broker::nkeys::{KeyKind, KeyPair};
use common::amp::{Broker, CalloutServer, Client, http_get, token_hash};
use common::python::require_nats_py;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);
const INFER: &str = "observatory.models.infer";

/// A running `tests/interop/mig_client.py`.
struct Mig {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<Value>,
    /// Answers read while waiting for another tag.
    early: HashMap<String, Value>,
    next: u64,
    name: String,
}

impl Mig {
    /// Connects as `acme/<name>` with its token and its reply prefix as inbox prefix.
    fn connect(world: &World, name: &str) -> Mig {
        let credential =
            json!({"user": format!("acme/{name}"), "password": format!("{name}-token")});
        Mig::connect_as(world, name, credential)
    }

    fn send(&mut self, mut cmd: Value) -> String {
        self.next += 1;
        let tag = format!("t{}", self.next);
        cmd["tag"] = json!(tag);
        writeln!(self.stdin, "{cmd}").expect("write to python");
        self.stdin.flush().expect("flush");
        tag
    }

    fn wait(&mut self, tag: &str) -> Value {
        if let Some(v) = self.early.remove(tag) {
            return v;
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no answer for {tag} from the python client"));
            let t = v["tag"].as_str().unwrap_or("").to_string();
            if t == tag {
                return v;
            }
            self.early.insert(t, v);
        }
    }

    fn call(&mut self, cmd: Value) -> Value {
        let tag = self.send(cmd);
        self.wait(&tag)
    }

    /// A MIG request with the caller's token as `Authorization`; the reply body.
    fn request(&mut self, op: &str, body: Value) -> Value {
        let auth = format!("Bearer {}-token", self.name);
        self.request_with(op, body, json!({"Authorization": auth}))
    }

    fn request_with(&mut self, op: &str, body: Value, headers: Value) -> Value {
        let r = self.call(
            json!({"cmd": "request", "subject": format!("mig.v0_1.acme.{op}"),
            "body": body, "headers": headers, "timeout": 15}),
        );
        assert!(r.get("error").is_none(), "{op}: {r}");
        r["reply"].clone()
    }

    /// A MIG request signed with Ann's NKey (what PUBLISH takes), with a fresh message id.
    fn signed(&mut self, w: &World, op: &str, mut body: Value) -> Value {
        use base64::Engine;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = format!(
            "s{}",
            NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        );
        let ts = amp_broker::rfc3339::format_system_time(std::time::SystemTime::now());
        let signed = format!("{id}\n{ts}\nmig.v0_1.acme.{op}");
        let sig =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(w.ann.sign(signed.as_bytes()));
        body["header"]["message_id"] = json!(id);
        body["header"]["timestamp"] = json!(ts);
        let auth = format!("NKey {} {sig}", w.ann.public_key());
        self.request_with(op, body, json!({"Authorization": auth}))
    }

    /// A request signed by `key` with message id `id` at `ts` (the same three make the
    /// same signature, as a resend of one request has).
    fn signed_as(&mut self, key: &KeyPair, id: &str, ts: &str, op: &str, mut body: Value) -> Value {
        use base64::Engine;
        let signed = format!("{id}\n{ts}\nmig.v0_1.acme.{op}");
        let sig =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key.sign(signed.as_bytes()));
        body["header"]["message_id"] = json!(id);
        body["header"]["timestamp"] = json!(ts);
        let auth = format!("NKey {} {sig}", key.public_key());
        self.request_with(op, body, json!({"Authorization": auth}))
    }

    /// The answer of `tag` if it came already.
    fn answered(&mut self, tag: &str) -> Option<Value> {
        while let Ok(v) = self.lines.try_recv() {
            let t = v["tag"].as_str().unwrap_or("").to_string();
            self.early.insert(t, v);
        }
        self.early.remove(tag)
    }

    /// Sends an invoke in the background; `wait` gives its answer.
    fn invoke_later(&mut self, capability: &str, body: Value) -> String {
        let auth = format!("Bearer {}-token", self.name);
        self.send(
            json!({"cmd": "request", "subject": format!("mig.v0_1.acme.invoke.{capability}"),
            "body": body, "headers": {"Authorization": auth}, "timeout": 15, "wait": false}),
        )
    }
}

impl Drop for Mig {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "exit"}));
        let _ = self.stdin.flush();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct World {
    brokers: Vec<Broker>,
    callout: CalloutServer,
    ann: KeyPair,
    /// Holds Ann's seed file.
    dir: tempfile::TempDir,
    /// The NATS side runs TLS with this PKI (brokers and MIG clients verify its CA).
    tls: Option<common::tls::Pki>,
    /// The brokers' configuration.
    config: Value,
}

fn config(ann: &KeyPair) -> Value {
    let token = |name: &str| json!(token_hash(&format!("{name}-token")));
    let cap = |id: &str| {
        json!({"id": id, "version": "1.2.0", "modes": ["unary", "server_stream"],
        "input_schema_uri": format!("schema://{id}/in"), "output_schema_uri": format!("schema://{id}/out"),
        "auth_scopes": ["capability:infer"]})
    };
    json!({
        "mig": {"enabled": true},
        // Registry entries (serving slots and leases, for HEARTBEAT) refresh every second.
        "limits": {"registry_ttl_s": 3},
        "namespaces": {"acme": {
            "participants": {
                "alice": {"token_sha256": token("alice"), "permissions": {"submit": ["infer", "idle", "small"],
                          "publish": ["orders.>"], "subscribe": ["orders.>"]}},
                "bob": {"token_sha256": token("bob"), "permissions": {"submit": ["infer"], "subscribe": ["news.*"]}},
                "carol": {"token_sha256": token("carol"), "permissions": {}},
                "dave": {"token_sha256": token("dave"), "permissions": {"submit": ["infer"]},
                         "policy": {"msgs_per_s": 0.01, "burst": 1}},
                "ann": {"nkey": ann.public_key(), "permissions": {"submit": ["infer"],
                        "publish": ["orders.>"], "subscribe": ["orders.>"]}},
                "eve": {"token_sha256": token("eve"), "permissions": {"subscribe": ["orders.>"]}},
                "erin": {"token_sha256": token("erin"), "permissions": {"submit": ["infer"]},
                         "policy": {"tasks_per_window": 2, "window_s": 3600}},
                "worker": {"token_sha256": token("worker"), "permissions": {"serve": ["infer", "idle", "small"]}}
            },
            "jobs": {
                "infer": {"max_attempts": 1, "mig": cap(INFER)},
                "idle": {"mig": {"id": "observatory.idle"}},
                "small": {"max_queued": 1, "mig": {"id": "observatory.small"}},
                "plain": {}
            }
        }}
    })
}

fn world(brokers: usize) -> World {
    world_with(brokers, None)
}

/// The NATS side on TLS (the broker's connection and every MIG client's), with the auth
/// callout as always.
fn tls_world(brokers: usize) -> World {
    world_with(brokers, Some(common::tls::Pki::new()))
}

fn world_with(brokers: usize, tls: Option<common::tls::Pki>) -> World {
    world_configured(brokers, tls, |_| {})
}

fn world_configured(
    brokers: usize,
    tls: Option<common::tls::Pki>,
    tweak: impl FnOnce(&mut Value),
) -> World {
    let ann = KeyPair::generate(KeyKind::User).expect("key");
    let tls_block = tls
        .as_ref()
        .map(|pki| pki.nats_tls_block(&pki.server, ""))
        .unwrap_or_default();
    let callout = CalloutServer::start_with(&tls_block);
    let mut config = config(&ann);
    tweak(&mut config);
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(dir.path().join("ann.seed"), ann.seed()).expect("seed");
    let mut w = World {
        brokers: Vec::new(),
        callout,
        ann,
        dir,
        tls,
        config,
    };
    let url = w.nats_url();
    for _ in 0..brokers {
        w.add_broker(&url);
    }
    w.await_mig();
    w
}

impl World {
    /// One more broker of the world's configuration, connecting to `url` (the server's,
    /// or a relay's in front of it).
    fn add_broker(&mut self, url: &str) {
        let ca = self.tls.as_ref().map(|pki| pki.ca_arg());
        let extra: Vec<&str> = match &ca {
            Some(ca) => vec!["--nats-tls-ca", ca],
            None => Vec::new(),
        };
        let broker = self.callout.broker_at(url, &self.config, &extra);
        self.brokers.push(broker);
    }

    fn nats_url(&self) -> String {
        match &self.tls {
            Some(_) => format!("tls://{}", self.callout.nats.addr()),
            None => self.callout.nats.url(),
        }
    }

    /// Waits until every broker answers MIG requests.
    fn await_mig(&self) {
        let mut m = Mig::connect(self, "alice");
        let deadline = Instant::now() + WAIT;
        let mut answered = 0;
        while answered < self.brokers.len() * 4 {
            let r = m.call(json!({"cmd": "request", "subject": "mig.v0_1.acme.hello",
                "body": {"header": {"tenant_id": "acme"}}, "headers": {"Authorization": "Bearer alice-token"}, "timeout": 1}));
            if r.get("reply").is_some() {
                answered += 1;
            }
            assert!(Instant::now() < deadline, "MIG not answering: {r}");
        }
    }

    fn worker(&self, broker: usize, job: &str, slots: u32) -> Client {
        let mut c = Client::connect(&self.brokers[broker]);
        let ok = c.request(json!({
            "op":"hello","ns":"acme","name":"worker",
            "auth":{"type":"token","token":"worker-token"},
            "serve":[{"job":job,"slots":slots}]
        }));
        assert_eq!(ok["op"], "ok", "hello: {ok}");
        c
    }

    fn amp_client(&self, broker: usize, name: &str) -> Client {
        Client::login(
            &self.brokers[broker],
            "acme",
            name,
            &format!("{name}-token"),
        )
    }

    fn metrics(&self, broker: usize) -> String {
        http_get(self.brokers[broker].addr, "/metrics")
            .map(|(_, body)| body)
            .unwrap_or_default()
    }
}

fn header(extra: Value) -> Value {
    let mut h = json!({"tenant_id": "acme"});
    if let (Some(h), Some(e)) = (h.as_object_mut(), extra.as_object()) {
        h.extend(e.clone());
    }
    h
}

fn error_code(reply: &Value) -> &str {
    reply["error"]["code"].as_str().unwrap_or("")
}

/// Takes the next offer and answers it with `answer` (`complete` with a result, or `fail`).
fn serve_one(worker: &mut Client, answer: Value) -> Value {
    let offer = worker.next_op("offer", WAIT).expect("an offer");
    let task = offer["task"].as_str().expect("task").to_string();
    let claim = worker.request(json!({"op":"claim","task":task}));
    assert_eq!(claim["op"], "ok", "claim: {claim}");
    let mut frame = answer;
    frame["task"] = json!(task);
    let done = worker.request(frame);
    assert_eq!(done["op"], "ok", "outcome: {done}");
    offer
}

#[test]
fn migd_smoke_checks_hello_discover_and_an_invoke_with_only_a_tenant() {
    // Over TLS on the NATS side, as an exposed deployment runs it.
    let w = tls_world(1);
    let mut worker = w.worker(0, "infer", 2);
    let mut alice = Mig::connect(&w, "alice");

    let hello = alice.request(
        "hello",
        json!({"header": header(json!({})), "supported_versions": ["0.1"], "requested_bindings": ["nats"]}),
    );
    assert!(hello.get("error").is_none(), "{hello}");
    assert_eq!(hello["selected_version"], "0.1");
    assert_eq!(hello["selected_binding"], "nats");
    assert_eq!(hello["header"]["tenant_id"], "acme");

    let discover = alice.request("discover", json!({"header": header(json!({}))}));
    assert!(discover.get("error").is_none(), "{discover}");
    let ids: Vec<&str> = discover["capabilities"]
        .as_array()
        .expect("capabilities")
        .iter()
        .filter_map(|c| c["id"].as_str())
        .collect();
    assert_eq!(ids, ["observatory.idle", INFER, "observatory.small"]);
    let infer = &discover["capabilities"][1];
    assert_eq!(infer["version"], "1.2.0");
    assert_eq!(infer["input_schema_uri"], format!("schema://{INFER}/in"));
    assert_eq!(infer["qos"]["delivery_semantics"], "at_least_once");
    assert_eq!(infer["qos"]["supports_replay"], true);

    let tag = alice.invoke_later(
        INFER,
        json!({"header": {"tenant_id": "acme"}, "payload": {"input": "x"}}),
    );
    let offer = serve_one(
        &mut worker,
        json!({"op":"complete","result":{"output":"y"}}),
    );
    assert_eq!(offer["body"], json!({"input": "x"}));
    assert_eq!(offer["from"], "acme/alice");
    assert_eq!(offer["headers"]["tenant_id"], "acme");
    let r = alice.wait(&tag);
    let reply = &r["reply"];
    assert!(reply.get("error").is_none(), "{r}");
    assert_eq!(reply["capability"], INFER);
    assert_eq!(reply["payload"], json!({"output": "y"}));
    assert_eq!(r["headers"]["tenant_id"], "acme");
    assert_eq!(r["headers"]["mig_version"], "0.1");
    assert_eq!(r["headers"]["message_id"], reply["header"]["message_id"]);

    // Discover is scoped to what the caller may invoke.
    let mut carol = Mig::connect(&w, "carol");
    let none = carol.request("discover", json!({"header": header(json!({}))}));
    assert_eq!(none["capabilities"], json!([]));
    let some = alice.request(
        "discover",
        json!({"header": header(json!({})), "query": "small", "include_qos": false, "include_schema_refs": false}),
    );
    assert_eq!(some["capabilities"].as_array().map(Vec::len), Some(1));
    assert!(some["capabilities"][0].get("qos").is_none());
    assert!(some["capabilities"][0].get("input_schema_uri").is_none());

    let metrics = w.metrics(0);
    assert!(
        metrics.contains(&format!(
            "amp_mig_requests_total{{op=\"invoke\",capability=\"{INFER}\",code=\"OK\"}} 1"
        )),
        "{metrics}"
    );
    assert!(metrics.contains("amp_mig_request_seconds_count{op=\"invoke\"} 1"));
    let log = w.brokers[0].log();
    assert!(
        log.contains("mig invocation")
            && log.contains("actor=acme/alice")
            && log.contains("outcome=success"),
        "{log}"
    );
}

#[test]
fn every_error_code_with_a_trigger() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let h = || json!({"tenant_id": "acme"});

    // Credentials.
    let r = alice.request_with(
        "discover",
        json!({"header": h()}),
        json!({"Authorization": "Bearer wrong"}),
    );
    assert_eq!(error_code(&r), "MIG_UNAUTHORIZED", "{r}");
    assert_eq!(r["error"]["retryable"], false);
    assert!(r["error"]["details"].is_object());
    let r = alice.request_with("discover", json!({"header": h()}), json!({}));
    assert_eq!(error_code(&r), "MIG_UNAUTHORIZED", "{r}");

    // Body and header.
    let r = alice.request("discover", json!("not json {"));
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
    let r = alice.request_with(
        "discover",
        json!({"header": {"tenant_id": "acme", "message_id": "a"}}),
        json!({"Authorization": "Bearer alice-token", "message_id": "b"}),
    );
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
    let r = alice.request(
        "discover",
        json!({"header": {"tenant_id": "acme", "mig_version": "0.2"}}),
    );
    assert_eq!(error_code(&r), "MIG_VERSION_MISMATCH", "{r}");
    let r = alice.request("hello", json!({"header": h(), "supported_versions": ["0.2", "1.0"], "requested_bindings": ["nats"]}));
    assert_eq!(error_code(&r), "MIG_VERSION_MISMATCH", "{r}");
    let r = alice.request("discover", json!({"header": {"tenant_id": "other"}}));
    assert_eq!(error_code(&r), "MIG_FORBIDDEN", "{r}");

    // Capabilities.
    let r = alice.request(
        "invoke.observatory.nothing",
        json!({"header": h(), "payload": {}}),
    );
    assert_eq!(error_code(&r), "MIG_UNSUPPORTED_CAPABILITY", "{r}");
    let r = alice.request("invoke.plain", json!({"header": h(), "payload": {}}));
    assert_eq!(error_code(&r), "MIG_UNSUPPORTED_CAPABILITY", "{r}");
    // A name the tenant has no capability of is no metrics label (a caller could fill
    // the series with its own).
    let metrics = w.metrics(0);
    assert!(
        !metrics.contains("observatory.nothing") && !metrics.contains("capability=\"plain\""),
        "{metrics}"
    );
    let mut carol = Mig::connect(&w, "carol");
    let r = carol.request(
        &format!("invoke.{INFER}"),
        json!({"header": h(), "payload": {}}),
    );
    assert_eq!(error_code(&r), "MIG_FORBIDDEN", "{r}");
    let r = alice.request(
        &format!("invoke.{INFER}"),
        json!({"header": h(), "payload": 7}),
    );
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");

    // A deadline nobody meets: MIG_TIMEOUT, retryable, and the task is cancelled.
    let started = Instant::now();
    let r = alice.request(
        "invoke.observatory.idle",
        json!({"header": {"tenant_id": "acme", "deadline_ms": 300}, "payload": {}}),
    );
    assert_eq!(error_code(&r), "MIG_TIMEOUT", "{r}");
    assert_eq!(r["error"]["retryable"], true);
    assert!(started.elapsed() >= Duration::from_millis(300));

    // A task cancelled while it waits (its deadline passed, no worker serves `small`)
    // gives its `max_queued` place back: the next invoke queues and times out in turn.
    let wait_ms = json!({"header": {"tenant_id": "acme", "deadline_ms": 300}, "payload": {}});
    let r = alice.request("invoke.observatory.small", wait_ms.clone());
    assert_eq!(error_code(&r), "MIG_TIMEOUT", "{r}");
    let until = Instant::now() + WAIT;
    loop {
        let r = alice.request("invoke.observatory.small", wait_ms.clone());
        if error_code(&r) == "MIG_TIMEOUT" {
            break;
        }
        assert_eq!(error_code(&r), "MIG_BACKPRESSURE", "{r}");
        assert!(
            Instant::now() < until,
            "the cancelled task still holds the only place: {r}"
        );
    }

    // Backpressure: `small` holds at most one task. The first is known to be stored once
    // a worker is offered it; a second invoke racing it could be counted first.
    let mut small = w.worker(0, "small", 1);
    let first = alice.invoke_later(
        "observatory.small",
        json!({"header": {"tenant_id": "acme", "deadline_ms": 3000}, "payload": {}}),
    );
    small
        .next_op("offer", WAIT)
        .expect("offer of the first small task");
    let r = alice.request(
        "invoke.observatory.small",
        json!({"header": {"tenant_id": "acme", "deadline_ms": 3000}, "payload": {}}),
    );
    assert_eq!(error_code(&r), "MIG_BACKPRESSURE", "{r}");
    assert_eq!(r["error"]["retryable"], true);
    assert!(r["error"]["details"]["retry_after_ms"].as_u64().is_some());
    assert_eq!(error_code(&alice.wait(&first)["reply"]), "MIG_TIMEOUT");
    drop(small);

    // Rate limits apply as on WebSocket.
    let mut dave = Mig::connect(&w, "dave");
    let body = json!({"header": {"tenant_id": "acme", "deadline_ms": 200}, "payload": {}});
    let _ = dave.request(&format!("invoke.{INFER}"), body.clone());
    let r = dave.request(&format!("invoke.{INFER}"), body);
    assert_eq!(error_code(&r), "MIG_RATE_LIMITED", "{r}");
    assert!(r["error"]["details"]["retry_after_ms"].as_u64().is_some());
    assert_eq!(r["error"]["details"]["amp_code"], "rate_limited");

    // Worker failures: a MIG code passes through, anything else is MIG_INTERNAL.
    let mut worker = w.worker(0, "infer", 1);
    for (code, expect) in [
        ("MIG_NOT_FOUND", "MIG_NOT_FOUND"),
        ("MIG_UNAVAILABLE", "MIG_UNAVAILABLE"),
        ("disk_full", "MIG_INTERNAL"),
    ] {
        let tag = alice.invoke_later(INFER, json!({"header": h(), "payload": {}}));
        serve_one(
            &mut worker,
            json!({"op":"fail","error":{"code":code,"message":"no"}}),
        );
        let r = alice.wait(&tag);
        assert_eq!(error_code(&r["reply"]), expect, "{r}");
        assert_eq!(
            r["reply"]["error"]["retryable"],
            expect == "MIG_UNAVAILABLE",
            "{r}"
        );
    }
    let metrics = w.metrics(0);
    assert!(metrics.contains("code=\"MIG_BACKPRESSURE\""), "{metrics}");
    assert!(metrics.contains("code=\"MIG_UNAUTHORIZED\""), "{metrics}");
}

#[test]
fn cancel_while_queued_while_leased_and_by_someone_else() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let mut bob = Mig::connect(&w, "bob");

    // Queued: nobody serves `idle`.
    let tag = alice.invoke_later(
        "observatory.idle",
        json!({"header": {"tenant_id": "acme", "message_id": "q1"}, "payload": {}}),
    );
    let deadline = Instant::now() + WAIT;
    let ack = loop {
        let ack = alice.request(
            "control.cancel.q1",
            json!({"header": {"tenant_id": "acme"}, "reason": "changed my mind"}),
        );
        if ack["status"] != "not_found" || Instant::now() > deadline {
            break ack;
        }
    };
    assert_eq!(ack["accepted"], true, "{ack}");
    assert_eq!(ack["status"], "cancelled");
    assert_eq!(ack["target_message_id"], "q1");
    let r = alice.wait(&tag)["reply"].clone();
    assert_eq!(error_code(&r), "MIG_TIMEOUT", "{r}");
    assert_eq!(r["error"]["message"], "cancelled: changed my mind");
    assert_eq!(r["error"]["retryable"], false);

    // Leased: the holder hears `revoked`.
    let mut worker = w.worker(0, "infer", 1);
    let tag = alice.invoke_later(
        INFER,
        json!({"header": {"tenant_id": "acme", "message_id": "l1"}, "payload": {}}),
    );
    let offer = worker.next_op("offer", WAIT).expect("offer");
    let task = offer["task"].as_str().expect("task").to_string();
    assert_eq!(
        worker.request(json!({"op":"claim","task":task}))["op"],
        "ok"
    );
    let r = bob.request(
        "control.cancel.l1",
        json!({"header": {"tenant_id": "acme"}}),
    );
    assert_eq!(error_code(&r), "MIG_FORBIDDEN", "{r}");
    let ack = alice.request(
        "control.cancel.l1",
        json!({"header": {"tenant_id": "acme"}, "target_message_id": "l1"}),
    );
    assert_eq!(ack["status"], "cancelled", "{ack}");
    let revoked = worker.next_op("revoked", WAIT).expect("revoked");
    assert_eq!(revoked["reason"], "cancelled");
    assert_eq!(error_code(&alice.wait(&tag)["reply"]), "MIG_TIMEOUT");

    // Finished and unknown.
    let ack = alice.request(
        "control.cancel.l1",
        json!({"header": {"tenant_id": "acme"}}),
    );
    assert_eq!(
        (ack["accepted"].clone(), ack["status"].clone()),
        (json!(false), json!("already_finished")),
        "{ack}"
    );
    let ack = alice.request(
        "control.cancel.nope",
        json!({"header": {"tenant_id": "acme"}}),
    );
    assert_eq!(ack["status"], "not_found", "{ack}");
    assert_eq!(ack["accepted"], false);
}

/// A CANCEL of an id nobody invoked is an ordinary answer (`not_found`), yet the task
/// store's refusal of it was logged as a failed change: each MIG caller could write a
/// warning line per request, at its request pace, burying the warnings that matter.
#[test]
fn cancels_of_unknown_ids_write_no_warnings() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    for i in 0..30 {
        let ack = alice.request(
            &format!("control.cancel.nope{i}"),
            json!({"header": {"tenant_id": "acme"}}),
        );
        assert_eq!(ack["status"], "not_found", "{ack}");
    }
    let log = w.brokers[0].log();
    let warned = log
        .lines()
        .filter(|l| l.contains("task change failed"))
        .count();
    assert_eq!(
        warned, 0,
        "{warned} warnings for 30 cancels of unknown ids:\n{log}"
    );
}

#[test]
fn forged_credentials_and_foreign_reply_subjects_are_refused() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let mut bob = Mig::connect(&w, "bob");
    alice.call(json!({"cmd": "subscribe", "sub": "seen", "subject": "_INBOX_acme_alice.>"}));

    // Bob's own token, Alice's reply subject: it is no credential of Alice's, refused as
    // any wrong token is (answered `MIG_UNAUTHORIZED` where the reply subject says:
    // telling it apart would tell a guesser that a guess was somebody's token).
    bob.call(
        json!({"cmd": "publish", "subject": "mig.v0_1.acme.discover",
        "reply": "_INBOX_acme_alice.stolen", "body": {"header": {"tenant_id": "acme"}},
        "headers": {"Authorization": "Bearer bob-token"}}),
    );
    // A reply subject outside every participant's prefix: no answer either.
    bob.call(
        json!({"cmd": "publish", "subject": "mig.v0_1.acme.discover",
        "reply": "_INBOX.anyone", "body": {"header": {"tenant_id": "acme"}},
        "headers": {"Authorization": "Bearer bob-token"}}),
    );
    let deadline = Instant::now() + WAIT;
    while !w
        .metrics(0)
        .contains("amp_mig_rejected_total{reason=\"reply_subject\"} 1")
    {
        assert!(Instant::now() < deadline, "{}", w.metrics(0));
        std::thread::sleep(Duration::from_millis(50));
    }
    // Alice's own request still answers, and nothing else reached her prefix.
    let ok = alice.request("discover", json!({"header": {"tenant_id": "acme"}}));
    assert!(ok.get("error").is_none(), "{ok}");
    let got = alice.call(json!({"cmd": "collected", "sub": "seen"}));
    let stolen: Vec<&Value> = got["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["subject"] == "_INBOX_acme_alice.stolen")
        .collect();
    assert!(
        stolen
            .iter()
            .all(|m| error_code(&m["body"]) == "MIG_UNAUTHORIZED"),
        "{got}"
    );

    // A JWT signed by another account.
    let other = KeyPair::generate(KeyKind::Account).expect("key");
    let claims = amp_broker::jwt::user_claims(
        &KeyPair::generate(KeyKind::User).expect("key").public_key(),
        "acme/alice",
        None,
    );
    let mut claims = claims;
    claims.insert("exp".into(), json!(u64::MAX / 4));
    let forged = amp_broker::jwt::encode(&claims, &other).expect("jwt");
    let r = alice.request_with(
        "discover",
        json!({"header": {"tenant_id": "acme"}}),
        json!({"Authorization": format!("Bearer {forged}")}),
    );
    assert_eq!(error_code(&r), "MIG_UNAUTHORIZED", "{r}");

    // NKey signatures: accepted once, a replay and a wrong subject are refused.
    let mut ann = Mig::connect_nkey(&w);
    let ts = amp_broker::rfc3339::format_system_time(std::time::SystemTime::now());
    let subject = "mig.v0_1.acme.discover";
    let sig = ann.call(
        json!({"cmd": "sign", "seed_file": w.dir.path().join("ann.seed"),
        "message": format!("n1\n{ts}\n{subject}")}),
    )["sig"]
        .as_str()
        .expect("sig")
        .to_string();
    let auth = json!({"Authorization": format!("NKey {} {sig}", w.ann.public_key())});
    let body = json!({"header": {"tenant_id": "acme", "message_id": "n1", "timestamp": ts}});
    let r = ann.request_with("discover", body.clone(), auth.clone());
    assert_eq!(r["capabilities"][0]["id"], INFER, "{r}");
    let r = ann.request_with("discover", body.clone(), auth.clone());
    assert_eq!(error_code(&r), "MIG_UNAUTHORIZED", "replay: {r}");
    let r = ann.request_with("control.heartbeat", body, auth);
    assert_eq!(error_code(&r), "MIG_UNAUTHORIZED", "other subject: {r}");
}

impl Mig {
    /// Ann connects to NATS with her NKey seed.
    fn connect_nkey(world: &World) -> Mig {
        let mut m = Mig::connect_as(
            world,
            "ann",
            json!({"nkeys_seed": world.dir.path().join("ann.seed")}),
        );
        m.name = "ann".into();
        m
    }

    fn connect_as(world: &World, name: &str, credential: Value) -> Mig {
        require_nats_py();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/mig_client.py");
        let mut child = Command::new("python3")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run python3");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let v: Value = serde_json::from_str(&line).unwrap_or(Value::String(line));
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        let mut m = Mig {
            child,
            stdin,
            lines,
            early: HashMap::new(),
            next: 0,
            name: name.to_string(),
        };
        let mut cmd = json!({"cmd": "connect", "url": world.nats_url(),
            "inbox_prefix": format!("_INBOX_acme_{name}")});
        if let Some(pki) = &world.tls {
            cmd["ca_file"] = json!(pki.ca_arg());
        }
        if let (Some(c), Some(extra)) = (cmd.as_object_mut(), credential.as_object()) {
            c.extend(extra.clone());
        }
        let r = m.call(cmd);
        assert_eq!(r["ok"], true, "connect: {r}");
        m
    }
}

#[test]
fn an_idempotent_retry_after_a_broker_restart_gets_the_first_outcome() {
    let mut w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let mut worker = w.worker(0, "infer", 1);
    let body = |id: &str| json!({"header": {"tenant_id": "acme", "message_id": id, "idempotency_key": "order-7"}, "payload": {"n": 7}});
    let tag = alice.invoke_later(INFER, body("first"));
    serve_one(&mut worker, json!({"op":"complete","result":{"n": 49}}));
    let first = alice.wait(&tag)["reply"].clone();
    assert_eq!(first["payload"], json!({"n": 49}), "{first}");
    drop(worker);

    w.brokers[0].restart();
    w.await_mig();
    let mut worker = w.worker(0, "infer", 1);
    let again = alice.request(&format!("invoke.{INFER}"), body("second"));
    assert_eq!(again["payload"], json!({"n": 49}), "{again}");
    assert_eq!(again["header"]["message_id"], "second");
    assert_eq!(again["header"]["idempotency_key"], "order-7");
    assert!(
        worker
            .next_op("offer", Duration::from_millis(500))
            .is_none(),
        "no second task"
    );

    // The same key with another payload is a different request.
    let other = alice.request(
        &format!("invoke.{INFER}"),
        json!({"header": {"tenant_id": "acme", "idempotency_key": "order-7"}, "payload": {"n": 8}}),
    );
    assert_eq!(error_code(&other), "MIG_INVALID_REQUEST", "{other}");
}

#[test]
fn two_brokers_answer_each_request_once() {
    let w = world(2);
    let mut worker = w.worker(1, "infer", 4);
    let mut alice = Mig::connect(&w, "alice");
    alice
        .call(json!({"cmd": "subscribe", "sub": "replies", "subject": "_INBOX_acme_alice.many.>"}));
    let n = 12;
    for i in 0..n {
        alice.call(json!({"cmd": "publish", "subject": format!("mig.v0_1.acme.invoke.{INFER}"),
            "reply": format!("_INBOX_acme_alice.many.{i}"),
            "body": {"header": {"tenant_id": "acme", "message_id": format!("m{i}")}, "payload": {"i": i}},
            "headers": {"Authorization": "Bearer alice-token"}}));
    }
    for _ in 0..n {
        let offer = worker.next_op("offer", WAIT).expect("offer");
        let task = offer["task"].as_str().expect("task").to_string();
        assert_eq!(
            worker.request(json!({"op":"claim","task":task}))["op"],
            "ok"
        );
        let done = worker.request(json!({"op":"complete","task":task,"result":offer["body"]}));
        assert_eq!(done["op"], "ok");
    }
    let deadline = Instant::now() + WAIT;
    let got = loop {
        let got = alice.call(json!({"cmd": "collected", "sub": "replies"}));
        if got["messages"].as_array().map_or(0, Vec::len) >= n || Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Nothing more arrives.
    std::thread::sleep(Duration::from_millis(300));
    let got_late = alice.call(json!({"cmd": "collected", "sub": "replies"}));
    assert_eq!(got["messages"], got_late["messages"]);
    let mut subjects: Vec<String> = got["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            assert_eq!(
                m["body"]["payload"]["i"]
                    .as_u64()
                    .map(|i| format!("_INBOX_acme_alice.many.{i}"))
                    .as_deref(),
                m["subject"].as_str(),
                "{m}"
            );
            m["subject"].as_str().unwrap_or("").to_string()
        })
        .collect();
    subjects.sort();
    subjects.dedup();
    assert_eq!(
        subjects.len(),
        n,
        "{got}\n{}\n{}",
        w.brokers[0].log(),
        w.brokers[1].log()
    );
    assert!(
        worker
            .next_op("offer", Duration::from_millis(300))
            .is_none()
    );
    // Both brokers served some of them (queue groups spread the requests).
    let answered = |i: usize| {
        let m = w.metrics(i);
        m.lines()
            .filter(|l| l.starts_with("amp_mig_requests_total{op=\"invoke\""))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<u64>().ok()))
            .sum::<u64>()
    };
    assert_eq!(answered(0) + answered(1), n as u64);
}

#[test]
fn a_caller_on_nats_is_paced_as_a_websocket_session_is() {
    // MIG requests come on NATS, past the WebSocket frame limiter: a caller could send
    // heartbeats (each a look at every registry entry of the tenant) and replay pages
    // (each up to 1,000 JetStream reads) as fast as NATS carried them.
    let w = world_configured(1, None, |c| {
        c["limits"]["max_frames_per_s"] = json!(100);
        c["limits"]["frame_burst"] = json!(200);
    });
    let options = amp_broker::nats::Options::new(&w.nats_url())
        .with_user_password("acme/alice", "alice-token")
        .with_inbox_prefix("_INBOX_acme_alice");
    let mut nc = amp_broker::nats::Client::connect(options).expect("alice on NATS");
    let inbox = "_INBOX_acme_alice.flood";
    let sid = nc.subscribe(inbox, None).expect("subscribe");
    let mut headers = amp_broker::nats::HeaderMap::new();
    headers
        .insert("Authorization", "Bearer alice-token")
        .expect("header");
    let body = json!({"header": {"tenant_id": "acme"}}).to_string();
    let sent = 500;
    for _ in 0..sent {
        nc.publish(
            "mig.v0_1.acme.control.heartbeat",
            Some(inbox),
            Some(&headers),
            body.as_bytes(),
        )
        .expect("publish");
    }
    nc.flush(WAIT).expect("flush");
    let (mut ok, mut limited) = (0, 0);
    while ok + limited < sent {
        let m = nc
            .next_message(sid, WAIT)
            .expect("read")
            .unwrap_or_else(|| panic!("{ok} answered, {limited} refused of {sent}"));
        let reply: Value = serde_json::from_slice(&m.payload).expect("json");
        if error_code(&reply) == "MIG_RATE_LIMITED" {
            assert!(reply.to_string().contains("retry_after_ms"), "{reply}");
            limited += 1;
        } else {
            assert!(reply.get("suggested_interval_ms").is_some(), "{reply}");
            ok += 1;
        }
    }
    // About one second's worth at once (less the few `hello`s the world waited with), and
    // what the rate adds while they are read.
    assert!((90..=250).contains(&ok), "{ok} answered, {limited} refused");
    // A page of replay counts each event it may read: one of 1,000 takes the rest of the
    // second and more.
    let page = json!({"header": {"tenant_id": "acme"}, "topic": "orders.>", "max_inflight": 1000});
    std::thread::sleep(Duration::from_millis(1100));
    let mut alice = Mig::connect(&w, "alice");
    let first = alice.request("control.subscribe", page.clone());
    assert!(first.get("error").is_none(), "{first}");
    let second = alice.request("control.subscribe", page);
    assert_eq!(error_code(&second), "MIG_RATE_LIMITED", "{second}");
}

#[test]
fn heartbeat_reports_load_of_the_tenants_capabilities() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let r = alice.request(
        "control.heartbeat",
        json!({"header": {"tenant_id": "acme"}}),
    );
    assert_eq!(r["suggested_interval_ms"], 5000, "{r}");
    assert_eq!(r["load_factor"], 0.0);
    let r = alice.request(
        "control.heartbeat",
        json!({"header": {"tenant_id": "acme"}, "interval_ms": 10}),
    );
    assert_eq!(r["suggested_interval_ms"], 1000, "{r}");
    // A worker with two slots holding one lease: half loaded.
    let mut worker = w.worker(0, "infer", 2);
    let tag = alice.invoke_later(
        INFER,
        json!({"header": {"tenant_id": "acme"}, "payload": {}}),
    );
    let offer = worker.next_op("offer", WAIT).expect("offer");
    let task = offer["task"].as_str().expect("task").to_string();
    assert_eq!(
        worker.request(json!({"op":"claim","task":task}))["op"],
        "ok"
    );
    let deadline = Instant::now() + WAIT;
    loop {
        let r = alice.request(
            "control.heartbeat",
            json!({"header": {"tenant_id": "acme"}}),
        );
        if r["load_factor"] == 0.5 {
            break;
        }
        assert!(Instant::now() < deadline, "{r}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        worker.request(json!({"op":"complete","task":task}))["op"],
        "ok"
    );
    assert!(alice.wait(&tag)["reply"].get("error").is_none());
    let r = alice.request(
        "control.heartbeat",
        json!({"header": {"tenant_id": "acme"}, "interval_ms": "x"}),
    );
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
}

#[test]
fn a_streaming_invoke_sends_progress_then_the_result_in_numbered_frames() {
    let w = world(1);
    let mut worker = w.worker(0, "infer", 1);
    let mut alice = Mig::connect(&w, "alice");
    alice.call(json!({"cmd": "subscribe", "sub": "s1", "subject": "mig.v0_1.acme.stream.s1"}));
    let started = alice.request(
        &format!("invoke.{INFER}"),
        json!({"header": {"tenant_id": "acme", "message_id": "s1"}, "payload": {"q": 1}, "stream_preference": "server_stream"}),
    );
    assert_eq!(started["kind"], "control", "{started}");
    assert_eq!(started["stream_id"], "s1");
    assert_eq!(started["payload"]["status"], "started");
    assert_eq!(started["header"]["meta"]["amp.seq"], 1);

    let offer = worker.next_op("offer", WAIT).expect("offer");
    let task = offer["task"].as_str().expect("task").to_string();
    assert_eq!(
        worker.request(json!({"op":"claim","task":task}))["op"],
        "ok"
    );
    for pct in [25, 50] {
        let hb = worker.request(json!({"op":"heartbeat","task":task,"progress":{"pct":pct}}));
        assert_eq!(hb["op"], "ok", "{hb}");
    }
    assert_eq!(
        worker.request(json!({"op":"heartbeat","task":task}))["op"],
        "ok"
    );
    let done = worker.request(json!({"op":"complete","task":task,"result":{"answer":42}}));
    assert_eq!(done["op"], "ok");

    let deadline = Instant::now() + WAIT;
    let frames = loop {
        let got = alice.call(json!({"cmd": "collected", "sub": "s1"}));
        let frames = got["messages"].as_array().cloned().unwrap_or_default();
        if frames.iter().any(|f| f["body"]["end_stream"] == true) || Instant::now() > deadline {
            break frames;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let bodies: Vec<Value> = frames.iter().map(|f| f["body"].clone()).collect();
    let seqs: Vec<u64> = bodies
        .iter()
        .filter_map(|b| b["header"]["meta"]["amp.seq"].as_u64())
        .collect();
    assert_eq!(seqs, [2, 3, 4], "{bodies:?}");
    assert_eq!(bodies[0]["kind"], "response");
    assert_eq!(bodies[0]["end_stream"], false);
    assert_eq!(bodies[0]["payload"], json!({"pct": 25}));
    assert_eq!(bodies[1]["payload"], json!({"pct": 50}));
    assert_eq!(bodies[2]["end_stream"], true);
    assert_eq!(bodies[2]["payload"], json!({"answer": 42}));
    assert_eq!(frames[2]["headers"]["message_id"], "s1");

    // Cancel during a stream ends it with an error frame.
    alice.call(json!({"cmd": "subscribe", "sub": "s2", "subject": "mig.v0_1.acme.stream.s2"}));
    let started = alice.request(
        &format!("invoke.{INFER}"),
        json!({"header": {"tenant_id": "acme", "message_id": "s2"}, "payload": {}, "stream_preference": "server_stream"}),
    );
    assert_eq!(started["kind"], "control", "{started}");
    let offer = worker.next_op("offer", WAIT).expect("offer");
    let task = offer["task"].as_str().expect("task").to_string();
    assert_eq!(
        worker.request(json!({"op":"claim","task":task}))["op"],
        "ok"
    );
    let ack = alice.request(
        "control.cancel.s2",
        json!({"header": {"tenant_id": "acme"}, "reason": "enough"}),
    );
    assert_eq!(ack["status"], "cancelled", "{ack}");
    let deadline = Instant::now() + WAIT;
    let last = loop {
        let got = alice.call(json!({"cmd": "collected", "sub": "s2"}));
        if let Some(f) = got["messages"].as_array().and_then(|m| m.last()).cloned()
            && f["body"]["end_stream"] == true
        {
            break f["body"].clone();
        }
        assert!(Instant::now() < deadline, "{got}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(last["kind"], "error", "{last}");
    assert_eq!(last["error"]["code"], "MIG_TIMEOUT");
    assert_eq!(last["error"]["message"], "cancelled: enough");
    assert_eq!(last["header"]["meta"]["amp.seq"], 2);

    // A stream id must be one subject token.
    let r = alice.request(
        &format!("invoke.{INFER}"),
        json!({"header": {"tenant_id": "acme", "message_id": "a.b"}, "payload": {}, "stream_preference": "server_stream"}),
    );
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
    let r = alice.request(
        "invoke.observatory.idle",
        json!({"header": {"tenant_id": "acme"}, "payload": {}, "stream_preference": "server_stream"}),
    );
    assert_eq!(error_code(&r), "MIG_UNSUPPORTED_CAPABILITY", "{r}");
}

#[test]
fn published_events_replay_in_pages_and_stitch_to_the_live_subject_once_each() {
    let w = world(2);
    let mut alice = Mig::connect(&w, "alice");
    let mut ann = Mig::connect_nkey(&w);
    let mut publish = |n: u64| {
        let r = ann.signed(
            &w,
            "events.orders.eu",
            json!({"header": {"tenant_id": "acme"}, "payload": {"n": n}}),
        );
        assert_eq!(r["accepted"], true, "{r}");
        assert_eq!(r["topic"], "orders.eu");
        r["sequence"].as_u64().expect("sequence")
    };
    let before: Vec<u64> = (1..=3).map(&mut publish).collect();
    // The subscriber listens live first, then pages through what is stored.
    alice.call(
        json!({"cmd": "subscribe", "sub": "live", "subject": "mig.v0_1.acme.events.orders.>"}),
    );
    let after: Vec<u64> = (4..=5).map(&mut publish).collect();
    // An event published over AMP is the same kind of event.
    let mut amp = Client::login(&w.brokers[0], "acme", "alice", "alice-token");
    let ok = amp.request(json!({"op":"publish","topic":"orders.us","body":{"n": 6}}));
    assert_eq!(ok["op"], "ok", "{ok}");

    let mut seen: Vec<u64> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut body =
            json!({"header": {"tenant_id": "acme"}, "topic": "orders.>", "max_inflight": 2});
        if let Some(c) = &cursor {
            body["resume_cursor"] = json!(c);
        }
        let page = alice.request("control.subscribe", body);
        assert!(page.get("error").is_none(), "{page}");
        for e in page["events"].as_array().expect("events") {
            assert_eq!(e["replay"], true);
            seen.push(e["sequence"].as_u64().expect("seq"));
        }
        cursor = page["next_cursor"].as_str().map(str::to_string);
        if page["caught_up"] == true {
            break;
        }
        assert!(seen.len() <= 20, "{page}");
    }
    // Live events: each once although two brokers run. Live is core NATS: an event
    // published just before the subscription may still be forwarded after it (the feed
    // lags its stream), and the client drops it by `sequence`.
    let collected = |alice: &mut Mig| -> Vec<Value> {
        let got = alice.call(json!({"cmd": "collected", "sub": "live"}));
        got["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| m["body"].clone())
            .filter(|b| b.get("event_id").is_some())
            .collect()
    };
    let seqs = |live: &[Value]| -> Vec<u64> {
        live.iter().filter_map(|e| e["sequence"].as_u64()).collect()
    };
    let newest = *after.last().expect("published");
    let deadline = Instant::now() + WAIT;
    loop {
        let live = seqs(&collected(&mut alice));
        let complete = after.iter().all(|s| live.contains(s)) && live.iter().any(|s| *s > newest);
        if complete || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // A second copy would come from the other broker's pull, which has nothing to await:
    // give it a moment, then look at everything that came.
    std::thread::sleep(Duration::from_millis(300));
    let live = collected(&mut alice);
    let live_seqs = seqs(&live);
    assert!(live.iter().all(|e| e["replay"] == false));
    let mut unique = live_seqs.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        live_seqs.len(),
        "a live event twice: {live:?}"
    );
    assert!(after.iter().all(|s| live_seqs.contains(s)), "{live:?}");
    let amp_seq: Vec<u64> = live_seqs.iter().copied().filter(|s| *s > newest).collect();
    assert_eq!(amp_seq.len(), 1, "the AMP publish, live once: {live:?}");
    assert!(
        live_seqs
            .iter()
            .all(|s| before.contains(s) || after.contains(s) || amp_seq.contains(s)),
        "{live:?}"
    );
    let mut all = seen.clone();
    for s in &live_seqs {
        if !all.contains(s) {
            all.push(*s);
        }
    }
    all.sort_unstable();
    let mut expected: Vec<u64> = before
        .iter()
        .chain(&after)
        .chain(&amp_seq)
        .copied()
        .collect();
    expected.sort_unstable();
    expected.dedup();
    assert_eq!(all, expected, "replayed {seen:?}, live {live_seqs:?}");
    let mut sorted = seen.clone();
    sorted.dedup();
    assert_eq!(sorted, seen, "pages are in order without duplicates");
    let amp_event = live
        .iter()
        .find(|e| e["topic"] == "orders.us")
        .expect("AMP event live");
    assert_eq!(amp_event["payload"], json!({"n": 6}));

    // A cursor is exclusive.
    let page = alice.request(
        "control.subscribe",
        json!({"header": {"tenant_id": "acme"}, "topic": "orders.eu", "resume_cursor": before[1].to_string()}),
    );
    let seqs: Vec<u64> = page["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["sequence"].as_u64())
        .collect();
    assert_eq!(seqs, [before[2], after[0], after[1]], "{page}");

    // Permissions.
    let mut bob = Mig::connect(&w, "bob");
    let r = bob.request(
        "control.subscribe",
        json!({"header": {"tenant_id": "acme"}, "topic": "orders.>"}),
    );
    assert_eq!(error_code(&r), "MIG_FORBIDDEN", "{r}");
    // Bob may not publish on NATS at all: his JWT refuses the request before the broker.
    let r = bob.call(
        json!({"cmd": "request", "subject": "mig.v0_1.acme.events.news.x",
        "body": {"header": {"tenant_id": "acme"}, "payload": {}},
        "headers": {"Authorization": "Bearer bob-token"}, "timeout": 1}),
    );
    assert!(
        r["error"].as_str().is_some_and(|e| e.contains("imeout")),
        "{r}"
    );
    let r = alice.request(
        "control.subscribe",
        json!({"header": {"tenant_id": "acme"}, "topic": "orders.>", "resume_cursor": "x"}),
    );
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
}

#[test]
fn the_readme_example_runs_as_written() {
    let readme =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("README.md"))
            .expect("README");
    let example = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/mig_example.py"),
    )
    .expect("example");
    let indented: String = example
        .lines()
        .map(|l| {
            if l.is_empty() {
                "\n".to_string()
            } else {
                format!("    {l}\n")
            }
        })
        .collect();
    assert!(
        readme.contains(&indented),
        "README's MIG example differs from tests/interop/mig_example.py"
    );

    let w = world(1);
    let mut worker = w.worker(0, "infer", 1);
    let url = w.callout.nats.url();
    let py = common::python::Py::spawn(
        "mig_example.py",
        &[&url, "acme", "alice", "alice-token", INFER],
    );
    assert_eq!(py.line(), "version 0.1");
    assert_eq!(
        py.line(),
        format!("capabilities observatory.idle {INFER} observatory.small")
    );
    let offer = serve_one(
        &mut worker,
        json!({"op":"complete","result":{"output":"HELLO"}}),
    );
    assert_eq!(offer["body"], json!({"input": "hello"}));
    assert_eq!(py.line(), "result {\"output\": \"HELLO\"}");
    py.finish();
}

#[test]
fn a_capability_task_out_of_attempts_is_a_dead_letter_its_workers_hear_of_and_may_redrive() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    // The worker's grant lets it listen to the dead letters of what it serves; alice, who
    // only submits, is refused the subscription by the server.
    let mut watcher = Mig::connect(&w, "worker");
    let dlq = format!("mig.v0_1.acme.dlq.{INFER}");
    watcher.call(json!({"cmd": "subscribe", "sub": "dlq", "subject": dlq}));
    alice.call(json!({"cmd": "subscribe", "sub": "dlq", "subject": dlq}));
    let mut worker = w.worker(0, "infer", 1);

    // `infer` has max_attempts 1: the worker's fail spends the last attempt.
    let body = json!({"prompt": "the last one"});
    let tag = alice.invoke_later(
        INFER,
        json!({"header": {"tenant_id": "acme"}, "payload": body}),
    );
    serve_one(
        &mut worker,
        json!({"op":"fail","retry":true,"error":{"code":"gpu_lost","message":"fell over"}}),
    );
    assert_eq!(error_code(&alice.wait(&tag)["reply"]), "MIG_INTERNAL");

    let mut letter = Value::Null;
    let mut nats_headers = Value::Null;
    let heard = common::wait_until(WAIT, || {
        let got = watcher.call(json!({"cmd": "collected", "sub": "dlq"}));
        letter = got["messages"][0]["body"].clone();
        nats_headers = got["messages"][0]["headers"].clone();
        !letter.is_null()
    });
    assert!(heard, "no dead letter on {dlq}");
    // mig-nats.md section 3: every message the broker publishes duplicates these.
    assert_eq!(nats_headers["mig_version"], "0.1", "{nats_headers}");
    assert_eq!(nats_headers["tenant_id"], "acme", "{nats_headers}");
    assert!(letter["header"]["message_id"].is_string(), "{letter}");
    assert_eq!(
        nats_headers["message_id"], letter["header"]["message_id"],
        "{nats_headers}"
    );
    assert_eq!(letter["capability"], INFER, "{letter}");
    assert_eq!(letter["payload"], body, "{letter}");
    assert_eq!(letter["error"]["code"], "gpu_lost", "{letter}");
    assert_eq!(letter["attempts"], 1, "{letter}");
    assert_eq!(letter["header"]["tenant_id"], "acme");
    let seq = letter["sequence"].as_u64().expect("sequence");
    let got = alice.call(json!({"cmd": "collected", "sub": "dlq"}));
    assert_eq!(got["messages"], json!([]), "{got}");
    assert!(
        got["errors"]
            .to_string()
            .to_lowercase()
            .contains("permissions violation"),
        "{got}"
    );

    // The same letter over AMP, and a redrive by the worker's side is refused (it may
    // serve, not submit) while the submitter's goes to the worker again.
    let page = worker.request(json!({"op":"dead_letters","job":"infer"}));
    let seqs: Vec<u64> = page["letters"]
        .as_array()
        .expect("letters")
        .iter()
        .filter_map(|l| l["seq"].as_u64())
        .collect();
    assert!(seqs.contains(&seq), "{page}");
    let r = worker.request(json!({"op":"redrive","job":"infer","seq":seq}));
    assert_eq!(r["code"], "forbidden", "{r}");
    let mut app = w.amp_client(0, "alice");
    let r = app.request(json!({"op":"redrive","job":"infer","seq":seq}));
    assert_eq!(r["op"], "ok", "{r}");
    let offer = worker.next_op("offer", WAIT).expect("the redriven task");
    assert_eq!(offer["task"], r["task"], "{offer}");
    assert_eq!(offer["body"], body, "{offer}");
    // No invocation waits for it: none of the failed one's ids or deadline come along,
    // and its outcome reaches the redriver's inbox as any task's. The letter's
    // `mig_capability` header took it for an invoke's, and no `task_result` came.
    for stale in ["mig_capability", "deadline_ms", "message_id", "mig_version"] {
        assert!(offer["headers"].get(stale).is_none(), "{stale}: {offer}");
    }
    let claim = worker.request(json!({"op":"claim","task":r["task"]}));
    assert_eq!(claim["op"], "ok", "{claim}");
    let done = worker.request(json!({"op":"complete","task":r["task"],"result":{"ok":1}}));
    assert_eq!(done["op"], "ok", "{done}");
    let result = app
        .next_op("message", WAIT)
        .expect("the redriven task's task_result");
    assert_eq!(result["kind"], "task_result", "{result}");
    assert_eq!(result["body"]["task"], r["task"], "{result}");
    assert_eq!(result["body"]["state"], "completed", "{result}");
}

#[test]
fn a_task_budget_counts_mig_invokes_that_create_a_task_and_no_retry() {
    let w = world(1);
    let mut erin = Mig::connect(&w, "erin");
    let mut worker = w.worker(0, "infer", 1);
    let invoke = |key: &str| json!({"header": {"tenant_id": "acme", "idempotency_key": key}, "payload": {"n": key}});
    for key in ["k1", "k2"] {
        let tag = erin.invoke_later(INFER, invoke(key));
        serve_one(&mut worker, json!({"op":"complete","result":{"done":key}}));
        let r = erin.wait(&tag);
        assert_eq!(r["reply"]["payload"], json!({"done": key}), "{r}");
    }
    // The budget of 2 is spent: a third task is refused, a retry of the first is not.
    let r = erin.request(&format!("invoke.{INFER}"), invoke("k3"));
    assert_eq!(error_code(&r), "MIG_RATE_LIMITED", "{r}");
    assert_eq!(r["error"]["details"]["amp_code"], "budget_exhausted", "{r}");
    let r = erin.request(&format!("invoke.{INFER}"), invoke("k1"));
    assert_eq!(r["payload"], json!({"done": "k1"}), "{r}");

    // The outcomes were the replies: nothing of them waits in erin's AMP inbox.
    let mut amp = w.amp_client(0, "erin");
    let stray = amp.next_op("message", Duration::from_secs(1));
    assert!(stray.is_none(), "a MIG outcome in the AMP inbox: {stray:?}");
}

#[test]
fn a_keyed_invocation_is_cancelled_through_any_broker() {
    let w = world(2);
    let mut alice = Mig::connect(&w, "alice");
    let mut bob = Mig::connect(&w, "bob");
    // Requests go to either broker (queue groups): with a dozen invocations, some cancels
    // reach the broker that does not hold theirs, which can only find a keyed one by
    // asking the holder (its task id comes from the key, not the message id).
    for i in 0..12 {
        let id = format!("k{i}");
        let tag = alice.invoke_later(
            "observatory.idle",
            json!({"header": {"tenant_id": "acme", "message_id": id, "idempotency_key": format!("key-{i}")},
                   "payload": {}}),
        );
        let cancel = |who: &mut Mig| {
            who.request(
                &format!("control.cancel.{id}"),
                json!({"header": {"tenant_id": "acme"}, "reason": "no longer needed"}),
            )
        };
        let mut ack = Value::Null;
        let found = common::wait_until(WAIT, || {
            ack = cancel(&mut bob);
            ack["error"]["code"] == "MIG_FORBIDDEN"
        });
        assert!(found, "bob's cancel of {id}: {ack}");
        let ack = cancel(&mut alice);
        assert_eq!(
            (&ack["accepted"], &ack["status"]),
            (&json!(true), &json!("cancelled")),
            "{id}: {ack}"
        );
        let r = alice.wait(&tag)["reply"].clone();
        assert_eq!(r["error"]["message"], "cancelled: no longer needed", "{r}");
    }
    let forwarded: u64 = (0..2)
        .map(|b| {
            w.metrics(b)
                .lines()
                .find_map(|l| l.strip_prefix("amp_mig_cancels_forwarded_total "))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum();
    assert!(forwarded > 0, "no cancel went through the other broker");
}

#[test]
fn a_broker_killed_mid_invocation_leaves_the_task_to_another_and_the_retry_gets_its_result() {
    let mut w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let body = |id: &str| {
        json!({"header": {"tenant_id": "acme", "message_id": id, "idempotency_key": "order-9"},
               "payload": {"n": 9}})
    };
    // Broker 0, the only one, takes the invocation; nobody there serves the job.
    let _lost = alice.invoke_later(INFER, body("first"));
    let submitted =
        common::wait_until(WAIT, || w.metrics(0).contains("amp_jobs_submitted_total 1"));
    assert!(submitted, "the invocation did not submit its task");

    // A second broker comes, its worker takes the task, and broker 0 dies with the
    // invocation it was waiting on.
    let second = w.callout.broker(&config(&w.ann), &[]);
    w.brokers.push(second);
    let mut worker = w.worker(1, "infer", 1);
    let offer = worker
        .next_op("offer", WAIT)
        .expect("the task reaches broker 1");
    let task = offer["task"].as_str().expect("task").to_string();
    assert_eq!(
        worker.request(json!({"op":"claim","task":task}))["op"],
        "ok"
    );
    w.brokers[0].kill();
    let done = worker.request(json!({"op":"complete","task":task,"result":{"n": 81}}));
    assert_eq!(done["op"], "ok", "{done}");

    // The caller's retry with the same key reaches broker 1 and gets the first outcome.
    let again = alice.request(&format!("invoke.{INFER}"), body("retry"));
    assert_eq!(again["payload"], json!({"n": 81}), "{again}");
    assert_eq!(again["header"]["message_id"], "retry");
}

/// The binding puts PUBLISH on the live events subject, so every subscriber of the topic
/// receives each PUBLISH request, headers included: a `Bearer` credential there is
/// handed to them. The broker refuses it (so that no client keeps doing it) and takes a
/// signature, which proves only that one message.
#[test]
fn a_publish_reaches_every_subscriber_of_its_topic_so_it_takes_a_signature() {
    let w = world(1);
    let mut eve = Mig::connect(&w, "eve");
    eve.call(json!({"cmd": "subscribe", "sub": "tap", "subject": "mig.v0_1.acme.events.orders.>"}));
    let mut alice = Mig::connect(&w, "alice");
    let r = alice.request(
        "events.orders.eu",
        json!({"header": {"tenant_id": "acme"}, "payload": {"n": 1}}),
    );
    assert_eq!(error_code(&r), "MIG_UNAUTHORIZED", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("NKey signature")),
        "{r}"
    );
    // What Eve, who may only read the topic, got: Alice's request with her token.
    let deadline = Instant::now() + WAIT;
    let tapped = loop {
        let got = eve.call(json!({"cmd": "collected", "sub": "tap"}));
        let tokens: Vec<String> = got["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .filter_map(|m| m["headers"]["Authorization"].as_str().map(str::to_string))
            .collect();
        if !tokens.is_empty() || Instant::now() > deadline {
            break tokens;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(tapped, ["Bearer alice-token"]);
    // Nothing was stored in her name.
    let page = alice.request(
        "control.subscribe",
        json!({"header": {"tenant_id": "acme"}, "topic": "orders.>"}),
    );
    assert_eq!(page["events"], json!([]), "{page}");
    // A signed PUBLISH is taken; what Eve sees of it proves nothing past that message.
    let mut ann = Mig::connect_nkey(&w);
    let r = ann.signed(
        &w,
        "events.orders.eu",
        json!({"header": {"tenant_id": "acme"}, "payload": {"n": 2}}),
    );
    assert_eq!(r["accepted"], true, "{r}");
}

/// One caller retrying one idempotency key spends no budget and queues nothing new, yet
/// each retry waited as an invocation of its own on the broker: it could hold every slot
/// (`mig.max_pending`) and everyone else got `MIG_BACKPRESSURE`. A caller holds a quarter.
#[test]
fn one_caller_cannot_take_every_invocation_slot_of_a_broker() {
    let w = world_configured(1, None, |c| c["mig"]["max_pending"] = json!(8));
    let mut alice = Mig::connect(&w, "alice");
    // Nobody serves `idle`: each invoke waits for its deadline.
    let body = json!({"header": {"tenant_id": "acme", "deadline_ms": 20_000,
                                 "idempotency_key": "same"}, "payload": {}});
    let tags: Vec<String> = (0..8)
        .map(|_| alice.invoke_later("observatory.idle", body.clone()))
        .collect();
    let answers: Vec<Value> = tags[2..]
        .iter()
        .map(|t| alice.wait(t)["reply"].clone())
        .collect();
    for r in &answers {
        assert_eq!(error_code(r), "MIG_BACKPRESSURE", "{r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("a caller waits on at most 2")),
            "{r}"
        );
    }
    // Another caller is still served (it waits for its own deadline).
    let mut bob = Mig::connect(&w, "bob");
    let r = bob.request(
        &format!("invoke.{INFER}"),
        json!({"header": {"tenant_id": "acme", "deadline_ms": 300}, "payload": {}}),
    );
    assert_eq!(error_code(&r), "MIG_TIMEOUT", "{r}");
}

/// A stream is named by its invoke's message id, and CANCEL finds an invocation by it:
/// another caller invoking with the same id (stream frames are readable tenant-wide)
/// had its error frame land on the first caller's stream, and made the first caller's own
/// CANCEL `MIG_FORBIDDEN`. On one broker such an id is refused while in use.
#[test]
fn a_message_id_in_use_by_another_callers_invocation_is_refused() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let tag = alice.invoke_later(
        INFER,
        json!({"header": {"tenant_id": "acme", "message_id": "shared", "deadline_ms": 20_000},
               "payload": {}, "stream_preference": "server_stream"}),
    );
    let started = alice.wait(&tag)["reply"].clone();
    assert_eq!(started["payload"]["status"], "started", "{started}");
    let mut bob = Mig::connect(&w, "bob");
    let r = bob.request(
        &format!("invoke.{INFER}"),
        json!({"header": {"tenant_id": "acme", "message_id": "shared", "deadline_ms": 300},
               "payload": {}, "stream_preference": "server_stream"}),
    );
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
    // Alice's own cancel still finds hers (once its task is stored).
    let deadline = Instant::now() + WAIT;
    let r = loop {
        let r = alice.request(
            "control.cancel.shared",
            json!({"header": {"tenant_id": "acme"}, "reason": "enough"}),
        );
        if r["status"] != "not_found" || Instant::now() > deadline {
            break r;
        }
    };
    assert_eq!(r["accepted"], true, "{r}");
}

/// A subscriber of a topic receives each signed PUBLISH whole, and the signature covers the
/// message id, time and subject, not the body. Each broker remembers the ids it has seen,
/// so a replay to the broker that stored the original was refused; one to another broker
/// stored the replayer's body as an event from the signer. The brokers now share the
/// record of signed ids through JetStream.
#[test]
fn a_signed_publish_replayed_to_another_broker_is_refused() {
    let w = world(2);
    let mut alice = Mig::connect(&w, "alice");
    let (tapped, other) = tapped_publish(&w, &mut alice);
    replay_through(&w, &mut alice, &tapped, other);
    assert_eq!(stored_orders(&mut alice), [json!({"n": 1})]);
    assert!(
        w.metrics(other)
            .contains("amp_mig_rejected_total{reason=\"replay\"} 1"),
        "{}",
        w.metrics(other)
    );
}

/// PUBLISH answers of broker `b`.
fn publishes_served(w: &World, b: usize) -> f64 {
    const SERIES: &str = "amp_mig_request_seconds_count{op=\"publish\"}";
    common::amp::metric(&w.brokers[b], SERIES).unwrap_or(0.0)
}

/// Ann's signed PUBLISH `{"n": 1}` on `orders.eu` as `alice` (subscribed to `orders.>`)
/// received it, request and reply subject, and the broker that did not store it.
fn tapped_publish(w: &World, alice: &mut Mig) -> (Value, usize) {
    alice.call(
        json!({"cmd": "subscribe", "sub": "tap", "subject": "mig.v0_1.acme.events.orders.>"}),
    );
    let mut ann = Mig::connect_nkey(w);
    let r = ann.signed(
        w,
        "events.orders.eu",
        json!({"header": {"tenant_id": "acme"}, "payload": {"n": 1}}),
    );
    assert_eq!(r["accepted"], true, "{r}");
    let first = if publishes_served(w, 0) == 1.0 { 0 } else { 1 };
    assert_eq!(
        publishes_served(w, first),
        1.0,
        "one broker stored the original"
    );
    let deadline = Instant::now() + WAIT;
    let tapped = loop {
        let got = alice.call(json!({"cmd": "collected", "sub": "tap"}));
        let request = got["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .find(|m| m["reply"].as_str().is_some_and(|r| !r.is_empty()))
            .cloned();
        if let Some(m) = request {
            break m;
        }
        assert!(Instant::now() < deadline, "the request was not seen: {got}");
        std::thread::sleep(Duration::from_millis(20));
    };
    (tapped, 1 - first)
}

/// Sends `tapped` again with alice's own payload, its headers and reply subject as they
/// were, until broker `other` has answered one (queue groups spread the requests; the
/// broker that stored the original refuses each as a replay from its own cache).
fn replay_through(w: &World, alice: &mut Mig, tapped: &Value, other: usize) {
    let mut forged = tapped["body"].clone();
    forged["payload"] = json!({"n": "forged by alice"});
    let served = |b: usize| publishes_served(w, b);
    let mut tries = 0;
    while served(other) == 0.0 {
        tries += 1;
        assert!(tries <= 40, "the other broker never took the replay");
        let before = served(0) + served(1);
        alice.call(
            json!({"cmd": "publish", "subject": tapped["subject"], "body": forged,
                          "headers": tapped["headers"], "reply": tapped["reply"]}),
        );
        let deadline = Instant::now() + WAIT;
        while served(0) + served(1) == before {
            assert!(Instant::now() < deadline, "the replay was not answered");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The payloads of the events stored on `orders.>`.
fn stored_orders(alice: &mut Mig) -> Vec<Value> {
    let page = alice.request(
        "control.subscribe",
        json!({"header": {"tenant_id": "acme"}, "topic": "orders.>"}),
    );
    page["events"]
        .as_array()
        .unwrap_or_else(|| panic!("events: {page}"))
        .iter()
        .map(|e| e["payload"].clone())
        .collect()
}

/// The check above sees only its own broker's invocations. With two brokers a caller who
/// read a stream's id (stream frames are readable tenant-wide) invoked with it through the
/// other broker: that broker said `started` and put its frames on the first caller's
/// stream. And an unkeyed unary invoke with that id, waiting on the broker the first
/// caller's CANCEL reached, had that CANCEL answered `MIG_FORBIDDEN`.
#[test]
fn a_message_id_in_use_on_another_broker_is_refused_and_does_not_block_its_cancel() {
    let mut w = world(2);
    let mut alice = Mig::connect(&w, "alice");
    let tag = alice.invoke_later(
        INFER,
        json!({"header": {"tenant_id": "acme", "message_id": "across", "deadline_ms": 30_000},
               "payload": {}, "stream_preference": "server_stream"}),
    );
    let started = alice.wait(&tag)["reply"].clone();
    assert_eq!(started["payload"]["status"], "started", "{started}");
    const SUBMITTED: &str = "amp_jobs_submitted_total";
    let submitted = |w: &World, b: usize| common::amp::metric(&w.brokers[b], SUBMITTED);
    let deadline = Instant::now() + WAIT;
    let holder = loop {
        if let Some(b) = (0..2).find(|&b| submitted(&w, b) == Some(1.0)) {
            break b;
        }
        assert!(
            Instant::now() < deadline,
            "Alice's task was never submitted"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let other = 1 - holder;
    // Bob streams with the same id until the other broker has answered him.
    let refused = format!(
        "amp_mig_requests_total{{op=\"invoke\",capability=\"{INFER}\",code=\"MIG_INVALID_REQUEST\"}}"
    );
    let mut bob = Mig::connect(&w, "bob");
    let mut tries = 0;
    while common::amp::metric(&w.brokers[other], &refused).is_none() {
        tries += 1;
        assert!(tries <= 40, "the other broker never answered Bob");
        let r = bob.request(
            &format!("invoke.{INFER}"),
            json!({"header": {"tenant_id": "acme", "message_id": "across", "deadline_ms": 300},
                   "payload": {}, "stream_preference": "server_stream"}),
        );
        assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
    }
    // Bob's unary invoke with that id waits on the other broker (nobody serves the job).
    let mut tries = 0;
    loop {
        tries += 1;
        assert!(tries <= 40, "Bob's invoke never waited on the other broker");
        let tag = bob.invoke_later(
            INFER,
            json!({"header": {"tenant_id": "acme", "message_id": "across", "deadline_ms": 30_000},
                   "payload": {}}),
        );
        let deadline = Instant::now() + WAIT;
        let waiting = loop {
            if let Some(r) = bob.answered(&tag) {
                assert_eq!(error_code(&r["reply"]), "MIG_INVALID_REQUEST", "{r}");
                break false;
            }
            if submitted(&w, other) == Some(1.0) {
                break true;
            }
            assert!(Instant::now() < deadline, "Bob's invoke went nowhere");
            std::thread::sleep(Duration::from_millis(20));
        };
        if waiting {
            break;
        }
    }
    // Alice's CANCEL can now reach only the broker Bob's invocation waits on. Until the
    // server has noticed the killed broker's connections, its queue subscription may
    // still take the request, which is then lost (core NATS requests are at most once):
    // Alice asks again, as a client does when a request times out.
    drop(w.brokers.remove(holder));
    let cancel = json!({"cmd": "request", "subject": "mig.v0_1.acme.control.cancel.across",
        "body": {"header": {"tenant_id": "acme"}, "reason": "enough"},
        "headers": {"Authorization": "Bearer alice-token"}, "timeout": 5});
    let mut tries = 0;
    let r = loop {
        tries += 1;
        let r = alice.call(cancel.clone());
        if r.get("error").is_none() || tries == 3 {
            break r;
        }
    };
    assert!(r.get("error").is_none(), "{r}");
    let r = &r["reply"];
    assert_eq!(r["status"], "cancelled", "{r}");
    assert_eq!(r["accepted"], true, "{r}");
}

/// The bucket of taken ids, as the version before per-key TTLs made it (no per-message
/// TTLs, keys kept 300 s), is upgraded when a broker starts: the server allows switching
/// per-message TTLs on, and without them every claim would be refused.
#[test]
fn a_seen_bucket_from_before_per_key_ttls_is_upgraded_at_start() {
    use amp_broker::broker::binding::mig_seen_stream_config;
    use amp_broker::jetstream::Context;
    let callout = CalloutServer::start();
    let seed = callout.broker_key.seed();
    let options = amp_broker::nats::Options::new(&callout.nats.url())
        .with_nkey_seed(&seed)
        .expect("seed");
    let mut js = Context::new(amp_broker::nats::Client::connect(options).expect("connect"));
    let mut old = mig_seen_stream_config(Default::default());
    old.allow_msg_ttl = None;
    old.max_age = Some(Duration::from_secs(300));
    js.create_stream(&old).expect("the old bucket");
    let ann = KeyPair::generate(KeyKind::User).expect("key");
    let broker = callout.broker(&config(&ann), &[]);
    let info = js.stream_info(&old.name).expect("info");
    assert_eq!(info.config.allow_msg_ttl, Some(true), "{:?}", info.config);
    assert_eq!(
        info.config.max_age,
        Some(Duration::from_secs(86_400 + 120)),
        "{:?}",
        info.config
    );
    assert!(common::amp::http_get(broker.addr, "/readyz").is_some_and(|(s, _)| s == 200));
}

/// A streaming invoke waits for its message id to be claimed before it starts; a CANCEL
/// sent right behind it found nothing then (`not_found`) and the invocation ran on to
/// its deadline. The cancel now waits for the claim and stops the invocation.
#[test]
fn a_cancel_right_behind_its_streaming_invoke_stops_it() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let tag = alice.invoke_later(
        INFER,
        json!({"header": {"tenant_id": "acme", "message_id": "behind", "deadline_ms": 20_000},
               "payload": {}, "stream_preference": "server_stream"}),
    );
    let r = alice.request(
        "control.cancel.behind",
        json!({"header": {"tenant_id": "acme"}, "reason": "changed my mind"}),
    );
    assert_eq!(r["accepted"], true, "{r}");
    assert_eq!(r["status"], "cancelled", "{r}");
    let started = Instant::now();
    let answer = alice.wait(&tag)["reply"].clone();
    let stopped = error_code(&answer) == "MIG_TIMEOUT"
        || answer["kind"] == "control" && started.elapsed() < Duration::from_secs(10);
    assert!(stopped, "{answer}");
}

/// The NATS server's `max_payload`, as DISCOVER reports it.
fn max_payload(m: &mut Mig) -> usize {
    let d = m.request("discover", json!({"header": header(json!({}))}));
    let max = d["capabilities"][0]["qos"]["max_payload_bytes"].as_u64();
    usize::try_from(max.expect("qos.max_payload_bytes")).expect("usize")
}

/// Pages `topic` from the start until `caught_up`, at most `pages` of them: the events
/// seen, and whether it caught up.
fn replay_all(m: &mut Mig, topic: &str, pages: usize) -> (Vec<Value>, bool) {
    let mut events = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..pages {
        let mut body = json!({"header": {"tenant_id": "acme"}, "topic": topic});
        if let Some(c) = &cursor {
            body["resume_cursor"] = json!(c);
        }
        let page = m.request("control.subscribe", body);
        assert!(page.get("error").is_none(), "{page}");
        events.extend(page["events"].as_array().expect("events").iter().cloned());
        if page["caught_up"] == true {
            return (events, true);
        }
        cursor = page["next_cursor"].as_str().map(str::to_string);
    }
    (events, false)
}

#[test]
fn an_event_too_large_for_a_replay_page_does_not_stop_the_replay() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let max = max_payload(&mut alice);
    // AMP takes events up to what JetStream stores; as a MIG EventMessage (header,
    // sequence and the rest around the body) this one fits in no replay page.
    let mut amp = w.amp_client(0, "alice");
    let big = "x".repeat(max - 1500);
    let ok = amp.request(json!({"op":"publish","topic":"orders.big","body":{"blob": big}}));
    assert_eq!(ok["op"], "ok", "the large AMP event is stored");
    let ok = amp.request(json!({"op":"publish","topic":"orders.small","body":{"n": 1}}));
    assert_eq!(ok["op"], "ok", "{ok}");

    let (events, caught_up) = replay_all(&mut alice, "orders.>", 3);
    assert!(
        caught_up,
        "the replay did not get past the large event in 3 pages"
    );
    let topics: Vec<&str> = events.iter().filter_map(|e| e["topic"].as_str()).collect();
    assert_eq!(topics, ["orders.small"], "the large event is skipped");
    assert_eq!(events[0]["payload"], json!({"n": 1}));
}

#[test]
fn a_publish_whose_event_message_could_not_be_delivered_is_refused() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let max = max_payload(&mut alice);
    let mut ann = Mig::connect_nkey(&w);
    // It would be stored (the stored event fits max_payload), but its EventMessage fits
    // in no replay page and would be delivered neither live nor replayed.
    let r = ann.signed(
        &w,
        "events.orders.eu",
        json!({"header": {"tenant_id": "acme"}, "payload": {"blob": "x".repeat(max - 2048)}}),
    );
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{}", r["error"]);
    assert_eq!(
        r["error"]["details"]["amp_code"], "too_large",
        "{}",
        r["error"]
    );

    // One that fits a page alone is taken and replayed.
    let blob = "y".repeat(max - 8192);
    let r = ann.signed(
        &w,
        "events.orders.eu",
        json!({"header": {"tenant_id": "acme"}, "payload": {"blob": blob}}),
    );
    assert_eq!(r["accepted"], true, "{}", r["error"]);
    let (events, caught_up) = replay_all(&mut alice, "orders.eu", 3);
    assert!(caught_up);
    assert_eq!(events.len(), 1, "only the second event is stored");
    assert_eq!(events[0]["sequence"], r["sequence"]);
    assert_eq!(events[0]["payload"]["blob"], blob);
}

#[test]
fn a_stream_id_the_broker_made_is_taken_on_every_broker() {
    let w = world(2);
    let mut worker = w.worker(0, "infer", 1);
    // Stream frames are readable tenant-wide: Bob listens to every stream.
    let mut bob = Mig::connect(&w, "bob");
    bob.call(json!({"cmd": "subscribe", "sub": "all", "subject": "mig.v0_1.acme.stream.>"}));
    let mut alice = Mig::connect(&w, "alice");
    let started = alice.request(
        &format!("invoke.{INFER}"),
        json!({"header": {"tenant_id": "acme"}, "payload": {"q": 1},
               "stream_preference": "server_stream"}),
    );
    assert_eq!(started["payload"]["status"], "started", "{started}");
    let made = started["stream_id"]
        .as_str()
        .expect("stream_id")
        .to_string();
    let stream = format!("mig.v0_1.acme.stream.{made}");
    alice.call(json!({"cmd": "subscribe", "sub": "mine", "subject": stream}));

    let offer = worker.next_op("offer", WAIT).expect("offer");
    let task = offer["task"].as_str().expect("task").to_string();
    let claim = worker.request(json!({"op":"claim","task":task}));
    assert_eq!(claim["op"], "ok", "{claim}");
    let hb = worker.request(json!({"op":"heartbeat","task":task,"progress":{"pct":10}}));
    assert_eq!(hb["op"], "ok", "{hb}");
    // Bob learns the id from the progress frame.
    let mut learned = String::new();
    let heard = common::wait_until(WAIT, || {
        let got = bob.call(json!({"cmd": "collected", "sub": "all"}));
        learned = got["messages"][0]["subject"]
            .as_str()
            .and_then(|s| s.strip_prefix("mig.v0_1.acme.stream."))
            .unwrap_or_default()
            .to_string();
        !learned.is_empty()
    });
    assert!(heard && learned == made, "Bob heard {learned:?}");

    const SUBMITTED: &str = "amp_jobs_submitted_total";
    let submitted = |b: usize| common::amp::metric(&w.brokers[b], SUBMITTED);
    let mut holder = None;
    let found = common::wait_until(WAIT, || {
        holder = (0..2).find(|&b| submitted(b) == Some(1.0));
        holder.is_some()
    });
    assert!(found, "Alice's task was never submitted");
    let other = 1 - holder.expect("holder");
    // Bob streams with that id until the broker that did not make it has answered him.
    let refused = format!(
        "amp_mig_requests_total{{op=\"invoke\",capability=\"{INFER}\",code=\"MIG_INVALID_REQUEST\"}}"
    );
    let mut answers = Vec::new();
    let mut tries = 0;
    while common::amp::metric(&w.brokers[other], &refused).is_none()
        && answers
            .iter()
            .all(|r: &Value| error_code(r) == "MIG_INVALID_REQUEST")
    {
        tries += 1;
        assert!(tries <= 40, "the other broker never answered Bob");
        answers.push(bob.request(
            &format!("invoke.{INFER}"),
            json!({"header": {"tenant_id": "acme", "message_id": learned, "deadline_ms": 200},
                   "payload": {}, "stream_preference": "server_stream"}),
        ));
    }
    let taken = answers
        .iter()
        .any(|r| error_code(r) != "MIG_INVALID_REQUEST");
    if taken {
        // Bob's invocation ends at its deadline with an error frame on the stream.
        let ended = common::wait_until(WAIT, || {
            let got = bob.call(json!({"cmd": "collected", "sub": "all"}));
            got["messages"]
                .as_array()
                .is_some_and(|m| m.iter().any(|f| f["body"]["kind"] == "error"))
        });
        assert!(ended, "Bob's invocation never ended");
    }

    let done = worker.request(json!({"op":"complete","task":task,"result":{"answer":42}}));
    assert_eq!(done["op"], "ok", "{done}");
    let mut frames = Vec::new();
    let finished = common::wait_until(WAIT, || {
        let got = alice.call(json!({"cmd": "collected", "sub": "mine"}));
        frames = got["messages"].as_array().cloned().unwrap_or_default();
        frames
            .iter()
            .any(|f| f["body"]["payload"] == json!({"answer": 42}))
    });
    assert!(finished, "{frames:?}");
    let ends: Vec<&Value> = frames
        .iter()
        .map(|f| &f["body"])
        .filter(|b| b["end_stream"] == true)
        .collect();
    assert_eq!(
        ends.len(),
        1,
        "a foreign end_stream on Alice's stream: {ends:?}"
    );
    assert_eq!(ends[0]["kind"], "response", "{ends:?}");
    assert!(
        !taken,
        "Bob's invoke with Alice's stream id was taken: {answers:?}"
    );
}

#[test]
fn a_refused_request_reflects_at_most_its_bounded_header_into_the_inbox_it_names() {
    let w = world(1);
    // Bob taps his own reply prefix, as his permissions allow.
    let mut bob = Mig::connect(&w, "bob");
    bob.call(json!({"cmd": "subscribe", "sub": "inbox", "subject": "_INBOX_acme_bob.>"}));
    // Alice sends a request with a wrong credential, a reply subject in Bob's inbox and
    // a 400 KB traceparent: the refusal goes to Bob's inbox, and must not carry it.
    let mut alice = Mig::connect(&w, "alice");
    let huge = "0".repeat(400_000);
    let sent = alice.call(json!({"cmd": "publish", "subject": "mig.v0_1.acme.hello",
        "reply": "_INBOX_acme_bob.x.1",
        "body": {"header": {"tenant_id": "acme", "traceparent": huge, "message_id": "m".repeat(128)}},
        "headers": {"Authorization": "Bearer not-bobs-token"}}));
    assert_eq!(sent["ok"], true, "{sent}");
    let mut got = Vec::new();
    let arrived = common::wait_until(WAIT, || {
        let c = bob.call(json!({"cmd": "collected", "sub": "inbox"}));
        got = c["messages"].as_array().cloned().unwrap_or_default();
        !got.is_empty()
    });
    assert!(arrived, "the refusal was not sent");
    let size: usize = got
        .iter()
        .map(|m| m["body"].to_string().len() + m["headers"].to_string().len())
        .sum();
    assert!(size < 1024, "{size} bytes reached Bob's inbox");
    assert_eq!(error_code(&got[0]["body"]), "MIG_UNAUTHORIZED");
    // The spec's echo of a valid header stays: every field of it is bounded.
    let sent = alice.call(json!({"cmd": "publish", "subject": "mig.v0_1.acme.hello",
        "reply": "_INBOX_acme_bob.x.2",
        "body": {"header": {"tenant_id": "acme", "traceparent": "0".repeat(256),
            "message_id": "m".repeat(128), "session_id": "s".repeat(128)}},
        "headers": {"Authorization": "Bearer not-bobs-token"}}));
    assert_eq!(sent["ok"], true, "{sent}");
    let arrived = common::wait_until(WAIT, || {
        let c = bob.call(json!({"cmd": "collected", "sub": "inbox"}));
        got = c["messages"].as_array().cloned().unwrap_or_default();
        got.len() == 2
    });
    assert!(arrived, "the second refusal was not sent");
    let echoed = &got[1];
    assert_eq!(echoed["body"]["header"]["message_id"], "m".repeat(128));
    let size = echoed["body"].to_string().len() + echoed["headers"].to_string().len();
    assert!(size < 2048, "{size} bytes reached Bob's inbox");

    // An authenticated request's traceparent is echoed, in the body and as a NATS header,
    // up to 256 characters; a longer one is refused.
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = alice.call(json!({"cmd": "request", "subject": "mig.v0_1.acme.hello",
        "body": {"header": {"tenant_id": "acme", "traceparent": tp}},
        "headers": {"Authorization": "Bearer alice-token"}, "timeout": 15}));
    assert_eq!(r["reply"]["selected_version"], "0.1", "{r}");
    assert_eq!(r["reply"]["header"]["traceparent"], tp, "{r}");
    assert_eq!(r["headers"]["traceparent"], tp, "{r}");
    let long = format!("{tp}-{}", "0".repeat(256 - tp.len()));
    let r = alice.request(
        "hello",
        json!({"header": {"tenant_id": "acme", "traceparent": long}}),
    );
    assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
    assert!(r["header"].get("traceparent").is_none(), "{r}");
}

/// JetStream as the broker sees it (its own credentials).
fn broker_js(w: &World) -> amp_broker::jetstream::Context {
    let seed = w.callout.broker_key.seed();
    let options = amp_broker::nats::Options::new(&w.callout.nats.url())
        .with_nkey_seed(&seed)
        .expect("seed");
    amp_broker::jetstream::Context::new(
        amp_broker::nats::Client::connect(options).expect("connect"),
    )
}

/// Messages held by `AMP_MIG_SEEN`.
fn seen_keys(w: &World) -> u64 {
    broker_js(w)
        .stream_info("KV_AMP_MIG_SEEN")
        .expect("the bucket of taken ids")
        .state
        .messages
}

/// A keyed invoke whose task has finished answers a retry at once from the task record,
/// spending no budget and no invocation slot for long, but each retry with a fresh
/// `message_id` claimed that id in `AMP_MIG_SEEN` for its deadline plus a minute. One
/// caller repeating a finished key at the pace it is allowed (1,000 a second) held some
/// 360,000 keys, about what the domain's 64 MiB bucket holds; then every signed PUBLISH
/// and named invoke of every tenant answered `MIG_UNAVAILABLE`. A caller now holds at
/// most `mig.max_claims_per_caller` live claims on a broker.
#[test]
fn one_caller_cannot_fill_the_bucket_of_taken_ids() {
    let w = world_configured(1, None, |c| c["mig"]["max_claims_per_caller"] = json!(20));
    let mut worker = w.worker(0, "infer", 1);
    let mut alice = Mig::connect(&w, "alice");
    let keyed = |id: &str| {
        json!({"header": header(json!({"message_id": id, "idempotency_key": "k",
                                        "deadline_ms": 300_000})),
               "payload": {}})
    };
    let tag = alice.invoke_later(INFER, keyed("first"));
    serve_one(&mut worker, json!({"op":"complete","result":{"ok":1}}));
    assert_eq!(alice.wait(&tag)["reply"]["payload"], json!({"ok": 1}));
    let mut refused = None;
    for n in 0..40 {
        let r = alice.request(&format!("invoke.{INFER}"), keyed(&format!("again-{n}")));
        if error_code(&r) == "MIG_RATE_LIMITED" {
            refused = Some((n, r));
            break;
        }
        assert_eq!(r["payload"], json!({"ok": 1}), "{r}");
    }
    let (n, r) = refused.unwrap_or_else(|| {
        panic!(
            "alice was never refused; AMP_MIG_SEEN holds {} keys",
            seen_keys(&w)
        )
    });
    // Her first invoke holds one claim, each retry one more.
    assert_eq!(n, 19, "{r}");
    assert_eq!(r["error"]["retryable"], true, "{r}");
    let retry = r["error"]["details"]["retry_after_ms"]
        .as_u64()
        .unwrap_or(0);
    assert!(retry > 300_000 && retry <= 360_000, "{r}");
    // Bob's named invoke still claims its id and runs.
    let mut bob = Mig::connect(&w, "bob");
    let tag = bob.invoke_later(
        INFER,
        json!({"header": header(json!({"message_id": "bobs", "idempotency_key": "b"})),
               "payload": {"n": 2}}),
    );
    serve_one(&mut worker, json!({"op":"complete","result":{"ok":2}}));
    assert_eq!(bob.wait(&tag)["reply"]["payload"], json!({"ok": 2}));
    assert_eq!(seen_keys(&w), 21, "alice's 20 claims and bob's");
}

/// `AMP_MIG_SEEN` deleted while the broker runs (an operator, anyone with JetStream
/// rights): a named invoke's claim finds nobody, is answered `MIG_UNAVAILABLE` with
/// `retry_after_ms`, and the broker makes the bucket again. Before, it stayed gone and
/// every named invoke and signed PUBLISH failed until a restart.
#[test]
fn the_bucket_of_taken_ids_deleted_while_the_broker_runs_is_made_again() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    let keyed = |id: &str| {
        json!({"header": header(json!({"message_id": id, "idempotency_key": id})),
               "payload": {}})
    };
    assert_eq!(seen_keys(&w), 0);
    assert!(
        broker_js(&w)
            .delete_stream("KV_AMP_MIG_SEEN")
            .expect("delete")
    );

    let r = alice.request(&format!("invoke.{INFER}"), keyed("gone"));
    assert_eq!(error_code(&r), "MIG_UNAVAILABLE", "{r}");
    assert!(
        common::wait_until(WAIT, || broker_js(&w)
            .stream_info("KV_AMP_MIG_SEEN")
            .is_ok()),
        "AMP_MIG_SEEN never made again; the refusal was {r}"
    );
    assert_eq!(r["error"]["retryable"], true, "{r}");
    assert!(
        r["error"]["details"]["retry_after_ms"]
            .as_u64()
            .is_some_and(|ms| ms > 0),
        "{r}"
    );

    // Named invokes wait out the claims of ids in use made again (a second), answered
    // `MIG_UNAVAILABLE` meanwhile.
    let stream = json!({"header": header(json!({"message_id": "back", "deadline_ms": 1000})),
                        "payload": {}, "stream_preference": "server_stream"});
    let back = answers_past_unavailable(1, || {
        alice.request(&format!("invoke.{INFER}"), stream.clone())
    });
    assert_eq!(back[0]["payload"]["status"], "started", "{back:?}");
    assert_eq!(seen_keys(&w), 1, "the claim is in the bucket made again");
    // The broker heard of the bucket twice, by its create's answer and by JetStream's
    // advisory (both within that second); it claimed its ids again once.
    let log = w.brokers[0].log();
    let rounds = log.matches("was made again: claiming again").count();
    assert_eq!(rounds, 1, "{log}");
}

/// Deletes `AMP_MIG_SEEN` and sends `poke` (a request that claims an id) until a broker,
/// finding the bucket gone, has made it again.
fn seen_bucket_made_again(w: &World, mut poke: impl FnMut() -> Value) {
    assert!(
        broker_js(w)
            .delete_stream("KV_AMP_MIG_SEEN")
            .expect("delete")
    );
    let mut pokes = Vec::new();
    let back = common::wait_until(WAIT, || {
        pokes.push(poke());
        broker_js(w).stream_info("KV_AMP_MIG_SEEN").is_ok()
    });
    assert!(back, "AMP_MIG_SEEN never made again: {pokes:?}");
}

/// The first `n` answers of `ask` that are not `MIG_UNAVAILABLE`, each of those waited
/// out for its `retry_after_ms` as a client would.
fn answers_past_unavailable(n: usize, mut ask: impl FnMut() -> Value) -> Vec<Value> {
    let deadline = Instant::now() + WAIT;
    let mut answers = Vec::new();
    while answers.len() < n {
        let r = ask();
        if error_code(&r) != "MIG_UNAVAILABLE" {
            answers.push(r);
            continue;
        }
        assert!(Instant::now() < deadline, "still unavailable: {r}");
        let ms = r["error"]["details"]["retry_after_ms"]
            .as_u64()
            .unwrap_or(100);
        std::thread::sleep(Duration::from_millis(ms));
    }
    answers
}

/// The bucket made again is empty: the message id of an invocation still running, taken
/// in the one deleted, was free again on every broker but the one running it. A security
/// review had Bob's invokes with Alice's stream id refused 6 of 6 before the deletion,
/// and 8 of 12 `started` (his frames on her stream) once the bucket was back. Every
/// broker now claims again the ids its invocations hold when it hears the bucket is made.
#[test]
fn a_message_id_in_use_stays_taken_once_the_bucket_of_taken_ids_is_made_again() {
    let w = world(2);
    let shared = |deadline_ms: u64| {
        json!({"header": header(json!({"message_id": "shared", "deadline_ms": deadline_ms})),
               "payload": {}, "stream_preference": "server_stream"})
    };
    let mut alice = Mig::connect(&w, "alice");
    let tag = alice.invoke_later(INFER, shared(60_000));
    let started = alice.wait(&tag)["reply"].clone();
    assert_eq!(started["payload"]["status"], "started", "{started}");
    let mut bob = Mig::connect(&w, "bob");
    let mut invoke = || bob.request(&format!("invoke.{INFER}"), shared(300));
    for _ in 0..6 {
        let r = invoke();
        assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "before: {r}");
    }
    seen_bucket_made_again(&w, &mut invoke);
    let answers = answers_past_unavailable(12, &mut invoke);
    let taken: Vec<&Value> = answers
        .iter()
        .filter(|r| error_code(r) != "MIG_INVALID_REQUEST")
        .collect();
    assert!(taken.is_empty(), "{} of 12 taken: {taken:?}", taken.len());
}

/// The same for a signed PUBLISH's id inside its replay window: a subscriber's copy with
/// its own body, sent to the broker that had not stored the original once the bucket was
/// made again, was stored as the signer's event.
#[test]
fn a_signed_publish_stays_a_replay_once_the_bucket_of_taken_ids_is_made_again() {
    let w = world(2);
    let mut alice = Mig::connect(&w, "alice");
    let (tapped, other) = tapped_publish(&w, &mut alice);
    let mut bob = Mig::connect(&w, "bob");
    let mut n = 0;
    let mut poke = || {
        n += 1;
        let id = format!("poke{n}");
        let body = json!({"header": header(json!({"message_id": id, "deadline_ms": 300})),
                          "payload": {}, "stream_preference": "server_stream"});
        bob.request(&format!("invoke.{INFER}"), body)
    };
    seen_bucket_made_again(&w, &mut poke);
    // A copy refused while the brokers wait for the re-claims has its id claimed by that
    // refusal: sent once they no longer wait, only the broker's re-claim stops it.
    answers_past_unavailable(2, &mut poke);
    replay_through(&w, &mut alice, &tapped, other);
    assert_eq!(stored_orders(&mut alice), [json!({"n": 1})]);
}

/// Who holds invocation message id `id` of tenant acme in `AMP_MIG_SEEN`, if anyone.
fn invocation_holder(w: &World, id: &str) -> Option<String> {
    use amp_broker::broker::mig::seen;
    let mut js = broker_js(w);
    let kv = js.kv_bind(seen::BUCKET).ok()?;
    let entry = js.kv_get(&kv, &seen::invocation_key("acme", id)).ok()?;
    Some(String::from_utf8_lossy(&entry.value).into_owned())
}

/// A broker whose main connection was down when the bucket was made again never heard
/// JetStream's advisory: the message id of the invocation it runs stayed free in the new
/// bucket, and another caller's invoke through another broker took it. Each broker now
/// asks at every reconnect whether the bucket is the one it knew.
#[test]
fn a_message_id_in_use_stays_taken_when_its_broker_was_away_as_the_bucket_was_made_again() {
    use amp_broker::broker::binding::mig_seen_stream_config;
    let callout = CalloutServer::start();
    let relay = common::relay::Relay::start(&callout.nats.addr());
    let mut w = World {
        brokers: Vec::new(),
        callout,
        ann: KeyPair::generate(KeyKind::User).expect("key"),
        dir: tempfile::tempdir().expect("dir"),
        tls: None,
        config: Value::Null,
    };
    w.config = config(&w.ann);
    // A, through the relay, alone: Alice's stream runs there.
    w.add_broker(&format!("nats://{}", relay.addr()));
    w.await_mig();
    let shared = |deadline_ms: u64| {
        json!({"header": header(json!({"message_id": "shared", "deadline_ms": deadline_ms})),
               "payload": {}, "stream_preference": "server_stream"})
    };
    let mut alice = Mig::connect(&w, "alice");
    let tag = alice.invoke_later(INFER, shared(120_000));
    let started = alice.wait(&tag)["reply"].clone();
    assert_eq!(started["payload"]["status"], "started", "{started}");
    let url = w.nats_url();
    w.add_broker(&url);
    w.await_mig();
    let mut bob = Mig::connect(&w, "bob");

    // A's main connection goes down (its ingress connections stay up, and leave MIG
    // requests to B meanwhile); the bucket is made again, B hears of it and A does not.
    let main = |said: &str| said.starts_with("CONNECT") && !said.contains(" ingress ");
    assert!(relay.cut_where(main) >= 1, "A's main connection");
    let connected = |w: &World| common::amp::metric(&w.brokers[0], "amp_nats_connected");
    assert!(
        common::wait_until(WAIT, || connected(&w) == Some(0.0)),
        "A's main connection seen down"
    );
    let mut js = broker_js(&w);
    assert!(js.delete_stream("KV_AMP_MIG_SEEN").expect("delete"));
    js.create_stream(&mig_seen_stream_config(Default::default()))
        .expect("made again");
    relay.restore();
    assert!(
        common::wait_until(WAIT, || connected(&w) == Some(1.0)),
        "A's main connection back; log:\n{}",
        w.brokers[0].log()
    );

    // A claims Alice's id again once it finds the bucket new; then Bob's invokes with her
    // stream id are refused through either broker.
    let reclaimed = common::wait_until(WAIT, || {
        invocation_holder(&w, "shared").as_deref() == Some("alice")
    });
    let mut invoke = || bob.request(&format!("invoke.{INFER}"), shared(300));
    let answers = answers_past_unavailable(12, &mut invoke);
    let taken: Vec<&Value> = answers
        .iter()
        .filter(|r| error_code(r) != "MIG_INVALID_REQUEST")
        .collect();
    assert!(
        taken.is_empty(),
        "{} of 12 taken (A's claim again seen: {reclaimed}): {taken:?}",
        taken.len()
    );
    assert!(reclaimed, "Alice's id held for her in the new bucket");
}

fn now_rfc3339() -> String {
    amp_broker::rfc3339::format_system_time(std::time::SystemTime::now())
}

/// A signed request's id is used up as soon as its signature verifies, before its pace
/// is looked at: sent again as it was after `MIG_RATE_LIMITED`, it is a replay. For a
/// while ids were taken only once paced, so that a resend passed; that left a refused
/// PUBLISH's id free for any subscriber of its topic to use with its own body
/// (`a_signed_publish_refused_for_pace_cannot_be_stored_with_another_body`). A refused
/// request is signed again with a new id.
#[test]
fn a_signed_request_refused_for_pace_is_signed_again_with_a_new_id() {
    let w = world_configured(1, None, |c| c["limits"]["max_frames_per_s"] = json!(1));
    let mut ann = Mig::connect_nkey(&w);
    let discover = json!({"header": {"tenant_id": "acme"}});
    let ts = now_rfc3339();
    // One a second, after a second's worth at once: the third at the latest is refused.
    let refused = (1..=3).map(|n| format!("pace-{n}")).find(|id| {
        let r = ann.signed_as(&w.ann, id, &ts, "discover", discover.clone());
        if error_code(&r) == "MIG_RATE_LIMITED" {
            return true;
        }
        assert!(r["capabilities"].is_array(), "{r}");
        false
    });
    let id = refused.expect("no request was refused for pace");
    let r = ann.signed_as(&w.ann, &id, &ts, "discover", discover.clone());
    assert_eq!(
        error_code(&r),
        "MIG_UNAUTHORIZED",
        "sent again as it was: {r}"
    );
    // Signed again with a new id, it passes once the pace allows one more.
    let mut tries = 0;
    let mut again = Value::Null;
    let served = common::wait_until(WAIT, || {
        tries += 1;
        let fresh = format!("{id}-again-{tries}");
        again = ann.signed_as(&w.ann, &fresh, &ts, "discover", discover.clone());
        error_code(&again) != "MIG_RATE_LIMITED"
    });
    assert!(served, "{again}");
    assert!(again["capabilities"].is_array(), "{again}");
}

/// Signed ids are remembered in one cache per broker, shared by every tenant's NKey
/// callers; full, it refused every signed request (PUBLISH included) until ids aged out,
/// 240 s, and sixteen identities signing their 4,096 each filled it. A full cache now
/// refuses only whoever holds the most of it; anyone else's id takes the place of that
/// caller's oldest. Here the cache holds 8.
#[test]
fn identities_filling_the_replay_cache_do_not_lock_out_another() {
    let keys: Vec<KeyPair> = (0..2)
        .map(|_| KeyPair::generate(KeyKind::User).expect("key"))
        .collect();
    let w = world_configured(1, None, |c| {
        c["mig"]["max_signed_ids"] = json!(8);
        for (n, k) in keys.iter().enumerate() {
            c["namespaces"]["acme"]["participants"][format!("n{n}")] =
                json!({"nkey": k.public_key(), "permissions": {"submit": ["infer"]}});
        }
    });
    let connect = |name: &str, key: &KeyPair| {
        let seed = w.dir.path().join(format!("{name}.seed"));
        std::fs::write(&seed, key.seed()).expect("seed");
        Mig::connect_as(&w, name, json!({"nkeys_seed": seed}))
    };
    let discover = json!({"header": {"tenant_id": "acme"}});
    let ts = now_rfc3339();
    let mut ann = Mig::connect_nkey(&w);
    for n in 0..8 {
        let r = ann.signed_as(&w.ann, &format!("a{n}"), &ts, "discover", discover.clone());
        assert!(r["capabilities"].is_array(), "{r}");
    }
    // Full of Ann's ids: her next waits for room, refused as such, not as a bad proof.
    let r = ann.signed_as(&w.ann, "a8", &ts, "discover", discover.clone());
    assert_eq!(error_code(&r), "MIG_RATE_LIMITED", "{r}");
    let retry = r["error"]["details"]["retry_after_ms"]
        .as_u64()
        .unwrap_or(0);
    assert!(retry > 0 && retry <= 240_000, "{r}");
    let mut n0 = connect("n0", &keys[0]);
    for id in ["x0", "x1"] {
        let r = n0.signed_as(&keys[0], id, &ts, "discover", discover.clone());
        assert!(r["capabilities"].is_array(), "n0 {id}: {r}");
    }
    let mut n1 = connect("n1", &keys[1]);
    let r = n1.signed_as(&keys[1], "y0", &ts, "discover", discover.clone());
    assert!(r["capabilities"].is_array(), "n1: {r}");
    // Ann's newer ids are still remembered: replays of them are refused.
    let r = ann.signed_as(&w.ann, "a7", &ts, "discover", discover);
    assert_eq!(error_code(&r), "MIG_UNAUTHORIZED", "{r}");
    assert!(
        w.metrics(0)
            .contains("amp_mig_rejected_total{reason=\"replay_cache_share\"} 1"),
        "{}",
        w.metrics(0)
    );
}

/// A subscriber of a topic receives each signed PUBLISH whole, and the signature covers
/// the message id, time and subject, not the body. A PUBLISH refused before its id was
/// recorded (for pace here) left the id free: Bob, who may publish and subscribe on the
/// topic, sent Ann's refused request again with his own body and her reply subject, and
/// the first copy the pace let through was stored as Ann's event. An id whose signature
/// verifies is now used up, on every broker, before anything can refuse its request.
#[test]
fn a_signed_publish_refused_for_pace_cannot_be_stored_with_another_body() {
    let w = world_configured(2, None, |c| {
        c["limits"]["max_frames_per_s"] = json!(1);
        let chat = json!({"publish": ["chat.>"], "subscribe": ["chat.>"]});
        let listed = &mut c["namespaces"]["acme"]["participants"];
        listed["ann"]["permissions"] = chat.clone();
        listed["bob"]["permissions"] = chat;
    });
    let mut bob = Mig::connect(&w, "bob");
    bob.call(json!({"cmd": "subscribe", "sub": "tap", "subject": "mig.v0_1.acme.events.chat.>"}));
    let mut ann = Mig::connect_nkey(&w);
    let forged_replies = "_INBOX_acme_ann.forged";
    ann.call(json!({"cmd": "subscribe", "sub": "answers", "subject": forged_replies}));
    let ts = now_rfc3339();
    // Back to back: one a second after a second's worth, on each of two brokers.
    let refused = (1..=6).map(|n| format!("chat-{n}")).find(|id| {
        let body = json!({"header": {"tenant_id": "acme"}, "payload": {"id": id}});
        let r = ann.signed_as(&w.ann, id, &ts, "events.chat.room", body);
        if error_code(&r) == "MIG_RATE_LIMITED" {
            return true;
        }
        assert_eq!(r["accepted"], true, "{r}");
        false
    });
    let id = refused.expect("no PUBLISH was refused for pace");
    // What Bob saw of it: the whole request.
    let mut tapped = Value::Null;
    let seen = common::wait_until(WAIT, || {
        let got = bob.call(json!({"cmd": "collected", "sub": "tap"}));
        let found = got["messages"].as_array().and_then(|all| {
            all.iter()
                .find(|m| m["body"]["header"]["message_id"] == json!(id))
                .cloned()
        });
        tapped = found.unwrap_or(Value::Null);
        !tapped.is_null()
    });
    assert!(seen, "Bob never saw Ann's refused request");
    let mut forged = tapped["body"].clone();
    forged["payload"] = json!({"x": "forged"});
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_secs(2) {
        bob.call(
            json!({"cmd": "publish", "subject": tapped["subject"], "body": forged,
                        "headers": tapped["headers"], "reply": forged_replies}),
        );
        sent += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every copy is refused: answered (to Ann's inbox, the reply subject Bob gave them),
    // or, past a few such refusals a second, answered with nothing and counted.
    let mut answers = Vec::new();
    let mut unanswered = 0;
    let all = common::wait_until(WAIT, || {
        let got = ann.call(json!({"cmd": "collected", "sub": "answers"}));
        answers = got["messages"].as_array().cloned().unwrap_or_default();
        unanswered = refusals_unanswered(&w);
        answers.len() + unanswered >= sent
    });
    assert!(
        all,
        "{} of {sent} copies answered, {unanswered} refused unanswered",
        answers.len()
    );
    let taken: Vec<&Value> = answers
        .iter()
        .filter(|a| a["body"]["accepted"] == true)
        .collect();
    let page = bob.request(
        "control.subscribe",
        json!({"header": {"tenant_id": "acme"}, "topic": "chat.>"}),
    );
    let events = page["events"].as_array().expect("events");
    let stored: Vec<&Value> = events
        .iter()
        .filter(|e| e["payload"]["x"] == "forged")
        .collect();
    assert!(
        stored.is_empty() && taken.is_empty(),
        "Bob's body stored as Ann's event: {stored:?}; answers accepted: {taken:?}"
    );
    assert!(!events.is_empty(), "Ann's own events are stored: {page}");
}

/// Refusals of unproved requests every broker answered with nothing.
fn refusals_unanswered(w: &World) -> usize {
    w.brokers
        .iter()
        .filter_map(|b| {
            common::amp::metric(b, "amp_mig_rejected_total{reason=\"refusal_unanswered\"}")
        })
        .sum::<f64>() as usize
}

/// `Authorization` of a request on `mig.v0_1.acme.<op>` signed by `key` with message id
/// `id` at `ts`.
fn nkey_authorization(key: &KeyPair, id: &str, ts: &str, op: &str) -> String {
    use base64::Engine;
    let signed = format!("{id}\n{ts}\nmig.v0_1.acme.{op}");
    let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key.sign(signed.as_bytes()));
    format!("NKey {} {sig}", key.public_key())
}

/// A signed PUBLISH whose reply subject is not under its signer's prefix (someone else's,
/// or no participant's: a client without its inbox prefix) is dropped unanswered, yet it
/// reached every subscriber of its topic all the same. It was dropped before its id
/// counted, so the id stayed free: Bob copied Ann's request with his own body and her
/// reply subject, and the copy was stored as her event. Its id is now used up on every
/// broker as any refused PUBLISH's is.
#[test]
fn a_signed_publish_dropped_for_its_reply_subject_cannot_be_stored_with_another_body() {
    let w = world_configured(2, None, |c| {
        let chat = json!({"publish": ["chat.>"], "subscribe": ["chat.>"]});
        let listed = &mut c["namespaces"]["acme"]["participants"];
        listed["ann"]["permissions"] = chat.clone();
        listed["bob"]["permissions"] = chat;
    });
    let mut bob = Mig::connect(&w, "bob");
    bob.call(json!({"cmd": "subscribe", "sub": "tap", "subject": "mig.v0_1.acme.events.chat.>"}));
    let mut ann = Mig::connect_nkey(&w);
    let answers = "_INBOX_acme_ann.forged";
    ann.call(json!({"cmd": "subscribe", "sub": "answers", "subject": answers}));
    let ts = now_rfc3339();
    let op = "events.chat.room";
    let dropped = [("d-1", "_INBOX_acme_bob.x"), ("d-2", "_INBOX.x")];
    for (id, reply) in dropped {
        let body = json!({"header": {"tenant_id": "acme", "message_id": id, "timestamp": ts},
                          "payload": {"id": id}});
        let auth = nkey_authorization(&w.ann, id, &ts, op);
        ann.call(
            json!({"cmd": "publish", "subject": format!("mig.v0_1.acme.{op}"), "body": body,
                        "headers": {"Authorization": auth}, "reply": reply}),
        );
    }
    const DROPPED: &str = "amp_mig_rejected_total{reason=\"reply_subject\"}";
    let count = |b: usize| common::amp::metric(&w.brokers[b], DROPPED).unwrap_or(0.0);
    let both = common::wait_until(WAIT, || count(0) + count(1) == 2.0);
    assert!(both, "the two requests were not dropped");
    // Each id is created in AMP_MIG_SEEN after its drop; before, neither was.
    let recorded = common::wait_until(WAIT, || seen_keys(&w) == 2);
    // What Bob saw: both requests whole.
    let mut tapped = Vec::new();
    let seen = common::wait_until(WAIT, || {
        let got = bob.call(json!({"cmd": "collected", "sub": "tap"}));
        tapped = got["messages"].as_array().cloned().unwrap_or_default();
        tapped.len() == 2
    });
    assert!(seen, "Bob saw {tapped:?}");
    // Several copies of each, so that both brokers get some.
    let mut sent = 0;
    for m in &tapped {
        let mut forged = m["body"].clone();
        forged["payload"] = json!({"x": "forged"});
        for _ in 0..4 {
            bob.call(
                json!({"cmd": "publish", "subject": m["subject"], "body": forged,
                            "headers": m["headers"], "reply": answers}),
            );
            sent += 1;
        }
    }
    // Refusals to one reply prefix are answered a few a second per broker; the rest are
    // counted unanswered.
    let mut replies = Vec::new();
    let mut unanswered = 0;
    let all = common::wait_until(WAIT, || {
        let got = ann.call(json!({"cmd": "collected", "sub": "answers"}));
        replies = got["messages"].as_array().cloned().unwrap_or_default();
        unanswered = refusals_unanswered(&w);
        replies.len() + unanswered >= sent
    });
    assert!(
        all,
        "{} of {sent} copies answered, {unanswered} refused unanswered",
        replies.len()
    );
    let page = bob.request(
        "control.subscribe",
        json!({"header": {"tenant_id": "acme"}, "topic": "chat.>"}),
    );
    let stored = page["events"].as_array().cloned().unwrap_or_default();
    let codes: Vec<&str> = replies
        .iter()
        .map(|r| r["body"]["error"]["code"].as_str().unwrap_or("none"))
        .collect();
    assert!(
        stored.is_empty() && codes.iter().all(|c| *c == "MIG_UNAUTHORIZED") && recorded,
        "stored as Ann's: {stored:?}; answers: {codes:?}; ids recorded: {recorded}"
    );
}

/// A PUBLISH keeps its event (up to `max_payload`) while its signed id is created in
/// `AMP_MIG_SEEN`, and only the caller's pace bounded how many: with JetStream slow to
/// answer, the bytes held grew with what callers sent. They now count in the bound that
/// submits waiting for JetStream share, a quarter of `limits.max_buffered_bytes`.
#[test]
fn publish_bodies_waiting_for_jetstream_are_bounded_in_bytes() {
    let w = world_configured(1, None, |c| {
        c["limits"]["max_buffered_bytes"] = json!(8 << 20);
        let chat = json!({"publish": ["chat.>"], "subscribe": ["chat.>"]});
        c["namespaces"]["acme"]["participants"]["ann"]["permissions"] = chat;
    });
    // JetStream keeps taking ids but stops answering: each claim waits for its timeout.
    let mut js = broker_js(&w);
    let mut seen = js.stream_info("KV_AMP_MIG_SEEN").expect("bucket").config;
    seen.no_ack = Some(true);
    js.update_stream(&seen).expect("acks off");
    let mut ann = Mig::connect_nkey(&w);
    let ts = now_rfc3339();
    let op = "events.chat.big";
    let filler = "x".repeat(200_000);
    let publish = |ann: &mut Mig, id: &str, wait: bool| {
        let body = json!({"header": {"tenant_id": "acme", "message_id": id, "timestamp": ts},
                          "payload": {"fill": filler}});
        let auth = nkey_authorization(&w.ann, id, &ts, op);
        ann.send(
            json!({"cmd": "request", "subject": format!("mig.v0_1.acme.{op}"),
                        "body": body, "headers": {"Authorization": auth}, "timeout": 15,
                        "wait": wait}),
        )
    };
    // 40 x 200 kB = 8 MB against a 2 MiB share: about 10 are held, the rest refused.
    let tags: Vec<String> = (0..40)
        .map(|n| publish(&mut ann, &format!("big-{n}"), false))
        .collect();
    let mut codes = Vec::new();
    for tag in &tags {
        let r = ann.wait(tag);
        assert!(r.get("error").is_none(), "{r}");
        codes.push(error_code(&r["reply"]).to_string());
        if error_code(&r["reply"]) == "MIG_BACKPRESSURE" {
            let retry = &r["reply"]["error"]["details"]["retry_after_ms"];
            assert!(retry.as_u64().is_some_and(|ms| ms > 0), "{r}");
        }
    }
    let refused = codes.iter().filter(|c| *c == "MIG_BACKPRESSURE").count();
    assert!(
        (25..=32).contains(&refused),
        "{refused} of 40 refused while JetStream did not answer: {codes:?}"
    );
    // The held ones were answered when their claims timed out, and the room is back.
    assert!(
        codes
            .iter()
            .all(|c| c == "MIG_BACKPRESSURE" || c == "MIG_UNAVAILABLE"),
        "{codes:?}"
    );
    seen.no_ack = Some(false);
    js.update_stream(&seen).expect("acks on");
    let tag = publish(&mut ann, "big-after", true);
    let r = ann.wait(&tag);
    assert_eq!(r["reply"]["accepted"], true, "{r}");
}

/// An INVOKE kept its whole payload, parsed as a `serde_json::Value` (32 bytes for each
/// `0,` of an array), until it was answered or its deadline (up to 300 s) passed, and only
/// the number of invocations was bounded (1,024 per caller): one caller with NATS
/// credentials made the broker hold GBs. Here, 32 invokes of 100 kB sent at once: before,
/// 21 waited (the jobs engine refused the rest) and the peak grew 51 MiB, against a
/// budget of 8. An invocation now keeps its payload as text, only until its submit, against
/// the bound that submits waiting for JetStream share (a quarter of
/// `limits.max_buffered_bytes`): 20 are taken, 12 refused, and the peak grows 2-5 MiB.
#[test]
fn invoke_payloads_are_not_held_while_their_tasks_wait() {
    const INVOKES: usize = 32;
    let w = world_configured(1, None, |c| {
        c["limits"]["max_buffered_bytes"] = json!(8 << 20);
    });
    let pid = w.brokers[0].pid().expect("pid");
    let mut js = broker_js(&w);
    // Tasks of `idle`, which nobody serves: each invocation waits for its deadline.
    let mut queued = || -> usize {
        let req = js
            .api()
            .stream_info_subjects("AMP_TASKS_acme", "amp.acme.job.idle")
            .expect("request");
        let info: Value = js
            .send(&req)
            .ok()
            .and_then(|m| serde_json::from_slice(&m.payload).ok())
            .unwrap_or(Value::Null);
        let n = info["state"]["subjects"]["amp.acme.job.idle"].as_u64();
        n.map_or(0, |n| n as usize)
    };
    let mut alice = Mig::connect(&w, "alice");
    // 100 kB of `0,` each, 1.6 MB as a `Value`. (Five times as long, a debug build took
    // longer to handle 64 of them than the requests' timeouts.)
    let zeros = vec!["0"; 50_000].join(",");
    let body = |n: usize| {
        Value::String(format!(
            r#"{{"header":{{"tenant_id":"acme","message_id":"big-{n}","deadline_ms":300000}},"payload":{{"a":[{zeros}]}}}}"#
        ))
    };
    // One first, so that what handling one such request takes is in the baseline.
    let first = alice.invoke_later("observatory.idle", body(0));
    let started = common::wait_until(WAIT, || queued() == 1);
    assert!(
        started,
        "the first task was not queued: {:?}",
        alice.answered(&first)
    );
    let before = common::status_bytes(pid, "VmHWM:");

    let tags: Vec<String> = (1..=INVOKES)
        .map(|n| alice.invoke_later("observatory.idle", body(n)))
        .collect();
    // Each is either refused at once or accepted and its task queued.
    let mut answers: HashMap<String, Value> = HashMap::new();
    let mut tasks = 0;
    let settled = common::wait_until(WAIT, || {
        for tag in &tags {
            if !answers.contains_key(tag)
                && let Some(a) = alice.answered(tag)
            {
                answers.insert(tag.clone(), a);
            }
        }
        tasks = queued().saturating_sub(1);
        answers.len() + tasks == INVOKES
    });
    let grew = common::status_bytes(pid, "VmHWM:").saturating_sub(before);
    assert!(
        settled,
        "{} answered and {tasks} tasks of {INVOKES}: {answers:?}",
        answers.len()
    );
    assert!(
        grew < 16 << 20,
        "the broker's peak resident set grew {} MiB with {tasks} invocations of 100 kB waiting",
        grew >> 20
    );
    assert!(tasks > 0, "every invoke was refused");
    // Refused for want of room. The jobs engine's submit holds a payload and its envelope
    // against the same bound, once the invocation has let go of the payload: 20 of them
    // fit as 20 payloads did, so the engine refuses none here.
    for a in answers.values() {
        assert_eq!(error_code(&a["reply"]), "MIG_BACKPRESSURE", "{a}");
        let retry = &a["reply"]["error"]["details"]["retry_after_ms"];
        assert!(retry.as_u64().is_some_and(|ms| ms > 0), "{a}");
    }
}

/// Live events come from one durable consumer per tenant (`mig_events`) that every broker
/// pulls. Deleted (by an operator, or gone with a server that restarted without its
/// state), the feed's pulls were refused for good and live events stopped without a
/// word. It is now made again, from the event after the last one the feed delivered.
#[test]
fn live_events_go_on_after_their_consumer_is_deleted() {
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    alice.call(
        json!({"cmd": "subscribe", "sub": "live", "subject": "mig.v0_1.acme.events.orders.>"}),
    );
    let mut ann = Mig::connect_nkey(&w);
    let mut publish = |n: u64| {
        let body = json!({"header": {"tenant_id": "acme"}, "payload": {"n": n}});
        let r = ann.signed(&w, "events.orders.eu", body);
        assert_eq!(r["accepted"], true, "{r}");
        r["sequence"].as_u64().expect("sequence")
    };
    let live = |alice: &mut Mig| -> Vec<u64> {
        let got = alice.call(json!({"cmd": "collected", "sub": "live"}));
        got["messages"]
            .as_array()
            .map(|all| {
                all.iter()
                    .filter(|m| m["body"].get("event_id").is_some())
                    .filter_map(|m| m["body"]["sequence"].as_u64())
                    .collect()
            })
            .unwrap_or_default()
    };
    let first = publish(1);
    let mut got = Vec::new();
    let arrived = common::wait_until(WAIT, || {
        got = live(&mut alice);
        got.contains(&first)
    });
    assert!(arrived, "the first event never came live: {got:?}");
    let deleted = broker_js(&w).delete_consumer("AMP_TOPICS_acme", "mig_events");
    assert_eq!(deleted.ok(), Some(true));
    let later: Vec<u64> = (2..=3).map(&mut publish).collect();
    let arrived = common::wait_until(WAIT, || {
        got = live(&mut alice);
        later.iter().all(|s| got.contains(s))
    });
    assert!(
        arrived,
        "live after the consumer was deleted: {got:?}; published {later:?}"
    );
    let mut each = got.clone();
    each.sort_unstable();
    each.dedup();
    assert_eq!(each.len(), got.len(), "an event came live twice: {got:?}");
}

/// Every write to the task store is a compare-and-set publish on the record's subject,
/// and nats-server delivers a publish to core subscribers even when the stream refuses
/// it. An invocation watching its record through a core subscription took such a write
/// as the record: here a completion that lost its compare-and-set (JetStream error
/// 10071) answered the invoke while the store still held the task queued.
#[test]
fn a_task_record_write_the_store_refused_does_not_answer_an_invoke() {
    use amp_broker::jetstream::{ApiPrefix, JsError, kv::Kv};
    let w = world(1);
    let mut alice = Mig::connect(&w, "alice");
    // Nobody serves `idle`: the task stays queued until the deadline.
    let tag = alice.invoke_later(
        "observatory.idle",
        json!({"header": header(json!({"idempotency_key": "k", "deadline_ms": 3000})),
               "payload": {}}),
    );
    let mut js = broker_js(&w);
    let kv = Kv::new(ApiPrefix::default(), "AMP_TASK_STATE").expect("kv");
    let mut key = String::new();
    let found = common::wait_until(WAIT, || {
        let req = js
            .api()
            .stream_info_subjects("KV_AMP_TASK_STATE", "$KV.AMP_TASK_STATE.acme.*")
            .expect("request");
        let info: Value = js
            .send(&req)
            .ok()
            .and_then(|m| serde_json::from_slice(&m.payload).ok())
            .unwrap_or(Value::Null);
        let subjects = info["state"]["subjects"].as_object().cloned();
        key = subjects
            .and_then(|s| s.keys().next().cloned())
            .and_then(|s| s.strip_prefix("$KV.AMP_TASK_STATE.").map(str::to_string))
            .unwrap_or_default();
        !key.is_empty()
    });
    assert!(
        found,
        "the invocation's task record was never written: {:?} {:?}",
        alice.answered(&tag),
        js.stream_info("KV_AMP_TASK_STATE")
            .map(|i| i.state.messages)
    );
    let entry = js.kv_get(&kv, &key).expect("the record");
    let mut forged: Value = serde_json::from_slice(&entry.value).expect("a JSON record");
    assert_eq!(forged["state"], "queued", "{forged}");
    forged["state"] = json!("completed");
    forged["result"] = json!({"forged": true});
    let write = js.kv_update(
        &kv,
        &key,
        forged.to_string().as_bytes(),
        entry.revision.saturating_sub(1),
    );
    assert!(
        matches!(write, Err(JsError::WrongLastSequence(_))),
        "{write:?}"
    );
    let stored = js.kv_get(&kv, &key).expect("the record");
    let stored: Value = serde_json::from_slice(&stored.value).expect("a JSON record");
    assert_eq!(stored["state"], "queued", "{stored}");
    let answer = alice.wait(&tag)["reply"].clone();
    assert_eq!(error_code(&answer), "MIG_TIMEOUT", "{answer}");
}

/// A NATS connection of `acme/<name>` (its token) with its reply prefix as inbox prefix,
/// for sending more than the python client can.
fn nats_as(w: &World, name: &str) -> amp_broker::nats::Client {
    let options = amp_broker::nats::Options::new(&w.nats_url())
        .with_user_password(&format!("acme/{name}"), &format!("{name}-token"))
        .with_inbox_prefix(&format!("_INBOX_acme_{name}"));
    amp_broker::nats::Client::connect(options).expect("connect")
}

/// `n` requests with a signature by nobody under `key` (an 86-character base64url
/// string, as a real one is), a fresh timestamp and a reply subject in some made-up
/// participant's prefix, each body padded to 4 KB after its header.
fn forged_flood(nc: &mut amp_broker::nats::Client, key: impl Fn(usize) -> String, n: usize) {
    let ts = now_rfc3339();
    let pad = "p".repeat(4096);
    for i in 0..n {
        let mut h = amp_broker::nats::HeaderMap::new();
        let auth = format!("NKey {} {}", key(i), "A".repeat(86));
        h.insert("Authorization", &auth).expect("header");
        let body = json!({"header": {"tenant_id": "acme", "message_id": format!("f{i}"),
                          "timestamp": ts}, "payload": {"pad": pad}});
        let reply = format!("_INBOX_acme_x{i}.x");
        nc.publish(
            "mig.v0_1.acme.hello",
            Some(&reply),
            Some(&h),
            body.to_string().as_bytes(),
        )
        .expect("publish");
    }
    nc.flush(WAIT).expect("flush");
}

/// A request with the sender's token behind everything it sent: NATS keeps one
/// connection's messages in order, so once it is answered the broker has taken all of them.
fn answered_behind(nc: &mut amp_broker::nats::Client, name: &str) {
    let mut h = amp_broker::nats::HeaderMap::new();
    h.insert("Authorization", &format!("Bearer {name}-token"))
        .expect("header");
    let body = json!({"header": {"tenant_id": "acme"}}).to_string();
    let r = nc
        .request("mig.v0_1.acme.hello", Some(&h), body.as_bytes(), WAIT)
        .expect("the broker answers behind the flood");
    let v: Value = serde_json::from_slice(&r.payload).expect("json");
    assert_eq!(v["selected_version"], "0.1", "{v}");
}

fn verifications(w: &World) -> u64 {
    common::amp::metric(&w.brokers[0], "amp_mig_verifications_total").unwrap_or(-1.0) as u64
}

/// Every participant may publish MIG requests, and each request with an NKey
/// `Authorization` cost an Ed25519 verification (and a parse of the whole body) whatever
/// its key, its reply subject or how many came before: one client sending at full speed
/// kept the broker's one thread verifying, until nats-server cut the broker's connection
/// as a slow consumer. Verifications are now budgeted before any Ed25519 work, per key
/// (`mig.verifications_per_key_per_s`, 200) and in all, and a key no participant has
/// costs none.
#[test]
fn a_flood_of_forged_signatures_costs_a_bounded_number_of_verifications() {
    let w = world(1);
    let mut session = w.amp_client(0, "alice");
    let mut carol = nats_as(&w, "carol");
    let before = verifications(&w);
    let started = Instant::now();
    let ann = w.ann.public_key();
    forged_flood(&mut carol, |_| ann.clone(), 10_000);
    // The broker is still at it (or should be done with little): a WebSocket session is
    // answered promptly all the same.
    let ping = Instant::now();
    let pong = session.request(json!({"op": "ping"}));
    assert_eq!(pong["op"], "ok", "{pong}");
    let ping_took = ping.elapsed();
    answered_behind(&mut carol, "carol");
    let elapsed = started.elapsed().as_secs_f64();
    let spent = verifications(&w) - before;
    let budget = (200.0 * (elapsed + 1.0)).ceil() as u64 + 1;
    assert!(
        spent <= budget,
        "10,000 forged requests cost {spent} verifications in {elapsed:.1} s (budget {budget})"
    );
    assert!(
        ping_took < Duration::from_secs(1),
        "a ping took {ping_took:?}"
    );

    // A key no participant has is refused without a verification.
    let keys: Vec<String> = (0..2000)
        .map(|_| KeyPair::generate(KeyKind::User).expect("key").public_key())
        .collect();
    let before = verifications(&w);
    forged_flood(&mut carol, |i| keys[i].clone(), keys.len());
    answered_behind(&mut carol, "carol");
    assert_eq!(verifications(&w), before, "unknown keys were verified");
}

/// A refusal before any credential is proved went to whatever reply subject the request
/// named: anyone could put a stream of `MIG_UNAUTHORIZED` (then throttled
/// `MIG_RATE_LIMITED`) answers, headers they chose echoed, into another participant's
/// inbox. Such refusals are now answered at most a few a second per reply prefix.
#[test]
fn refusals_of_unproved_requests_are_not_a_stream_into_anothers_inbox() {
    let w = world(1);
    let mut bob = Mig::connect(&w, "bob");
    bob.call(json!({"cmd": "subscribe", "sub": "inbox", "subject": "_INBOX_acme_bob.>"}));
    let mut carol = nats_as(&w, "carol");
    let started = Instant::now();
    let mut h = amp_broker::nats::HeaderMap::new();
    h.insert("Authorization", "Bearer not-bobs-token")
        .expect("header");
    for i in 0..200 {
        let body = json!({"header": {"tenant_id": "acme", "message_id": format!("r{i}")}});
        carol
            .publish(
                "mig.v0_1.acme.hello",
                Some(&format!("_INBOX_acme_bob.r{i}")),
                Some(&h),
                body.to_string().as_bytes(),
            )
            .expect("publish");
    }
    answered_behind(&mut carol, "carol");
    let elapsed = started.elapsed().as_secs_f64();
    // The broker answered Carol after whatever it sent Bob, and `collected` flushes Bob's
    // connection first: every refusal sent is in.
    let got = bob.call(json!({"cmd": "collected", "sub": "inbox"}));
    let refusals: Vec<&Value> = got["messages"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter(|m| {
                    m["subject"]
                        .as_str()
                        .and_then(|s| s.strip_prefix("_INBOX_acme_bob.r"))
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .collect()
        })
        .unwrap_or_default();
    let budget = (5.0 * (elapsed + 1.0)).ceil() as usize + 1;
    assert!(
        refusals.len() <= budget,
        "{} of 200 refusals reached Bob's inbox in {elapsed:.1} s (budget {budget})",
        refusals.len()
    );
    // The first ones are answered as the spec has it.
    assert!(!refusals.is_empty(), "no refusal was answered at all");
    assert_eq!(error_code(&refusals[0]["body"]), "MIG_UNAUTHORIZED");
}

/// `n` requests of `nc` on `subject`, each body made by `body(i)`, all answered on `inbox`.
fn pipeline(
    nc: &mut amp_broker::nats::Client,
    subject: &str,
    inbox: &str,
    headers: impl Fn(usize) -> amp_broker::nats::HeaderMap,
    body: impl Fn(usize) -> Value,
    n: usize,
) {
    for i in 0..n {
        let bytes = body(i).to_string();
        nc.publish(subject, Some(inbox), Some(&headers(i)), bytes.as_bytes())
            .expect("publish");
    }
    nc.flush(WAIT).expect("flush");
}

/// The next `n` answers on `sid`, each `MIG_RATE_LIMITED` with a `retry_after_ms`: refused
/// at once, before any request taken was answered (its claim timed out).
fn refused_first(nc: &mut amp_broker::nats::Client, sid: amp_broker::nats::Sid, n: usize) {
    for refused in 0..n {
        let m = nc
            .next_message(sid, WAIT)
            .expect("read")
            .unwrap_or_else(|| panic!("{refused} of {n} answered"));
        let reply: Value = serde_json::from_slice(&m.payload).expect("json");
        assert_eq!(
            error_code(&reply),
            "MIG_RATE_LIMITED",
            "answer {refused} of the {n} expected refused: {reply}"
        );
        let retry = &reply["error"]["details"]["retry_after_ms"];
        assert!(retry.as_u64().is_some_and(|ms| ms > 0), "{reply}");
    }
}

/// The next `n` answers on `sid`, each `MIG_UNAVAILABLE`: requests taken whose claims
/// timed out.
fn timed_out(nc: &mut amp_broker::nats::Client, sid: amp_broker::nats::Sid, n: usize) {
    for k in 0..n {
        let m = nc
            .next_message(sid, WAIT)
            .expect("read")
            .unwrap_or_else(|| panic!("{k} of the {n} taken answered"));
        let reply: Value = serde_json::from_slice(&m.payload).expect("json");
        assert_eq!(error_code(&reply), "MIG_UNAVAILABLE", "{reply}");
    }
}

/// Switches `AMP_MIG_SEEN`'s acks off (JetStream keeps taking message ids but stops
/// answering: each claim waits for the broker's 5 s request timeout) or on again.
fn silence_seen(w: &World, silent: bool) {
    let mut js = broker_js(w);
    let mut seen = js.stream_info("KV_AMP_MIG_SEEN").expect("bucket").config;
    seen.no_ack = Some(silent);
    js.update_stream(&seen).expect("acks switched");
}

/// A MIG caller's JetStream requests were held only to its pace: with JetStream slow to
/// answer, one caller at 1,000 requests a second held thousands of the broker's NATS
/// request slots (65,536 for everything it does), a dozen held them all, and every AMP
/// `send`, `submit` and registry write failed `unavailable`. They now count in the
/// participant's requests in flight, one count with its WebSocket sessions'
/// (`limits.max_participant_requests_in_flight`).
#[test]
fn a_mig_caller_holds_at_most_its_participants_share_of_requests_in_flight() {
    let w = world_configured(1, None, |c| {
        c["limits"]["max_participant_requests_in_flight"] = json!(64);
        c["namespaces"]["acme"]["participants"]["alice"]["permissions"]["send"] = json!(["bob"]);
        c["namespaces"]["acme"]["participants"]["bob"]["permissions"]["send"] = json!(["alice"]);
    });
    let mut alice_ws = w.amp_client(0, "alice");
    let mut bob_ws = w.amp_client(0, "bob");
    let mut alice = nats_as(&w, "alice");
    let inbox = "_INBOX_acme_alice.flood";
    let sid = alice.subscribe(inbox, None).expect("subscribe");
    let bearer = |_: usize| {
        let mut h = amp_broker::nats::HeaderMap::new();
        h.insert("Authorization", "Bearer alice-token")
            .expect("header");
        h
    };
    silence_seen(&w, true);
    // Keyed invokes: each has its message id claimed in `AMP_MIG_SEEN` first.
    let (sent, cap) = (300, 64);
    let started = Instant::now();
    let invoke = |i: usize| {
        json!({"header": {"tenant_id": "acme", "message_id": format!("k{i}"),
                          "idempotency_key": format!("k{i}")}, "payload": {}})
    };
    let subject = format!("mig.v0_1.acme.invoke.{INFER}");
    pipeline(&mut alice, &subject, inbox, bearer, invoke, sent);
    refused_first(&mut alice, sid, sent - cap);
    // While the 64 wait (their claims time out 5 s after they went out): a page of
    // replay is refused too, and so is the participant's request on WebSocket (one
    // count for both), while another participant's is taken.
    let page = json!({"header": {"tenant_id": "acme"}, "topic": "orders.>", "max_inflight": 1});
    let subscribe = "mig.v0_1.acme.control.subscribe";
    pipeline(&mut alice, subscribe, inbox, bearer, |_| page.clone(), 1);
    refused_first(&mut alice, sid, 1);
    alice_ws.send(&json!({"op":"send","id":"a0","to":"bob","body":0}));
    let f = alice_ws.answer_to("a0");
    assert_eq!(f["code"], "rate_limited", "{f}");
    let message = f["message"].as_str().unwrap_or_default();
    assert!(message.contains("participant has at most 64"), "{f}");
    let f = bob_ws.request(json!({"op":"send","to":"alice","body":0}));
    assert_eq!(f["op"], "ok", "{f}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the checks ran into the claims' timeout: {:?}",
        started.elapsed()
    );
    // The 64 taken are answered when their claims time out, and the count comes back down.
    timed_out(&mut alice, sid, cap);
    silence_seen(&w, false);
    let f = alice_ws.request(json!({"op":"send","to":"bob","body":1}));
    assert_eq!(f["op"], "ok", "{f}");
    let r = alice
        .request(
            subscribe,
            Some(&bearer(0)),
            page.to_string().as_bytes(),
            WAIT,
        )
        .expect("a page");
    let reply: Value = serde_json::from_slice(&r.payload).expect("json");
    assert_eq!(reply["caught_up"], true, "{reply}");
}

/// The same for signed PUBLISHes, whose refusals have their ids claimed for every broker
/// too: past the cap the refusal is answered at once, its id used up on this broker only.
#[test]
fn a_publisher_on_nats_holds_at_most_its_participants_share_of_requests_in_flight() {
    // Few: a debug build verifies a signature in tens of milliseconds.
    let (sent, cap) = (40, 16);
    let w = world_configured(1, None, |c| {
        c["limits"]["max_participant_requests_in_flight"] = json!(cap);
    });
    let options = amp_broker::nats::Options::new(&w.nats_url())
        .with_nkey_seed(&w.ann.seed())
        .expect("seed")
        .with_inbox_prefix("_INBOX_acme_ann");
    let mut ann = amp_broker::nats::Client::connect(options).expect("ann on NATS");
    let inbox = "_INBOX_acme_ann.flood";
    let sid = ann.subscribe(inbox, None).expect("subscribe");
    silence_seen(&w, true);
    let ts = now_rfc3339();
    let op = "events.orders.eu";
    let signed = |i: usize| {
        let mut h = amp_broker::nats::HeaderMap::new();
        let auth = nkey_authorization(&w.ann, &format!("p{i}"), &ts, op);
        h.insert("Authorization", &auth).expect("header");
        h
    };
    let publish = |i: usize| {
        json!({"header": {"tenant_id": "acme", "message_id": format!("p{i}"), "timestamp": ts},
               "payload": {"n": i}})
    };
    let subject = format!("mig.v0_1.acme.{op}");
    pipeline(&mut ann, &subject, inbox, signed, publish, sent);
    refused_first(&mut ann, sid, sent - cap);
    timed_out(&mut ann, sid, cap);
}

/// Spec section 3: the broker duplicates `traceparent`, `session_id` and the header's other
/// ids as NATS headers on every message it publishes. One a NATS header cannot carry (a
/// control character other than tab) was checked only for its length: a PUBLISH stored
/// its event without the `traceparent` header and answered `accepted`, and a reply left
/// the field out of its NATS headers. It is a malformed request member, refused
/// `MIG_INVALID_REQUEST` naming it (as AMP refuses it `schema`), or not proved when it
/// is in a signed request's header.
#[test]
fn a_header_field_no_nats_header_can_carry_is_refused() {
    let w = world(1);
    let bad = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\u{1}";
    let mut ann = Mig::connect_nkey(&w);
    let r = ann.signed(
        &w,
        "events.orders.eu",
        json!({"header": {"tenant_id": "acme", "traceparent": bad}, "payload": {"n": 1}}),
    );
    // A signature is checked against a header that parses: as for a traceparent over
    // its length, a signed request whose header does not is not proved.
    assert_eq!(error_code(&r), "MIG_UNAUTHORIZED", "{r}");
    let mut alice = Mig::connect(&w, "alice");
    let (events, caught_up) = replay_all(&mut alice, "orders.>", 2);
    assert!(caught_up);
    assert_eq!(events, Vec::<Value>::new(), "nothing is stored");
    for (name, v) in [("traceparent", bad), ("session_id", "s\u{7f}")] {
        let r = alice.request("hello", json!({"header": {"tenant_id": "acme", name: v}}));
        assert_eq!(error_code(&r), "MIG_INVALID_REQUEST", "{r}");
        let named = format!("header.{name}");
        assert!(
            r["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(&named)),
            "{r}"
        );
    }
    // A tab is a character a NATS header carries: such a value is echoed in both.
    let tabbed = "not\ttrace context";
    let r = alice.call(json!({"cmd": "request", "subject": "mig.v0_1.acme.hello",
        "body": {"header": {"tenant_id": "acme", "traceparent": tabbed}},
        "headers": {"Authorization": "Bearer alice-token"}, "timeout": 15}));
    assert_eq!(r["reply"]["selected_version"], "0.1", "{r}");
    assert_eq!(r["reply"]["header"]["traceparent"], tabbed, "{r}");
    assert_eq!(r["headers"]["traceparent"], tabbed, "{r}");
}

/// A NATS connect of `acme/bob`, answered by the auth callout, with how long it took.
fn callout_connect(w: &World) -> Result<(amp_broker::nats::Client, Duration), String> {
    let t = Instant::now();
    let mut options = amp_broker::nats::Options::new(&w.nats_url())
        .with_user_password("acme/bob", "bob-token")
        .with_inbox_prefix("_INBOX_acme_bob");
    options.connect_timeout = Duration::from_secs(10);
    let nc = amp_broker::nats::Client::connect(options)
        .map_err(|e| format!("connect after {:?}: {e}", t.elapsed()))?;
    Ok((nc, t.elapsed()))
}

/// A NATS connect of `acme/bob` (answered by the auth callout) and a MIG `hello` over it,
/// each with how long it took; an error names what failed.
fn connect_and_hello(w: &World) -> Result<(Duration, Duration), String> {
    let (mut nc, connected) = callout_connect(w)?;
    let t = Instant::now();
    let mut h = amp_broker::nats::HeaderMap::new();
    h.insert("Authorization", "Bearer bob-token")
        .map_err(|e| e.to_string())?;
    let body = json!({"header": {"tenant_id": "acme"}}).to_string();
    let r = nc
        .request("mig.v0_1.acme.hello", Some(&h), body.as_bytes(), WAIT)
        .map_err(|e| format!("hello after {:?}: {e}", t.elapsed()))?;
    let reply: Value = serde_json::from_slice(&r.payload).map_err(|e| e.to_string())?;
    if reply["selected_version"] != "0.1" {
        return Err(format!("hello answered {reply}"));
    }
    Ok((connected, t.elapsed()))
}

/// Every event of a tenant's topics, those published over AMP included, goes out on its
/// live subject `mig.v0_1.<ns>.events.<topic>`, which the brokers subscribe to (a queue
/// group, for PUBLISH requests): each broker reads its share of the tenant's whole topic
/// volume back, on the connection that brings the auth callout's and MIG's requests. That
/// connection read 16 KiB a loop turn, and ordinary topic traffic from WebSocket sessions
/// queued ahead of every callout and MIG request.
#[test]
fn topic_traffic_does_not_hold_up_the_auth_callout_or_mig_requests() {
    let w = world(1);
    connect_and_hello(&w).expect("the callout and MIG answer");
    let publishing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let published = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    const PIPELINE: u64 = 8;
    let publishers: Vec<_> = (0..2)
        .map(|p| {
            let mut alice = w.amp_client(0, "alice");
            let (publishing, published) = (publishing.clone(), published.clone());
            std::thread::spawn(move || {
                let pad = "x".repeat(60 * 1024);
                // Pipelined, PIPELINE publishes in flight.
                let mut i = 0u64;
                while publishing.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    alice.send(&json!({"op":"publish","id":format!("p{i}"),
                        "topic":format!("orders.p{p}"),"body":{"pad":pad}}));
                    if i > PIPELINE {
                        let ok = alice.answer_to(&format!("p{}", i - PIPELINE));
                        assert_eq!(ok["op"], "ok", "publish: {ok}");
                        published.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let started = Instant::now();
    let (mut worst_connect, mut worst_hello) = (Duration::ZERO, Duration::ZERO);
    let mut failed = Vec::new();
    let mut n = 0;
    while started.elapsed() < Duration::from_secs(10) {
        n += 1;
        let t = Instant::now();
        match connect_and_hello(&w) {
            Ok((connect, hello)) => {
                worst_connect = worst_connect.max(connect);
                worst_hello = worst_hello.max(hello);
            }
            Err(e) => failed.push(e),
        }
        std::thread::sleep(Duration::from_millis(100).saturating_sub(t.elapsed()));
    }
    publishing.store(false, std::sync::atomic::Ordering::Relaxed);
    for p in publishers {
        p.join().expect("publisher");
    }
    let published = published.load(std::sync::atomic::Ordering::Relaxed);
    let reconnects: Vec<_> = ["callout", "requests", "events"]
        .iter()
        .map(|c| {
            let name = format!("amp_nats_ingress_reconnects_total{{connection=\"{c}\"}}");
            common::amp::metric(&w.brokers[0], &name)
        })
        .collect();
    eprintln!(
        "{published} events of 60 KiB published; {n} connects and hellos, worst {worst_connect:?} \
         and {worst_hello:?}; ingress reconnects {reconnects:?}"
    );
    assert!(published > 100, "the topic traffic ran: {published} events");
    assert!(
        failed.is_empty()
            && worst_connect < Duration::from_secs(1)
            && worst_hello < Duration::from_secs(1),
        "{n} connects and hellos, worst {worst_connect:?} and {worst_hello:?}, failed: {failed:?}"
    );
    assert_eq!(
        reconnects,
        [Some(0.0), Some(0.0), Some(0.0)],
        "log:\n{}",
        w.brokers[0].log()
    );
}

/// With MIG on, any participant with a NATS credential may publish on the MIG request
/// subjects, as fast as it likes. They came on the same ingress connection as the auth
/// callout's requests, read 16 KiB a loop turn: a flood of them queued in the server ahead
/// of every callout request, and NATS clients could not log in while it lasted. The
/// callout's requests now come on an ingress connection of their own.
#[test]
fn a_flood_on_the_mig_request_subjects_does_not_hold_up_the_auth_callout() {
    use std::io::Read;
    let w = world(1);
    callout_connect(&w).expect("the callout answers");
    // carol may publish on the MIG request subjects, as every participant may.
    let mut attacker = std::net::TcpStream::connect(w.callout.nats.addr()).expect("connect");
    attacker
        .write_all(
            b"CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1,\
              \"user\":\"acme/carol\",\"pass\":\"carol-token\"}\r\nPING\r\n",
        )
        .expect("write");
    attacker.set_read_timeout(Some(WAIT)).expect("read timeout");
    let mut said = Vec::new();
    while !String::from_utf8_lossy(&said).contains("PONG") {
        let mut buf = [0u8; 4096];
        let n = attacker.read(&mut buf).expect("the server's answer");
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&said));
        said.extend_from_slice(&buf[..n]);
        assert!(!String::from_utf8_lossy(&said).contains("-ERR"), "{said:?}");
    }
    let flooding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flood = {
        let flooding = flooding.clone();
        std::thread::spawn(move || {
            let one = b"PUB mig.v0_1.acme.invoke.x 0\r\n\r\n";
            let chunk = one.repeat((1 << 20) / one.len());
            while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                // nats-server may cut this connection; the flood then ends early.
                if attacker.write_all(&chunk).is_err() {
                    break;
                }
            }
        })
    };
    let started = Instant::now();
    let mut worst = Duration::ZERO;
    let mut failed = Vec::new();
    let mut n = 0;
    while started.elapsed() < Duration::from_secs(10) {
        n += 1;
        let t = Instant::now();
        match callout_connect(&w) {
            Ok((_, took)) => worst = worst.max(took),
            Err(e) => failed.push(e),
        }
        std::thread::sleep(Duration::from_millis(100).saturating_sub(t.elapsed()));
    }
    flooding.store(false, std::sync::atomic::Ordering::Relaxed);
    flood.join().expect("flood thread");
    let broker = &w.brokers[0];
    let reached = common::amp::metric(
        broker,
        "amp_mig_rejected_total{reason=\"no_reply_subject\"}",
    );
    let reconnects: Vec<_> = ["callout", "requests"]
        .iter()
        .map(|c| {
            let name = format!("amp_nats_ingress_reconnects_total{{connection=\"{c}\"}}");
            common::amp::metric(broker, &name)
        })
        .collect();
    eprintln!(
        "{n} connects, worst {worst:?}, {} failed; {reached:?} flood messages reached MIG; \
         ingress reconnects (callout, requests) {reconnects:?}",
        failed.len(),
    );
    assert!(
        reached.is_some_and(|d| d > 1000.0),
        "the flood reached the broker: {reached:?}"
    );
    assert!(
        failed.is_empty() && worst < Duration::from_secs(1),
        "{n} connects, worst {worst:?}, failed: {failed:?}; log:\n{}",
        broker.log()
    );
    // The server may cut the requests ingress as a slow consumer, never the callout's.
    assert_eq!(reconnects[0], Some(0.0), "log:\n{}", broker.log());
}
