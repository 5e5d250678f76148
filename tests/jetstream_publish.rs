//! Publishing with PubAck against a real nats-server: dedupe, expectations, per-message
//! TTL, many publishes in flight.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use amp_broker::jetstream::{
    Context, JsError, MsgSelector, MsgTtl, PublishOptions, StorageType, StreamConfig,
};
use amp_broker::nats::{Client, HeaderMap, Options};

fn connect(server: &common::NatsServer) -> Context {
    let client = Client::connect(Options::new(&server.url())).expect("connect");
    Context::new(client).with_timeout(Duration::from_secs(5))
}

fn opts() -> PublishOptions {
    PublishOptions::default()
}

#[test]
fn pub_ack_names_stream_and_sequence_and_headers_are_stored() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    js.create_stream(&StreamConfig::new("P", &["p.>"]))
        .expect("stream");
    let mut h = HeaderMap::new();
    h.insert("X-Trace", "abc").expect("header");
    h.append("X-Multi", "1").expect("header");
    h.append("X-Multi", "2").expect("header");
    let ack = js
        .publish("p.a", Some(&h), b"one", &opts())
        .expect("publish");
    assert_eq!(
        (ack.stream.as_str(), ack.seq, ack.duplicate),
        ("P", 1, false)
    );
    let stored = js.get_msg("P", &MsgSelector::Sequence(1)).expect("get");
    let hs = stored.headers.expect("headers");
    assert_eq!(hs.get("X-Trace"), Some("abc"));
    assert_eq!(hs.get_all("X-Multi").collect::<Vec<_>>(), ["1", "2"]);
    assert_eq!(
        js.publish("nostream.x", None, b"", &opts()).err(),
        Some(JsError::NoResponders)
    );
}

#[test]
fn same_msg_id_within_the_window_is_a_duplicate() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    js.create_stream(&StreamConfig::new("P", &["p"]))
        .expect("stream");
    let with_id = PublishOptions {
        msg_id: Some("order-1".into()),
        ..opts()
    };
    let first = js.publish("p", None, b"x", &with_id).expect("first");
    let second = js.publish("p", None, b"x", &with_id).expect("second");
    assert!(!first.duplicate);
    assert!(second.duplicate);
    assert_eq!(first.seq, second.seq);
    assert_eq!(js.stream_info("P").expect("info").state.messages, 1);
}

#[test]
fn expected_stream_and_last_sequences_are_enforced() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    js.create_stream(&StreamConfig::new("P", &["p.>"]))
        .expect("stream");
    let err = js
        .publish(
            "p.a",
            None,
            b"",
            &PublishOptions {
                expected_stream: Some("OTHER".into()),
                ..opts()
            },
        )
        .expect_err("wrong stream");
    assert_eq!(err.err_code(), Some(10060), "{err}");
    js.publish(
        "p.a",
        None,
        b"",
        &PublishOptions {
            expected_stream: Some("P".into()),
            expected_last_sequence: Some(0),
            ..opts()
        },
    )
    .expect("first with expectations");
    match js.publish(
        "p.b",
        None,
        b"",
        &PublishOptions {
            expected_last_sequence: Some(5),
            ..opts()
        },
    ) {
        Err(JsError::WrongLastSequence(e)) => {
            assert_eq!((e.code, e.err_code), (400, 10071));
            assert!(e.description.contains("wrong last sequence"), "{e}");
        }
        other => panic!("expected 10071, got {other:?}"),
    }
    js.publish("p.b", None, b"", &opts()).expect("p.b");
    let subject_seq = |seq| PublishOptions {
        expected_last_subject_sequence: Some(seq),
        ..opts()
    };
    assert!(matches!(
        js.publish("p.a", None, b"", &subject_seq(2)),
        Err(JsError::WrongLastSequence(_))
    ));
    let ack = js
        .publish("p.a", None, b"", &subject_seq(1))
        .expect("subject sequence 1 is p.a's last");
    assert_eq!(ack.seq, 3);
    assert!(matches!(
        js.publish("p.c", None, b"", &subject_seq(1)),
        Err(JsError::WrongLastSequence(_))
    ));
    js.publish("p.c", None, b"", &subject_seq(0))
        .expect("p.c has no message yet");
}

#[test]
fn message_ttl_expires_the_message_and_needs_allow_msg_ttl() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let mut cfg = StreamConfig::new("T", &["t.>"]);
    cfg.storage = Some(StorageType::Memory);
    js.create_stream(&cfg).expect("stream");
    let ttl = PublishOptions {
        ttl: Some(MsgTtl::After(Duration::from_secs(1))),
        ..opts()
    };
    let refused = js
        .publish("t.a", None, b"", &ttl)
        .expect_err("no allow_msg_ttl");
    assert!(refused.api_error().is_some(), "{refused:?}");

    cfg.allow_msg_ttl = Some(true);
    js.update_stream(&cfg).expect("allow msg ttl");
    let short = js
        .publish("t.a", None, b"short", &ttl)
        .expect("ttl publish");
    let kept = js.publish("t.b", None, b"kept", &opts()).expect("publish");
    let forever = PublishOptions {
        ttl: Some(MsgTtl::Never),
        ..opts()
    };
    js.publish("t.c", None, b"never", &forever).expect("never");
    assert!(js.get_msg("T", &MsgSelector::Sequence(short.seq)).is_ok());
    let gone = common::wait_until(Duration::from_secs(5), || {
        matches!(
            js.get_msg("T", &MsgSelector::Sequence(short.seq)),
            Err(JsError::MessageNotFound(_))
        )
    });
    assert!(gone, "the TTL message did not expire");
    assert!(js.get_msg("T", &MsgSelector::Sequence(kept.seq)).is_ok());
    let stored = js
        .get_msg("T", &MsgSelector::LastBySubject("t.c".into()))
        .expect("never");
    assert_eq!(stored.header("Nats-TTL"), Some("never"));
}

#[test]
fn many_publishes_in_flight_are_each_completed_by_their_ack() {
    let server = common::NatsServer::start();
    let mut js = connect(&server);
    let mut cfg = StreamConfig::new("M", &["m"]);
    cfg.storage = Some(StorageType::Memory);
    js.create_stream(&cfg).expect("stream");
    let n = 1000;
    let ids: Vec<_> = (0..n)
        .map(|i| {
            js.publish_async("m", None, format!("{i}").as_bytes(), &opts())
                .expect("publish")
        })
        .collect();
    let mut seqs = HashSet::new();
    // Waited for in reverse order: each ack is matched to its own request.
    for id in ids.into_iter().rev() {
        let ack = js.wait_pub_ack(id).expect("ack");
        assert_eq!(ack.stream, "M");
        assert!(seqs.insert(ack.seq), "sequence {} acked twice", ack.seq);
    }
    assert_eq!(seqs.len(), n);
    assert_eq!(seqs.iter().max(), Some(&(n as u64)));
    let last = js
        .get_msg("M", &MsgSelector::Sequence(n as u64))
        .expect("last");
    assert_eq!(last.payload, format!("{}", n - 1).as_bytes());
}
