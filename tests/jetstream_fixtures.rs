//! The sans-IO JetStream parsers on bytes recorded from a real nats-server 2.15.1
//! (proto-fixtures/, see its README): pull statuses, deliveries and their ack metadata,
//! API replies. No server needed; these pin the parsers to what the server really sends.

use std::path::Path;

use amp_broker::jetstream::{
    AckMetadata, Delivery, Inbound, JsError, PubAck, StreamInfo, classify, parse_response,
    publish::parse_pub_ack,
};
use amp_broker::proto::{HeaderMap, Op, Parsed, Parser, Role};

struct Recorded {
    subject: String,
    reply: Option<String>,
    headers: Option<HeaderMap>,
    payload: Vec<u8>,
}

impl Recorded {
    fn delivery(&self) -> Delivery<'_> {
        Delivery {
            subject: &self.subject,
            reply: self.reply.as_deref(),
            headers: self.headers.as_ref(),
            payload: &self.payload,
        }
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8(b.to_vec()).expect("UTF-8 subject")
}

/// Every MSG/HMSG the server sent in a recording.
fn messages(name: &str) -> Vec<Recorded> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("proto-fixtures")
        .join(name);
    let data = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{name}: {e}; run python3 scripts/capture-fixtures.py"));
    let parser = Parser::new(Role::Client);
    let mut out = Vec::new();
    let mut start = 0;
    while start < data.len() {
        match parser.parse(&data[start..]).expect("recorded bytes parse") {
            Parsed::Complete(op, used) => {
                match op {
                    Op::Msg {
                        subject,
                        reply,
                        payload,
                        ..
                    } => out.push(Recorded {
                        subject: text(subject),
                        reply: reply.map(text),
                        headers: None,
                        payload: payload.to_vec(),
                    }),
                    Op::Hmsg {
                        subject,
                        reply,
                        headers,
                        payload,
                        ..
                    } => out.push(Recorded {
                        subject: text(subject),
                        reply: reply.map(text),
                        headers: Some(HeaderMap::parse(headers).expect("recorded header block")),
                        payload: payload.to_vec(),
                    }),
                    _ => {}
                }
                start += used;
            }
            Parsed::Partial { .. } => panic!("{name}: recording ends inside an operation"),
        }
    }
    out
}

fn classified(name: &str) -> Vec<String> {
    messages(name)
        .iter()
        .map(|m| format!("{:?}", classify(&m.delivery())))
        .collect()
}

#[test]
fn recorded_pull_statuses_classify_as_their_kinds() {
    assert_eq!(classified("s2c-js-404-no-messages.bin"), ["NoMessages"]);
    let timeouts = messages("s2c-js-408-request-timeout.bin");
    assert!(matches!(
        classify(&timeouts[0].delivery()),
        Inbound::RequestTimeout {
            pending_messages: Some(_),
            pending_bytes: Some(_)
        }
    ));
    for (name, reason) in [
        ("s2c-js-409-max-bytes.bin", "Message Size Exceeds MaxBytes"),
        ("s2c-js-409-exceeded-max-waiting.bin", "Exceeded MaxWaiting"),
        ("s2c-js-409-consumer-deleted.bin", "Consumer Deleted"),
    ] {
        let all = messages(name);
        let conflict = all
            .iter()
            .map(|m| classify(&m.delivery()))
            .find(|c| matches!(c, Inbound::Conflict { .. }))
            .unwrap_or_else(|| panic!("{name}: no 409"));
        assert_eq!(
            conflict,
            Inbound::Conflict {
                description: reason
            },
            "{name}"
        );
        assert!(conflict.ends_pull());
    }
}

#[test]
fn recorded_heartbeats_and_flow_control_classify_and_flow_control_has_a_reply() {
    let beats = messages("s2c-js-100-idle-heartbeat.bin");
    let kinds: Vec<Inbound<'_>> = beats.iter().map(|m| classify(&m.delivery())).collect();
    let heartbeats = kinds
        .iter()
        .filter(|k| matches!(k, Inbound::IdleHeartbeat { .. }))
        .count();
    assert!(heartbeats >= 1, "{kinds:?}");
    assert!(
        matches!(kinds.last(), Some(Inbound::RequestTimeout { .. })),
        "{kinds:?}"
    );

    let fc = messages("s2c-js-100-flow-control.bin");
    let requests: Vec<&str> = fc
        .iter()
        .filter_map(|m| match classify(&m.delivery()) {
            Inbound::FlowControl { reply } => Some(reply),
            _ => None,
        })
        .collect();
    assert!(
        !requests.is_empty(),
        "no flow control request in the recording"
    );
    assert!(
        requests.iter().all(|r| r.starts_with("$JS.FC.")),
        "{requests:?}"
    );
}

#[test]
fn recorded_deliveries_are_messages_with_parseable_ack_metadata() {
    let deliveries = messages("s2c-js-pull-deliveries.bin");
    let metas: Vec<AckMetadata<'_>> = deliveries
        .iter()
        .filter(|m| classify(&m.delivery()) == Inbound::Message)
        .map(|m| AckMetadata::parse(m.reply.as_deref().expect("ack reply")).expect("metadata"))
        .collect();
    assert_eq!(metas.len(), 2);
    for (i, meta) in metas.iter().enumerate() {
        assert_eq!((meta.stream, meta.consumer), ("FIX", "pull"));
        assert_eq!(meta.delivered, 1);
        assert_eq!(meta.consumer_sequence, i as u64 + 1);
        assert!(meta.timestamp_nanos > 1_700_000_000_000_000_000);
    }
    assert!(metas[0].stream_sequence < metas[1].stream_sequence);
    assert_eq!(metas[1].pending, 0);
}

#[test]
fn recorded_api_replies_parse_to_typed_values_and_errors() {
    let replies = messages("s2c-js-api-replies.bin");
    let payloads: Vec<&[u8]> = replies.iter().map(|m| m.payload.as_slice()).collect();
    assert_eq!(
        payloads.len(),
        5,
        "stream create, pub ack, ack of a msg id, its duplicate, error"
    );
    let info: StreamInfo = parse_response(payloads[0]).expect("stream create reply");
    assert_eq!(info.config.name, "FIX");
    assert_eq!(info.config.subjects, vec!["fix.>"]);
    let ack: PubAck = parse_pub_ack(None, payloads[1]).expect("pub ack");
    assert_eq!(
        (ack.stream.as_str(), ack.seq, ack.duplicate),
        ("FIX", 1, false)
    );
    let first = parse_pub_ack(None, payloads[2]).expect("ack of the msg id");
    let dup = parse_pub_ack(None, payloads[3]).expect("duplicate ack");
    assert!(!first.duplicate);
    assert!(dup.duplicate);
    assert_eq!(first.seq, dup.seq);
    match parse_response::<StreamInfo>(payloads[4]) {
        Err(JsError::StreamNotFound(e)) => assert_eq!((e.code, e.err_code), (404, 10059)),
        other => panic!("expected stream not found, got {other:?}"),
    }
}
