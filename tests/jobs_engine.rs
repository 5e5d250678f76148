//! The jobs engine against a real nats-server with JetStream: the `Jobs` component driven
//! through a real NATS connection, with sessions stood in for by their ids (the frames the
//! component queues for them are what a WebSocket client would receive).

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use amp_broker::amp::{ClientFrame, FrameValidator};
use amp_broker::broker::binding::{self, StreamSettings};
use amp_broker::broker::clock::{self, Clock};
use amp_broker::broker::config::Config;
use amp_broker::broker::continuations::Continuations;
use amp_broker::broker::ids::IdSource;
use amp_broker::broker::jobs::{Caller, Jobs, JobsOutput};
use amp_broker::broker::timers::Timers;
use amp_broker::jetstream::ApiPrefix;
use amp_broker::nats::{Client, Event, Options};
use amp_broker::rfc3339;
use serde_json::{Value, json};

/// The engine is driven without sessions, so no token is ever presented; each entry still
/// needs one of its own (the configuration refuses a token held twice).
fn token_sha(n: u8) -> String {
    format!("{n:064x}")
}

fn config(lease_s: u64, offer_ms: u64, max_attempts: u32) -> Config {
    let all = json!({"submit": ["*"], "serve": ["*"]});
    let text = json!({
        "namespaces": {"acme": {
            "jobs": {"render": {"lease_s": lease_s, "offer_ms": offer_ms, "max_attempts": max_attempts}},
            "participants": {
                "app": {"token_sha256": token_sha(0), "permissions": all},
                "other": {"token_sha256": token_sha(1), "permissions": all},
                "w1": {"token_sha256": token_sha(2), "permissions": all},
                "w2": {"token_sha256": token_sha(3), "permissions": all, "labels": {"gpu": "a100"}},
                "w3": {"token_sha256": token_sha(4), "permissions": all},
                "w4": {"token_sha256": token_sha(5), "permissions": all},
                "nobody": {"token_sha256": token_sha(6), "permissions": {}}
            }
        }}
    });
    Config::parse(text.to_string().as_bytes()).expect("test configuration")
}

fn wall_ms() -> i64 {
    rfc3339::unix_millis(SystemTime::now())
}

/// Creates the streams and the bucket the jobs engine uses.
fn provision(client: &mut Client) {
    let s = StreamSettings::default();
    for cfg in [
        binding::tasks_stream_config("acme", s),
        binding::task_state_stream_config(s),
        binding::inbox_stream_config("acme", 0, 10_000, s),
    ] {
        let req = ApiPrefix::new().stream_create(&cfg).expect("stream name");
        let reply = client
            .request(&req.subject, None, &req.payload, Duration::from_secs(5))
            .expect("stream create answered");
        let v: Value = serde_json::from_slice(&reply.payload).expect("json");
        assert!(v.get("error").is_none(), "stream create failed: {v}");
    }
}

/// One broker's jobs engine on its own NATS connection.
struct Broker {
    client: Client,
    jobs: Jobs,
    /// The engine's round trips in flight and its timers (the core keeps these tables
    /// under the runtime).
    table: Continuations,
    timers: Timers,
    config: Config,
    validator: FrameValidator,
    out: Vec<JobsOutput>,
}

impl Broker {
    fn start(url: &str, id: &str, config: Config) -> Broker {
        let mut client = Client::connect(Options::new(url)).expect("connect");
        provision(&mut client);
        // Each broker its own seed, as under the runtime: two brokers never share ids.
        let ids = IdSource::from_seed(clock::os_seed().expect("OS randomness"));
        let jobs =
            Jobs::new(id, &config, Clock::new(Instant::now(), wall_ms()), ids).expect("jobs");
        Broker {
            client,
            jobs,
            table: Continuations::default(),
            timers: Timers::default(),
            config,
            validator: FrameValidator::new().expect("schema"),
            out: Vec::new(),
        }
    }

    /// Sends a client frame from `session` of participant `name`.
    #[track_caller]
    fn send(&mut self, session: u64, name: &str, frame: Value) {
        self.send_at(session, name, frame, Instant::now());
        self.step(Duration::ZERO);
    }

    /// Hands the engine a client frame as if it arrived at `now`, moving no bytes and
    /// running no timers: what the engine decides on its own state at that moment.
    #[track_caller]
    fn send_at(&mut self, session: u64, name: &str, frame: Value, now: Instant) {
        let frame: ClientFrame = self
            .validator
            .decode(&frame.to_string())
            .unwrap_or_else(|e| panic!("invalid frame {frame}: {}", e.reply()));
        let participant = self
            .config
            .participant("acme", name)
            .expect("participant")
            .clone();
        let labels = participant.labels.clone();
        let caller = Caller {
            session,
            ns: "acme",
            name,
            participant: &participant,
            labels: &labels,
        };
        let conn = self.client.connection_mut();
        assert!(self.jobs.frame(conn, &caller, frame, now));
    }

    /// Runs the engine's timers as if it were `now`, moving no bytes.
    fn timers_at(&mut self, now: Instant) {
        self.jobs
            .timers_due(&mut self.timers, self.client.connection_mut(), now);
    }

    fn close_session(&mut self, session: u64) {
        self.jobs
            .session_closed(self.client.connection_mut(), session, Instant::now());
        self.step(Duration::ZERO);
    }

    /// Moves bytes and events for up to `wait`, feeding the engine.
    fn step(&mut self, wait: Duration) {
        self.step_as_if(wait, None);
    }

    /// Moves bytes and events for up to `wait`, feeding the engine what arrived as if it
    /// arrived at `at` (a reply held up on its way), timers at the real time.
    fn step_as_if(&mut self, wait: Duration, at: Option<Instant>) {
        self.step_losing(wait, at, None);
    }

    /// As `step_as_if`; when what the engine wrote in answer contains `lost`, all it wrote
    /// then is dropped unsent (its requests time out). True when something was dropped.
    fn step_losing(&mut self, wait: Duration, at: Option<Instant>, lost: Option<&[u8]>) -> bool {
        let mut events = Vec::new();
        let _ = self.client.run_until(wait, |e| {
            events.push(e.clone());
            false
        });
        let now = at.unwrap_or_else(Instant::now);
        let conn = self.client.connection_mut();
        for e in events {
            match e {
                Event::Message { sid, msg } => {
                    self.jobs.on_message(conn, sid, &msg, now);
                }
                Event::Response { id, msg } => {
                    self.jobs.reply_to(&mut self.table, conn, id, Ok(msg), now);
                }
                Event::RequestFailed { id, error } => {
                    self.jobs
                        .reply_to(&mut self.table, conn, id, Err(error), now);
                }
                Event::Reconnected { .. } => self.jobs.on_reconnected(conn, now),
                _ => {}
            }
        }
        self.jobs.timers_due(&mut self.timers, conn, Instant::now());
        while let Some(o) = self.jobs.poll_output() {
            self.out.push(o);
        }
        let conn = self.client.connection_mut();
        let written = conn.output();
        let drop = lost.is_some_and(|l| written.windows(l.len()).any(|w| w == l));
        if drop {
            conn.consume_output(written.len());
        }
        // Write what the engine queued.
        let _ = self.client.run_until(Duration::ZERO, |_| false);
        drop
    }

    /// Waits for a frame to `session` matching `pred` and takes it (and what came before it
    /// for that session).
    #[track_caller]
    fn expect(&mut self, session: u64, timeout: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(pos) = self.out.iter().position(|o| match o {
                JobsOutput::Reply {
                    session: s, text, ..
                }
                | JobsOutput::Frame { session: s, text } => *s == session && pred(&parse(text)),
                _ => false,
            }) {
                let o = self.out.remove(pos);
                return match o {
                    JobsOutput::Reply { text, .. } | JobsOutput::Frame { text, .. } => parse(&text),
                    _ => Value::Null,
                };
            }
            assert!(
                Instant::now() < deadline,
                "no matching frame for session {session}; have {:?}",
                self.out
            );
            self.step(Duration::from_millis(5));
        }
    }

    #[track_caller]
    fn reply(&mut self, session: u64, re: &str) -> Value {
        self.expect(session, Duration::from_secs(10), |v| v["re"] == re)
    }

    /// The answer to `re` if the engine has given it, without pumping.
    fn reply_if_any(&mut self, session: u64, re: &str) -> Option<Value> {
        let pos = self.out.iter().position(|o| {
            matches!(o, JobsOutput::Reply { session: s, re: r, .. } if *s == session && r == re)
        })?;
        match self.out.remove(pos) {
            JobsOutput::Reply { text, .. } => Some(parse(&text)),
            _ => None,
        }
    }

    #[track_caller]
    fn offer(&mut self, session: u64, timeout: Duration) -> Value {
        self.expect(session, timeout, |v| v["op"] == "offer")
    }

    /// Frames queued for `session` so far (after pumping a little).
    fn frames_for(&mut self, session: u64, wait: Duration) -> Vec<Value> {
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            self.step(Duration::from_millis(5));
        }
        self.out
            .iter()
            .filter_map(|o| match o {
                JobsOutput::Reply {
                    session: s, text, ..
                }
                | JobsOutput::Frame { session: s, text }
                    if *s == session =>
                {
                    Some(parse(text))
                }
                _ => None,
            })
            .collect()
    }

    #[track_caller]
    fn request(&mut self, session: u64, name: &str, frame: Value) -> Value {
        let re = frame["id"].as_str().expect("id").to_string();
        self.send(session, name, frame);
        self.reply(session, &re)
    }

    #[track_caller]
    fn status(&mut self, session: u64, task: &str) -> Value {
        let id = format!("q-{task}-{}", Instant::now().elapsed().as_nanos());
        let r = self.request(session, "app", json!({"op":"status","id":id,"task":task}));
        assert_eq!(r["op"], "ok", "status: {r}");
        r["task"].clone()
    }
}

/// The last `task_result` stored in the submitter's inbox stream. The engine is pumped
/// meanwhile: the result's publish may still sit in its connection's write buffer.
fn stored_result(b: &mut Broker, client: &mut Client) -> Value {
    use base64::Engine;
    let deadline = Instant::now() + SECS;
    loop {
        let reply = client
            .request(
                "$JS.API.STREAM.MSG.GET.AMP_INBOX_acme",
                None,
                br#"{"last_by_subj":"amp.acme.inbox.app"}"#,
                SECS,
            )
            .expect("message get");
        let v: Value = serde_json::from_slice(&reply.payload).expect("json");
        if let Some(data) = v["message"]["data"].as_str() {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(data)
                .expect("base64");
            let env: Value = serde_json::from_slice(&bytes).expect("envelope");
            assert_eq!(env["kind"], "task_result");
            return env;
        }
        assert!(Instant::now() < deadline, "no task_result stored: {v}");
        b.step(Duration::from_millis(20));
    }
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("frame is not JSON ({e}): {text}"))
}

fn history_states(task: &Value) -> Vec<String> {
    task["history"]
        .as_array()
        .expect("history")
        .iter()
        .map(|h| h["state"].as_str().unwrap_or_default().to_string())
        .collect()
}

const APP: u64 = 1;
const W1: u64 = 11;
const W2: u64 = 12;
const W3: u64 = 13;
const SECS: Duration = Duration::from_secs(10);

#[test]
fn a_task_is_offered_claimed_heartbeaten_completed_and_its_result_reaches_the_submitter() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let mut watcher = Client::connect(Options::new(&server.url())).expect("connect");
    let inbox = watcher.subscribe("amp.acme.inbox.app", None).expect("sub");
    watcher.flush(SECS).expect("flush");

    let r = b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t1","job":"render","task":"T1","body":{"frame":7},"headers":{"traceparent":"00-aa-bb-01"}}),
    );
    assert_eq!(r, json!({"op":"ok","re":"t1","task":"T1","dup":false}));
    assert_eq!(b.status(APP, "T1")["state"], "queued");

    let r = b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v1","job":"render","slots":1}),
    );
    assert_eq!(r["op"], "ok");
    let offer = b.offer(W1, SECS);
    assert_eq!(offer["task"], "T1");
    assert_eq!(offer["job"], "render");
    assert_eq!(offer["from"], "acme/app");
    assert_eq!(offer["body"], json!({"frame":7}));
    assert_eq!(offer["headers"]["traceparent"], "00-aa-bb-01");
    assert_eq!(
        (
            &offer["attempt"],
            &offer["max_attempts"],
            &offer["lease_s"],
            &offer["offer_ms"]
        ),
        (&json!(1), &json!(3), &json!(30), &json!(5000))
    );
    let status = b.status(APP, "T1");
    assert_eq!(status["state"], "offered");
    assert_eq!(status["attempt"], 0);

    let r = b.request(W1, "w1", json!({"op":"claim","id":"c1","task":"T1"}));
    assert_eq!(r["op"], "ok", "{r}");
    let until =
        rfc3339::parse_nanos(r["lease_until"].as_str().expect("lease_until")).expect("time");
    let status = b.status(APP, "T1");
    assert_eq!(status["state"], "leased");
    assert_eq!(status["holder"], "acme/w1");
    assert_eq!(status["attempt"], 1);

    let r = b.request(
        W1,
        "w1",
        json!({"op":"heartbeat","id":"b1","task":"T1","progress":{"pct":50}}),
    );
    assert_eq!(r["op"], "ok", "{r}");
    let later =
        rfc3339::parse_nanos(r["lease_until"].as_str().expect("lease_until")).expect("time");
    assert!(later >= until, "a heartbeat extends the lease");

    let r = b.request(
        W1,
        "w1",
        json!({"op":"complete","id":"k1","task":"T1","result":{"url":"s3://x"}}),
    );
    assert_eq!(r, json!({"op":"ok","re":"k1"}));
    let status = b.status(APP, "T1");
    assert_eq!(status["state"], "completed");
    assert_eq!(status["result"], json!({"url":"s3://x"}));
    assert_eq!(
        history_states(&status),
        ["queued", "offered", "leased", "completed"]
    );
    for h in status["history"].as_array().expect("history") {
        assert!(rfc3339::parse_nanos(h["at"].as_str().expect("at")).is_some());
    }
    assert_eq!(status["history"][2]["by"], "acme/w1");

    let msg = watcher
        .next_message(inbox, SECS)
        .expect("watch")
        .expect("a task_result message");
    assert_eq!(msg.header("AMP-Kind"), Some("task_result"));
    let env: Value = serde_json::from_slice(&msg.payload).expect("envelope");
    assert_eq!(env["kind"], "task_result");
    assert_eq!(env["to"], "acme/app");
    assert_eq!(
        env["body"],
        json!({"task":"T1","state":"completed","attempts":1,"result":{"url":"s3://x"}})
    );
    // Completing again: the lease is gone.
    let r = b.request(W1, "w1", json!({"op":"complete","id":"k2","task":"T1"}));
    assert_eq!(r["code"], "lease_lost");
}

#[test]
fn resubmitting_a_task_id_is_idempotent_and_a_different_body_or_job_conflicts() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let submit = |id: &str, job: &str, body: Value| json!({"op":"submit","id":id,"job":job,"task":"T","body":body});
    let r = b.request(APP, "app", submit("s1", "render", json!({"a":1,"b":2})));
    assert_eq!(r["dup"], false);
    let r = b.request(APP, "app", submit("s2", "render", json!({"b":2,"a":1})));
    assert_eq!(r, json!({"op":"ok","re":"s2","task":"T","dup":true}));
    let r = b.request(APP, "app", submit("s3", "render", json!({"a":1,"b":3})));
    assert_eq!(r["code"], "conflict");
    assert_eq!(r["path"], "/task");
    let r = b.request(APP, "app", submit("s4", "encode", json!({"a":1,"b":2})));
    assert_eq!(r["code"], "conflict");
    // One message in the job stream, not two.
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":5}),
    );
    let offer = b.offer(W1, SECS);
    assert_eq!(offer["task"], "T");
    let frames = b.frames_for(W1, Duration::from_millis(500));
    assert!(
        frames.iter().all(|f| f["op"] != "offer"),
        "a second offer: {frames:?}"
    );
    let r = b.request(
        APP,
        "app",
        json!({"op":"submit","id":"s5","job":"render","body":null}),
    );
    assert_eq!(r["dup"], false);
    assert_eq!(
        r["task"].as_str().map(str::len),
        Some(amp_broker::broker::ids::ID_LEN),
        "a generated id"
    );
}

#[test]
fn decline_and_an_unclaimed_offer_go_to_another_session_without_spending_an_attempt() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 800, 3));
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    let offer = b.offer(W1, SECS);
    assert_eq!(offer["attempt"], 1);
    // Only the session offered the task may claim or decline it.
    b.request(
        W2,
        "w2",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    let r = b.request(W2, "w2", json!({"op":"claim","id":"c","task":"T"}));
    assert_eq!(r["code"], "lease_lost");
    let r = b.request(W1, "w1", json!({"op":"decline","id":"d","task":"T"}));
    assert_eq!(r, json!({"op":"ok","re":"d"}));
    let offer = b.offer(W2, SECS);
    assert_eq!(offer["attempt"], 1, "a decline spends no attempt");
    // W2 lets the offer lapse: it counts as a decline and W1 gets it again.
    let offer = b.offer(W1, SECS);
    assert_eq!(offer["attempt"], 1);
    let r = b.request(W2, "w2", json!({"op":"claim","id":"c2","task":"T"}));
    assert_eq!(r["code"], "lease_lost", "the lapsed offer is gone");
    let status = b.status(APP, "T");
    assert_eq!(status["attempt"], 0);
    assert_eq!(
        history_states(&status),
        [
            "queued", "offered", "queued", "offered", "queued", "offered"
        ]
    );
}

#[test]
fn an_expired_lease_is_revoked_and_reoffered_and_the_stale_holder_gets_lease_lost() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(1, 5000, 3));
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    let r = b.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    assert_eq!(r["op"], "ok");
    b.request(
        W2,
        "w2",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    let revoked = b.expect(W1, SECS, |v| v["op"] == "revoked");
    assert_eq!(
        revoked,
        json!({"op":"revoked","task":"T","reason":"lease_expired"})
    );
    for (id, op) in [("h", "heartbeat"), ("k", "complete")] {
        let r = b.request(W1, "w1", json!({"op":op,"id":id,"task":"T"}));
        assert_eq!(r["code"], "lease_lost", "{op} after expiry");
    }
    // Redelivered after the lease: offered again, as the second attempt, to the idle session.
    let offer = b.offer(W2, SECS);
    assert_eq!(offer["attempt"], 2);
    let r = b.request(W2, "w2", json!({"op":"claim","id":"c","task":"T"}));
    assert_eq!(r["op"], "ok");
    let r = b.request(
        W2,
        "w2",
        json!({"op":"complete","id":"k","task":"T","result":"w2"}),
    );
    assert_eq!(r["op"], "ok");
    let status = b.status(APP, "T");
    assert_eq!(status["state"], "completed");
    assert_eq!(status["result"], "w2");
    assert_eq!(status["attempt"], 2);
    assert_eq!(
        history_states(&status),
        [
            "queued",
            "offered",
            "leased",
            "queued",
            "offered",
            "leased",
            "completed"
        ]
    );
}

/// A holder that goes silent with its session open loses the task at `lease_until`, and
/// the task is offered again right then: after a heartbeat, and after a claim with none.
/// The broker's last in-progress ack of a lease used to restart the message's AckWait
/// 0.9 `lease_s` after the heartbeat (or the delivery), so JetStream held the task for
/// about 0.9 `lease_s` past the revoke (3.6 s of a 4 s lease here).
#[test]
fn an_expired_lease_is_offered_again_right_after_lease_until() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(4, 5000, 3));
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    let r = b.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    assert_eq!(r["op"], "ok", "{r}");
    b.request(
        W2,
        "w2",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    let r = b.request(W1, "w1", json!({"op":"heartbeat","id":"h","task":"T"}));
    assert_eq!(r["op"], "ok", "{r}");
    // W1 goes silent after its heartbeat; its session stays open.
    let revoked = b.expect(W1, SECS, |v| v["op"] == "revoked");
    assert_eq!(revoked["reason"], "lease_expired", "{revoked}");
    let at = Instant::now();
    let offer = b.offer(W2, SECS);
    let late = at.elapsed();
    assert_eq!(offer["attempt"], 2, "{offer}");
    assert!(
        late < Duration::from_secs(2),
        "offered {late:?} after the revoke of a lease silent since its heartbeat"
    );
    // W2 claims and goes silent without a heartbeat: W1, idle the longer, gets it next.
    let r = b.request(W2, "w2", json!({"op":"claim","id":"c","task":"T"}));
    assert_eq!(r["op"], "ok", "{r}");
    let revoked = b.expect(W2, SECS, |v| v["op"] == "revoked");
    assert_eq!(revoked["reason"], "lease_expired", "{revoked}");
    let at = Instant::now();
    let offer = b.offer(W1, SECS);
    let late = at.elapsed();
    assert_eq!(offer["attempt"], 3, "{offer}");
    assert!(
        late < Duration::from_secs(2),
        "offered {late:?} after the revoke of a lease silent since its claim"
    );
}

/// Claims task `T` for W1 and returns the claim's `lease_until` and the instant it
/// stands for on this process's clocks.
fn claimed(b: &mut Broker) -> (String, Instant) {
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    let r = b.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    assert_eq!(r["op"], "ok", "{r}");
    let until = r["lease_until"].as_str().expect("lease_until").to_string();
    let until_ns = rfc3339::parse_nanos(&until).expect("time");
    let left_ms = i64::try_from(until_ns / 1_000_000).expect("ms") - wall_ms();
    let at = Instant::now() + Duration::from_millis(u64::try_from(left_ms).expect("future"));
    (until, at)
}

#[test]
fn a_heartbeat_after_lease_until_is_refused_even_before_the_expiry_timer_has_run() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let (until, at) = claimed(&mut b);
    // The frames come 100 ms past lease_until; the engine's expiry timer has not run.
    let late = at + Duration::from_millis(100);
    b.send_at(
        W1,
        "w1",
        json!({"op":"heartbeat","id":"h","task":"T"}),
        late,
    );
    b.send_at(
        W1,
        "w1",
        json!({"op":"complete","id":"k","task":"T","result":"late"}),
        late,
    );
    b.step(Duration::ZERO);
    for re in ["h", "k"] {
        let r = b.reply(W1, re);
        assert_eq!(r["code"], "lease_lost", "{re}: {r}");
    }
    // Nothing was written: the lease stands as claimed, and at the real time (within it)
    // the same holder still heartbeats.
    let status = b.status(APP, "T");
    assert_eq!(
        (&status["state"], &status["lease_until"]),
        (&json!("leased"), &json!(until))
    );
    let r = b.request(W1, "w1", json!({"op":"heartbeat","id":"h2","task":"T"}));
    assert_eq!(r["op"], "ok", "{r}");
}

#[test]
fn a_claim_whose_write_is_answered_after_the_lease_it_grants_ran_out_gets_lease_lost() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(1, 5000, 3));
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    // The claim's write goes out now (a lease of 1 s from now); its answer is handled as
    // if it arrived 1.5 s later. Before: `ok` with a `lease_until` already past.
    let sent = Instant::now();
    b.send_at(W1, "w1", json!({"op":"claim","id":"c","task":"T"}), sent);
    let late = sent + Duration::from_millis(1500);
    let deadline = Instant::now() + SECS;
    let r = loop {
        b.step_as_if(Duration::from_millis(20), Some(late));
        if let Some(r) = b.reply_if_any(W1, "c") {
            break r;
        }
        assert!(Instant::now() < deadline, "the claim is answered");
    };
    assert_eq!(r["code"], "lease_lost", "{r}");
    // The attempt is spent as for any lease that ran out; the task is offered again, and
    // the session that was told `lease_lost` gets no `revoked` besides.
    let again = b.offer(W1, SECS * 3);
    assert_eq!(again["attempt"], 2, "{again}");
    let frames = b.frames_for(W1, Duration::from_millis(100));
    assert!(frames.iter().all(|f| f["op"] != "revoked"), "{frames:?}");
}

#[test]
fn a_heartbeat_accepted_just_before_lease_until_extends_the_lease_though_its_write_outlasts_it() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let (until, at) = claimed(&mut b);
    // Accepted 200 ms before lease_until; the expiry falls due while its write is out.
    b.send_at(
        W1,
        "w1",
        json!({"op":"heartbeat","id":"h","task":"T"}),
        at - Duration::from_millis(200),
    );
    b.timers_at(at + Duration::from_millis(200));
    let r = b.reply(W1, "h");
    assert_eq!(r["op"], "ok", "{r}");
    let extended = r["lease_until"].as_str().expect("lease_until");
    assert!(extended > until.as_str(), "{extended} after {until}");
    let frames = b.frames_for(W1, Duration::from_millis(100));
    assert!(
        frames.iter().all(|f| f["op"] != "revoked"),
        "an extended lease is not revoked: {frames:?}"
    );
    let r = b.request(
        W1,
        "w1",
        json!({"op":"complete","id":"k","task":"T","result":"in time"}),
    );
    assert_eq!(r["op"], "ok", "{r}");
    let status = b.status(APP, "T");
    assert_eq!(
        (&status["state"], &status["attempt"]),
        (&json!("completed"), &json!(1))
    );
    assert_eq!(
        history_states(&status),
        ["queued", "offered", "leased", "completed"]
    );
}

#[test]
fn a_complete_whose_write_fails_after_lease_until_is_unavailable_and_the_lease_still_expires() {
    let mut server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let (_, at) = claimed(&mut b);
    // Accepted within the lease; the expiry falls due while its write is out, and then
    // the write fails with the server gone.
    b.send_at(
        W1,
        "w1",
        json!({"op":"complete","id":"k","task":"T","result":"lost"}),
        at - Duration::from_millis(200),
    );
    b.timers_at(at + Duration::from_millis(200));
    server.kill();
    let r = b.reply(W1, "k");
    assert_eq!(r["code"], "unavailable", "{r}");
    b.timers_at(at + Duration::from_millis(300));
    let revoked = b.expect(W1, SECS, |v| v["op"] == "revoked");
    assert_eq!(
        revoked,
        json!({"op":"revoked","task":"T","reason":"lease_expired"})
    );
}

#[test]
fn the_last_attempt_running_out_fails_the_task_and_tells_the_submitter() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(1, 5000, 3));
    let mut watcher = Client::connect(Options::new(&server.url())).expect("connect");
    let inbox = watcher.subscribe("amp.acme.inbox.app", None).expect("sub");
    watcher.flush(SECS).expect("flush");
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1,"max_attempts":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    b.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    b.expect(W1, SECS, |v| v["op"] == "revoked");
    let deadline = Instant::now() + SECS;
    loop {
        let s = b.status(APP, "T");
        if s["state"] == "failed" {
            assert_eq!(s["error"]["code"], "attempts_exhausted");
            assert_eq!(s["attempt"], 1);
            break;
        }
        assert!(Instant::now() < deadline, "never failed: {s}");
        b.step(Duration::from_millis(50));
    }
    let env = stored_result(&mut b, &mut watcher);
    let _ = inbox;
    assert_eq!(env["body"]["state"], "failed");
    assert_eq!(env["body"]["attempts"], 1);
    let frames = b.frames_for(W1, Duration::from_millis(300));
    assert!(
        frames.iter().all(|f| f["op"] != "offer"),
        "no new offer: {frames:?}"
    );
}

#[test]
fn fail_with_retry_requeues_and_without_retry_fails() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    b.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    let r = b.request(
        W1,
        "w1",
        json!({"op":"fail","id":"f","task":"T","error":{"code":"oom","message":"out of memory"},"retry":true}),
    );
    assert_eq!(r, json!({"op":"ok","re":"f","state":"queued"}));
    let offer = b.offer(W1, SECS);
    assert_eq!(offer["attempt"], 2);
    b.request(W1, "w1", json!({"op":"claim","id":"c2","task":"T"}));
    let r = b.request(
        W1,
        "w1",
        json!({"op":"fail","id":"f2","task":"T","error":{"code":"bad"}}),
    );
    assert_eq!(r, json!({"op":"ok","re":"f2","state":"failed"}));
    let status = b.status(APP, "T");
    assert_eq!(status["state"], "failed");
    assert_eq!(status["error"], json!({"code":"bad"}));
    assert_eq!(status["attempt"], 2);
}

#[test]
fn cancel_is_for_the_submitter_and_revokes_a_running_lease() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"Q","body":1}),
    );
    let r = b.request(W3, "other", json!({"op":"cancel","id":"x","task":"Q"}));
    assert_eq!(r["code"], "forbidden");
    let r = b.request(APP, "app", json!({"op":"cancel","id":"x","task":"Q"}));
    assert_eq!(r, json!({"op":"ok","re":"x"}));
    assert_eq!(b.status(APP, "Q")["state"], "cancelled");
    let r = b.request(APP, "app", json!({"op":"cancel","id":"x2","task":"Q"}));
    assert_eq!(r["code"], "conflict");
    let r = b.request(APP, "app", json!({"op":"cancel","id":"x3","task":"nope"}));
    assert_eq!(r["code"], "not_found");
    let r = b.request(APP, "app", json!({"op":"status","id":"x4","task":"nope"}));
    assert_eq!(r["code"], "not_found");

    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t2","job":"render","task":"L","body":2}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":2}),
    );
    // The cancelled task's message is acknowledged away, never offered.
    let offer = b.offer(W1, SECS);
    assert_eq!(offer["task"], "L");
    b.request(W1, "w1", json!({"op":"claim","id":"c","task":"L"}));
    let r = b.request(APP, "app", json!({"op":"cancel","id":"x5","task":"L"}));
    assert_eq!(r["op"], "ok");
    let revoked = b.expect(W1, SECS, |v| v["op"] == "revoked");
    assert_eq!(
        revoked,
        json!({"op":"revoked","task":"L","reason":"cancelled"})
    );
    let r = b.request(W1, "w1", json!({"op":"complete","id":"k","task":"L"}));
    assert_eq!(r["code"], "lease_lost");
    assert_eq!(b.status(APP, "L")["state"], "cancelled");
}

/// `task_result` messages stored in app's inbox.
fn inbox_results(client: &mut Client) -> u64 {
    let reply = client
        .request(
            "$JS.API.STREAM.INFO.AMP_INBOX_acme",
            None,
            br#"{"subjects_filter":"amp.acme.inbox.app"}"#,
            SECS,
        )
        .expect("stream info");
    let v: Value = serde_json::from_slice(&reply.payload).expect("json");
    v["state"]["subjects"]["amp.acme.inbox.app"]
        .as_u64()
        .unwrap_or(0)
}

/// Spec 2.4: a cancelled task's `task_result` reaches the submitter. The message of a
/// cancelled task is gone, so no redelivery publishes the result again: a cancel whose
/// result publish timed out (here: it never reached the server) answered `ok` all the
/// same, and the submitter, told `ok`, never retried; no result was ever stored.
#[test]
fn a_cancel_whose_task_result_was_not_stored_is_unavailable_and_its_retry_stores_it() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let mut client = Client::connect(Options::new(&server.url())).expect("connect");
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.send_at(
        APP,
        "app",
        json!({"op":"cancel","id":"x1","task":"T"}),
        Instant::now(),
    );
    // The read, then the compare-and-set; what the engine sends once that is stored (the
    // result's publish) is lost on the way.
    let deadline = Instant::now() + SECS;
    while !b.step_losing(Duration::from_millis(5), None, Some(b"amp.acme.inbox.app")) {
        assert!(Instant::now() < deadline, "the cancel is stored");
    }
    let r = b.reply(APP, "x1");
    let stored = inbox_results(&mut client);
    assert!(
        r["op"] != "ok" || stored == 1,
        "cancel answered {r} with {stored} task_result stored"
    );
    assert_eq!(r["code"], "unavailable", "{r}");
    assert_eq!(b.status(APP, "T")["state"], "cancelled");
    // The client retries, as after any `unavailable`: the result is stored now, once.
    let r = b.request(APP, "app", json!({"op":"cancel","id":"x2","task":"T"}));
    assert_eq!(r, json!({"op":"ok","re":"x2"}));
    assert_eq!(inbox_results(&mut client), 1);
    let env = stored_result(&mut b, &mut client);
    assert_eq!(env["body"]["state"], "cancelled", "{env}");
    // Another retry within the window repeats it, deduplicated: still one.
    let r = b.request(APP, "app", json!({"op":"cancel","id":"x3","task":"T"}));
    assert_eq!(r["code"], "conflict", "{r}");
    assert_eq!(inbox_results(&mut client), 1);
}

/// A cancel whose `task_result` a full inbox refused answers `unavailable`, and its
/// retry republishes the result also past the 90 s repeat window while every publish of
/// it there was refused. A cancel of the cancelled task through another broker stored
/// the result meanwhile; the retry past the inbox's duplicate window (120 s; 1 s here)
/// stored it a second time.
#[test]
fn a_refused_cancel_result_a_cancel_through_another_broker_stored_is_not_stored_again() {
    let server = common::NatsServer::start();
    let mut a = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let mut b = Broker::start(&server.url(), "b2", config(30, 5000, 3));
    let mut client = Client::connect(Options::new(&server.url())).expect("connect");
    let mut js = server.jetstream();
    let r = a.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    assert_eq!(r["op"], "ok", "{r}");
    // Full: one message held, and no room for another (discard `new` refuses it).
    let filler = js.publish(
        "amp.acme.inbox.other",
        None,
        b"{}",
        &amp_broker::jetstream::PublishOptions::default(),
    );
    filler.expect("filler stored");
    let mut inbox = js.stream_info("AMP_INBOX_acme").expect("inbox").config;
    inbox.max_msgs = Some(1);
    js.update_stream(&inbox).expect("inbox full");
    let r = a.request(APP, "app", json!({"op":"cancel","id":"x1","task":"T"}));
    assert_eq!(r["code"], "unavailable", "{r}");
    // The record says every publish of the result was refused (a's mark).
    let deadline = Instant::now() + SECS;
    while record_of_t(&mut js).get("result_refused").is_none() {
        assert!(Instant::now() < deadline, "the record is marked");
        a.step(Duration::from_millis(5));
    }
    inbox.max_msgs = Some(-1);
    inbox.duplicate_window = Some(Duration::from_secs(1));
    js.update_stream(&inbox)
        .expect("room, and a 1 s duplicate window");
    // So b takes it for the retry of a's cancel: `ok`, once the result is stored.
    let r = b.request(APP, "app", json!({"op":"cancel","id":"y1","task":"T"}));
    assert_eq!(r["op"], "ok", "{r}");
    // Its result's publish goes without the answer waiting for it.
    let deadline = Instant::now() + SECS;
    while inbox_results(&mut client) == 0 {
        assert!(Instant::now() < deadline, "the repeat stores the result");
        b.step(Duration::from_millis(5));
    }
    // Past the duplicate window (b's writes moving meanwhile), the retry through a.
    b.frames_for(APP, Duration::from_millis(1500));
    let r = a.request(APP, "app", json!({"op":"cancel","id":"x2","task":"T"}));
    assert_eq!(r, json!({"op":"ok","re":"x2"}));
    a.frames_for(APP, Duration::from_millis(200));
    assert_eq!(inbox_results(&mut client), 1, "task_results stored");
}

/// The record of task `T` in namespace `acme`, as the task store holds it.
fn record_of_t(js: &mut amp_broker::jetstream::Context) -> Value {
    let kv = js.kv_bind("AMP_TASK_STATE").expect("task store");
    let entry = js.kv_get(&kv, "acme.T").expect("record");
    serde_json::from_slice(&entry.value).expect("record JSON")
}

/// A dead task whose letter could not be stored keeps its message for a redelivery,
/// and the record is marked `result_sent` once its `task_result` is stored. The mark is
/// sent with the message's NAK, not waited for: a redelivery that finds no mark (here
/// the mark's write and the NAK are lost, and the message comes back after its AckWait)
/// publishes the result again, a duplicate within the inbox's 120 s window, and writes
/// the mark. One result all the same; only a mark that failed for the whole window
/// would let a repeat through.
#[test]
fn a_result_sent_mark_lost_on_its_way_leaves_one_task_result() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(2, 5000, 1));
    let mut client = Client::connect(Options::new(&server.url())).expect("connect");
    let mut js = server.jetstream();
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    b.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    // No dead-letter stream is made here: the letter finds none.
    b.send(
        W1,
        "w1",
        json!({"op":"fail","id":"f","task":"T","error":{"code":"bad"}}),
    );
    // The result is stored; what the engine writes next (the mark's read, the NAK) is
    // lost.
    let deadline = Instant::now() + SECS;
    while !b.step_losing(Duration::from_millis(5), None, Some(b".KV_AMP_TASK_STATE")) {
        assert!(Instant::now() < deadline, "the mark is read");
    }
    assert_eq!(b.reply(W1, "f")["state"], "failed");
    assert_eq!(inbox_results(&mut client), 1);
    assert!(record_of_t(&mut js).get("result_sent").is_none());
    let deadline = Instant::now() + SECS;
    while record_of_t(&mut js).get("result_sent").is_none() {
        assert!(Instant::now() < deadline, "a redelivery marks the record");
        b.step(Duration::from_millis(20));
    }
    assert_eq!(inbox_results(&mut client), 1, "the repeat is a duplicate");
    // The letter's stream comes: the letter is stored, the message goes, no result.
    let dlq = binding::dlq_stream_config("acme", 3600, 0, StreamSettings::default());
    js.create_stream(&dlq).expect("dead-letter stream");
    let messages = |js: &mut amp_broker::jetstream::Context, stream: &str| {
        js.stream_info(stream).expect("stream info").state.messages
    };
    let deadline = Instant::now() + SECS;
    while messages(&mut js, "AMP_TASKS_acme") > 0 {
        assert!(Instant::now() < deadline, "the task message goes");
        b.step(Duration::from_millis(20));
    }
    assert_eq!(messages(&mut js, "AMP_DLQ_acme"), 1);
    assert_eq!(inbox_results(&mut client), 1, "task_results stored");
}

#[test]
fn only_eligible_sessions_get_offers_and_an_untakeable_task_stays_queued() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"G","body":1,"eligible":{"labels":{"gpu":"a100"}}}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    let frames = b.frames_for(W1, Duration::from_millis(800));
    assert!(frames.iter().all(|f| f["op"] != "offer"), "{frames:?}");
    assert_eq!(b.status(APP, "G")["state"], "queued");
    b.request(
        W2,
        "w2",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    let offer = b.offer(W2, SECS);
    assert_eq!(offer["task"], "G");
    let r = b.request(
        W3,
        "nobody",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    assert_eq!(r["code"], "forbidden");
    let r = b.request(
        W3,
        "nobody",
        json!({"op":"submit","id":"s","job":"render","body":1}),
    );
    assert_eq!(r["code"], "forbidden");
}

#[test]
fn offers_go_to_the_least_loaded_session_and_never_beyond_free_slots() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    for i in 0..6 {
        b.request(
            APP,
            "app",
            json!({"op":"submit","id":format!("t{i}"),"job":"render","task":format!("T{i}"),"body":i}),
        );
    }
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":2}),
    );
    b.request(
        W2,
        "w2",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    let frames_w1 = b.frames_for(W1, Duration::from_millis(800));
    let frames_w2 = b.frames_for(W2, Duration::ZERO);
    let offers = |f: &Vec<Value>| f.iter().filter(|v| v["op"] == "offer").count();
    assert_eq!(offers(&frames_w1), 2, "{frames_w1:?}");
    assert_eq!(offers(&frames_w2), 1, "{frames_w2:?}");
    let mut queued = 0;
    for i in 0..6 {
        if b.status(APP, &format!("T{i}"))["state"] == "queued" {
            queued += 1;
        }
    }
    assert_eq!(queued, 3, "three slots, three offers");
}

#[test]
fn a_worker_that_disconnects_mid_lease_loses_the_task_after_the_lease() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(1, 5000, 3));
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    b.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    b.close_session(W1);
    let started = Instant::now();
    b.request(
        W2,
        "w2",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    let offer = b.offer(W2, SECS);
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "not before the lease ran out"
    );
    assert_eq!(offer["attempt"], 2);
    // A session closing with an offer out releases it at once.
    let r = b.request(W2, "w2", json!({"op":"decline","id":"d","task":"T"}));
    assert_eq!(r["op"], "ok");
}

#[test]
fn two_brokers_never_lease_one_task_twice_and_share_the_work() {
    let server = common::NatsServer::start();
    let mut b1 = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let mut b2 = Broker::start(&server.url(), "b2", config(30, 5000, 3));
    let n = 200;
    for i in 0..n {
        b1.send(APP, "app", json!({"op":"submit","id":format!("t{i}"),"job":"render","task":format!("T{i}"),"body":i}));
    }
    for i in 0..n {
        b1.reply(APP, &format!("t{i}"));
    }
    b1.send(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":2}),
    );
    b2.send(
        W2,
        "w2",
        json!({"op":"serve","id":"v","job":"render","slots":2}),
    );
    let mut done: BTreeMap<String, u64> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut k = 0;
    while done.len() < n && Instant::now() < deadline {
        for (b, w, name) in [(&mut b1, W1, "w1"), (&mut b2, W2, "w2")] {
            b.step(Duration::from_millis(2));
            let offers: Vec<String> = b
                .out
                .iter()
                .filter_map(|o| match o {
                    JobsOutput::Frame { session, text } if *session == w => {
                        let v = parse(text);
                        (v["op"] == "offer")
                            .then(|| v["task"].as_str().unwrap_or_default().to_string())
                    }
                    _ => None,
                })
                .collect();
            b.out
                .retain(|o| !matches!(o, JobsOutput::Frame { session, .. } if *session == w));
            for task in offers {
                k += 1;
                let r = b.request(
                    w,
                    name,
                    json!({"op":"claim","id":format!("c{k}"),"task":task}),
                );
                assert_eq!(r["op"], "ok", "{r}");
                let r = b.request(
                    w,
                    name,
                    json!({"op":"complete","id":format!("k{k}"),"task":task}),
                );
                assert_eq!(r["op"], "ok", "{r}");
                *done.entry(task).or_default() += 1;
            }
        }
    }
    assert_eq!(done.len(), n, "every task completed");
    assert!(done.values().all(|&c| c == 1), "each exactly once");
    for i in (0..n).step_by(37) {
        let s = b1.status(APP, &format!("T{i}"));
        assert_eq!(s["state"], "completed");
        let leases = history_states(&s).iter().filter(|h| *h == "leased").count();
        assert_eq!(leases, 1);
    }
    let s1 = b1.jobs.stats().completed;
    let s2 = b2.jobs.stats().completed;
    assert_eq!(s1 + s2, n as u64);
    assert!(s1 > 0 && s2 > 0, "both brokers worked: {s1} / {s2}");
}

#[test]
fn status_through_another_broker_says_offered_while_an_unwritten_offer_is_out() {
    let server = common::NatsServer::start();
    let mut b1 = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let mut b2 = Broker::start(&server.url(), "b2", config(30, 5000, 3));
    b2.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b1.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b1.offer(W1, SECS);
    // b2 knows nothing of the offer; it asks, and b1 (pumped here) answers.
    let ask = |b1: &mut Broker, b2: &mut Broker, id: &str| {
        b2.send(APP, "app", json!({"op":"status","id":id,"task":"T"}));
        let deadline = Instant::now() + SECS;
        loop {
            b1.step(Duration::from_millis(2));
            b2.step(Duration::from_millis(2));
            let pos = b2.out.iter().position(|o| {
                matches!(o, JobsOutput::Reply { session, re, .. } if *session == APP && re == id)
            });
            if let Some(JobsOutput::Reply { text, .. }) = pos.map(|p| b2.out.remove(p)) {
                return parse(&text);
            }
            assert!(Instant::now() < deadline, "no status answer");
        }
    };
    let asked = Instant::now();
    let r = ask(&mut b1, &mut b2, "q1");
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "the holder answers at once"
    );
    let status = &r["task"];
    assert_eq!(status["state"], "offered", "{r}");
    assert_eq!(status["attempt"], 0);
    assert!(status.get("holder").is_none(), "an offer is no lease: {r}");
    assert_eq!(history_states(status), ["queued", "offered"]);
    assert_eq!(status["history"][1]["by"], "acme/w1");

    let r = b1.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    assert_eq!(r["op"], "ok", "{r}");
    let r = ask(&mut b1, &mut b2, "q2");
    assert_eq!(r["task"]["state"], "leased", "{r}");
    assert_eq!(
        history_states(&r["task"]),
        ["queued", "offered", "leased"],
        "the claim wrote the offer it took"
    );
    // Nobody holds an offer of a queued task: nobody answers, and at once.
    b2.request(
        APP,
        "app",
        json!({"op":"submit","id":"t2","job":"render","task":"U","body":2}),
    );
    let asked = Instant::now();
    b2.send(APP, "app", json!({"op":"status","id":"q3","task":"U"}));
    let r = b2.reply(APP, "q3");
    assert_eq!(r["task"]["state"], "queued", "{r}");
    assert!(asked.elapsed() < Duration::from_secs(1), "no waiting");
}

/// Two numbers of the job consumer's info, by JSON pointer, as JetStream reports them.
fn job_consumer(client: &mut Client, a: &str, b: &str) -> (u64, u64) {
    let reply = client
        .request(
            "$JS.API.CONSUMER.INFO.AMP_TASKS_acme.job_render",
            None,
            b"",
            SECS,
        )
        .expect("consumer info");
    let v: Value = serde_json::from_slice(&reply.payload).expect("json");
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(u64::MAX);
    (n(a), n(b))
}

/// The job consumer's delivery count and redeliveries.
fn job_deliveries(client: &mut Client) -> (u64, u64) {
    job_consumer(client, "/delivered/consumer_seq", "/num_redelivered")
}

#[test]
fn a_lease_outliving_its_deliverys_ack_wait_keeps_the_message_without_a_heartbeat() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(2, 5000, 3));
    let mut client = Client::connect(Options::new(&server.url())).expect("connect");
    b.request(
        APP,
        "app",
        json!({"op":"submit","id":"t","job":"render","task":"T","body":1}),
    );
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    b.offer(W1, SECS);
    // A free slot keeps a pull waiting, so a message whose AckWait ran out would come back.
    b.request(
        W2,
        "w2",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    // Claimed 1.2 s into the 2 s AckWait: the lease ends 1.2 s after the AckWait would.
    let _ = b.frames_for(W1, Duration::from_millis(1200));
    let ops = b.jobs.stats().js_ops;
    let r = b.request(W1, "w1", json!({"op":"claim","id":"c","task":"T"}));
    assert_eq!(r["op"], "ok", "{r}");
    assert_eq!(
        b.jobs.stats().js_ops - ops,
        1,
        "the claim is its compare-and-set alone"
    );
    assert_eq!(
        job_deliveries(&mut client),
        (1, 0),
        "no in-progress ack was needed yet"
    );
    // Past the AckWait of the delivery, within the lease, with no heartbeat.
    let frames = b.frames_for(W1, Duration::from_millis(1500));
    assert!(frames.iter().all(|f| f["op"] != "revoked"), "{frames:?}");
    assert_eq!(
        job_deliveries(&mut client),
        (1, 0),
        "the broker's in-progress ack kept the message from being redelivered"
    );
    let r = b.request(
        W1,
        "w1",
        json!({"op":"complete","id":"k","task":"T","result":"kept"}),
    );
    assert_eq!(r["op"], "ok", "{r}");
    assert_eq!(b.status(APP, "T")["state"], "completed");
}

/// The job consumer's messages waiting and delivered-but-unacknowledged.
fn job_backlog(client: &mut Client) -> (u64, u64) {
    job_consumer(client, "/num_pending", "/num_ack_pending")
}

/// A fresh task's message carries its record, so its first delivery is offered without
/// reading the task store. A task cancelled while it waits, through a broker that never
/// saw its message, is offered on that stale record all the same: the claim's
/// compare-and-set finds the cancel, the worker hears `lease_lost`, the message goes and
/// the submitter gets exactly one result.
#[test]
fn a_fresh_task_is_offered_on_the_record_it_carries_and_a_cancel_since_still_wins() {
    let server = common::NatsServer::start();
    let mut b1 = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    let mut b2 = Broker::start(&server.url(), "b2", config(30, 5000, 3));
    let mut client = Client::connect(Options::new(&server.url())).expect("connect");
    let inbox = client.subscribe("amp.acme.inbox.app", None).expect("sub");
    client.flush(SECS).expect("flush");

    b1.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    // Messages stored within a quarter second of the consumer's creation are read.
    let frames = b1.frames_for(W1, Duration::from_millis(400));
    assert!(frames.iter().all(|f| f["op"] != "offer"), "{frames:?}");

    b1.request(
        APP,
        "app",
        json!({"op":"submit","id":"t1","job":"render","task":"A","body":1}),
    );
    let offer = b1.offer(W1, SECS);
    assert_eq!((&offer["task"], &offer["body"]), (&json!("A"), &json!(1)));
    assert_eq!(b1.jobs.stats().record_reads_spared, 1);
    let r = b1.request(W1, "w1", json!({"op":"claim","id":"c1","task":"A"}));
    assert_eq!(r["op"], "ok", "{r}");

    // W1's one slot is taken: B waits in the queue while b2 cancels it.
    b1.request(
        APP,
        "app",
        json!({"op":"submit","id":"t2","job":"render","task":"B","body":2}),
    );
    let r = b2.request(APP, "app", json!({"op":"cancel","id":"x","task":"B"}));
    assert_eq!(r, json!({"op":"ok","re":"x"}));
    assert_eq!(job_backlog(&mut client).0, 1, "b2 could not dequeue B");

    let r = b1.request(W1, "w1", json!({"op":"complete","id":"k1","task":"A"}));
    assert_eq!(r["op"], "ok", "{r}");
    let offer = b1.offer(W1, SECS);
    assert_eq!(
        offer["task"], "B",
        "offered on the record B's message carries"
    );
    assert_eq!(b1.jobs.stats().record_reads_spared, 2);
    let r = b1.request(W1, "w1", json!({"op":"claim","id":"c2","task":"B"}));
    assert_eq!(r["code"], "lease_lost", "{r}");
    assert_eq!(b1.status(APP, "B")["state"], "cancelled");
    let status = b1.status(APP, "B");
    assert!(
        !history_states(&status).iter().any(|s| s == "leased"),
        "{status}"
    );

    let deadline = Instant::now() + SECS;
    while job_backlog(&mut client) != (0, 0) {
        assert!(Instant::now() < deadline, "B's message stayed");
        b1.step(Duration::from_millis(20));
    }
    // One result per task: B's cancel (b2 published it at once), then A's completion.
    let mut results = Vec::new();
    while let Some(msg) = client
        .next_message(inbox, Duration::from_millis(300))
        .expect("watch")
    {
        let env: Value = serde_json::from_slice(&msg.payload).expect("envelope");
        results.push((env["body"]["task"].clone(), env["body"]["state"].clone()));
    }
    assert_eq!(
        results,
        [
            (json!("B"), json!("cancelled")),
            (json!("A"), json!("completed"))
        ]
    );
}

/// On the common path a task costs six JetStream operations: the task-store create and
/// the task publish (submit), CAS `leased` (claim), CAS `completed`, the `task_result`
/// publish and the `+NXT` that acks the message and asks for the next one (complete).
/// The record is not read (the message carries it) and no pull is sent of its own: the
/// previous task's `+NXT` is the pull that delivers the next.
#[test]
fn a_task_on_the_common_path_costs_six_jetstream_operations() {
    let server = common::NatsServer::start();
    let mut b = Broker::start(&server.url(), "b1", config(30, 5000, 3));
    b.request(
        W1,
        "w1",
        json!({"op":"serve","id":"v","job":"render","slots":1}),
    );
    // Messages stored within a quarter second of the consumer's creation are read.
    let _ = b.frames_for(W1, Duration::from_millis(400));
    let before = b.jobs.stats();
    const TASKS: u64 = 5;
    for i in 0..TASKS {
        let task = format!("T{i}");
        let r = b.request(
            APP,
            "app",
            json!({"op":"submit","id":format!("s{i}"),"job":"render","task":task,"body":i}),
        );
        assert_eq!(r["op"], "ok", "{r}");
        assert_eq!(b.offer(W1, SECS)["task"], task.as_str());
        let r = b.request(
            W1,
            "w1",
            json!({"op":"claim","id":format!("c{i}"),"task":task}),
        );
        assert_eq!(r["op"], "ok", "{r}");
        let r = b.request(
            W1,
            "w1",
            json!({"op":"complete","id":format!("k{i}"),"task":task}),
        );
        assert_eq!(r["op"], "ok", "{r}");
    }
    let after = b.jobs.stats();
    assert_eq!(
        after.record_reads_spared - before.record_reads_spared,
        TASKS
    );
    assert_eq!(
        after.js_ops - before.js_ops,
        6 * TASKS,
        "JetStream operations for {TASKS} tasks"
    );
}
