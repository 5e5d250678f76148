//! The front end driven directly, where a JetStream answer's timing matters: on a
//! connection that is not connected, so requests wait in its reconnect buffer and no
//! answer comes unless a test hands one in.

use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::invoke::{self, Invocation};
use super::{Alarm, Ctx, Mig, envelope};
use crate::broker::budget::{BudgetConfig, Budgets};
use crate::broker::clock::Clock;
use crate::broker::config::Config;
use crate::broker::ids::IdSource;
use crate::broker::jobs::Jobs;
use crate::broker::rate_limit::RateLimiter;
use crate::nats::{Connection, Options};

fn config() -> Config {
    let v = json!({"mig": {"enabled": true}, "namespaces": {"acme": {
        "participants": {"alice": {"token_sha256": "0".repeat(64),
                                   "permissions": {"submit": ["infer"]}}},
        "jobs": {"infer": {"mig": {"id": "infer"}}}}}});
    Config::parse(v.to_string().as_bytes()).expect("config")
}

/// The deadline of an invocation passed while the task store's create of its task was
/// still out: the cancel was sent at once, found no task (`not_found`), and the task
/// was then created and ran with nobody waiting for it. The cancel now waits for the
/// submit's answer.
#[test]
fn a_deadline_during_the_submit_cancels_the_task_once_it_exists() {
    let t0 = Instant::now();
    let config = config();
    let clock = Clock::new(t0, 1_800_000_000_000);
    let ids = IdSource::from_seed([7; 32]);
    let mut jobs = Jobs::new("b0", &config, clock, ids.derive("jobs")).expect("jobs");
    let mut rates = RateLimiter::new(16);
    let mut budgets = Budgets::new(BudgetConfig::default());
    let mut ctx = Ctx {
        config: &config,
        jobs: &mut jobs,
        rates: &mut rates,
        budgets: &mut budgets,
        registry: None,
    };
    let mut options = Options::new("nats://127.0.0.1:4222");
    options.retry_on_failed_connect = true;
    let mut conn = Connection::new(options, t0);
    let mut mig = Mig::new("b0", clock, ids.derive("mig")).expect("mig");

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
    let inv = Invocation::new(&r, accepted, 1000, t0);
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
    let inv = Invocation::new(&r, invoke::accept(&config, &r).expect("accepted"), 1000, t0);
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
