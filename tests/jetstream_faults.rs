//! JetStream across a server restart: publishes that got a PubAck survive it, publishes
//! in flight end with an error instead of hanging, and work resumes after reconnect.

mod common;

use std::time::{Duration, Instant};

use amp_broker::jetstream::{
    Context, JsError, MsgSelector, PublishOptions, StorageType, StreamConfig,
};
use amp_broker::nats::{Client, Options};

#[test]
fn server_restart_mid_stream_keeps_every_acked_publish_and_fails_the_rest_clearly() {
    let mut server = common::NatsServer::start();
    let client = Client::connect(Options::new(&server.url())).expect("connect");
    let mut js = Context::new(client).with_timeout(Duration::from_secs(3));
    let mut cfg = StreamConfig::new("DUR", &["dur"]);
    cfg.storage = Some(StorageType::File);
    js.create_stream(&cfg).expect("stream");

    let total = 2000u64;
    let ids: Vec<_> = (0..total)
        .map(|i| {
            let opts = PublishOptions {
                msg_id: Some(format!("m{i}")),
                ..PublishOptions::default()
            };
            js.publish_async("dur", None, format!("{i}").as_bytes(), &opts)
                .expect("publish")
        })
        .collect();
    let mut acked = Vec::new();
    let mut failed = Vec::new();
    let started = Instant::now();
    for (i, id) in ids.into_iter().enumerate() {
        if i == 200 {
            // Killed (SIGKILL) and started again on the same port and store.
            server.restart();
        }
        match js.wait_pub_ack(id) {
            Ok(ack) => acked.push((i, ack.seq)),
            Err(e @ (JsError::Transport(_) | JsError::Timeout)) => failed.push((i, e)),
            Err(other) => panic!("publish {i}: unexpected {other:?}"),
        }
    }
    // Every wait ended within its timeout: nothing hung.
    assert!(started.elapsed() < Duration::from_secs(60));
    assert!(acked.len() >= 200, "acked {}", acked.len());
    for (i, e) in &failed {
        assert!(
            e.to_string().contains("connection") || *e == JsError::Timeout,
            "publish {i}: unclear error {e}"
        );
    }

    // Reconnected: every acknowledged publish is in the stream with its payload.
    let back = common::wait_until(Duration::from_secs(10), || js.stream_info("DUR").is_ok());
    assert!(back, "JetStream did not come back after the restart");
    for (i, seq) in &acked {
        let m = js
            .get_msg("DUR", &MsgSelector::Sequence(*seq))
            .unwrap_or_else(|e| panic!("acked publish {i} (seq {seq}) lost: {e}"));
        assert_eq!(m.payload, format!("{i}").as_bytes());
    }
    // Publishing goes on after the restart.
    let ack = js
        .publish("dur", None, b"after", &PublishOptions::default())
        .expect("publish after restart");
    assert!(ack.seq > acked.iter().map(|(_, s)| *s).max().unwrap_or(0));
}
