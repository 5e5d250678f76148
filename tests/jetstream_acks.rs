//! Ack kinds against a real nats-server: +ACK, ack-sync, -NAK with delay, +WPI, +TERM.

mod common;

use std::time::{Duration, Instant};

use amp_broker::jetstream::{
    AckKind, AckMetadata, ConsumerAction, ConsumerConfig, Context, JsError, PublishOptions,
    PullRequest, StreamConfig,
};
use amp_broker::nats::{Client, Message, Options};

fn setup(server: &common::NatsServer, ack_wait: Duration, messages: usize) -> Context {
    let client = Client::connect(Options::new(&server.url())).expect("connect");
    let mut js = Context::new(client).with_timeout(Duration::from_secs(5));
    js.create_stream(&StreamConfig::new("A", &["a"]))
        .expect("stream");
    for i in 0..messages {
        js.publish(
            "a",
            None,
            format!("m{i}").as_bytes(),
            &PublishOptions::default(),
        )
        .expect("publish");
    }
    let mut cfg = ConsumerConfig::durable_pull("C");
    cfg.ack_wait = Some(ack_wait);
    js.create_consumer("A", &cfg, ConsumerAction::Create)
        .expect("consumer");
    js
}

fn fetch(js: &mut Context, batch: u64, expires: Duration) -> Vec<Message> {
    let pull = PullRequest {
        expires: Some(expires),
        ..PullRequest::batch(batch)
    };
    js.fetch("A", "C", &pull, expires + Duration::from_secs(1))
        .expect("fetch")
        .messages
}

fn fetch_now(js: &mut Context) -> Vec<Message> {
    let pull = PullRequest {
        no_wait: true,
        ..PullRequest::batch(10)
    };
    js.fetch("A", "C", &pull, Duration::from_secs(2))
        .expect("fetch")
        .messages
}

fn delivered(msg: &Message) -> u64 {
    AckMetadata::parse(msg.reply.as_deref().expect("reply"))
        .expect("metadata")
        .delivered
}

#[test]
fn ack_sync_is_confirmed_and_clears_the_pending_ack() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, Duration::from_secs(30), 2);
    let msgs = fetch(&mut js, 2, Duration::from_secs(1));
    assert_eq!(msgs.len(), 2);
    assert_eq!(js.consumer_info("A", "C").expect("info").num_ack_pending, 2);
    js.ack_sync(&msgs[0], &AckKind::Ack).expect("ack sync");
    // Confirmed: the server has processed it when ack_sync returns.
    assert_eq!(js.consumer_info("A", "C").expect("info").num_ack_pending, 1);
    js.ack(&msgs[1], &AckKind::Ack).expect("ack");
    assert!(common::wait_until(Duration::from_secs(5), || {
        js.consumer_info("A", "C").expect("info").num_ack_pending == 0
    }));
    let info = js.consumer_info("A", "C").expect("info");
    assert_eq!(info.ack_floor.stream_seq, 2);
    let not_js = Message {
        subject: "x".into(),
        reply: Some("_INBOX.x".into()),
        headers: None,
        payload: Vec::new(),
    };
    assert!(matches!(
        js.ack(&not_js, &AckKind::Ack),
        Err(JsError::Invalid(_))
    ));
}

#[test]
fn nak_with_delay_is_redelivered_after_the_delay() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, Duration::from_secs(30), 1);
    let msgs = fetch(&mut js, 1, Duration::from_secs(1));
    assert_eq!(delivered(&msgs[0]), 1);
    let delay = Duration::from_millis(1500);
    let nak_at = Instant::now();
    js.ack_sync(&msgs[0], &AckKind::Nak { delay: Some(delay) })
        .expect("nak");
    assert!(
        fetch_now(&mut js).is_empty(),
        "redelivered before the delay"
    );
    let again = fetch(&mut js, 1, Duration::from_secs(5));
    assert_eq!(again.len(), 1, "not redelivered");
    assert!(
        nak_at.elapsed() >= Duration::from_millis(1300),
        "{:?}",
        nak_at.elapsed()
    );
    assert_eq!(again[0].payload, b"m0");
    assert_eq!(delivered(&again[0]), 2);
    // A plain NAK redelivers at once.
    js.ack_sync(&again[0], &AckKind::Nak { delay: None })
        .expect("nak");
    let third = fetch(&mut js, 1, Duration::from_secs(1));
    assert_eq!(delivered(&third[0]), 3);
}

#[test]
fn in_progress_extends_the_ack_wait_and_term_stops_redelivery() {
    let server = common::NatsServer::start();
    // Long enough that a loaded machine still sends each +WPI well within it.
    let ack_wait = Duration::from_millis(1500);
    let mut js = setup(&server, ack_wait, 2);
    let msgs = fetch(&mut js, 2, Duration::from_secs(1));
    assert_eq!(msgs.len(), 2);
    js.ack_sync(
        &msgs[1],
        &AckKind::Term {
            reason: Some("cannot parse".into()),
        },
    )
    .expect("term");
    // Keep msgs[0] in progress for well over two ack waits.
    let until = Instant::now() + ack_wait * 2 + ack_wait / 2;
    while Instant::now() < until {
        js.ack_sync(&msgs[0], &AckKind::InProgress).expect("wpi");
        assert!(
            fetch_now(&mut js).is_empty(),
            "redelivered although in progress"
        );
        std::thread::sleep(ack_wait / 6);
    }
    // Without +WPI it comes back after the ack wait; the terminated one never does.
    let back = fetch(&mut js, 1, ack_wait * 3);
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].payload, b"m0");
    assert_eq!(delivered(&back[0]), 2);
    js.ack_sync(&back[0], &AckKind::Ack).expect("ack");
    assert!(fetch(&mut js, 2, ack_wait * 2).is_empty());
    assert_eq!(js.consumer_info("A", "C").expect("info").num_ack_pending, 0);
}

/// `+NXT` acks the message and is itself a pull: the next messages go to its reply
/// subject, and the server ends it with a 408 carrying what it could not deliver.
#[test]
fn ack_next_acks_and_pulls_more_onto_its_reply_subject() {
    let server = common::NatsServer::start();
    let mut js = setup(&server, Duration::from_secs(30), 3);
    let first = fetch(&mut js, 1, Duration::from_secs(1));
    assert_eq!(first.len(), 1);
    let inbox = "_INBOX.ack_next";
    let sid = js.client().subscribe(inbox, None).expect("subscribe");
    let pull = PullRequest {
        expires: Some(Duration::from_millis(500)),
        ..PullRequest::batch(3)
    };
    let ack = first[0].reply.clone().expect("ack subject");
    js.client()
        .publish(&ack, Some(inbox), None, &AckKind::Next { pull }.payload())
        .expect("+NXT");
    let mut got = Vec::new();
    let mut status = None;
    while let Some(m) = js
        .client()
        .next_message(sid, Duration::from_secs(3))
        .expect("next")
    {
        match m.status() {
            None => got.push(String::from_utf8_lossy(&m.payload).into_owned()),
            Some(code) => {
                status = Some((code, m.header("Nats-Pending-Messages").map(str::to_owned)));
                break;
            }
        }
    }
    assert_eq!(got, ["m1", "m2"]);
    assert_eq!(status, Some((408, Some("1".to_string()))));
    let info = js.consumer_info("A", "C").expect("info");
    assert_eq!(info.ack_floor.stream_seq, 1, "the first message was acked");
    assert_eq!(info.num_ack_pending, 2);
}
