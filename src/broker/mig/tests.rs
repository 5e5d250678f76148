//! The front end driven directly, where a JetStream answer's timing matters: on a
//! connection that is not connected, so requests wait in its reconnect buffer and no
//! answer comes unless a test hands one in.

use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::invoke::{self, Invocation, Stage};
use super::{Alarm, Awaiting, Ctx, Mig, Pending, envelope};
use crate::broker::budget::{BudgetConfig, Budgets};
use crate::broker::clock::Clock;
use crate::broker::config::Config;
use crate::broker::held_bytes::{HeldBytes, Hold};
use crate::broker::ids::IdSource;
use crate::broker::in_flight::Tally;
use crate::broker::jobs::{Jobs, SessionId};
use crate::broker::rate_limit::RateLimiter;
use crate::broker::task_store::body_digest;
use crate::broker::timers::{Timers, Wake};
use crate::nats::{Connection, Message, Options};
use crate::proto::headers::HeaderMap;

fn config() -> Config {
    let v = json!({"mig": {"enabled": true}, "namespaces": {"acme": {
        "participants": {"alice": {"token_sha256": "0".repeat(64),
                                   "permissions": {"submit": ["infer"]}}},
        "jobs": {"infer": {"mig": {"id": "infer"}}}}}});
    Config::parse(v.to_string().as_bytes()).expect("config")
}

/// What the front's requests reach: the jobs engine and the limits.
struct Engines {
    jobs: Jobs,
    rates: RateLimiter,
    budgets: Budgets,
    in_flight: Tally,
}

impl Engines {
    fn ctx<'a>(&'a mut self, config: &'a Config) -> Ctx<'a> {
        Ctx {
            config,
            jobs: &mut self.jobs,
            rates: &mut self.rates,
            budgets: &mut self.budgets,
            in_flight: &mut self.in_flight,
            registry: None,
        }
    }
}

/// The front of broker `b0` on `config`, on a connection that is not connected (see the
/// module's comment), and its engines.
fn bench(config: &Config, t0: Instant) -> (Connection, Mig, Engines) {
    let clock = Clock::new(t0, 1_800_000_000_000);
    let ids = IdSource::from_seed([7; 32]);
    let engines = Engines {
        jobs: Jobs::new("b0", config, clock, ids.derive("jobs")).expect("jobs"),
        rates: RateLimiter::new(16),
        budgets: Budgets::new(BudgetConfig::default()),
        in_flight: Tally::default(),
    };
    let mut options = Options::new("nats://127.0.0.1:4222");
    options.retry_on_failed_connect = true;
    let conn = Connection::new(options, t0);
    let mig = Mig::new("b0", clock, ids.derive("mig")).expect("mig");
    (conn, mig, engines)
}

/// A hold on no bound, for an invocation a test makes itself.
fn unbound() -> Hold {
    HeldBytes::new(0).take(0).expect("nothing fits")
}

/// The deadline of an invocation passed while the task store's create of its task was
/// still out: the cancel was sent at once, found no task (`not_found`), and the task
/// was then created and ran with nobody waiting for it. The cancel now waits for the
/// submit's answer.
#[test]
fn a_deadline_during_the_submit_cancels_the_task_once_it_exists() {
    let t0 = Instant::now();
    let config = config();
    let (mut conn, mut mig, mut engines) = bench(&config, t0);
    let mut ctx = engines.ctx(&config);

    let body: Map<String, Value> = serde_json::from_value(
        json!({"header": {"tenant_id": "acme", "message_id": "m1"}, "payload": {}}),
    )
    .expect("body");
    let header = envelope::parse_header(&body, None, || "made".into()).expect("header");
    let participant = config.participant("acme", "alice").expect("alice");
    let r = invoke::Request {
        ns: "acme",
        caller: "alice",
        participant,
        capability: "infer",
        reply: "_INBOX_acme_alice.1",
        header: &header,
        body: &body,
    };
    let accepted = invoke::accept(&config, &r).expect("accepted");
    let inv = Invocation::new(&r, accepted, unbound(), 1000, t0);
    let session = mig.new_session();
    mig.invocations.insert(session, inv);
    mig.submit(&mut conn, &mut ctx, session, t0);
    let out = conn.pending_requests();
    assert!(out > 0, "the submit sent nothing");

    let deadline = t0 + Duration::from_secs(1);
    mig.on_alarm(&mut conn, &mut ctx, Alarm::Deadline(session), deadline);
    assert!(
        !mig.invocations.contains_key(&session),
        "answered at its deadline"
    );
    assert_eq!(
        conn.pending_requests(),
        out,
        "a cancel went out before the task existed"
    );
    // The submit is answered: the task exists, and its cancel goes out now.
    let ok = json!({"op": "ok", "re": "submit"}).to_string();
    mig.on_jobs_reply(&mut conn, &mut ctx, session, &ok, deadline);
    assert_eq!(
        conn.pending_requests(),
        out + 1,
        "the task was not cancelled"
    );
    assert!(mig.expired_submits.is_empty());
    // A submit refused after the deadline leaves nothing to cancel.
    let inv = Invocation::new(
        &r,
        invoke::accept(&config, &r).expect("accepted"),
        unbound(),
        1000,
        t0,
    );
    let session = mig.new_session();
    mig.invocations.insert(session, inv);
    mig.submit(&mut conn, &mut ctx, session, t0);
    let out = conn.pending_requests();
    mig.on_alarm(&mut conn, &mut ctx, Alarm::Deadline(session), deadline);
    let refused = json!({"op": "error", "re": "submit", "code": "unavailable"}).to_string();
    mig.on_jobs_reply(&mut conn, &mut ctx, session, &refused, deadline);
    assert_eq!(conn.pending_requests(), out);
    assert!(mig.expired_submits.is_empty());
}

/// A message on a task record's subject reaches the broker as the write reaches the
/// server, which may be before the stream has stored it (in a cluster, before its raft
/// round ends), and a read then finds the record as it was. Since such a message is only
/// a sign (a write the stream refused comes too), the record is read again a little later
/// until the store shows what the sign said, at most three times.
#[test]
fn a_record_sign_ahead_of_the_store_is_read_again_until_the_store_shows_it() {
    let t0 = Instant::now();
    let config = config();
    let (mut conn, mut mig, mut engines) = bench(&config, t0);
    let mut ctx = engines.ctx(&config);
    let mut timers = Timers::default();

    let body: Map<String, Value> = serde_json::from_value(
        json!({"header": {"tenant_id": "acme", "message_id": "m1"}, "payload": {}}),
    )
    .expect("body");
    let header = envelope::parse_header(&body, None, || "made".into()).expect("header");
    let participant = config.participant("acme", "alice").expect("alice");
    let r = invoke::Request {
        ns: "acme",
        caller: "alice",
        participant,
        capability: "infer",
        reply: "_INBOX_acme_alice.1",
        header: &header,
        body: &body,
    };
    let waiting = || {
        let accepted = invoke::accept(&config, &r).expect("ok");
        let mut inv = Invocation::new(&r, accepted, unbound(), 60_000, t0);
        inv.stage = Stage::Waiting;
        inv
    };
    let task = waiting().task;
    let subject = format!("$KV.AMP_TASK_STATE.acme.{task}");
    let record = |state: &str| {
        json!({"id": task, "job": "infer", "state": state, "attempt": 1,
               "max_attempts": 3, "submitted_by": "acme/alice",
               "body_sha256": body_digest(&json!({})), "result": {"ok": true}})
        .to_string()
        .into_bytes()
    };
    let sign = Message {
        subject: subject.clone(),
        reply: None,
        headers: None,
        payload: record("completed"),
    };
    // What a direct get answers: the record stored at `seq`.
    let stored = |state: &str, seq: &str| {
        let mut h = HeaderMap::new();
        h.insert("Nats-Subject", &subject).expect("header");
        h.insert("Nats-Sequence", seq).expect("header");
        Ok(Message {
            subject: "_INBOX.get".into(),
            reply: None,
            headers: Some(h),
            payload: record(state),
        })
    };
    let refused = mig.new_session();
    let session = mig.new_session();
    for s in [refused, session] {
        mig.invocations.insert(s, waiting());
    }
    let mut due = |mig: &mut Mig, until: Instant| {
        timers.file(&mut mig.later, Wake::Mig);
        match timers.pop_due(until) {
            Some((at, Wake::Mig(alarm))) => Some((at, alarm)),
            _ => None,
        }
    };

    // The completion's sign reads the record; the store has the task leased still.
    let out = conn.pending_requests();
    mig.record_changed(&mut conn, session, &sign, t0);
    assert_eq!(conn.pending_requests(), out + 1, "the record was not read");
    mig.record_read(&mut conn, &mut ctx, session, stored("leased", "7"), t0);
    assert!(
        mig.invocations.contains_key(&session),
        "answered from a sign the store does not show"
    );
    // Read again 10 ms later, when the store has it: that answers.
    let (at, alarm) = due(&mut mig, t0 + Duration::from_secs(5)).expect("no read again");
    assert_eq!(at, t0 + Duration::from_millis(10));
    mig.on_alarm(&mut conn, &mut ctx, alarm, at);
    assert_eq!(
        conn.pending_requests(),
        out + 2,
        "the record was not read again"
    );
    mig.record_read(&mut conn, &mut ctx, session, stored("completed", "8"), at);
    assert!(!mig.invocations.contains_key(&session), "not answered");

    // A write the stream refused is never shown: three reads again, then none.
    mig.record_changed(&mut conn, refused, &sign, t0);
    mig.record_read(&mut conn, &mut ctx, refused, stored("leased", "7"), t0);
    let mut waits = Vec::new();
    while let Some((at, alarm)) = due(&mut mig, t0 + Duration::from_secs(60)) {
        if !mig.alarm_matters(&alarm) {
            continue;
        }
        waits.push(at.saturating_duration_since(t0));
        mig.on_alarm(&mut conn, &mut ctx, alarm, at);
        mig.record_read(&mut conn, &mut ctx, refused, stored("leased", "7"), at);
    }
    let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
    assert_eq!(ms, [10, 110, 1110]);
    assert!(
        mig.invocations.contains_key(&refused),
        "answered from a refused write"
    );
}

/// A caller's requests that ask JetStream hold places in its participant's requests in
/// flight (`limits.max_participant_requests_in_flight`): a replay page holds one from its
/// first read to its answer, carried from read to read, and gives it back however it
/// ends (here a timeout); past the cap a request is refused before it asks anything.
#[test]
fn replay_pages_hold_their_place_in_flight_until_they_are_answered() {
    use sha2::{Digest, Sha256};
    let t0 = Instant::now();
    let hash: String = Sha256::digest(b"alice-token")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let v = json!({"mig": {"enabled": true},
        "limits": {"max_participant_requests_in_flight": 4},
        "namespaces": {"acme": {
            "participants": {"alice": {"token_sha256": hash,
                                       "permissions": {"subscribe": ["orders.>"]}}},
            "jobs": {"infer": {"mig": {"id": "infer"}}}}}});
    let config = Config::parse(v.to_string().as_bytes()).expect("config");
    let (mut conn, mut mig, mut engines) = bench(&config, t0);
    let held = engines.in_flight.count("acme/alice");
    let mut ctx = engines.ctx(&config);

    let mut headers = HeaderMap::new();
    headers
        .insert("Authorization", "Bearer alice-token")
        .expect("header");
    let page = json!({"header": {"tenant_id": "acme"}, "topic": "orders.>", "max_inflight": 2});
    let subscribe = Message {
        subject: "mig.v0_1.acme.control.subscribe".into(),
        reply: Some("_INBOX_acme_alice.1".into()),
        headers: Some(headers),
        payload: page.to_string().into_bytes(),
    };
    let out = conn.pending_requests();
    for _ in 0..10 {
        mig.on_request(&mut conn, &mut ctx, &subscribe, t0);
    }
    assert_eq!(
        conn.pending_requests(),
        out + 4,
        "past the cap nothing is asked"
    );
    assert_eq!(held.get(), 4);
    // Each page's first read finds an event: its second read holds the same place.
    let stored = json!({"message": {"subject": "amp.acme.topic.orders.eu", "seq": 1,
        "data": "e30=", "time": "2026-01-01T00:00:00Z"}})
    .to_string();
    for (_, awaiting) in mig.staged.take() {
        let found = Ok(Message {
            subject: "_INBOX.get".into(),
            reply: None,
            headers: None,
            payload: stored.clone().into_bytes(),
        });
        mig.on_reply(&mut conn, &mut ctx, awaiting, found, t0);
    }
    let second = mig.staged.take();
    assert_eq!(second.len(), 4, "every page read on");
    assert_eq!(held.get(), 4, "a page's next read took no second place");
    for (_, awaiting) in second {
        mig.on_reply(&mut conn, &mut ctx, awaiting, created(), t0);
    }
    assert_eq!(held.get(), 0, "every page answered gave its place back");
    mig.on_request(&mut conn, &mut ctx, &subscribe, t0);
    assert_eq!(held.get(), 1, "room again");
}

/// A redrive of an invocation's dead letter drops what describes the invocation: every
/// header an invocation's task gets, `traceparent` aside, must be named there.
#[test]
fn every_header_of_an_invocation_but_its_traceparent_is_one_a_redrive_drops() {
    let config = config();
    let body: Map<String, Value> = serde_json::from_value(json!({
        "header": {"tenant_id": "acme", "message_id": "m1", "session_id": "s1",
                   "idempotency_key": "k1",
                   "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        "payload": {}
    }))
    .expect("body");
    let header = envelope::parse_header(&body, None, || "made".into()).expect("header");
    let participant = config.participant("acme", "alice").expect("alice");
    let r = invoke::Request {
        ns: "acme",
        caller: "alice",
        participant,
        capability: "infer",
        reply: "_INBOX_acme_alice.1",
        header: &header,
        body: &body,
    };
    let accepted = invoke::accept(&config, &r).expect("accepted");
    let hold = crate::broker::held_bytes::HeldBytes::new(1 << 20)
        .take(0)
        .expect("room");
    let inv = Invocation::new(&r, accepted, hold, 1000, Instant::now());
    let mut names: Vec<&str> = inv.headers.keys().map(String::as_str).collect();
    names.sort_unstable();
    let mut expected: Vec<&str> = invoke::INVOCATION_HEADERS.to_vec();
    expected.push("traceparent");
    expected.sort_unstable();
    assert_eq!(names, expected);
}

/// An invocation kept its payload, parsed, until it was answered or its deadline passed
/// (up to `mig.max_deadline_ms`), counted by nothing but the number of invocations. Its
/// text is now held against the bound that submits waiting for JetStream share (a quarter
/// of `limits.max_buffered_bytes`) until its task exists, past which an INVOKE answers
/// `MIG_BACKPRESSURE`, and the invocation then keeps only the payload's digest.
#[test]
fn invoke_payloads_are_held_against_the_bound_until_their_task_exists() {
    use sha2::{Digest, Sha256};
    let t0 = Instant::now();
    let hash: String = Sha256::digest(b"alice-token")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // 10,000 bytes held at most: three payloads of 2,508 bytes fit, a fourth does not.
    let v = json!({"mig": {"enabled": true}, "limits": {"max_buffered_bytes": 40_000},
        "namespaces": {"acme": {
            "participants": {"alice": {"token_sha256": hash,
                                       "permissions": {"submit": ["infer"]}}},
            "jobs": {"infer": {"mig": {"id": "infer"}}}}}});
    let config = Config::parse(v.to_string().as_bytes()).expect("config");
    let (mut conn, mut mig, mut engines) = bench(&config, t0);
    let held = engines.jobs.held_bytes().clone();
    let mut ctx = engines.ctx(&config);

    let payload = json!({"s": "x".repeat(2_500)});
    let len = payload.to_string().len();
    assert_eq!(len, 2_508);
    let invoke = |n: u32| {
        let mut headers = HeaderMap::new();
        headers
            .insert("Authorization", "Bearer alice-token")
            .expect("header");
        let body = json!({"header": {"tenant_id": "acme", "message_id": format!("m{n}")},
                          "payload": payload});
        Message {
            subject: "mig.v0_1.acme.invoke.infer".into(),
            reply: Some(format!("_INBOX_acme_alice.{n}")),
            headers: Some(headers),
            payload: body.to_string().into_bytes(),
        }
    };
    let backpressure = |mig: &Mig| {
        let mut out = String::new();
        mig.metrics.render(&mut out, 0);
        out.lines()
            .find(|l| l.contains(r#"code="MIG_BACKPRESSURE""#))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    for n in 0..4 {
        mig.on_request(&mut conn, &mut ctx, &invoke(n), t0);
    }
    assert_eq!(mig.invocations.len(), 3, "a fourth payload did not fit");
    assert_eq!(held.held(), 3 * len);
    assert_eq!(backpressure(&mig), 1);

    // Each reads its task record first. One finds its task (a retry of it): it only
    // waits, with the digest, and its bytes come back.
    let reads: Vec<SessionId> = mig
        .staged
        .take()
        .into_iter()
        .filter_map(|(_, Awaiting(p))| match p {
            Pending::Record(s) => Some(s),
            _ => None,
        })
        .collect();
    let [found, new, _] = reads[..] else {
        panic!("record reads: {reads:?}");
    };
    let direct_get = |subject: String, record: Value| {
        let mut h = HeaderMap::new();
        h.insert("Nats-Subject", &subject).expect("header");
        h.insert("Nats-Sequence", "1").expect("header");
        Ok(Message {
            subject: "_INBOX.get".into(),
            reply: None,
            headers: Some(h),
            payload: record.to_string().into_bytes(),
        })
    };
    let task = mig.invocations[&found].task.clone();
    let record = json!({"id": task, "job": "infer", "state": "queued", "attempt": 0,
        "max_attempts": 3, "submitted_by": "acme/alice", "body_sha256": body_digest(&payload)});
    let subject = format!("$KV.AMP_TASK_STATE.acme.{task}");
    mig.record_read(&mut conn, &mut ctx, found, direct_get(subject, record), t0);
    let inv = &mig.invocations[&found];
    assert!(inv.stage == Stage::Waiting && inv.payload.is_none());
    assert_eq!(
        held.held(),
        2 * len,
        "the bytes of a task that exists are held"
    );

    // The other's task is new: the submit takes its payload, and the jobs engine holds
    // the task message (payload and envelope) until the store's create is answered.
    let elsewhere = "$KV.AMP_TASK_STATE.acme.other".to_string();
    mig.record_read(
        &mut conn,
        &mut ctx,
        new,
        direct_get(elsewhere, json!({})),
        t0,
    );
    let inv = &mig.invocations[&new];
    assert!(inv.stage == Stage::Submitting && inv.payload.is_none());
    let engine = held.held() - len;
    assert!(
        engine > len && engine < len + 2_000,
        "the engine holds {engine}"
    );
    let ok = json!({"op": "ok", "re": "submit"}).to_string();
    mig.on_jobs_reply(&mut conn, &mut ctx, new, &ok, t0);
    assert_eq!(mig.invocations[&new].stage, Stage::Waiting);
    // Room for one more again.
    mig.on_request(&mut conn, &mut ctx, &invoke(4), t0);
    assert_eq!(mig.invocations.len(), 4);
    assert_eq!(backpressure(&mig), 1);
}

/// The bucket of taken ids made again: every signed PUBLISH id the replay cache holds is
/// claimed again (a request's id that only this broker saw is not), at most
/// `OUT_AT_ONCE` at a time and a few per step (each hashed as it is sent), and named
/// invokes and PUBLISHes wait until every one is answered and the other brokers have had
/// their second.
#[test]
fn a_bucket_of_taken_ids_made_again_gets_its_ids_back_a_window_at_a_time() {
    let t0 = Instant::now();
    let config = config();
    let (mut conn, mut mig, mut engines) = bench(&config, t0);
    let mut ctx = engines.ctx(&config);
    let wall = mig.wall_ms(t0);
    for n in 0..1500 {
        let id = format!("p{n}");
        let taken = mig
            .auth
            .take_signed("acme", "alice", &id, true, 65_536, t0, wall);
        assert_eq!(taken, Ok(()));
    }
    let invoke = mig
        .auth
        .take_signed("acme", "alice", "i", false, 65_536, t0, wall);
    assert_eq!(invoke, Ok(()));
    assert!(!mig.reclaims.settling(t0));

    let before = conn.pending_requests();
    mig.seen_is(&mut conn, &config, "2026-12-07T16:38:58.1Z", t0);
    let first = conn.pending_requests() - before;
    assert!(
        first <= 64,
        "{first} sent by the step that started the round"
    );
    // Answered one step at a time, each answer the step that sends more.
    let (mut sent, mut answered, mut most_out, mut most_per_step) = (first, 0, first, 0);
    let mut out: Vec<_> = mig.staged.take();
    while let Some((_, awaiting)) = out.pop() {
        assert!(mig.reclaims.settling(t0 + Duration::from_secs(5)));
        let before = conn.pending_requests();
        mig.on_reply(&mut conn, &mut ctx, awaiting, created(), t0);
        answered += 1;
        let now_sent = conn.pending_requests() - before;
        most_per_step = most_per_step.max(now_sent);
        sent += now_sent;
        most_out = most_out.max(sent - answered);
        out.extend(mig.staged.take());
    }
    assert_eq!(sent, 1500, "each PUBLISH's id once, the invoke's not");
    assert!(most_out <= 1024, "{most_out} out at once");
    assert!(most_per_step <= 2, "{most_per_step} sent by one answer");
    assert!(mig.reclaims.settling(t0), "the others' second");
    assert!(!mig.reclaims.settling(t0 + Duration::from_secs(1)));
}

/// A broker hears of a bucket made again up to three ways (its own create's answer, the
/// advisory, a reconnect); each asks which bucket is there, and only one it has not known
/// has its ids claimed again. A check that goes unanswered is asked again a second later.
#[test]
fn the_bucket_of_taken_ids_is_claimed_again_once_per_bucket() {
    let t0 = Instant::now();
    let config = config();
    let clock = Clock::new(t0, 1_800_000_000_000);
    let ids = IdSource::from_seed([7; 32]);
    let mut jobs = Jobs::new("b0", &config, clock, ids.derive("jobs")).expect("jobs");
    let mut rates = RateLimiter::new(16);
    let mut budgets = Budgets::new(BudgetConfig::default());
    let mut in_flight = Tally::default();
    let mut ctx = Ctx {
        config: &config,
        jobs: &mut jobs,
        rates: &mut rates,
        budgets: &mut budgets,
        in_flight: &mut in_flight,
        registry: None,
    };
    let mut options = Options::new("nats://127.0.0.1:4222");
    options.retry_on_failed_connect = true;
    let mut conn = Connection::new(options, t0);
    let mut mig = Mig::new("b0", clock, ids.derive("mig")).expect("mig");
    // At start the bucket there is known, and the ids taken later are in it.
    mig.watch_seen(&mut conn, t0).expect("watching");
    assert_eq!(
        answer(&mut mig, &mut conn, &mut ctx, "2026-12-07T10:00:00Z"),
        0
    );
    assert!(!mig.reclaims.settling(t0));
    let wall = mig.wall_ms(t0);
    for id in ["p1", "p2", "p3"] {
        let taken = mig
            .auth
            .take_signed("acme", "alice", id, true, 64, t0, wall);
        assert_eq!(taken, Ok(()));
    }
    // Made again by this broker: claimed again on its create's answer, not again on the
    // advisory (nor when its check crossed the create).
    mig.on_message(&mut conn, &mut ctx, advisory_sid(&mig), &advisory(), t0);
    mig.seen_is(&mut conn, &config, "2026-12-07T11:00:00Z", t0);
    assert_eq!(
        answer(&mut mig, &mut conn, &mut ctx, "2026-12-07T11:00:00Z"),
        3
    );
    mig.on_message(&mut conn, &mut ctx, advisory_sid(&mig), &advisory(), t0);
    assert_eq!(
        answer(&mut mig, &mut conn, &mut ctx, "2026-12-07T11:00:00Z"),
        0
    );
    // Made again while the connection was down: found at the reconnect.
    mig.after_reconnect(&mut conn, t0);
    assert_eq!(
        answer(&mut mig, &mut conn, &mut ctx, "2026-12-07T12:00:00Z"),
        3
    );
    // A trigger while a check is out asks again once it is answered.
    mig.after_reconnect(&mut conn, t0);
    mig.after_reconnect(&mut conn, t0);
    mig.after_reconnect(&mut conn, t0);
    let out = mig.staged.take();
    assert_eq!(out.len(), 1, "one check out at a time");
    for (_, awaiting) in out {
        let reply = stream_info("2026-12-07T12:00:00Z");
        mig.on_reply(&mut conn, &mut ctx, awaiting, reply, t0);
    }
    assert_eq!(
        answer(&mut mig, &mut conn, &mut ctx, "2026-12-07T13:00:00Z"),
        3
    );
    assert_eq!(mig.staged.take().len(), 0);
    // Unanswered: asked again a second later, by one timer however many fail meanwhile.
    for _ in 0..2 {
        mig.after_reconnect(&mut conn, t0);
        for (_, awaiting) in mig.staged.take() {
            let timed_out = Err(crate::nats::RequestError::Timeout);
            mig.on_reply(&mut conn, &mut ctx, awaiting, timed_out, t0);
        }
    }
    let mut timers = Timers::default();
    timers.file(&mut mig.later, Wake::Mig);
    assert_eq!(timers.armed(), 1);
    let Some((at, Wake::Mig(alarm))) = timers.pop_due(t0 + Duration::from_secs(1)) else {
        panic!("no check asked again");
    };
    assert_eq!(at, t0 + Duration::from_secs(1));
    mig.on_alarm(&mut conn, &mut ctx, alarm, at);
    assert_eq!(
        answer(&mut mig, &mut conn, &mut ctx, "2026-12-07T13:00:00Z"),
        0
    );
}

/// Hands each check out the answer that the bucket there was `created` then: how many
/// re-claims went out meanwhile.
fn answer(mig: &mut Mig, conn: &mut Connection, ctx: &mut Ctx<'_>, created: &str) -> usize {
    let now = Instant::now();
    let mut reclaims = 0;
    for (_, awaiting) in mig.staged.take() {
        match awaiting {
            Awaiting(Pending::SeenCheck) => {
                mig.on_reply(conn, ctx, awaiting, stream_info(created), now)
            }
            Awaiting(Pending::Reclaim(_)) => reclaims += 1,
            _ => panic!("something else was asked"),
        }
    }
    reclaims + mig.staged.take().len()
}

fn stream_info(created: &str) -> Result<Message, crate::nats::RequestError> {
    Ok(Message {
        subject: "_INBOX.x".into(),
        reply: None,
        headers: None,
        payload: json!({"created": created, "config": {}})
            .to_string()
            .into_bytes(),
    })
}

/// The subscription of JetStream's advisory of the bucket's creation.
fn advisory_sid(mig: &Mig) -> crate::nats::Sid {
    mig.subs
        .iter()
        .find(|(_, s)| matches!(s, super::Sub::SeenMade))
        .map(|(sid, _)| *sid)
        .expect("subscribed")
}

/// A key's create answered: stored.
fn created() -> Result<Message, crate::nats::RequestError> {
    Ok(Message {
        subject: "_INBOX.x".to_string(),
        reply: None,
        headers: None,
        payload: br#"{"stream":"KV_AMP_MIG_SEEN","seq":1}"#.to_vec(),
    })
}

fn advisory() -> Message {
    Message {
        subject: super::reclaim::made_advisory(),
        reply: None,
        headers: None,
        payload: br#"{"type":"io.nats.jetstream.advisory.v1.stream_action","action":"create"}"#
            .to_vec(),
    }
}

/// A round of re-claims cut by a connection loss (each failed `Disconnected`) is started
/// again by the reconnect's check. Before, `known` was set to the new bucket when the
/// round started, so the check found it known and the ids stayed free in it.
#[test]
fn a_round_cut_by_a_reconnect_is_claimed_again_at_the_reconnect() {
    let t0 = Instant::now();
    let config = config();
    let (mut conn, mut mig, mut engines) = bench(&config, t0);
    let mut ctx = engines.ctx(&config);
    mig.watch_seen(&mut conn, t0).expect("watching");
    assert_eq!(
        answer(&mut mig, &mut conn, &mut ctx, "2026-12-07T10:00:00Z"),
        0
    );
    let wall = mig.wall_ms(t0);
    for id in ["p1", "p2", "p3"] {
        let taken = mig
            .auth
            .take_signed("acme", "alice", id, true, 64, t0, wall);
        assert_eq!(taken, Ok(()));
    }
    mig.seen_is(&mut conn, &config, "2026-12-07T11:00:00Z", t0);
    let out = mig.staged.take();
    assert_eq!(out.len(), 3);
    for (_, awaiting) in out {
        let lost = Err(crate::nats::RequestError::Disconnected);
        mig.on_reply(&mut conn, &mut ctx, awaiting, lost, t0);
    }
    mig.after_reconnect(&mut conn, t0);
    assert_eq!(
        answer(&mut mig, &mut conn, &mut ctx, "2026-12-07T11:00:00Z"),
        3,
        "the ids whose re-claims went down with the connection"
    );
}

/// Whatever a participant with a NATS credential sends on the MIG request subjects, and
/// whatever comes back from JetStream for it, the front end answers or drops it and goes
/// on: no input path panics (bodies that are no JSON, cut off, not UTF-8, nested past the
/// parser's limit, numbers past every integer type; header fields of every wrong type;
/// credentials of every shape, signed ones included; junk or failed JetStream answers).
/// Requests that need no JetStream are each answered at once.
#[test]
fn hostile_requests_and_answers_are_refused_without_a_panic() {
    use crate::nkeys::{KeyKind, KeyPair};
    use base64::Engine;
    use sha2::{Digest, Sha256};
    let t0 = Instant::now();
    let ann = KeyPair::generate(KeyKind::User).expect("key");
    let hash: String = Sha256::digest(b"alice-token")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let perms = json!({"submit": ["infer"], "publish": ["orders.>"], "subscribe": ["orders.>"]});
    let v = json!({"mig": {"enabled": true}, "limits": {"max_frames_per_s": 1_000_000},
        "namespaces": {"acme": {
            "participants": {"alice": {"token_sha256": hash, "permissions": perms},
                             "ann": {"nkey": ann.public_key(), "permissions": perms}},
            "jobs": {"infer": {"mig": {"id": "infer", "modes": ["unary", "server_stream"]}}}}}});
    let config = Config::parse(v.to_string().as_bytes()).expect("config");
    let (mut conn, mut mig, mut engines) = bench(&config, t0);
    let mut ctx = engines.ctx(&config);
    let wall = mig.wall_ms(t0);
    let ts = crate::rfc3339::format_millis(wall);

    let deep = |open: &str, n: usize| open.repeat(n);
    let mut raw: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        b"\"header\"".to_vec(),
        b"{".to_vec(),
        b"{\"header\":".to_vec(),
        b"{\"header\":{\"tenant_id\":\"acme\"".to_vec(),
        b"\xff\xfe\xfd".to_vec(),
        b"{\"header\":{\"tenant_id\":\"acme\"}}\xff".to_vec(),
        b"{\"header\":{\"tenant_id\":\"ac\xffme\"}}".to_vec(),
        deep("[", 100_000).into_bytes(),
        format!(
            "{{\"header\":{{\"tenant_id\":\"acme\"}},\"payload\":{}",
            deep("{\"a\":", 5_000)
        )
        .into_bytes(),
        format!("{{\"header\":{}}}", deep("[", 10_000)).into_bytes(),
        br#"{"header":{"tenant_id":"acme"},"header":{"tenant_id":"other"}}"#.to_vec(),
        br#"{"header":{"tenant_id":"acme","message_id":"\ud800"}}"#.to_vec(),
        br#"{"header":{"tenant_id":"acme"},"payload":{"n":1e999999}}"#.to_vec(),
        br#"{"header":{"tenant_id":"acme"},"payload":{"n":-1e400}}"#.to_vec(),
    ];
    let shapes = raw.len();
    let header_members = [
        json!({"tenant_id": 7}),
        json!({"tenant_id": ["acme"]}),
        json!({"tenant_id": "acme", "mig_version": 0.1}),
        json!({"tenant_id": "acme", "mig_version": "0.2"}),
        json!({"tenant_id": "acme", "message_id": {"a": 1}}),
        json!({"tenant_id": "acme", "message_id": "\u{0}"}),
        json!({"tenant_id": "acme", "message_id": "\t"}),
        json!({"tenant_id": "acme", "message_id": "𝄞".repeat(128)}),
        json!({"tenant_id": "acme", "message_id": "𝄞".repeat(129)}),
        json!({"tenant_id": "acme", "message_id": "a.b.*.>"}),
        json!({"tenant_id": "acme", "deadline_ms": u64::MAX}),
        json!({"tenant_id": "acme", "deadline_ms": 1e300}),
        json!({"tenant_id": "acme", "deadline_ms": -1}),
        json!({"tenant_id": "acme", "deadline_ms": 0.5}),
        json!({"tenant_id": "acme", "timestamp": "+275760-09-13T00:00:00Z"}),
        json!({"tenant_id": "acme", "timestamp": "9999-12-31T23:59:60.999999999999Z"}),
        json!({"tenant_id": "acme", "timestamp": 12}),
        json!({"tenant_id": "acme", "traceparent": "x".repeat(100_000)}),
        json!({"tenant_id": "acme", "session_id": "s", "idempotency_key": "k", "meta": [1]}),
        json!("acme"),
        json!(null),
    ];
    let members = [
        json!({}),
        json!({"payload": [1, 2]}),
        json!({"payload": {"a": 1}, "capability": 5}),
        json!({"payload": {"a": 1}, "stream_preference": "server_stream"}),
        json!({"payload": {"a": 1}, "stream_preference": ["x"]}),
        json!({"payload": {"a": 1}, "topic": "orders.*"}),
        json!({"payload": {"a": 1}, "key": {"k": 1}}),
        json!({"supported_versions": "0.1", "requested_bindings": [1], "requested_features": [null]}),
        json!({"query": 5, "include_schema_refs": "no", "include_qos": 1}),
        json!({"interval_ms": u64::MAX}),
        json!({"interval_ms": -1e308}),
        json!({"topic": ">", "resume_cursor": "18446744073709551615", "max_inflight": u64::MAX}),
        json!({"topic": "a..b", "resume_cursor": -1, "max_inflight": 0}),
        json!({"topic": 1, "resume_cursor": {"x": 1}}),
        json!({"target_message_id": "other", "reason": "r".repeat(100_000)}),
        json!({"target_message_id": 5, "reason": 5}),
    ];
    for h in &header_members {
        for m in &members {
            let mut body = m.clone();
            body["header"] = h.clone();
            raw.push(body.to_string().into_bytes());
        }
    }
    for m in &members {
        let mut body = m.clone();
        body["header"] = json!({"tenant_id": "acme"});
        raw.push(body.to_string().into_bytes());
    }
    let subjects = [
        "mig.v0_1.acme.hello",
        "mig.v0_1.acme.discover",
        "mig.v0_1.acme.control.heartbeat",
        "mig.v0_1.acme.invoke.infer",
        "mig.v0_1.acme.invoke.no.such.thing",
        "mig.v0_1.acme.events.orders.eu",
        "mig.v0_1.acme.events.orders.*",
        "mig.v0_1.acme.control.subscribe",
        "mig.v0_1.acme.control.cancel.m1",
        "mig.v0_1.acme.control.cancel.*",
        "mig.v0_1.acme.control.nothing",
        "mig.v0_1.other.hello",
    ];
    let credentials = [
        "Bearer alice-token",
        "Bearer alice-token ",
        "Bearer a.b.c",
        "Bearer ..",
        "NKey",
        "NKey UABC",
        "NKey UABC sig",
        "Basic x",
        "",
    ];
    let junk_answers = |n: usize| -> Result<Message, crate::nats::RequestError> {
        let payload: &[u8] = match n % 6 {
            0 => return Err(crate::nats::RequestError::Timeout),
            1 => return Err(crate::nats::RequestError::NoResponders),
            2 => b"",
            3 => b"\xff{",
            4 => br#"{"error":{"code":10071,"err_code":10071,"description":"x"}}"#,
            _ => br#"{"stream":"KV_AMP_MIG_SEEN","seq":18446744073709551615,"message":{"seq":-1,"data":"!!"}}"#,
        };
        Ok(Message {
            subject: "_INBOX.x".into(),
            reply: None,
            headers: None,
            payload: payload.to_vec(),
        })
    };
    let answered = |mig: &Mig| {
        let mut out = String::new();
        mig.metrics.render(&mut out, 0);
        out.lines()
            .filter(|l| l.starts_with("amp_mig_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>()
    };
    let mut n = 0usize;
    let mut signed = 0u64;
    for subject in subjects {
        for (b, body) in raw.iter().enumerate() {
            // Past the bodies that are no object, the headers and members are what
            // differ: Alice's token and Ann's signature carry them past authentication.
            // Ann's signature (an empty credential here) where it matters most: PUBLISH,
            // which takes only a signature, and INVOKE.
            let tried = if b < shapes { credentials.len() } else { 1 };
            let sign = subject.contains(".events.") || subject.ends_with(".invoke.infer");
            for credential in credentials[..tried]
                .iter()
                .map(|c| c.to_string())
                .chain(sign.then(String::new))
            {
                n += 1;
                let mut headers = HeaderMap::new();
                let mut payload = body.clone();
                if credential.is_empty() {
                    // Signed by Ann over a fresh id, whatever else the body holds.
                    signed += 1;
                    let id = format!("s{signed}");
                    let mut b: Value = serde_json::from_slice(body).unwrap_or(json!({}));
                    if !b.is_object() {
                        b = json!({});
                    }
                    if !b["header"].is_object() {
                        b["header"] = json!({});
                    }
                    b["header"]["message_id"] = json!(id);
                    b["header"]["timestamp"] = json!(ts);
                    payload = b.to_string().into_bytes();
                    let text = format!("{id}\n{ts}\n{subject}");
                    let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
                        .encode(ann.sign(text.as_bytes()));
                    let auth = format!("NKey {} {sig}", ann.public_key());
                    headers.insert("Authorization", &auth).expect("header");
                } else {
                    headers
                        .insert("Authorization", &credential)
                        .expect("header");
                }
                // Failures under Alice's prefix would throttle her token: the others
                // name a prefix of their own, each answered within the refusal budget.
                let name = match credential.as_str() {
                    "" => "ann".to_string(),
                    c if c.starts_with("Bearer alice-token") => "alice".to_string(),
                    _ => format!("m{n}"),
                };
                let now = t0 + Duration::from_millis(n as u64);
                let msg = Message {
                    subject: subject.into(),
                    reply: Some(format!("_INBOX_acme_{name}.{n}")),
                    headers: Some(headers),
                    payload,
                };
                let at_once = subject.ends_with(".hello")
                    || subject.ends_with(".discover")
                    || subject.ends_with(".heartbeat");
                let proves = credential.starts_with("Bearer alice-token");
                let checked = at_once && proves && subject.contains(".acme.");
                let before = if checked { answered(&mig) } else { 0 };
                mig.on_request(&mut conn, &mut ctx, &msg, now);
                if checked {
                    assert_eq!(
                        answered(&mig),
                        before + 1,
                        "{subject} {credential:?} {:?}",
                        String::from_utf8_lossy(&msg.payload)
                    );
                }
                for round in 0..4 {
                    let staged = mig.staged.take();
                    if staged.is_empty() {
                        break;
                    }
                    for (k, (_, awaiting)) in staged.into_iter().enumerate() {
                        mig.on_reply(
                            &mut conn,
                            &mut ctx,
                            awaiting,
                            junk_answers(n + k + round),
                            now,
                        );
                    }
                }
            }
        }
    }
    assert!(n > 6_000, "{n} requests");
    // The junk JetStream answers were taken as such: requests that got that far were
    // answered `MIG_UNAVAILABLE`.
    let mut out = String::new();
    mig.metrics.render(&mut out, 0);
    for op in ["invoke", "publish", "subscribe"] {
        let code = format!("op=\"{op}\",");
        assert!(
            out.lines()
                .any(|l| l.contains(&code) && l.contains("code=\"MIG_UNAVAILABLE\"")),
            "no {op} reached JetStream: {out}"
        );
    }
}

/// `mig.max_pending` is each broker's, for every tenant, and one caller holds at most a
/// quarter of it: four callers (retrying one idempotency key each, which spends no
/// budget) held every slot for up to `mig.max_deadline_ms`, and every other caller of
/// every tenant got `MIG_BACKPRESSURE`. A caller now takes a slot only while it holds
/// fewer than are free: four callers taking their fill leave room for a fifth.
#[test]
fn a_few_callers_cannot_take_every_invocation_slot_of_a_broker() {
    use sha2::{Digest, Sha256};
    let t0 = Instant::now();
    let names = ["alice", "bob", "carol", "dave", "erin"];
    let mut participants = Map::new();
    for name in names {
        let hash: String = Sha256::digest(format!("{name}-token").as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        participants.insert(
            name.into(),
            json!({"token_sha256": hash, "permissions": {"submit": ["infer"]}}),
        );
    }
    let v = json!({"mig": {"enabled": true, "max_pending": 8},
        "namespaces": {"acme": {"participants": participants,
            "jobs": {"infer": {"mig": {"id": "infer"}}}}}});
    let config = Config::parse(v.to_string().as_bytes()).expect("config");
    let (mut conn, mut mig, mut engines) = bench(&config, t0);
    let mut ctx = engines.ctx(&config);
    let mut n = 0;
    let mut invoke = |mig: &mut Mig, ctx: &mut Ctx<'_>, name: &str| {
        n += 1;
        let mut headers = HeaderMap::new();
        let auth = format!("Bearer {name}-token");
        headers.insert("Authorization", &auth).expect("header");
        let body = json!({"header": {"tenant_id": "acme"}, "payload": {"n": n}});
        let msg = Message {
            subject: "mig.v0_1.acme.invoke.infer".into(),
            reply: Some(format!("_INBOX_acme_{name}.{n}")),
            headers: Some(headers),
            payload: body.to_string().into_bytes(),
        };
        let before = mig.invocations.len();
        mig.on_request(&mut conn, ctx, &msg, t0);
        mig.invocations.len() > before
    };
    // The first four each take what they may (their quarter, 2, while room lasts).
    for name in &names[..4] {
        while invoke(&mut mig, &mut ctx, name) {}
    }
    assert!(
        invoke(&mut mig, &mut ctx, "erin"),
        "the four took all {} slots",
        mig.invocations.len()
    );
}

/// The message `finish` writes for a result of `result_bytes` to an invocation of `body`
/// (its header's `message_id` is m1), on a connection whose server allows 4096 bytes: its
/// subject and JSON body; and the request metrics rendered.
fn finish_past_max_payload(body: Value, result_bytes: usize) -> (String, Value, String) {
    use crate::proto::{Op, Parsed, Parser, Role};
    let t0 = Instant::now();
    let v = json!({"mig": {"enabled": true}, "namespaces": {"acme": {
        "participants": {"alice": {"token_sha256": "0".repeat(64),
                                   "permissions": {"submit": ["infer"]}}},
        "jobs": {"infer": {"mig": {"id": "infer", "modes": ["unary", "server_stream"]}}}}}});
    let config = Config::parse(v.to_string().as_bytes()).expect("config");
    let (mut conn, mut mig, _engines) = bench(&config, t0);
    assert!(conn.poll_connect(t0).is_some(), "a connection to open");
    conn.on_transport_open(t0);
    conn.receive(
        b"INFO {\"server_id\":\"S\",\"headers\":true,\"max_payload\":4096}\r\nPONG\r\n",
        t0,
    );
    let n = conn.output().len();
    conn.consume_output(n);

    let body: Map<String, Value> = serde_json::from_value(body).expect("body");
    let header = envelope::parse_header(&body, None, || "made".into()).expect("header");
    let participant = config.participant("acme", "alice").expect("alice");
    let r = invoke::Request {
        ns: "acme",
        caller: "alice",
        participant,
        capability: "infer",
        reply: "_INBOX_acme_alice.1",
        header: &header,
        body: &body,
    };
    let accepted = invoke::accept(&config, &r).expect("accepted");
    let session = mig.new_session();
    mig.invocations
        .insert(session, Invocation::new(&r, accepted, unbound(), 1000, t0));
    let result = json!({"capability": "infer", "payload": "x".repeat(result_bytes)});
    mig.finish(&mut conn, session, Ok(result), t0);

    let parser = Parser::new(Role::Server);
    let (subject, answer) = match parser.parse(conn.output()) {
        Ok(Parsed::Complete(
            Op::Hpub {
                subject, payload, ..
            },
            _,
        )) => (
            String::from_utf8_lossy(subject).into_owned(),
            serde_json::from_slice::<Value>(payload).expect("JSON"),
        ),
        other => panic!("no answer to the caller: {other:?}"),
    };
    let mut metrics = String::new();
    mig.metrics.render(&mut metrics, 0);
    (subject, answer, metrics)
}

/// Whether `metrics` counts a request with `code`.
fn counted(metrics: &str, code: &str) -> bool {
    metrics
        .lines()
        .any(|l| l.starts_with("amp_mig_requests_total{") && l.contains(&format!("\"{code}\"")))
}

/// An INVOKE's result past the server's `max_payload` once in its envelope: the reply was
/// refused by the connection, logged ("MIG reply not sent") and counted as `OK`, and the
/// caller waited for its own timeout. It now hears a small `MIG_INVALID_REQUEST`
/// (`amp_code` `too_large`, as an AMP `status` of such a result is refused), counted so.
#[test]
fn a_reply_past_max_payload_answers_a_small_error_instead() {
    let body = json!({"header": {"tenant_id": "acme", "message_id": "m1"}, "payload": {}});
    let (subject, answer, metrics) = finish_past_max_payload(body, 5000);
    assert_eq!(subject, "_INBOX_acme_alice.1");
    assert_eq!(answer["error"]["code"], "MIG_INVALID_REQUEST", "{answer}");
    assert_eq!(
        answer["error"]["details"]["amp_code"], "too_large",
        "{answer}"
    );
    assert_eq!(answer["header"]["message_id"], "m1", "{answer}");
    assert!(counted(&metrics, "MIG_INVALID_REQUEST"), "{metrics}");
    assert!(!counted(&metrics, "OK"), "{metrics}");
}

/// The same for a streaming invoke's terminal frame on its stream subject: it was only
/// logged ("MIG stream frame not sent") and counted `OK`, and the stream never ended.
#[test]
fn a_terminal_stream_frame_past_max_payload_ends_the_stream_with_an_error() {
    let body = json!({"header": {"tenant_id": "acme", "message_id": "m1"}, "payload": {},
        "stream_preference": "server_stream"});
    let (subject, frame, metrics) = finish_past_max_payload(body, 5000);
    assert_eq!(subject, "mig.v0_1.acme.stream.m1");
    assert_eq!(frame["kind"], "error", "{frame}");
    assert_eq!(frame["end_stream"], true, "{frame}");
    assert_eq!(frame["error"]["code"], "MIG_INVALID_REQUEST", "{frame}");
    assert_eq!(
        frame["error"]["details"]["amp_code"], "too_large",
        "{frame}"
    );
    assert!(counted(&metrics, "MIG_INVALID_REQUEST"), "{metrics}");
    assert!(!counted(&metrics, "OK"), "{metrics}");
}
