//! KV buckets against a real nats-server: create/bind, get/put, create-if-absent,
//! compare-and-set, delete, purge and per-key TTL.

mod common;

use std::time::Duration;

use amp_broker::jetstream::kv::{KvConfig, KvOperation};
use amp_broker::jetstream::{Context, JsError, MsgTtl, StorageType};
use amp_broker::nats::{Client, Options};

fn connect(server: &common::NatsServer) -> Context {
    let client = Client::connect(Options::new(&server.url())).expect("connect");
    Context::new(client).with_timeout(Duration::from_secs(5))
}

#[test]
fn bucket_create_makes_the_kv_stream_and_bind_finds_it() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let mut cfg = KvConfig::new("cfg");
    cfg.history = 3;
    cfg.ttl = Some(Duration::from_secs(3600));
    cfg.storage = StorageType::Memory;
    cfg.limit_marker_ttl = Some(Duration::from_secs(30));
    let kv = js.kv_create(&cfg).expect("bucket");
    assert_eq!(kv.stream(), "KV_cfg");
    let info = js.stream_info("KV_cfg").expect("stream");
    let s = &info.config;
    assert_eq!(s.subjects, vec!["$KV.cfg.>"]);
    assert_eq!(s.max_msgs_per_subject, Some(3));
    assert_eq!(s.max_age, Some(Duration::from_secs(3600)));
    assert_eq!(s.allow_direct, Some(true));
    assert_eq!(s.allow_rollup_hdrs, Some(true));
    assert_eq!(s.deny_delete, Some(true));
    assert_eq!(s.allow_msg_ttl, Some(true));
    assert_eq!(s.subject_delete_marker_ttl, Some(Duration::from_secs(30)));
    // Creating it again with the same config is fine, and so is the config read back.
    js.kv_create(&cfg).expect("same config again");
    let read = KvConfig::from_stream_config(&info.config).expect("bucket config");
    assert_eq!(
        (read.history, read.ttl),
        (3, Some(Duration::from_secs(3600)))
    );
    assert_eq!(read.limit_marker_ttl, Some(Duration::from_secs(30)));
    assert!(!read.extra.is_empty());
    js.kv_create(&read)
        .expect("create from the config read back");
    let bound = js.kv_bind("cfg").expect("bind");
    assert_eq!(bound, kv);
    assert_eq!(js.kv_bind("missing").err(), Some(JsError::BucketNotFound));
    let orphan = amp_broker::jetstream::kv::Kv::new(js.api().clone(), "missing").expect("handle");
    assert_eq!(js.kv_get(&orphan, "k").err(), Some(JsError::BucketNotFound));
    assert_eq!(
        js.kv_put(&orphan, "k", b"v").err(),
        Some(JsError::BucketNotFound)
    );
    assert!(js.kv_delete_bucket("cfg").expect("delete bucket"));
    assert_eq!(
        js.kv_delete_bucket("cfg").err(),
        Some(JsError::BucketNotFound)
    );
}

#[test]
fn put_get_history_and_revisions() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let mut cfg = KvConfig::new("b");
    cfg.history = 5;
    let kv = js.kv_create(&cfg).expect("bucket");
    assert_eq!(js.kv_get(&kv, "user.1").err(), Some(JsError::KeyNotFound));
    let r1 = js.kv_put(&kv, "user.1", b"alice").expect("put");
    let r2 = js.kv_put(&kv, "user.1", b"alice2").expect("put");
    assert!(r2 > r1);
    let e = js.kv_get(&kv, "user.1").expect("get");
    assert_eq!((e.value.as_slice(), e.revision), (b"alice2".as_slice(), r2));
    assert_eq!(e.operation, KvOperation::Put);
    assert_eq!(e.key, "user.1");
    assert!(e.created_nanos > 1_700_000_000_000_000_000);
    let old = js.kv_get_revision(&kv, "user.1", r1).expect("revision");
    assert_eq!(old.value, b"alice");
    js.kv_put(&kv, "other", b"x").expect("put");
    assert_eq!(
        js.kv_get_revision(&kv, "user.1", r2 + 1).err(),
        Some(JsError::KeyNotFound)
    );
    assert!(matches!(
        js.kv_put(&kv, "bad key", b""),
        Err(JsError::Invalid(_))
    ));
}

#[test]
fn create_only_if_absent_conflicts_on_existing_and_succeeds_over_deleted() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let kv = js.kv_create(&KvConfig::new("c")).expect("bucket");
    let r1 = js.kv_create_key(&kv, "k", b"first", None).expect("create");
    match js.kv_create_key(&kv, "k", b"second", None) {
        Err(JsError::WrongLastSequence(e)) => assert_eq!(e.err_code, 10071),
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(js.kv_get(&kv, "k").expect("get").value, b"first");
    js.kv_delete(&kv, "k").expect("delete");
    let r2 = js
        .kv_create_key(&kv, "k", b"again", None)
        .expect("create over a delete marker");
    assert!(r2 > r1);
    js.kv_purge(&kv, "k").expect("purge");
    js.kv_create_key(&kv, "k", b"after purge", None)
        .expect("create over a purge marker");
    assert_eq!(js.kv_get(&kv, "k").expect("get").value, b"after purge");
}

#[test]
fn update_is_compare_and_set_on_the_revision() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let kv = js.kv_create(&KvConfig::new("u")).expect("bucket");
    let r1 = js.kv_put(&kv, "k", b"1").expect("put");
    let r2 = js.kv_update(&kv, "k", b"2", r1).expect("update at r1");
    match js.kv_update(&kv, "k", b"stale", r1) {
        Err(JsError::WrongLastSequence(e)) => {
            assert_eq!((e.code, e.err_code), (400, 10071));
        }
        other => panic!("expected a CAS conflict, got {other:?}"),
    }
    assert_eq!(js.kv_get(&kv, "k").expect("get").value, b"2");
    js.kv_update(&kv, "k", b"3", r2).expect("update at r2");
    assert!(matches!(
        js.kv_update(&kv, "never", b"x", 1),
        Err(JsError::WrongLastSequence(_))
    ));
}

#[test]
fn delete_keeps_history_and_purge_drops_it() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let mut cfg = KvConfig::new("d");
    cfg.history = 10;
    let kv = js.kv_create(&cfg).expect("bucket");
    for v in [b"1", b"2", b"3"] {
        js.kv_put(&kv, "k", v).expect("put");
    }
    js.kv_delete(&kv, "k").expect("delete");
    assert_eq!(js.kv_get(&kv, "k").err(), Some(JsError::KeyNotFound));
    let marker = js.kv_entry(&kv, "k").expect("entry");
    assert_eq!(marker.operation, KvOperation::Delete);
    assert!(marker.value.is_empty());
    assert_eq!(js.stream_info("KV_d").expect("info").state.messages, 4);
    js.kv_put(&kv, "k", b"4").expect("put");
    js.kv_purge(&kv, "k").expect("purge");
    let marker = js.kv_entry(&kv, "k").expect("entry");
    assert_eq!(marker.operation, KvOperation::Purge);
    // Only the purge marker is left of the key's history.
    assert_eq!(js.stream_info("KV_d").expect("info").state.messages, 1);
}

#[test]
fn per_key_ttl_expires_the_key() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let mut cfg = KvConfig::new("t");
    cfg.allow_msg_ttl = true;
    let kv = js.kv_create(&cfg).expect("bucket");
    js.kv_put_ttl(&kv, "session", b"s1", MsgTtl::After(Duration::from_secs(1)))
        .expect("put with ttl");
    js.kv_create_key(
        &kv,
        "lock",
        b"l1",
        Some(MsgTtl::After(Duration::from_secs(1))),
    )
    .expect("create with ttl");
    js.kv_put(&kv, "stays", b"x").expect("put");
    assert_eq!(js.kv_get(&kv, "session").expect("get").value, b"s1");
    let expired = common::wait_until(Duration::from_secs(5), || {
        js.kv_get(&kv, "session").err() == Some(JsError::KeyNotFound)
            && js.kv_get(&kv, "lock").err() == Some(JsError::KeyNotFound)
    });
    assert!(expired, "keys with a TTL did not expire");
    assert_eq!(js.kv_get(&kv, "stays").expect("get").value, b"x");
    // An expired lock can be taken again.
    js.kv_create_key(&kv, "lock", b"l2", None)
        .expect("create after expiry");
}
