//! Stream administration, stored-message reads and API errors against a real nats-server.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use amp_broker::jetstream::{
    ApiPrefix, Context, JsError, MsgSelector, PublishOptions, PurgeRequest, StorageType,
    StreamConfig,
};
use amp_broker::nats::{Client, HeaderMap, Options};

fn connect(url: &str) -> Context {
    let client = Client::connect(Options::new(url)).expect("connect");
    Context::new(client).with_timeout(Duration::from_secs(5))
}

fn publish(js: &mut Context, subject: &str, payload: &[u8]) -> u64 {
    js.publish(subject, None, payload, &PublishOptions::default())
        .expect("publish")
        .seq
}

#[test]
fn account_info_reports_streams_and_api_level() {
    let server = common::NatsServer::start();
    let mut js = connect(&server.url());
    js.create_stream(&StreamConfig::new("A", &["a.>"]))
        .expect("create");
    let info = js.account_info().expect("account info");
    assert_eq!(info.streams, 1);
    assert!(info.api.level >= 1, "{info:?}");
}

#[test]
fn stream_create_info_update_delete_round_trip_the_config() {
    let server = common::NatsServer::start();
    let mut js = connect(&server.url());
    let mut cfg = StreamConfig::new("ORDERS", &["orders.>"]);
    cfg.storage = Some(StorageType::Memory);
    cfg.max_msgs_per_subject = Some(3);
    let created = js.create_stream(&cfg).expect("create");
    assert_eq!(created.config.name, "ORDERS");
    assert_eq!(created.config.storage, Some(StorageType::Memory));
    // Fields this crate does not name come back in `extra` and survive an update.
    assert!(
        created.config.extra.contains_key("compression"),
        "{:?}",
        created.config.extra
    );

    let mut updated = js.stream_info("ORDERS").expect("info").config;
    updated.description = Some("all orders".into());
    updated.subjects.push("refunds.>".into());
    let info = js.update_stream(&updated).expect("update");
    assert_eq!(info.config.description.as_deref(), Some("all orders"));
    assert_eq!(info.config.subjects, vec!["orders.>", "refunds.>"]);
    assert_eq!(info.config.extra, created.config.extra);

    assert!(js.delete_stream("ORDERS").expect("delete"));
    match js.stream_info("ORDERS") {
        Err(JsError::StreamNotFound(e)) => {
            assert_eq!((e.code, e.err_code), (404, 10059));
        }
        other => panic!("expected stream not found, got {other:?}"),
    }
    assert!(matches!(
        js.delete_stream("ORDERS"),
        Err(JsError::StreamNotFound(_))
    ));
}

#[test]
fn creating_a_stream_twice_with_another_config_is_an_api_error_with_its_codes() {
    let server = common::NatsServer::start();
    let mut js = connect(&server.url());
    js.create_stream(&StreamConfig::new("S", &["s.>"]))
        .expect("create");
    let err = js
        .create_stream(&StreamConfig::new("S", &["other.>"]))
        .expect_err("conflict");
    let api = err.api_error().expect("api error").clone();
    assert_eq!(api.err_code, 10058, "{err}");
    assert_eq!(api.code, 400);
    assert!(matches!(err, JsError::Api(_)));
}

#[test]
fn stream_names_and_list_follow_pages_and_filter_by_subject() {
    let server = common::NatsServer::start();
    let mut js = connect(&server.url());
    for i in 0..5 {
        js.create_stream(&StreamConfig::new(&format!("N{i}"), &[&format!("n{i}.>")]))
            .expect("create");
    }
    let mut names = js.stream_names(None).expect("names");
    names.sort();
    assert_eq!(names, vec!["N0", "N1", "N2", "N3", "N4"]);
    assert_eq!(js.stream_names(Some("n3.x")).expect("filtered"), vec!["N3"]);
    let list = js.stream_list().expect("list");
    assert_eq!(list.len(), 5);
    assert!(list.iter().all(|s| s.config.name.starts_with('N')));
}

#[test]
fn purge_by_subject_keep_and_sequence() {
    let server = common::NatsServer::start();
    let mut js = connect(&server.url());
    js.create_stream(&StreamConfig::new("P", &["p.>"]))
        .expect("create");
    for i in 0..10 {
        publish(&mut js, if i % 2 == 0 { "p.even" } else { "p.odd" }, b"x");
    }
    let r = js
        .purge_stream(
            "P",
            &PurgeRequest {
                filter: Some("p.even".into()),
                ..PurgeRequest::default()
            },
        )
        .expect("purge filter");
    assert_eq!(r.purged, 5);
    assert_eq!(js.stream_info("P").expect("info").state.messages, 5);
    let r = js
        .purge_stream(
            "P",
            &PurgeRequest {
                keep: Some(2),
                ..PurgeRequest::default()
            },
        )
        .expect("purge keep");
    assert_eq!(r.purged, 3);
    let state = js.stream_info("P").expect("info").state;
    assert_eq!((state.messages, state.first_seq), (2, 8));
    let r = js
        .purge_stream(
            "P",
            &PurgeRequest {
                seq: Some(10),
                ..PurgeRequest::default()
            },
        )
        .expect("purge below seq");
    assert_eq!(r.purged, 1);
    let r = js
        .purge_stream("P", &PurgeRequest::default())
        .expect("purge all");
    assert_eq!(r.purged, 1);
    assert_eq!(js.stream_info("P").expect("info").state.messages, 0);
}

#[test]
fn msg_get_and_direct_get_by_sequence_last_and_next_by_subject() {
    let server = common::NatsServer::start();
    let mut js = connect(&server.url());
    let mut cfg = StreamConfig::new("G", &["g.>"]);
    cfg.allow_direct = Some(true);
    js.create_stream(&cfg).expect("create");
    let mut h = HeaderMap::new();
    h.insert("X-Kind", "first").expect("header");
    js.publish("g.a", Some(&h), b"a1", &PublishOptions::default())
        .expect("publish");
    publish(&mut js, "g.b", b"b1");
    publish(&mut js, "g.a", b"a2");
    publish(&mut js, "g.b", b"b2");

    for direct in [false, true] {
        let get = |js: &mut Context, which: MsgSelector| {
            if direct {
                js.direct_get("G", &which)
            } else {
                js.get_msg("G", &which)
            }
        };
        let m = get(&mut js, MsgSelector::Sequence(1)).expect("by seq");
        assert_eq!((m.subject.as_str(), m.sequence), ("g.a", 1));
        assert_eq!(m.payload, b"a1");
        assert_eq!(m.header("X-Kind"), Some("first"), "direct={direct}");
        assert!(!m.time.is_empty());
        let m = get(&mut js, MsgSelector::LastBySubject("g.a".into())).expect("last");
        assert_eq!((m.sequence, m.payload.as_slice()), (3, b"a2".as_slice()));
        let m = get(
            &mut js,
            MsgSelector::NextBySubject {
                subject: "g.b".into(),
                from: 3,
            },
        )
        .expect("next");
        assert_eq!((m.sequence, m.payload.as_slice()), (4, b"b2".as_slice()));
        match get(&mut js, MsgSelector::Sequence(99)) {
            Err(JsError::MessageNotFound(e)) => assert_eq!(e.code, 404, "direct={direct}"),
            other => panic!("expected message not found, got {other:?}"),
        }
        match get(&mut js, MsgSelector::LastBySubject("g.none".into())) {
            Err(JsError::MessageNotFound(_)) => {}
            other => panic!("expected message not found, got {other:?}"),
        }
    }
    match js.get_msg("G", &MsgSelector::Sequence(99)) {
        Err(JsError::MessageNotFound(e)) => assert_eq!(e.err_code, 10037),
        other => panic!("expected 10037, got {other:?}"),
    }
}

#[test]
fn message_delete_removes_one_sequence() {
    let server = common::NatsServer::start();
    let mut js = connect(&server.url());
    js.create_stream(&StreamConfig::new("D", &["d"]))
        .expect("create");
    for _ in 0..3 {
        publish(&mut js, "d", b"x");
    }
    assert!(js.delete_msg("D", 2, false).expect("delete"));
    assert!(js.delete_msg("D", 3, true).expect("erase"));
    let info = js.stream_info("D").expect("info");
    assert_eq!(info.state.messages, 1);
    assert!(matches!(
        js.get_msg("D", &MsgSelector::Sequence(2)),
        Err(JsError::MessageNotFound(_))
    ));
    let err = js.delete_msg("D", 2, false).expect_err("already gone");
    assert!(err.api_error().is_some(), "{err:?}");
}

#[test]
fn domain_prefix_reaches_the_domain_api() {
    let hub = common::NatsServer::with_config("jetstream { domain: hub }");
    let client = Client::connect(Options::new(&hub.url())).expect("connect");
    let mut js = Context::new(client).with_api(ApiPrefix::domain("hub").expect("domain"));
    assert_eq!(js.api().as_str(), "$JS.hub.API");
    js.create_stream(&StreamConfig::new("H", &["h.>"]))
        .expect("create via domain prefix");
    let info = js.account_info().expect("info");
    assert_eq!(info.domain.as_deref(), Some("hub"));
    let mut wrong = connect(&hub.url()).with_api(ApiPrefix::domain("elsewhere").expect("domain"));
    wrong = wrong.with_timeout(Duration::from_secs(2));
    assert_eq!(wrong.account_info().err(), Some(JsError::NotEnabled));
}

/// A nats-server without JetStream, killed (by PID) when dropped.
struct PlainServer(Child);

impl Drop for PlainServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_plain_server() -> (PlainServer, u16) {
    let port = common::free_port();
    let child = Command::new(common::nats_server_bin())
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn nats-server without JetStream");
    let ready = common::wait_until(Duration::from_secs(10), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let guard = PlainServer(child);
    assert!(ready, "nats-server without JetStream did not come up");
    (guard, port)
}

#[test]
fn server_without_jetstream_is_not_enabled() {
    let (_server, port) = start_plain_server();
    let mut js = connect(&format!("nats://127.0.0.1:{port}"));
    assert_eq!(js.account_info().err(), Some(JsError::NotEnabled));
}

#[test]
fn account_without_jetstream_is_not_enabled_for_account_10039() {
    let server = common::NatsServer::with_config(
        "accounts {\n  JS: { jetstream: enabled, users: [{user: js, password: js}] }\n  PLAIN: { users: [{user: plain, password: plain}] }\n}\n",
    );
    let url = format!("nats://plain:plain@127.0.0.1:{}", server.port);
    let mut js = connect(&url);
    match js.account_info() {
        Err(JsError::NotEnabledForAccount(e)) => {
            assert_eq!((e.code, e.err_code), (503, 10039));
        }
        other => panic!("expected 10039, got {other:?}"),
    }
    let url = format!("nats://js:js@127.0.0.1:{}", server.port);
    assert!(connect(&url).account_info().is_ok());
}
