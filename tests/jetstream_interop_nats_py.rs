//! Interop with the official Python client, nats-py: headers survive in both directions
//! and KV entries written by one client are read by the other. The Python halves are
//! small scripts in tests/interop/, run with python3 under a deadline.

mod common;

use std::time::Duration;

use amp_broker::jetstream::kv::{KvConfig, KvOperation};
use amp_broker::jetstream::{Context, JsError};
use amp_broker::nats::{Client, HeaderMap, Options};
use base64::Engine;
use common::python::Py;

fn connect(server: &common::NatsServer) -> Context {
    let client = Client::connect(Options::new(&server.url())).expect("connect");
    Context::new(client).with_timeout(Duration::from_secs(5))
}

fn b64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("base64 from python")
}

#[test]
fn headers_published_by_us_arrive_intact_in_nats_py() {
    let server = common::NatsServer::start();
    let url = server.url();
    let py = Py::spawn("sub_headers.py", &[&url, "interop.>", "3"]);
    assert_eq!(py.line(), "READY");
    let mut js = connect(&server);
    let mut h = HeaderMap::new();
    h.insert("X-Origin", "amp-broker").expect("header");
    h.insert("X-Spaces", "a value: with colon and  spaces")
        .expect("header");
    h.insert("Nats-Msg-Id", "rs-1").expect("header");
    let c = js.client();
    c.publish("interop.plain", None, None, b"plain from rust")
        .expect("publish");
    c.publish("interop.h", None, Some(&h), b"\x00\x01binary\xff")
        .expect("publish");
    let mut only = HeaderMap::new();
    only.insert("X-Empty-Body", "yes").expect("header");
    c.publish("interop.empty", None, Some(&only), b"")
        .expect("publish");
    c.flush(Duration::from_secs(5)).expect("flush");
    let got: Vec<serde_json::Value> = (0..3)
        .map(|_| serde_json::from_str(&py.line()).expect("json line"))
        .collect();
    py.finish();
    assert_eq!(got[0]["subject"], "interop.plain");
    assert_eq!(
        b64(got[0]["data"].as_str().expect("data")),
        b"plain from rust"
    );
    assert_eq!(got[0]["headers"], serde_json::json!({}));
    assert_eq!(got[1]["subject"], "interop.h");
    assert_eq!(
        b64(got[1]["data"].as_str().expect("data")),
        b"\x00\x01binary\xff"
    );
    assert_eq!(
        got[1]["headers"],
        serde_json::json!({
            "X-Origin": "amp-broker",
            "X-Spaces": "a value: with colon and  spaces",
            "Nats-Msg-Id": "rs-1"
        })
    );
    assert_eq!(
        got[2]["headers"],
        serde_json::json!({"X-Empty-Body": "yes"})
    );
    assert_eq!(got[2]["data"], "");
}

#[test]
fn headers_published_by_nats_py_arrive_intact_here() {
    let server = common::NatsServer::start();
    let mut client = Client::connect(Options::new(&server.url())).expect("connect");
    let sid = client.subscribe("interop.py", None).expect("sub");
    client.flush(Duration::from_secs(5)).expect("flush");
    let py = Py::spawn("pub_headers.py", &[&server.url(), "interop.py"]);
    let mut got = Vec::new();
    while got.len() < 3 {
        let msg = client
            .next_message(sid, Duration::from_secs(10))
            .expect("next")
            .expect("a message from nats-py");
        got.push(msg);
    }
    py.finish();
    assert_eq!(got[0].payload, b"plain from python");
    assert!(got[0].headers.as_ref().is_none_or(|h| h.is_empty()));
    assert_eq!(got[1].payload, b"\x00\x01binary\xff");
    let h = got[1].headers.as_ref().expect("headers");
    assert_eq!(h.get("X-Origin"), Some("nats-py"));
    assert_eq!(h.get("X-Spaces"), Some("a value: with colon and  spaces"));
    assert_eq!(h.get("Nats-Msg-Id"), Some("py-1"));
    assert_eq!(h.status(), None);
    assert!(got[2].payload.is_empty());
    assert_eq!(got[2].header("X-Empty-Body"), Some("yes"));
}

#[test]
fn kv_entries_written_here_are_read_by_nats_py() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let mut cfg = KvConfig::new("fromrust");
    cfg.history = 5;
    let kv = js.kv_create(&cfg).expect("bucket");
    let rev = js.kv_put(&kv, "greeting", b"hello from rust").expect("put");
    js.kv_put(&kv, "bin", b"\x00\xff").expect("put");
    js.kv_put(&kv, "gone", b"x").expect("put");
    js.kv_delete(&kv, "gone").expect("delete");
    js.kv_put(&kv, "purged", b"x").expect("put");
    js.kv_purge(&kv, "purged").expect("purge");
    let py = Py::spawn(
        "kv.py",
        &[
            &server.url(),
            "read",
            "fromrust",
            "greeting",
            "bin",
            "gone",
            "purged",
            "never",
        ],
    );
    let out: serde_json::Value = serde_json::from_str(&py.line()).expect("json");
    py.finish();
    assert_eq!(
        b64(out["greeting"]["value"].as_str().expect("value")),
        b"hello from rust"
    );
    assert_eq!(out["greeting"]["revision"], rev);
    assert_eq!(
        b64(out["bin"]["value"].as_str().expect("value")),
        b"\x00\xff"
    );
    assert_eq!(out["gone"], "not_found");
    assert_eq!(out["purged"], "not_found");
    assert_eq!(out["never"], "not_found");
    // nats-py's create() sees our key as existing.
    assert_eq!(out["_create_first"], "conflict");
}

#[test]
fn kv_entries_written_by_nats_py_are_read_here() {
    let server = common::NatsServer::start();
    let py = Py::spawn("kv.py", &[&server.url(), "write", "frompy"]);
    let out: serde_json::Value = serde_json::from_str(&py.line()).expect("json");
    py.finish();
    assert_eq!(out["ok"], true);
    let mut js = connect(&server);
    let kv = js.kv_bind("frompy").expect("bind the bucket nats-py made");
    let a = js.kv_get(&kv, "a").expect("a");
    assert_eq!(a.value, b"from python v2");
    let first = js
        .kv_get_revision(&kv, "a", a.revision - 1)
        .expect("a at r1");
    assert_eq!(first.value, b"from python");
    assert_eq!(js.kv_get(&kv, "c").expect("c").value, b"created by python");
    assert_eq!(js.kv_get(&kv, "d").err(), Some(JsError::KeyNotFound));
    assert_eq!(
        js.kv_entry(&kv, "d").expect("marker").operation,
        KvOperation::Delete
    );
    assert_eq!(
        js.kv_entry(&kv, "p").expect("marker").operation,
        KvOperation::Purge
    );
    // CAS on nats-py's revision, and create over its delete marker.
    js.kv_update(&kv, "a", b"from rust", a.revision)
        .expect("update at python's revision");
    js.kv_create_key(&kv, "d", b"recreated", None)
        .expect("create over python's delete");
    assert!(matches!(
        js.kv_create_key(&kv, "c", b"x", None),
        Err(JsError::WrongLastSequence(_))
    ));
}
