//! Consumers (2.9+ create API), pull requests and their statuses, push delivery and
//! flow control, against a real nats-server.

mod common;

use std::time::Duration;

use amp_broker::jetstream::{
    AckMetadata, AckPolicy, ConsumerAction, ConsumerConfig, Context, Delivery, Inbound, JsError,
    PublishOptions, PullRequest, StorageType, StreamConfig, classify,
};
use amp_broker::nats::{Client, Options};

fn connect(url: &str) -> Context {
    let client = Client::connect(Options::new(url)).expect("connect");
    Context::new(client).with_timeout(Duration::from_secs(5))
}

fn setup(server: &common::NatsServer, messages: usize) -> Context {
    let mut js = connect(&server.url());
    js.create_stream(&StreamConfig::new("S", &["s.>"]))
        .expect("stream");
    for i in 0..messages {
        js.publish(
            &format!("s.{}", i % 2),
            None,
            format!("m{i}").as_bytes(),
            &PublishOptions::default(),
        )
        .expect("publish");
    }
    js
}

#[test]
fn durable_consumer_create_update_info_names_delete() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, 3);
    let mut cfg = ConsumerConfig::durable_pull("D");
    cfg.filter_subject = Some("s.0".into());
    let info = js
        .create_consumer("S", &cfg, ConsumerAction::Create)
        .expect("create");
    assert_eq!(info.name, "D");
    assert_eq!(info.config.durable_name.as_deref(), Some("D"));
    assert_eq!(info.num_pending, 2);
    // The same config again is accepted; another config with `create` is refused.
    js.create_consumer("S", &cfg, ConsumerAction::Create)
        .expect("idempotent create");
    let mut changed = cfg.clone();
    changed.description = Some("changed".into());
    let err = js
        .create_consumer("S", &changed, ConsumerAction::Create)
        .expect_err("exists");
    assert_eq!(err.err_code(), Some(10148), "{err}");
    let info = js
        .create_consumer("S", &changed, ConsumerAction::Update)
        .expect("update");
    assert_eq!(info.config.description.as_deref(), Some("changed"));
    let err = js
        .create_consumer(
            "S",
            &ConsumerConfig::durable_pull("MISSING"),
            ConsumerAction::Update,
        )
        .expect_err("update of a missing consumer");
    assert_eq!(err.err_code(), Some(10149), "{err}");

    // A consumer read back can be sent again unchanged (unknown fields round-trip).
    let read = js.consumer_info("S", "D").expect("info").config;
    js.create_consumer("S", &read, ConsumerAction::Update)
        .expect("update with the config read back");

    let eph = js
        .create_consumer(
            "S",
            &ConsumerConfig {
                ack_policy: Some(AckPolicy::None),
                ..ConsumerConfig::default()
            },
            ConsumerAction::Create,
        )
        .expect("ephemeral");
    assert!(!eph.name.is_empty());
    assert!(eph.config.durable_name.is_none());
    let mut names = js.consumer_names("S").expect("names");
    names.sort();
    let mut expected = vec!["D".to_string(), eph.name.clone()];
    expected.sort();
    assert_eq!(names, expected);

    assert!(js.delete_consumer("S", "D").expect("delete"));
    match js.consumer_info("S", "D") {
        Err(JsError::ConsumerNotFound(e)) => assert_eq!((e.code, e.err_code), (404, 10014)),
        other => panic!("expected consumer not found, got {other:?}"),
    }
    assert!(matches!(
        js.create_consumer("NOPE", &cfg, ConsumerAction::Create),
        Err(JsError::StreamNotFound(_))
    ));
}

#[test]
fn pull_fetches_a_batch_with_ack_metadata() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, 5);
    js.create_consumer(
        "S",
        &ConsumerConfig::durable_pull("P"),
        ConsumerAction::Create,
    )
    .expect("consumer");
    let pull = PullRequest {
        expires: Some(Duration::from_secs(2)),
        ..PullRequest::batch(3)
    };
    let got = js
        .fetch("S", "P", &pull, Duration::from_secs(3))
        .expect("fetch");
    assert_eq!(got.messages.len(), 3);
    assert_eq!(got.end, None);
    let payloads: Vec<&[u8]> = got.messages.iter().map(|m| m.payload.as_slice()).collect();
    assert_eq!(payloads, [b"m0".as_slice(), b"m1", b"m2"]);
    let reply = got.messages[2].reply.as_deref().expect("ack reply");
    let meta = AckMetadata::parse(reply).expect("metadata");
    assert_eq!((meta.stream, meta.consumer), ("S", "P"));
    assert_eq!(meta.delivered, 1);
    assert_eq!((meta.stream_sequence, meta.consumer_sequence), (3, 3));
    assert_eq!(meta.pending, 2);
    assert!(meta.timestamp_nanos > 1_700_000_000_000_000_000);
}

#[test]
fn no_wait_pull_on_an_empty_consumer_gets_404() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, 0);
    js.create_consumer(
        "S",
        &ConsumerConfig::durable_pull("P"),
        ConsumerAction::Create,
    )
    .expect("consumer");
    let pull = PullRequest {
        no_wait: true,
        ..PullRequest::batch(5)
    };
    let got = js
        .fetch("S", "P", &pull, Duration::from_secs(3))
        .expect("fetch");
    assert!(got.messages.is_empty());
    assert_eq!(got.end.map(|e| e.0), Some(404));
}

#[test]
fn expired_pull_gets_408_after_idle_heartbeats() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, 0);
    js.create_consumer(
        "S",
        &ConsumerConfig::durable_pull("P"),
        ConsumerAction::Create,
    )
    .expect("consumer");
    let pull = PullRequest {
        expires: Some(Duration::from_millis(1600)),
        idle_heartbeat: Some(Duration::from_millis(300)),
        ..PullRequest::batch(5)
    };
    let got = js
        .fetch("S", "P", &pull, Duration::from_secs(5))
        .expect("fetch");
    assert!(got.messages.is_empty());
    let (code, description) = got.end.expect("a status ended the pull");
    assert_eq!(code, 408, "{description}");
    assert!(got.heartbeats >= 2, "heartbeats: {}", got.heartbeats);
}

#[test]
fn message_over_max_bytes_ends_the_pull_with_409() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, 0);
    js.publish("s.big", None, &[b'x'; 2000], &PublishOptions::default())
        .expect("publish");
    js.create_consumer(
        "S",
        &ConsumerConfig::durable_pull("P"),
        ConsumerAction::Create,
    )
    .expect("consumer");
    let pull = PullRequest {
        expires: Some(Duration::from_secs(2)),
        max_bytes: Some(100),
        ..PullRequest::batch(5)
    };
    let got = js
        .fetch("S", "P", &pull, Duration::from_secs(3))
        .expect("fetch");
    let (code, description) = got.end.expect("409");
    assert_eq!(code, 409);
    assert_eq!(description, "Message Size Exceeds MaxBytes");
}

#[test]
fn a_pull_whose_max_bytes_are_used_up_exactly_ends_without_a_status() {
    // The broker's paced pulls count each delivery as the server does
    // (`Message::pulled_size`): a pull whose bytes are used up exactly ends silently,
    // and only that count tells the broker to pull again.
    let server = common::NatsServer::start();
    let mut js = setup(&server, 0);
    for i in 0..3 {
        let opts = PublishOptions {
            msg_id: Some(format!("id-{i}")),
            ..PublishOptions::default()
        };
        js.publish("s.sized", None, &[b'x'; 700], &opts)
            .expect("publish");
    }
    // Two consumers whose deliveries' ack replies are as long as each other's.
    for name in ["P1", "P2"] {
        js.create_consumer(
            "S",
            &ConsumerConfig::durable_pull(name),
            ConsumerAction::Create,
        )
        .expect("consumer");
    }
    let all = js
        .fetch("S", "P1", &PullRequest::batch(3), Duration::from_secs(3))
        .expect("fetch");
    assert_eq!(all.messages.len(), 3);
    assert!(all.messages.iter().all(|m| m.headers.is_some()));
    let size: usize = all.messages.iter().map(|m| m.pulled_size()).sum();
    let pull = PullRequest {
        expires: Some(Duration::from_millis(1500)),
        max_bytes: Some(size as u64),
        ..PullRequest::batch(10)
    };
    let got = js
        .fetch("S", "P2", &pull, Duration::from_millis(2500))
        .expect("fetch");
    // One byte short of the server's count: a 409 after two. One over: the pull waits
    // for more and expires (408).
    assert_eq!(
        (got.messages.len(), got.end),
        (3, None),
        "counted {size} bytes"
    );
}

#[test]
fn deleting_the_consumer_ends_a_waiting_pull_with_409_consumer_deleted() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, 0);
    js.create_consumer(
        "S",
        &ConsumerConfig::durable_pull("P"),
        ConsumerAction::Create,
    )
    .expect("consumer");
    let inbox = js.client().connection_mut().new_inbox();
    let sid = js.client().subscribe(&inbox, None).expect("sub");
    let req = js
        .api()
        .pull_next(
            "S",
            "P",
            &PullRequest {
                expires: Some(Duration::from_secs(10)),
                ..PullRequest::batch(1)
            },
        )
        .expect("req");
    js.client()
        .publish(&req.subject, Some(&inbox), None, &req.payload)
        .expect("pull");
    // The pull is registered once the consumer counts it as waiting.
    assert!(common::wait_until(Duration::from_secs(5), || {
        js.consumer_info("S", "P").expect("info").num_waiting == 1
    }));
    js.delete_consumer("S", "P").expect("delete");
    let msg = js
        .client()
        .next_message(sid, Duration::from_secs(5))
        .expect("next")
        .expect("a status");
    match classify(&Delivery::from(&msg)) {
        Inbound::Conflict { description } => assert_eq!(description, "Consumer Deleted"),
        other => panic!("expected 409, got {other:?}"),
    }
}

#[test]
fn push_consumer_delivers_and_asks_for_flow_control() {
    let server = common::NatsServer::start();
    let mut js = connect(&server.url());
    let mut cfg = StreamConfig::new("F", &["f"]);
    cfg.storage = Some(StorageType::Memory);
    js.create_stream(&cfg).expect("stream");
    let chunk = vec![b'z'; 64 * 1024];
    let count = 96;
    for _ in 0..count {
        js.publish("f", None, &chunk, &PublishOptions::default())
            .expect("publish");
    }
    let deliver = js.client().connection_mut().new_inbox();
    let sid = js.client().subscribe(&deliver, None).expect("sub");
    let mut cc = ConsumerConfig::durable_push("PUSH", &deliver);
    cc.ack_policy = Some(AckPolicy::None);
    cc.flow_control = Some(true);
    cc.idle_heartbeat = Some(Duration::from_secs(1));
    js.create_consumer("F", &cc, ConsumerAction::Create)
        .expect("push consumer");
    let (mut data, mut flow_controls) = (0, 0);
    while data < count {
        let msg = js
            .client()
            .next_message(sid, Duration::from_secs(5))
            .expect("next")
            .unwrap_or_else(|| panic!("stalled after {data} messages"));
        match classify(&Delivery::from(&msg)) {
            Inbound::Message => {
                assert_eq!(msg.payload.len(), chunk.len());
                data += 1;
            }
            Inbound::FlowControl { reply } => {
                flow_controls += 1;
                let reply = reply.to_string();
                js.client().publish(&reply, None, None, b"").expect("fc");
            }
            Inbound::IdleHeartbeat { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(flow_controls >= 1, "no flow control request seen");
}
