//! KV watch (an ordered push consumer driven by `KvWatcher`) against a real nats-server:
//! initial values, live changes, TTL expiry markers, filters and self-reset.

mod common;

use std::time::{Duration, Instant};

use amp_broker::jetstream::kv::{
    Kv, KvConfig, KvEntry, KvOperation, MarkerReason, WatchEvent, WatchOptions,
};
use amp_broker::jetstream::{BlockingWatch, Context, MsgTtl, StorageType};
use amp_broker::nats::{Client, Options};

fn connect(server: &common::NatsServer) -> Context {
    let client = Client::connect(Options::new(&server.url())).expect("connect");
    Context::new(client).with_timeout(Duration::from_secs(5))
}

fn bucket(js: &mut Context, name: &str) -> Kv {
    let mut cfg = KvConfig::new(name);
    cfg.history = 10;
    cfg.storage = StorageType::Memory;
    js.kv_create(&cfg).expect("bucket")
}

/// Events until `n` entries have been seen (other events included), or the timeout.
fn entries(
    w: &mut BlockingWatch,
    js: &mut Context,
    n: usize,
    timeout: Duration,
) -> (Vec<KvEntry>, Vec<WatchEvent>) {
    let deadline = Instant::now() + timeout;
    let (mut got, mut other) = (Vec::new(), Vec::new());
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match w.next(js, left).expect("watch") {
            Some(WatchEvent::Entry(e)) => got.push(e),
            Some(e) => other.push(e),
            None => break,
        }
    }
    (got, other)
}

#[test]
fn watch_reports_latest_values_then_done_then_live_changes() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let kv = bucket(&mut js, "w");
    js.kv_put(&kv, "a", b"a1").expect("put");
    js.kv_put(&kv, "a", b"a2").expect("put");
    js.kv_put(&kv, "b", b"b1").expect("put");
    let mut w = js.kv_watch(&kv, WatchOptions::default()).expect("watch");
    let (initial, _) = entries(&mut w, &mut js, 2, Duration::from_secs(5));
    let values: Vec<(&str, &[u8])> = initial
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_slice()))
        .collect();
    assert_eq!(values, [("a", b"a2".as_slice()), ("b", b"b1".as_slice())]);
    assert_eq!(
        w.next(&mut js, Duration::from_secs(5)).expect("watch"),
        Some(WatchEvent::InitialValuesDone)
    );

    js.kv_put(&kv, "c", b"c1").expect("put");
    js.kv_delete(&kv, "a").expect("delete");
    js.kv_purge(&kv, "b").expect("purge");
    let (live, other) = entries(&mut w, &mut js, 3, Duration::from_secs(5));
    assert!(other.is_empty(), "{other:?}");
    let ops: Vec<(&str, KvOperation)> =
        live.iter().map(|e| (e.key.as_str(), e.operation)).collect();
    assert_eq!(
        ops,
        [
            ("c", KvOperation::Put),
            ("a", KvOperation::Delete),
            ("b", KvOperation::Purge)
        ]
    );
    assert!(live.windows(2).all(|p| p[0].revision < p[1].revision));
    assert_eq!(w.watcher().last_revision(), live[2].revision);
    w.stop(&mut js).expect("stop");
    assert!(js.consumer_names("KV_w").expect("names").is_empty());
}

#[test]
fn watch_of_an_empty_bucket_is_done_at_once() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let kv = bucket(&mut js, "e");
    let mut w = js.kv_watch(&kv, WatchOptions::default()).expect("watch");
    assert_eq!(
        w.next(&mut js, Duration::from_secs(5)).expect("watch"),
        Some(WatchEvent::InitialValuesDone)
    );
    js.kv_put(&kv, "x", b"1").expect("put");
    let (got, _) = entries(&mut w, &mut js, 1, Duration::from_secs(5));
    assert_eq!(got[0].key, "x");
}

#[test]
fn watch_with_history_filter_and_updates_only() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let kv = bucket(&mut js, "h");
    js.kv_put(&kv, "user.1", b"v1").expect("put");
    js.kv_put(&kv, "user.1", b"v2").expect("put");
    js.kv_put(&kv, "order.1", b"o").expect("put");
    let history = WatchOptions {
        include_history: true,
        keys: vec!["user.*".into()],
        ..WatchOptions::default()
    };
    let mut w = js.kv_watch(&kv, history).expect("watch");
    let (got, _) = entries(&mut w, &mut js, 2, Duration::from_secs(5));
    let values: Vec<&[u8]> = got.iter().map(|e| e.value.as_slice()).collect();
    assert_eq!(values, [b"v1".as_slice(), b"v2"]);

    let updates = WatchOptions {
        updates_only: true,
        ..WatchOptions::default()
    };
    let mut u = js.kv_watch(&kv, updates).expect("watch");
    assert_eq!(
        u.next(&mut js, Duration::from_secs(5)).expect("watch"),
        Some(WatchEvent::InitialValuesDone)
    );
    // Wait until the consumer exists before writing, so the write is an update to it.
    assert!(common::wait_until(Duration::from_secs(5), || {
        js.consumer_names("KV_h").expect("names").len() == 2
    }));
    js.kv_put(&kv, "order.2", b"new").expect("put");
    let (got, _) = entries(&mut u, &mut js, 1, Duration::from_secs(5));
    assert_eq!(got[0].key, "order.2");
}

#[test]
fn per_key_ttl_expiry_is_seen_by_a_watcher_as_a_max_age_marker() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let mut cfg = KvConfig::new("ttl");
    cfg.limit_marker_ttl = Some(Duration::from_secs(5));
    let kv = js.kv_create(&cfg).expect("bucket");
    let mut w = js.kv_watch(&kv, WatchOptions::default()).expect("watch");
    assert_eq!(
        w.next(&mut js, Duration::from_secs(5)).expect("watch"),
        Some(WatchEvent::InitialValuesDone)
    );
    let put_at = Instant::now();
    js.kv_put_ttl(&kv, "session", b"s", MsgTtl::After(Duration::from_secs(1)))
        .expect("put with ttl");
    let (got, _) = entries(&mut w, &mut js, 2, Duration::from_secs(8));
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].operation, KvOperation::Put);
    let marker = &got[1];
    assert_eq!(marker.key, "session");
    assert_eq!(marker.operation, KvOperation::Purge);
    assert_eq!(marker.marker, Some(MarkerReason::MaxAge));
    assert!(put_at.elapsed() >= Duration::from_millis(900));
    assert_eq!(
        js.kv_get(&kv, "session").err(),
        Some(amp_broker::jetstream::JsError::KeyNotFound)
    );
}

#[test]
fn watcher_whose_consumer_vanishes_resets_from_its_last_revision_without_loss() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let kv = bucket(&mut js, "r");
    for i in 0..3 {
        js.kv_put(&kv, &format!("k{i}"), b"before").expect("put");
    }
    let options = WatchOptions {
        idle_heartbeat: Duration::from_millis(300),
        ..WatchOptions::default()
    };
    let mut w = js.kv_watch(&kv, options).expect("watch");
    let (first, _) = entries(&mut w, &mut js, 3, Duration::from_secs(5));
    assert_eq!(first.len(), 3);
    let consumer = w.watcher().consumer_name().to_string();
    js.delete_consumer("KV_r", &consumer)
        .expect("delete the watch consumer");
    // Written while the watch has no consumer.
    for i in 0..3 {
        js.kv_put(&kv, &format!("k{i}"), b"during").expect("put");
    }
    let (after, other) = entries(&mut w, &mut js, 3, Duration::from_secs(10));
    assert!(
        other.iter().any(|e| matches!(e, WatchEvent::Reset { .. })),
        "{other:?}"
    );
    assert!(w.watcher().resets() >= 1);
    assert_ne!(w.watcher().consumer_name(), consumer);
    let got: Vec<(&str, &[u8])> = after
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_slice()))
        .collect();
    assert_eq!(
        got,
        [
            ("k0", b"during".as_slice()),
            ("k1", b"during".as_slice()),
            ("k2", b"during".as_slice())
        ]
    );
    assert_eq!(after[0].revision, first[2].revision + 1);
    // And it keeps going.
    js.kv_put(&kv, "k9", b"later").expect("put");
    let (later, _) = entries(&mut w, &mut js, 1, Duration::from_secs(5));
    assert_eq!(later[0].key, "k9");
}

#[test]
fn a_resync_watch_resumes_after_a_short_absence_unless_the_stream_lost_what_came_after() {
    // A resync watch read every key again at each start over; within the bucket's
    // message lifetime it resumes after its last revision, and reads again only when
    // the server cannot start it there.
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let kv = bucket(&mut js, "s");
    js.kv_put(&kv, "a", b"1").expect("put");
    js.kv_put(&kv, "b", b"1").expect("put");
    let options = WatchOptions {
        resync: true,
        resume_within_lifetime: Some(Duration::from_secs(3600)),
        ..WatchOptions::default()
    };
    let mut w = js.kv_watch(&kv, options).expect("watch");
    let (first, _) = entries(&mut w, &mut js, 2, Duration::from_secs(5));
    assert_eq!(first.len(), 2);
    assert_eq!(
        w.next(&mut js, Duration::from_secs(5)).expect("watch"),
        Some(WatchEvent::InitialValuesDone)
    );
    js.kv_put(&kv, "c", b"1").expect("put");
    w.restart("away for a moment");
    let (resumed, other) = entries(&mut w, &mut js, 1, Duration::from_secs(5));
    let keys: Vec<&str> = resumed.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["c"], "{other:?}");
    assert!(!other.contains(&WatchEvent::Resync), "{other:?}");
    assert_eq!(w.watcher().resyncs(), 1);
    // What came after the last revision seen is gone from the stream: read again.
    js.kv_put(&kv, "d", b"1").expect("put");
    js.purge_stream("KV_s", &Default::default()).expect("purge");
    w.restart("away for a moment");
    let mut other = Vec::new();
    while let Some(e) = w.next(&mut js, Duration::from_secs(5)).expect("watch") {
        let done = e == WatchEvent::InitialValuesDone;
        other.push(e);
        if done {
            break;
        }
    }
    assert!(other.contains(&WatchEvent::Resync), "{other:?}");
    assert_eq!(other.last(), Some(&WatchEvent::InitialValuesDone));
    assert_eq!(w.watcher().resyncs(), 2);
}
