//! Task budgets counted in JetStream: two independent broker instances (each its own
//! `Budgets` and its own NATS connection) share one budget through a real nats-server's
//! `AMP_BUDGET` bucket.

mod common;

use amp_broker::broker::budget::{
    BUDGET_BUCKET, Budget, BudgetConfig, Budgets, KvOp, KvOpKind, KvReply, Settled, Spend, bucket,
    budget_key, budget_stream_config,
};
use amp_broker::jetstream::ApiPrefix;
use amp_broker::nats::{Client, Options};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const WAIT: Duration = Duration::from_secs(5);

/// One broker: its budget state and its connection.
struct Broker {
    budgets: Budgets,
    client: Client,
    round_trips: u32,
}

impl Broker {
    fn new(server: &common::NatsServer) -> Broker {
        Broker {
            budgets: Budgets::new(BudgetConfig::default()),
            client: Client::connect(Options::new(&server.url())).expect("connect"),
            round_trips: 0,
        }
    }

    fn send(&mut self, op: &KvOp) -> KvReply {
        self.round_trips += 1;
        let kv = bucket(ApiPrefix::default()).expect("budget bucket");
        let req = op.request(&kv).expect("budget request");
        match self
            .client
            .request(&req.subject, req.headers.as_ref(), &req.payload, WAIT)
        {
            Ok(msg) => match op.kind {
                KvOpKind::Get => {
                    KvReply::from_get(msg.status(), msg.headers.as_ref(), &msg.payload)
                }
                KvOpKind::Write { .. } => KvReply::from_pub_ack(msg.status(), &msg.payload),
            },
            Err(_) => KvReply::Failed,
        }
    }

    /// Drives one submit to a decision, as the broker's loop would.
    fn spend(&mut self, who: &str, budget: Budget, unix_ms: u64) -> Spend {
        loop {
            match self.budgets.try_spend(who, budget, unix_ms) {
                Spend::Wait => {}
                decided => return decided,
            }
            loop {
                let op = self.budgets.poll_op().expect("an operation to send");
                let reply = self.send(&op);
                match self.budgets.on_reply(op.id, reply) {
                    None => continue,
                    Some(Settled::Retry { .. }) => break,
                    Some(Settled::Unavailable { participant }) => {
                        panic!("JetStream unavailable for {participant}")
                    }
                }
            }
        }
    }
}

fn create_bucket(server: &common::NatsServer) {
    let mut c = Client::connect(Options::new(&server.url())).expect("connect");
    let config = budget_stream_config(1);
    assert_eq!(config.name, format!("KV_{BUDGET_BUCKET}"));
    let req = ApiPrefix::new()
        .stream_create(&config)
        .expect("stream name");
    let reply = c
        .request(&req.subject, None, &req.payload, WAIT)
        .expect("stream create");
    let v: serde_json::Value = serde_json::from_slice(&reply.payload).expect("json");
    assert!(v.get("error").is_none(), "{v}");
}

fn stored_count(server: &common::NatsServer, key: &str) -> KvReply {
    let mut c = Client::connect(Options::new(&server.url())).expect("connect");
    let op = KvOp {
        id: 0,
        key: key.to_string(),
        kind: KvOpKind::Get,
    };
    let req = op
        .request(&bucket(ApiPrefix::default()).expect("budget bucket"))
        .expect("budget request");
    let msg = c
        .request(&req.subject, None, &req.payload, WAIT)
        .expect("direct get");
    KvReply::from_get(msg.status(), msg.headers.as_ref(), &msg.payload)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[test]
fn two_brokers_together_admit_exactly_the_budget_and_then_both_refuse() {
    let server = common::NatsServer::start();
    create_bucket(&server);
    let budget = Budget {
        tasks_per_window: 30,
        window_s: 3600,
    };
    // A fixed instant in the middle of a window, so the test never straddles two.
    let at = 1_800_000_000_000 + 1_800_000;
    let mut one = Broker::new(&server);
    let mut two = Broker::new(&server);
    let mut granted = 0;
    for i in 0..100 {
        let b = if i % 2 == 0 { &mut one } else { &mut two };
        match b.spend("acme/a", budget, at) {
            Spend::Granted => granted += 1,
            Spend::Exhausted => {}
            Spend::Wait => unreachable!("spend drives reservations to a decision"),
        }
    }
    let stranded = one.budgets.reserved_left("acme/a") + two.budgets.reserved_left("acme/a");
    assert_eq!(
        granted + stranded,
        30,
        "granted {granted}, stranded {stranded}"
    );
    assert!(granted <= 30);
    assert!(
        granted >= 28,
        "chunks shrink near the end: granted {granted}"
    );
    assert_eq!(one.spend("acme/a", budget, at), Spend::Exhausted);
    assert_eq!(two.spend("acme/a", budget, at), Spend::Exhausted);
    let key = budget_key("acme/a", budget.window_index(at));
    assert!(matches!(
        stored_count(&server, &key),
        KvReply::Current { count: 30, .. }
    ));
    // Far fewer round trips than tasks: chunks.
    assert!(
        one.round_trips + two.round_trips < 30,
        "{} + {}",
        one.round_trips,
        two.round_trips
    );
    // Another participant has its own budget.
    assert_eq!(one.spend("acme/b", budget, at), Spend::Granted);
}

#[test]
fn simultaneous_reservations_conflict_on_the_server_and_the_loser_rereads() {
    let server = common::NatsServer::start();
    create_bucket(&server);
    let budget = Budget {
        tasks_per_window: 100,
        window_s: 3600,
    };
    let at = 1_800_000_000_000;
    let mut one = Broker::new(&server);
    let mut two = Broker::new(&server);
    assert_eq!(one.budgets.try_spend("acme/a", budget, at), Spend::Wait);
    assert_eq!(two.budgets.try_spend("acme/a", budget, at), Spend::Wait);
    // Both read the empty key before either writes.
    let get1 = one.budgets.poll_op().expect("get");
    let get2 = two.budgets.poll_op().expect("get");
    let r1 = one.send(&get1);
    let r2 = two.send(&get2);
    assert_eq!(one.budgets.on_reply(get1.id, r1), None);
    assert_eq!(two.budgets.on_reply(get2.id, r2), None);
    let w1 = one.budgets.poll_op().expect("write");
    let w2 = two.budgets.poll_op().expect("write");
    let r1 = one.send(&w1);
    assert!(matches!(r1, KvReply::Written { .. }), "{r1:?}");
    let r2 = two.send(&w2);
    assert_eq!(
        r2,
        KvReply::Conflict,
        "the server refuses the stale compare-and-set"
    );
    assert!(one.budgets.on_reply(w1.id, r1).is_some());
    assert_eq!(two.budgets.on_reply(w2.id, r2), None);
    let reread = two.budgets.poll_op().expect("reread");
    assert_eq!(reread.kind, KvOpKind::Get);
    let r = two.send(&reread);
    assert_eq!(two.budgets.on_reply(reread.id, r), None);
    let w = two.budgets.poll_op().expect("write again");
    let r = two.send(&w);
    assert!(two.budgets.on_reply(w.id, r).is_some());
    assert_eq!(one.spend("acme/a", budget, at), Spend::Granted);
    assert_eq!(two.spend("acme/a", budget, at), Spend::Granted);
    let key = budget_key("acme/a", budget.window_index(at));
    assert!(matches!(
        stored_count(&server, &key),
        KvReply::Current { count: 20, .. }
    ));
}

#[test]
fn a_crashed_broker_strands_at_most_its_chunk_and_never_causes_overspend() {
    let server = common::NatsServer::start();
    create_bucket(&server);
    let budget = Budget {
        tasks_per_window: 40,
        window_s: 3600,
    };
    let at = 1_800_000_000_000;
    let mut crashed = Broker::new(&server);
    assert_eq!(crashed.spend("acme/a", budget, at), Spend::Granted);
    let held = crashed.budgets.reserved_left("acme/a");
    drop(crashed);
    let mut survivor = Broker::new(&server);
    let mut granted = 0;
    while survivor.spend("acme/a", budget, at) == Spend::Granted {
        granted += 1;
    }
    assert_eq!(held, 9, "a chunk of 10, one spent");
    assert_eq!(
        1 + granted + held,
        40,
        "the crash stranded exactly the unused chunk"
    );
}

#[test]
fn window_counts_expire_with_their_ttl() {
    let server = common::NatsServer::start();
    create_bucket(&server);
    let budget = Budget {
        tasks_per_window: 5,
        window_s: 1,
    };
    let mut b = Broker::new(&server);
    let at = unix_ms();
    assert_eq!(b.spend("acme/a", budget, at), Spend::Granted);
    let key = budget_key("acme/a", budget.window_index(at));
    assert!(matches!(
        stored_count(&server, &key),
        KvReply::Current { count: 3, .. }
    ));
    // Written with `Nats-TTL: 2s`: the key disappears on its own.
    assert!(common::wait_until(Duration::from_secs(6), || {
        stored_count(&server, &key)
            == KvReply::Current {
                revision: 0,
                count: 0,
            }
    }));
}
