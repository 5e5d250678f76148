//! Hostile participants against jobs, ids, the registry and hello: a broker process on a
//! real nats-server, attackers and victims over real WebSockets.

mod common;

use std::time::{Duration, Instant};

use amp_broker::jetstream::Context;
use amp_broker::jetstream::kv::KvOperation;
use amp_broker::nats::{Client as NatsClient, Options};
use common::NatsServer;
use common::amp::{Broker, Client};
use common::jobs::{config, login};
use serde_json::json;

fn jetstream(nats: &NatsServer) -> Context {
    let client = NatsClient::connect(Options::new(&nats.url())).expect("connect");
    Context::new(client).with_timeout(Duration::from_secs(5))
}

/// Messages ever stored in the registry bucket of `acme` (puts and deletes).
fn registry_writes(js: &mut Context) -> u64 {
    js.stream_info("KV_AMP_REGISTRY_acme")
        .map(|i| i.state.last_seq)
        .unwrap_or(0)
}

/// The client's side of the WebSocket closing handshake, then the socket is dropped.
fn close_cleanly(c: Client) {
    let mut ws = c.into_websocket();
    let _ = ws.close(None);
    while ws.read().is_ok() {}
}

#[test]
fn hello_close_churn_leaves_one_registry_refresh_per_participant() {
    // TTL 6 s: the broker refreshes each entry every 2 s.
    let refresh = Duration::from_secs(2);
    let nats = NatsServer::start();
    let mut c = config(&["a"], 30, 5000);
    c["limits"] = json!({"registry_ttl_s": 6});
    let broker = Broker::start(&nats.url(), &c);
    let mut js = jetstream(&nats);

    let cycles = 200;
    let started = Instant::now();
    for _ in 0..cycles {
        close_cleanly(login(&broker, "a"));
    }
    let churn = started.elapsed();
    let stay = login(&broker, "a");
    // Every chain started by the churn has fired at least once by now: those that found
    // the participant present re-armed themselves.
    std::thread::sleep(refresh + Duration::from_millis(500));
    let before = registry_writes(&mut js);
    std::thread::sleep(refresh * 2);
    let puts = registry_writes(&mut js) - before;
    eprintln!(
        "{cycles} hello/close cycles in {churn:?}: {puts} registry writes in two refresh intervals"
    );
    assert!(
        (1..=3).contains(&puts),
        "one refresh per participant per interval: {puts} writes in two intervals"
    );

    // Gone: its delete, and no refresh after it.
    close_cleanly(stay);
    let kv = js.kv_bind("AMP_REGISTRY_acme").expect("registry bucket");
    assert!(
        common::wait_until(Duration::from_secs(5), || js
            .kv_entry(&kv, "a")
            .is_ok_and(|e| e.operation == KvOperation::Delete)),
        "the delete is written"
    );
    let after_delete = registry_writes(&mut js);
    std::thread::sleep(refresh + Duration::from_millis(500));
    assert_eq!(
        registry_writes(&mut js),
        after_delete,
        "no refresh once the last session is gone"
    );
}
