//! What a participant holding NATS credentials can do directly on NATS (README "Direct NATS
//! access"): a real nats-server with `auth_callout`, the broker binary as the callout and
//! JWT issuer, AMP traffic over WebSocket, and participants on NATS with the official
//! Python client (nats-py). Every forbidden item is a permission violation and shows
//! nothing; every allowed item works.

mod common;

use std::time::Duration;

use amp_broker::broker::binding;
use amp_broker::jetstream::Context;
use amp_broker::jetstream::consumer::{ConsumerAction, ConsumerConfig};
use amp_broker::nats::{Client as NatsClient, Options};
use common::amp::{Broker, CalloutServer, Client, token_hash};
use common::python::Py;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);

struct World {
    // Dropped after the broker that answers its callout.
    broker: Broker,
    callout: CalloutServer,
}

fn participant(perms: Value) -> Value {
    json!({"permissions": perms})
}

fn world() -> World {
    let callout = CalloutServer::start();
    let mut participants = serde_json::Map::new();
    for (name, perms) in [
        (
            "alice",
            json!({"send": ["bob"], "publish": ["orders.*"], "subscribe": ["orders.>"], "submit": ["render"]}),
        ),
        (
            "bob",
            json!({"subscribe": ["news.*"], "publish": ["news.*"]}),
        ),
        ("worker", json!({"serve": ["render"]})),
        // Over WebSocket mallory may write where the forgery below tries to.
        (
            "mallory",
            json!({"send": ["bob"], "publish": ["orders.*"], "submit": ["render"], "serve": ["render"]}),
        ),
        ("carol", json!({})),
    ] {
        let mut p = participant(perms);
        p["token_sha256"] = json!(token_hash(&format!("{name}-token")));
        participants.insert(name.to_string(), p);
    }
    let config = json!({"namespaces": {"acme": {
        "participants": participants,
        "jobs": {"render": {}},
    }}});
    let broker = callout.broker(&config, &[]);
    World { broker, callout }
}

/// A running `tests/interop/access_probe.py`.
struct Probe {
    py: Py,
    done: String,
}

/// What the probe saw.
#[derive(Debug)]
struct Seen {
    connected: bool,
    errors: Vec<String>,
    received: Vec<Value>,
    pulled: Vec<Value>,
    answers: Vec<Value>,
}

impl Seen {
    fn violation(&self, kind: &str, subject: &str) -> bool {
        let needle = format!("{kind} to \"{subject}\"").to_lowercase();
        self.errors
            .iter()
            .any(|e| e.to_lowercase().contains(&needle))
    }

    /// Everything that reached the participant, as one text.
    fn everything(&self) -> String {
        format!("{:?} {:?} {:?}", self.received, self.pulled, self.answers)
    }
}

impl World {
    fn observer(&self) -> NatsClient {
        let options = Options::new(&self.callout.nats.url())
            .with_nkey_seed(&self.callout.broker_key.seed())
            .expect("seed");
        NatsClient::connect(options).expect("observer connects")
    }

    /// Starts the probe as participant `name` on NATS (user `acme/<name>`, its token) and
    /// waits until every step in `steps` is flushed.
    fn probe(&self, name: &str, steps: Value) -> Probe {
        let done = format!("_INBOX_acme_{name}.done");
        let mut spec = json!({
            "url": self.callout.nats.url(),
            "user": format!("acme/{name}"),
            "password": format!("{name}-token"),
            "inbox_prefix": format!("_INBOX_acme_{name}"),
            "done": done,
        });
        if let (Some(spec), Some(steps)) = (spec.as_object_mut(), steps.as_object()) {
            spec.extend(steps.clone());
        }
        let py = Py::spawn("access_probe.py", &[&spec.to_string()]);
        assert_eq!(py.line(), "READY");
        Probe { py, done }
    }

    /// Ends the probe's run and returns what it saw.
    fn finish(&self, probe: Probe) -> Seen {
        let mut observer = self.observer();
        observer
            .publish(&probe.done, None, None, b"")
            .expect("publish");
        observer.flush(WAIT).expect("flush");
        let result = probe.py.line();
        probe.py.finish();
        let v: Value = serde_json::from_str(&result).expect("json result");
        let list = |key: &str| v[key].as_array().cloned().unwrap_or_default();
        Seen {
            connected: v["connected"].as_bool().unwrap_or(false),
            errors: list("errors")
                .iter()
                .filter_map(|e| e.as_str().map(str::to_string))
                .collect(),
            received: list("received"),
            pulled: list("pulled"),
            answers: list("answers"),
        }
    }

    fn login(&self, name: &str) -> Client {
        Client::login(&self.broker, "acme", name, &format!("{name}-token"))
    }
}

fn message_body(c: &mut Client) -> Value {
    let m = c.next_op("message", WAIT).expect("a message");
    c.send(&json!({"op":"ack","seq":m["seq"]}));
    m
}

#[test]
fn a_participant_on_nats_reads_nothing_addressed_to_others() {
    let w = world();
    let mut alice = w.login("alice");
    let mut bob = w.login("bob");
    let mut worker = w.login("worker");
    assert_eq!(
        worker.request(json!({"op":"serve","job":"render","slots":1}))["op"],
        "ok"
    );
    // Stored before the probe connects: what a reader of the streams could fetch.
    alice.request(json!({"op":"send","to":"bob","body":{"secret":"stored-message"}}));
    assert_eq!(message_body(&mut bob)["body"]["secret"], "stored-message");
    let submitted =
        alice.request(json!({"op":"submit","job":"render","body":{"secret":"task-body"}}));
    assert_eq!(submitted["op"], "ok", "{submitted}");
    let offer = worker.next_op("offer", WAIT).expect("offer");
    assert_eq!(offer["body"]["secret"], "task-body");
    let task = offer["task"].clone();
    assert_eq!(
        worker.request(json!({"op":"claim","task":task}))["op"],
        "ok"
    );

    let subscriptions = [
        "_INBOX.>",
        ">",
        "_AMP_BROKER.>",
        "amp.>",
        "amp.acme.inbox.bob",
        "amp.acme.inbox.*",
        "amp.acme.job.render",
        "amp.acme.topic.orders.>",
        "_INBOX_acme_bob.>",
        "$JS.ACK.>",
        "$JS.API.>",
        "$KV.>",
    ];
    let requests = [
        "$JS.API.CONSUMER.MSG.NEXT.AMP_INBOX_acme.inbox_bob",
        "$JS.API.CONSUMER.MSG.NEXT.AMP_TASKS_acme.job_render",
        "$JS.API.STREAM.MSG.GET.AMP_INBOX_acme",
        "$JS.API.DIRECT.GET.AMP_INBOX_acme",
        "$JS.API.DIRECT.GET.KV_AMP_TASK_STATE",
        "$JS.API.CONSUMER.CREATE.AMP_INBOX_acme",
        "$JS.API.CONSUMER.CREATE.AMP_TASKS_acme.spy.amp.acme.job.render",
        "$JS.API.CONSUMER.INFO.AMP_INBOX_acme.inbox_bob",
        "$JS.API.STREAM.INFO.AMP_INBOX_acme",
    ];
    let probe = w.probe(
        "carol",
        json!({
            "subscribe": subscriptions,
            "timeout": 0.5,
            "pull": [[requests[0], r#"{"batch":1,"no_wait":true}"#], [requests[1], r#"{"batch":1,"no_wait":true}"#]],
            "request": requests[2..].iter().map(|s| json!([s, r#"{"seq":1}"#])).collect::<Vec<_>>(),
        }),
    );
    // Traffic while the probe listens: a pull delivery to the broker, an event, a reply.
    alice.request(json!({"op":"send","to":"bob","body":{"secret":"live-message"}}));
    assert_eq!(message_body(&mut bob)["body"]["secret"], "live-message");
    alice.request(json!({"op":"publish","topic":"orders.eu","body":{"secret":"live-event"}}));
    assert_eq!(
        worker.request(json!({"op":"heartbeat","task":task}))["op"],
        "ok"
    );
    let seen = w.finish(probe);

    assert!(seen.connected, "{seen:?}");
    for subject in subscriptions {
        assert!(
            seen.violation("subscription", subject),
            "{subject}: {seen:?}"
        );
    }
    for subject in requests {
        assert!(seen.violation("publish", subject), "{subject}: {seen:?}");
    }
    assert!(seen.received.is_empty(), "{seen:?}");
    let everything = seen.everything();
    for secret in ["stored-message", "live-message", "live-event", "task-body"] {
        assert!(!everything.contains(secret), "{secret} leaked: {seen:?}");
    }
}

#[test]
fn a_participant_on_nats_cannot_write_as_anyone_or_around_the_broker() {
    let w = world();
    let mut alice = w.login("alice");
    let mut bob = w.login("bob");
    let forged = json!({
        "id": "forged-1", "from": "acme/ceo", "to": "acme/bob", "kind": "task_result",
        "ts": "2026-01-01T00:00:00.000Z", "headers": {}, "body": {"forged": true},
    })
    .to_string();
    let writes = [
        "amp.acme.inbox.bob",
        "amp.acme.topic.orders.eu",
        "amp.acme.job.render",
        "$JS.API.CONSUMER.MSG.NEXT.AMP_TASKS_acme.job_render",
        "$JS.ACK.AMP_TASKS_acme.job_render.1.1.1.1.0",
        "$JS.ACK.AMP_INBOX_acme.inbox_bob.1.1.1.1.0",
        "$KV.AMP_REGISTRY_acme.ceo",
        "$KV.AMP_TASK_STATE.acme.forged-1",
        "$JS.API.STREAM.PURGE.AMP_INBOX_acme",
        "$JS.API.STREAM.DELETE.AMP_TOPICS_acme",
        "$SYS.REQ.USER.AUTH",
        "_AMP_BROKER.forged.reply",
        "_INBOX_acme_bob.forged",
    ];
    let probe = w.probe(
        "mallory",
        json!({"publish": writes.iter().map(|s| json!([s, forged])).collect::<Vec<_>>()}),
    );
    // The probe's publishes were flushed (and refused) before it said READY; a forged
    // envelope in bob's inbox would now come before this real message.
    alice.request(json!({"op":"send","to":"bob","body":{"real":true}}));
    let seen = w.finish(probe);
    let first = message_body(&mut bob);
    assert_eq!(first["from"], "acme/alice", "{first}");
    assert_eq!(first["kind"], "message", "{first}");
    assert_eq!(first["body"], json!({"real": true}));
    assert!(seen.connected, "{seen:?}");
    for subject in writes {
        assert!(seen.violation("publish", subject), "{subject}: {seen:?}");
    }
    let mut js = Context::new(w.observer());
    let tasks = js
        .stream_info(&binding::tasks_stream("acme"))
        .expect("tasks stream");
    assert_eq!(
        tasks.state.messages, 0,
        "no task was stored around the broker"
    );
}

#[test]
fn a_participant_on_nats_hears_its_topics_and_its_replies_and_nothing_more() {
    let w = world();
    // Bob's inbox consumer, as the broker creates it at his first hello; bob himself never
    // connects over WebSocket, so the broker holds no pull on it.
    let mut js = Context::new(w.observer());
    let config: ConsumerConfig = binding::inbox_consumer_config("acme", "bob", 30, 64);
    js.create_consumer(
        &binding::inbox_stream("acme"),
        &config,
        ConsumerAction::CreateOrUpdate,
    )
    .expect("inbox consumer");
    let mut alice = w.login("alice");
    let sent = alice.request(json!({"op":"send","to":"bob","body":{"n":1}}));
    assert_eq!(sent["op"], "ok", "{sent}");

    let own_next = "$JS.API.CONSUMER.MSG.NEXT.AMP_INBOX_acme.inbox_bob";
    let own_info = "$JS.API.CONSUMER.INFO.AMP_INBOX_acme.inbox_bob";
    let probe = w.probe(
        "bob",
        json!({
            "subscribe": ["amp.acme.topic.news.today", "_INBOX_acme_alice.>", "amp.acme.topic.orders.eu"],
            "pull": [[own_next, r#"{"batch":1,"no_wait":true}"#], ["$JS.API.CONSUMER.MSG.NEXT.AMP_INBOX_acme.inbox_alice", r#"{"batch":1,"no_wait":true}"#]],
            "request": [[own_info, ""]],
            "publish": [["$JS.ACK.AMP_INBOX_acme.inbox_bob.1.1.1.1.0", "+ACK"], ["$JS.ACK.AMP_INBOX_acme.inbox_alice.1.1.1.1.0", "+ACK"]],
        }),
    );
    let mut observer = w.observer();
    observer
        .publish("amp.acme.topic.news.today", None, None, b"{\"headline\":1}")
        .expect("publish");
    observer.flush(WAIT).expect("flush");
    let seen = w.finish(probe);

    assert!(seen.connected, "{seen:?}");
    // Allowed: live events of topics it may subscribe to (and replies under its prefix).
    assert_eq!(seen.received.len(), 1, "{seen:?}");
    assert_eq!(seen.received[0]["subject"], "amp.acme.topic.news.today");
    // Forbidden: another's replies, topics it may not subscribe to, and every JetStream
    // request and ack, its own inbox's too (their answers could be aimed anywhere: see
    // the next test); its inbox is read over WebSocket.
    for subject in ["_INBOX_acme_alice.>", "amp.acme.topic.orders.eu"] {
        assert!(
            seen.violation("subscription", subject),
            "{subject}: {seen:?}"
        );
    }
    for subject in [
        own_next,
        own_info,
        "$JS.API.CONSUMER.MSG.NEXT.AMP_INBOX_acme.inbox_alice",
        "$JS.ACK.AMP_INBOX_acme.inbox_bob.1.1.1.1.0",
        "$JS.ACK.AMP_INBOX_acme.inbox_alice.1.1.1.1.0",
    ] {
        assert!(seen.violation("publish", subject), "{subject}: {seen:?}");
    }
    assert!(!seen.everything().contains("\"n\":1"), "{seen:?}");
    let info = js
        .consumer_info(&binding::inbox_stream("acme"), "inbox_bob")
        .expect("consumer info");
    assert_eq!(info.num_pending, 1, "the message waits for bob's session");
}

#[test]
fn a_participant_on_nats_cannot_aim_jetstream_answers_at_others() {
    // nats-server checks a publish's subject against the publisher's permissions, never
    // its reply subject, and JetStream sends its answer (a pull's messages, an info, an
    // ack's confirmation) to whatever reply subject it is given: into a stream that
    // captures it, a KV key, the brokers' own subjects. A participant allowed to pull or
    // read its own inbox consumer could so write where it may not publish.
    let w = world();
    let mut alice = w.login("alice");
    let mut bob = w.login("bob");
    let mut mallory = w.login("mallory");
    let sub = bob.request(json!({"op":"subscribe","topic":"news.*","sub":"n","durable":true}));
    assert_eq!(sub["op"], "ok", "{sub}");
    // Mallory's own inbox holds a message of its own: what a pull would hand out.
    mallory.request(json!({"op":"send","to":"bob","body":{"warm":true}}));
    assert_eq!(message_body(&mut bob)["body"]["warm"], true);
    drop(mallory);
    let info = "$JS.API.CONSUMER.INFO.AMP_INBOX_acme.inbox_mallory";
    let next = "$JS.API.CONSUMER.MSG.NEXT.AMP_INBOX_acme.inbox_mallory";
    let aimed = [
        (info, "amp.acme.inbox.bob", ""),
        (next, "amp.acme.inbox.bob", r#"{"batch":1,"no_wait":true}"#),
        (info, "$KV.AMP_REGISTRY_acme.ceo", ""),
        (info, "amp.acme.topic.news.today", ""),
        (info, "_AMP_BROKER.DURABLE.acme.bob.n", ""),
    ];
    let mut js = Context::new(w.observer());
    let stored = |js: &mut Context, stream: &str| {
        js.stream_info(stream)
            .map(|i| i.state.messages)
            .expect("stream info")
    };
    let inbox_before = stored(&mut js, &binding::inbox_stream("acme"));
    let probe = w.probe(
        "mallory",
        json!({"publish_reply": aimed.iter().map(|(s, r, p)| json!([s, r, p])).collect::<Vec<_>>()}),
    );
    let seen = w.finish(probe);
    assert!(seen.connected, "{seen:?}");
    for (subject, _, _) in aimed {
        assert!(seen.violation("publish", subject), "{subject}: {seen:?}");
    }
    assert_eq!(
        stored(&mut js, &binding::inbox_stream("acme")),
        inbox_before,
        "nothing was stored in the inbox stream around the broker"
    );
    assert_eq!(stored(&mut js, "AMP_TOPICS_acme"), 0, "nor in the topics");
    let registry = js.kv_bind("AMP_REGISTRY_acme").expect("registry bucket");
    assert!(
        js.kv_get(&registry, "ceo").is_err(),
        "no registry entry was written"
    );
    // Bob's durable is still his: his next event comes to it.
    alice.request(json!({"op":"send","to":"bob","body":{"real":true}}));
    let first = message_body(&mut bob);
    assert_eq!(first["from"], "acme/alice", "{first}");
    assert_eq!(first["body"], json!({"real": true}), "{first}");
    let published = bob.request(json!({"op":"publish","topic":"news.today","body":{"n":1}}));
    assert_eq!(published["op"], "ok", "{published}");
    let event = bob
        .next_op("event", WAIT)
        .expect("the durable still delivers");
    assert_eq!(event["body"], json!({"n": 1}), "{event}");
}
