//! The connection state machine on a virtual clock: the test plays the server's bytes and
//! moves time by hand.

use super::*;
use crate::nkeys::{KeyPair, PublicKey};
use crate::proto::{Op, Parsed, Parser, Role};
use base64::Engine;
use std::time::{Duration, Instant};

const INFO: &str = "INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\n";

struct Harness {
    conn: Connection,
    now: Instant,
}

impl Harness {
    fn new(options: Options) -> Harness {
        let now = Instant::now();
        Harness {
            conn: Connection::new(options.clone(), now),
            now,
        }
    }

    fn options(urls: &str) -> Options {
        let mut o = Options::new(urls);
        o.no_randomize = true;
        o
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        if self.conn.poll_timeout().is_some_and(|t| t <= self.now) {
            self.conn.handle_timeout(self.now);
        }
    }

    /// Dials, sends INFO, answers PONG; returns what the client wrote in the handshake.
    fn connect_with(&mut self, info: &str) -> Vec<u8> {
        let addr = self.conn.poll_connect(self.now).expect("a server to dial");
        assert!(!addr.host.is_empty());
        self.conn.on_transport_open(self.now);
        self.conn.receive(info.as_bytes(), self.now);
        let out = self.take_output();
        assert!(
            out.ends_with(b"PING\r\n"),
            "{}",
            String::from_utf8_lossy(&out)
        );
        self.conn.receive(b"PONG\r\n", self.now);
        assert!(self.conn.is_connected());
        out
    }

    fn connect(&mut self) -> Vec<u8> {
        self.connect_with(INFO)
    }

    fn take_output(&mut self) -> Vec<u8> {
        let out = self.conn.output().to_vec();
        self.conn.consume_output_at(out.len(), self.now);
        out
    }

    fn events(&mut self) -> Vec<Event> {
        std::iter::from_fn(|| self.conn.poll_event()).collect()
    }
}

/// The client operations in `bytes`, as (name, text) pairs for assertions.
fn ops(bytes: &[u8]) -> Vec<String> {
    let parser = Parser::new(Role::Server);
    let mut out = Vec::new();
    let mut start = 0;
    while start < bytes.len() {
        match parser.parse(&bytes[start..]) {
            Ok(Parsed::Complete(op, used)) => {
                out.push(match op {
                    Op::Connect(j) => format!("CONNECT {}", String::from_utf8_lossy(j)),
                    Op::Pub {
                        subject, payload, ..
                    } => format!(
                        "PUB {} {}",
                        String::from_utf8_lossy(subject),
                        String::from_utf8_lossy(payload)
                    ),
                    Op::Hpub { subject, .. } => {
                        format!("HPUB {}", String::from_utf8_lossy(subject))
                    }
                    Op::Sub {
                        subject,
                        queue,
                        sid,
                    } => format!(
                        "SUB {} {} {}",
                        String::from_utf8_lossy(subject),
                        queue
                            .map(|q| String::from_utf8_lossy(q).into_owned())
                            .unwrap_or_default(),
                        String::from_utf8_lossy(sid)
                    ),
                    Op::Unsub { sid, max_msgs } => {
                        format!("UNSUB {} {:?}", String::from_utf8_lossy(sid), max_msgs)
                    }
                    Op::Ping => "PING".into(),
                    Op::Pong => "PONG".into(),
                    other => format!("{other:?}"),
                });
                start += used;
            }
            other => panic!("unparsable client output: {other:?}"),
        }
    }
    out
}

fn connect_json(out: &[u8]) -> serde_json::Value {
    let first = ops(out).into_iter().next().expect("an op");
    let json = first.strip_prefix("CONNECT ").expect("CONNECT first");
    serde_json::from_str(json).expect("CONNECT json")
}

#[test]
fn handshake_sends_connect_with_the_agreed_flags_then_ping() {
    let mut h = Harness::new(Harness::options("nats://127.0.0.1:4222").with_name("amp"));
    let out = h.connect();
    let c = connect_json(&out);
    assert_eq!(c["verbose"], false);
    assert_eq!(c["pedantic"], false);
    assert_eq!(c["headers"], true);
    assert_eq!(c["no_responders"], true);
    assert_eq!(c["protocol"], 1);
    assert_eq!(c["name"], "amp");
    assert_eq!(c["lang"], "rust");
    assert!(c["version"].is_string());
    assert_eq!(ops(&out).last().map(String::as_str), Some("PING"));
    let events = h.events();
    assert!(matches!(&events[..], [Event::Connected { server }] if server.port == 4222));
}

#[test]
fn url_credentials_go_into_connect_as_user_pass_or_token() {
    let mut h = Harness::new(Harness::options("nats://bob:pw@h:1"));
    let c = connect_json(&h.connect());
    assert_eq!(
        (c["user"].as_str(), c["pass"].as_str()),
        (Some("bob"), Some("pw"))
    );

    let mut h = Harness::new(Harness::options("nats://s3cret@h:1"));
    let c = connect_json(&h.connect());
    assert_eq!(c["auth_token"], "s3cret");
    assert!(c.get("user").is_none_or(|u| u.is_null()));
}

#[test]
fn nkey_auth_signs_the_servers_nonce() {
    let key = KeyPair::generate(crate::nkeys::KeyKind::User).expect("key");
    let options = Harness::options("h:1")
        .with_nkey_seed(&key.seed())
        .expect("seed");
    let mut h = Harness::new(options);
    let info = "INFO {\"server_id\":\"S\",\"nonce\":\"abc-NONCE_1\",\"max_payload\":1024}\r\n";
    let c = connect_json(&h.connect_with(info));
    assert_eq!(c["nkey"], key.public_key());
    let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(c["sig"].as_str().expect("sig"))
        .expect("base64url");
    PublicKey::decode(&key.public_key())
        .expect("public")
        .verify(b"abc-NONCE_1", &sig)
        .expect("signature over the nonce");
    assert_eq!(h.conn.max_payload(), 1024);
}

#[test]
fn creds_auth_sends_the_jwt_and_the_nonce_signature() {
    let key = KeyPair::generate(crate::nkeys::KeyKind::User).expect("key");
    let text = creds::format("hdr.claims.sig", &key.seed());
    let mut h = Harness::new(
        Harness::options("h:1")
            .with_credentials(&text)
            .expect("creds"),
    );
    let c = connect_json(&h.connect_with("INFO {\"nonce\":\"n0\"}\r\n"));
    assert_eq!(c["jwt"], "hdr.claims.sig");
    assert!(c["sig"].is_string());
    assert!(c.get("nkey").is_none_or(|n| n.is_null()));
}

#[test]
fn keepalive_pings_and_a_stale_connection_is_dropped_and_redialed() {
    let mut o = Harness::options("h:1");
    o.ping_interval = Duration::from_secs(10);
    o.max_pings_outstanding = 2;
    let mut h = Harness::new(o);
    h.connect();
    h.events();
    assert!(h.take_output().is_empty());
    h.advance(Duration::from_secs(10));
    assert_eq!(ops(&h.take_output()), ["PING"]);
    h.conn.receive(b"PONG\r\n", h.now);
    // Two more intervals unanswered: two PINGs out, the third tick is stale.
    h.advance(Duration::from_secs(10));
    h.advance(Duration::from_secs(10));
    assert_eq!(ops(&h.take_output()), ["PING", "PING"]);
    assert!(h.conn.is_connected());
    h.advance(Duration::from_secs(10));
    assert!(!h.conn.is_connected());
    assert!(h.conn.poll_close(), "the shell must drop the socket");
    let events = h.events();
    assert!(
        matches!(&events[..], [Event::Disconnected { reason }] if reason.contains("stale")),
        "{events:?}"
    );
    // Reconnect is attempted at once.
    assert!(h.conn.poll_connect(h.now).is_some());
}

#[test]
fn server_ping_is_answered_with_pong() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.conn.receive(b"PING\r\n", h.now);
    assert_eq!(ops(&h.take_output()), ["PONG"]);
}

/// nats-server's first bytes are always its INFO (nats.go refuses anything else). A PING
/// before it was answered: a PONG went out ahead of CONNECT (which a server with auth
/// takes as an authorization violation) and, on a `tls://` connection, in plaintext.
#[test]
fn anything_but_info_or_err_before_the_info_fails_the_attempt_unanswered() {
    for first in ["PING\r\n", "PONG\r\n", "+OK\r\n", "MSG a 1 0\r\n\r\n"] {
        for url in ["h:1", "tls://h:1"] {
            let mut o = Harness::options(url);
            o.retry_on_failed_connect = true;
            let mut h = Harness::new(o);
            h.conn.poll_connect(h.now).expect("a server to dial");
            h.conn.on_transport_open(h.now);
            h.conn.receive(first.as_bytes(), h.now);
            h.conn.receive(INFO.as_bytes(), h.now);
            let out = String::from_utf8_lossy(h.conn.output()).into_owned();
            assert_eq!(out, "", "{first:?} on {url}");
            assert!(
                h.conn.poll_close(),
                "{first:?} on {url}: the attempt goes on"
            );
            assert!(!h.conn.is_connected());
        }
    }
}

/// A PING flood before the handshake's PONG, the PONGs never read: the attempt fails
/// and the server is dialed again after its backoff. Before, the connection asked the
/// shell to drop the socket but stayed in its handshake, its output still queued, until
/// the connect timeout, and then asked again to drop a socket already gone.
#[test]
fn a_ping_flood_during_the_handshake_fails_the_attempt_at_once() {
    let mut o = Harness::options("h:1");
    o.max_write_buffer = 1000;
    o.retry_on_failed_connect = true;
    let mut h = Harness::new(o);
    h.conn.poll_connect(h.now).expect("a server to dial");
    h.conn.on_transport_open(h.now);
    h.conn.receive(INFO.as_bytes(), h.now);
    h.conn.receive(&b"PING\r\n".repeat(300), h.now);
    assert!(h.conn.poll_close());
    let out = String::from_utf8_lossy(h.conn.output()).into_owned();
    assert_eq!(out, "", "output of a dropped socket");
    let redial = h.conn.poll_timeout().expect("a redial");
    assert!(
        redial < h.now + Duration::from_secs(1),
        "waits {:?} for the handshake deadline of a dropped socket",
        redial - h.now
    );
    h.advance(Duration::from_secs(1));
    assert!(h.conn.poll_connect(h.now).is_some(), "not dialed again");
    assert!(!h.conn.poll_close(), "a second drop of the same socket");
}

#[test]
fn request_times_out_at_its_deadline_on_the_virtual_clock() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let id = h
        .conn
        .request("svc", None, b"q", Duration::from_millis(500), h.now)
        .expect("request");
    let out = ops(&h.take_output());
    assert!(out[0].starts_with("SUB _INBOX."), "{out:?}");
    assert!(out[0].contains(".* "), "one wildcard inbox: {out:?}");
    assert_eq!(out[1], "PUB svc q");
    assert!(h.conn.poll_timeout() <= Some(h.now + Duration::from_millis(500)));
    h.advance(Duration::from_millis(499));
    assert!(h.events().is_empty());
    h.advance(Duration::from_millis(1));
    assert_eq!(
        h.events(),
        [Event::RequestFailed {
            id,
            error: RequestError::Timeout
        }]
    );
    assert_eq!(h.conn.pending_requests(), 0);
}

#[test]
fn an_absurd_request_timeout_or_ping_interval_saturates_instead_of_panicking() {
    let mut o = Harness::options("h:1");
    o.ping_interval = Duration::MAX;
    o.connect_timeout = Duration::MAX;
    let mut h = Harness::new(o);
    h.connect();
    h.events();
    h.conn
        .request("svc", None, b"q", Duration::MAX, h.now)
        .expect("request");
    let next = h.conn.poll_timeout().expect("a deadline");
    assert!(
        next > h.now + Duration::from_secs(365 * 24 * 3600),
        "{next:?}"
    );
    h.advance(Duration::from_secs(3600));
    assert_eq!(h.conn.pending_requests(), 1);
}

#[test]
fn replies_are_matched_by_token_and_503_ends_the_request_at_once() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let a = h
        .conn
        .request("a", None, b"", Duration::from_secs(5), h.now)
        .expect("a");
    let b = h
        .conn
        .request("b", None, b"", Duration::from_secs(5), h.now)
        .expect("b");
    let out = ops(&h.take_output());
    let sub = out[0].split(' ').collect::<Vec<_>>();
    let (pattern, sid) = (sub[1], sub[3]);
    let prefix = pattern.trim_end_matches('*');
    // b's reply first, then a 503 for a.
    let reply_b = format!("MSG {prefix}{} {sid} 2\r\nok\r\n", b.0);
    h.conn.receive(reply_b.as_bytes(), h.now);
    let hdr = "NATS/1.0 503\r\n\r\n";
    let reply_a = format!(
        "HMSG {prefix}{} {sid} {} {}\r\n{hdr}\r\n",
        a.0,
        hdr.len(),
        hdr.len()
    );
    h.conn.receive(reply_a.as_bytes(), h.now);
    let events = h.events();
    assert!(matches!(&events[0], Event::Response { id, msg } if *id == b && msg.payload == b"ok"));
    assert_eq!(
        events[1],
        Event::RequestFailed {
            id: a,
            error: RequestError::NoResponders
        }
    );
    // A late duplicate is dropped.
    h.conn.receive(reply_b.as_bytes(), h.now);
    assert!(h.events().is_empty());
}

#[test]
fn messages_split_across_reads_are_delivered_once_complete() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let sid = h.conn.subscribe("x.>", Some("q")).expect("sub");
    assert_eq!(ops(&h.take_output()), [format!("SUB x.> q {sid}")]);
    let wire = format!("MSG x.y {sid} r 5\r\nhello\r\nMSG x.z {sid} 0\r\n\r\n");
    for chunk in wire.as_bytes().chunks(3) {
        h.conn.receive(chunk, h.now);
    }
    let events = h.events();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        matches!(&events[0], Event::Message { msg, .. } if msg.payload == b"hello" && msg.reply.as_deref() == Some("r"))
    );
    assert!(matches!(&events[1], Event::Message { msg, .. } if msg.subject == "x.z"));
}

#[test]
fn a_status_only_subscription_gets_statuses_with_their_fields_and_no_others_fields() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let plain = h.conn.subscribe("p", None).expect("sub");
    let status_only = h.conn.subscribe("s", None).expect("sub");
    h.conn.status_only_headers(status_only);
    h.take_output();
    for (subject, sid) in [("p", plain), ("s", status_only)] {
        for hdr in [
            "NATS/1.0\r\nAMP-From: acme/a\r\n\r\n",
            "NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\n\r\n",
        ] {
            let wire = format!(
                "HMSG {subject} {sid} {} {}\r\n{hdr}ok\r\n",
                hdr.len(),
                hdr.len() + 2
            );
            h.conn.receive(wire.as_bytes(), h.now);
        }
    }
    let got: Vec<(String, Option<u16>, Option<String>, usize)> = h
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Message { msg, .. } => Some((
                msg.subject.clone(),
                msg.status(),
                msg.header("AMP-From")
                    .or(msg.header("Nats-Pending-Messages"))
                    .map(str::to_string),
                msg.pulled_size(),
            )),
            _ => None,
        })
        .collect();
    // What a pull's `max_bytes` counts: subject, header block and payload either way.
    let (fields, status) = (1 + 30 + 2, 1 + 58 + 2);
    assert_eq!(
        got,
        [
            ("p".to_string(), None, Some("acme/a".to_string()), fields),
            ("p".to_string(), Some(408), Some("1".to_string()), status),
            ("s".to_string(), None, None, fields),
            ("s".to_string(), Some(408), Some("1".to_string()), status),
        ]
    );
}

#[test]
fn a_delivered_subject_with_a_cr_or_control_byte_is_dropped_and_counted_not_fatal() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let sid = h.conn.subscribe("amp.>", None).expect("sub");
    h.take_output();
    let id = h
        .conn
        .request("svc", None, b"q", Duration::from_secs(5), h.now)
        .expect("request");
    let inbox = ops(&h.take_output())[0]
        .split(' ')
        .nth(1)
        .map(|s| s.trim_end_matches('*').to_string())
        .expect("inbox");
    // Bytes nats-server 2.15.1 delivers when another client publishes such subjects.
    let mut wire = Vec::new();
    for bad in [
        &b"amp.acme.topic.x\r"[..],
        b"amp.acme.topic.\x01x",
        b"amp.acme.topic.\xff",
    ] {
        wire.extend_from_slice(b"MSG ");
        wire.extend_from_slice(bad);
        wire.extend_from_slice(format!(" {sid} 2\r\nhi\r\n").as_bytes());
    }
    wire.extend_from_slice(format!("MSG amp.acme.topic.y {sid} _INBOX.r\r 2\r\nhi\r\n").as_bytes());
    wire.extend_from_slice(format!("MSG {inbox}\r {sid} 2\r\nhi\r\n").as_bytes());
    wire.extend_from_slice(format!("MSG amp.acme.topic.ok {sid} 2\r\nok\r\n").as_bytes());
    h.conn.receive(&wire, h.now);
    assert!(h.conn.is_connected(), "the connection survives");
    let events = h.events();
    assert!(
        matches!(&events[0], Event::Message { msg, .. } if msg.subject == "amp.acme.topic.ok"),
        "{events:?}"
    );
    assert_eq!(
        events[1],
        Event::InvalidMessages { dropped: 5 },
        "{events:?}"
    );
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(h.conn.stats().invalid_msgs, 5);
    assert_eq!(
        h.conn.pending_requests(),
        1,
        "the request {id:?} still waits"
    );
}

#[test]
fn a_dropped_jetstream_delivery_is_terminated_so_it_does_not_come_back() {
    // JetStream stores what a client published on `amp.acme.topic.x\r` (the stream's
    // `amp.acme.topic.>` matches it) and delivers it with an ack reply; unacked it would
    // come again after every ack wait and hold a slot of the consumer's window.
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let deliver = h.conn.new_inbox();
    let sid = h.conn.subscribe(&deliver, None).expect("sub");
    h.take_output();
    let ack = "$JS.ACK.AMP_TOPICS_acme.sub_a.1.7.7.1796155404000000000.0";
    let wire = format!("MSG amp.acme.topic.x\r {sid} {ack} 2\r\nhi\r\n");
    h.conn.receive(wire.as_bytes(), h.now);
    assert_eq!(h.events(), [Event::InvalidMessages { dropped: 1 }]);
    assert_eq!(ops(&h.take_output()), [format!("PUB {ack} +TERM")]);
    // A reply that is not a JetStream ack subject is never written to.
    let wire = format!("MSG amp.acme.topic.x\r {sid} _INBOX.someone 2\r\nhi\r\n");
    h.conn.receive(wire.as_bytes(), h.now);
    assert!(h.take_output().is_empty());
}

#[test]
fn an_odd_message_on_a_subscription_anyone_may_publish_to_terminates_nothing() {
    // A client allowed to publish where the broker listens (MIG requests) sent an odd
    // subject with another stream's ack subject as its reply: the broker terminated that
    // message with its own credentials. Only JetStream's deliveries to this connection's
    // own inbox subjects, which no one else can publish to, are ended.
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let sid = h
        .conn
        .subscribe("mig.v0_1.acme.invoke.>", None)
        .expect("sub");
    h.take_output();
    let ack = "$JS.ACK.AMP_TASKS_acme.job_render.1.7.7.1796155404000000000.0";
    let wire = format!("MSG mig.v0_1.acme.invoke.x\x01 {sid} {ack} 2\r\nhi\r\n");
    h.conn.receive(wire.as_bytes(), h.now);
    assert_eq!(h.events(), [Event::InvalidMessages { dropped: 1 }]);
    assert!(h.take_output().is_empty(), "no +TERM on another's message");
}

#[test]
fn reconnect_restores_subscriptions_then_writes_buffered_publishes() {
    let mut o = Harness::options("h:1");
    o.reconnect_delay = Duration::from_millis(100);
    let mut h = Harness::new(o);
    h.connect();
    let keep = h.conn.subscribe("keep", None).expect("sub");
    let limited = h.conn.subscribe("lim", Some("g")).expect("sub");
    h.conn.unsubscribe(limited, Some(5)).expect("auto-unsub");
    let wire = format!("MSG lim {limited} 1\r\na\r\nMSG lim {limited} 1\r\nb\r\n");
    h.conn.receive(wire.as_bytes(), h.now);
    h.take_output();
    h.events();

    // A connection that lasted (one dropped at once is dialed again after a backoff).
    h.now += Duration::from_secs(5);
    h.conn.on_transport_closed(h.now, "reset by peer");
    assert!(
        matches!(&h.events()[..], [Event::Disconnected { reason }] if reason == "reset by peer")
    );
    h.conn
        .publish("buffered", None, None, b"1")
        .expect("buffered while away");
    assert!(h.conn.reconnect_buffered() > 0);
    let out = h.connect();
    let out = ops(&out);
    assert_eq!(h.events().len(), 1);
    let after = ops(&h.take_output());
    assert!(out[0].starts_with("CONNECT"));
    assert_eq!(
        after,
        [
            format!("SUB keep  {keep}"),
            format!("SUB lim g {limited}"),
            format!("UNSUB {limited} Some(3)"),
            "PUB buffered 1".to_string(),
        ]
    );
    assert_eq!(h.conn.reconnect_buffered(), 0);
    assert_eq!(h.conn.stats().reconnects, 1);
}

#[test]
fn full_reconnect_buffer_refuses_the_publish() {
    let mut o = Harness::options("h:1");
    o.reconnect_buffer_size = 100;
    let mut h = Harness::new(o);
    h.conn.publish("a", None, None, &[0; 40]).expect("fits");
    let err = h.conn.publish("a", None, None, &[0; 60]).expect_err("full");
    assert_eq!(err, Error::ReconnectBufferFull { capacity: 100 });
    h.conn
        .publish("a", None, None, &[0; 10])
        .expect("smaller one still fits");
}

#[test]
fn full_write_buffer_refuses_the_publish_while_connected() {
    let mut o = Harness::options("h:1");
    o.max_write_buffer = 200;
    let mut h = Harness::new(o);
    h.connect();
    h.conn.publish("a", None, None, &[0; 100]).expect("fits");
    let err = h
        .conn
        .publish("a", None, None, &[0; 100])
        .expect_err("full");
    assert_eq!(err, Error::WriteBufferFull { capacity: 200 });
    h.take_output();
    h.conn
        .publish("a", None, None, &[0; 100])
        .expect("room again once written");
}

#[test]
fn backoff_grows_between_failed_attempts_on_the_same_server() {
    let mut o = Harness::options("h:1");
    o.retry_on_failed_connect = true;
    o.reconnect_delay = Duration::from_millis(100);
    o.reconnect_delay_max = Duration::from_secs(1);
    let mut h = Harness::new(o);
    let mut waits = Vec::new();
    for _ in 0..6 {
        let t0 = h.now;
        while h.conn.poll_connect(h.now).is_none() {
            h.now += Duration::from_millis(1);
        }
        waits.push(h.now - t0);
        h.conn.on_transport_closed(h.now, "refused");
    }
    assert_eq!(waits[0], Duration::ZERO);
    for (i, full_ms) in [(1, 100u64), (2, 200), (3, 400), (4, 800), (5, 1000)] {
        let w = waits[i].as_millis() as u64;
        assert!(w >= full_ms / 2 && w <= full_ms + 1, "attempt {i}: {w}ms");
    }
}

#[test]
fn first_connect_tries_each_server_once_then_closes() {
    let mut h = Harness::new(Harness::options("a:1,b:2"));
    let first = h.conn.poll_connect(h.now).expect("a");
    h.conn.on_transport_closed(h.now, "refused");
    let second = h.conn.poll_connect(h.now).expect("b at once");
    assert_ne!(first, second);
    h.conn.on_transport_closed(h.now, "refused");
    assert!(h.conn.is_closed());
    assert!(matches!(
        &h.events()[..],
        [Event::Closed { reason: Error::ConnectFailed(r) }] if r == "refused"
    ));
    assert!(h.conn.publish("x", None, None, b"").is_err());
}

#[test]
fn authorization_violation_on_first_connect_closes_with_that_error() {
    let mut h = Harness::new(Harness::options("h:1").with_user_password("u", "wrong"));
    h.conn.poll_connect(h.now).expect("dial");
    h.conn.on_transport_open(h.now);
    h.conn.receive(INFO.as_bytes(), h.now);
    h.conn.receive(b"-ERR 'Authorization Violation'\r\n", h.now);
    assert!(h.conn.is_closed());
    assert!(h.conn.poll_close());
    assert_eq!(
        h.events(),
        [Event::Closed {
            reason: Error::Authorization("Authorization Violation".into())
        }]
    );
}

#[test]
fn recoverable_err_is_an_event_and_fatal_err_reconnects() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    h.conn.receive(
        b"-ERR 'Permissions Violation for Publish to \"x\"'\r\n",
        h.now,
    );
    assert!(h.conn.is_connected());
    assert!(matches!(&h.events()[..], [Event::ServerError(t)] if t.starts_with("Permissions")));
    h.conn
        .receive(b"-ERR 'Maximum Connections Exceeded'\r\n", h.now);
    assert!(!h.conn.is_connected());
    assert!(h.conn.poll_close());
    assert!(
        matches!(&h.events()[..], [Event::Disconnected { reason }] if reason.contains("Maximum Connections Exceeded"))
    );
    // Dropped at once after its handshake: dialed again after a backoff.
    assert!(h.conn.poll_connect(h.now).is_none());
    h.advance(Duration::from_secs(4));
    assert!(h.conn.poll_connect(h.now).is_some());
}

#[test]
fn a_server_that_pings_and_never_reads_is_dropped_not_buffered() {
    let mut o = Harness::options("h:1");
    o.max_write_buffer = 1000;
    let mut h = Harness::new(o);
    h.connect();
    h.events();
    // PINGs it never reads the PONGs of, and a PONG now and then it never was asked for
    // (which must not count as the server being alive).
    let mut burst = b"PING\r\n".repeat(100);
    burst.extend_from_slice(b"PONG\r\n");
    for _ in 0..100 {
        h.conn.receive(&burst, h.now);
        assert!(
            h.conn.output().len() <= 1000 + 6,
            "{}",
            h.conn.output().len()
        );
        if h.conn.poll_close() {
            break;
        }
    }
    assert!(!h.conn.is_connected());
    let events = h.events();
    assert!(
        matches!(&events[..], [Event::Disconnected { reason }] if reason.contains("does not read")),
        "{events:?}"
    );
}

#[test]
fn each_pong_answers_one_ping_so_half_answered_keepalives_go_stale() {
    let mut o = Harness::options("h:1");
    o.ping_interval = Duration::from_secs(10);
    o.max_pings_outstanding = 2;
    let mut h = Harness::new(o);
    h.connect();
    h.events();
    // One PONG for every two PINGs (and unasked ones at the start): the outstanding
    // count grows by one each round instead of starting again at zero.
    h.conn.receive(b"PONG\r\nPONG\r\n", h.now);
    for round in 0..6 {
        h.advance(Duration::from_secs(10));
        h.take_output();
        if round % 2 == 1 {
            h.conn.receive(b"PONG\r\n", h.now);
        }
    }
    assert!(!h.conn.is_connected(), "stale: half its PINGs unanswered");
}

#[test]
fn an_info_cannot_raise_max_payload_past_what_any_server_allows() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect_with(
        "INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":4000000000}\r\n",
    );
    h.events();
    assert_eq!(h.conn.max_payload(), 64 * 1024 * 1024);
    h.conn.receive(b"SUB x 1\r\n", h.now);
    // Announced, not sent: refused at the header instead of buffered.
    h.conn.receive(b"MSG a 1 200000000\r\n", h.now);
    assert!(h.conn.poll_close());
    assert!(!h.conn.is_connected());
}

/// nats-server sends what JetStream answers about a stored message past `max_payload`
/// (checked against 2.15.1: `STREAM.MSG.GET` of a 900,000-byte message, under the default
/// 1 MiB, came as a 1,200,147-byte `MSG`). Refusing it dropped the connection.
#[test]
fn an_answer_about_a_stored_message_may_exceed_max_payload_by_its_encoding() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let sid = h.conn.subscribe("r", None).expect("sub");
    h.take_output();
    let payload = vec![b'a'; 1_200_147];
    let mut wire = format!("MSG r {sid} {}\r\n", payload.len()).into_bytes();
    wire.extend_from_slice(&payload);
    wire.extend_from_slice(b"\r\n");
    h.conn.receive(&wire, h.now);
    assert!(h.conn.is_connected());
    let events = h.events();
    assert!(
        matches!(&events[..], [Event::Message { msg, .. }] if msg.payload.len() == payload.len()),
        "{}",
        events.len()
    );
    // Bounded all the same: half as much again, and 64 KiB.
    h.conn.receive(
        format!("MSG r {sid} {}\r\n", 1_048_576 * 3 / 2 + 65_537).as_bytes(),
        h.now,
    );
    assert!(h.conn.poll_close());
}

#[test]
fn a_connection_dropped_right_after_its_handshake_is_redialed_with_growing_backoff() {
    let mut h = Harness::new(Harness::options("h:1"));
    let mut waits = Vec::new();
    for _ in 0..5 {
        h.connect();
        h.conn.receive(b"-ERR 'Stale Connection'\r\n", h.now);
        assert!(!h.conn.is_connected());
        assert!(h.conn.poll_close());
        h.events();
        let at = h.conn.poll_timeout().expect("a redial is scheduled");
        assert!(h.conn.poll_connect(h.now).is_none(), "not at once");
        waits.push(at - h.now);
        h.now = at;
        h.conn.handle_timeout(h.now);
    }
    assert!(waits[4] > waits[0], "{waits:?}");
    // One that lasted is dialed again at once.
    h.connect();
    h.advance(Duration::from_secs(30));
    h.take_output();
    h.conn.receive(b"-ERR 'Stale Connection'\r\n", h.now);
    assert!(h.conn.poll_connect(h.now).is_some());
}

#[test]
fn garbage_from_the_server_drops_the_connection_with_a_clear_reason() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let id = h
        .conn
        .request("svc", None, b"", Duration::from_secs(5), h.now)
        .expect("req");
    h.conn.receive(b"HELLO THERE\r\n", h.now);
    assert!(h.conn.poll_close());
    let events = h.events();
    assert!(
        matches!(&events[0], Event::Disconnected { reason } if reason.contains("protocol error")),
        "{events:?}"
    );
    assert_eq!(
        events[1],
        Event::RequestFailed {
            id,
            error: RequestError::Disconnected
        }
    );
}

#[test]
fn async_info_adds_connect_urls_and_lame_duck_moves_to_another_server() {
    let mut h = Harness::new(Harness::options("a:1"));
    h.connect();
    h.events();
    h.conn
        .receive(b"INFO {\"connect_urls\":[\"a:1\",\"b:2\"]}\r\n", h.now);
    let discovered = h.conn.discovered_servers();
    assert_eq!(discovered.len(), 1);
    assert_eq!(discovered[0].to_string(), "b:2");
    h.conn.publish("x", None, None, b"1").expect("pub");
    h.conn.receive(
        b"INFO {\"connect_urls\":[\"a:1\",\"b:2\"],\"ldm\":true}\r\n",
        h.now,
    );
    assert_eq!(h.events(), [Event::LameDuck]);
    // What was queued for the old server goes out first, then the move.
    assert!(h.conn.is_connected());
    h.conn
        .publish("y", None, None, b"2")
        .expect("goes to the reconnect buffer");
    assert_eq!(ops(&h.take_output()), ["PUB x 1"]);
    assert!(h.conn.poll_close());
    let next = h.conn.poll_connect(h.now).expect("dial elsewhere");
    assert_eq!(next.to_string(), "b:2");
    h.conn.on_transport_open(h.now);
    h.conn.receive(INFO.as_bytes(), h.now);
    h.conn.receive(b"PONG\r\n", h.now);
    h.take_output();
    let events = h.events();
    assert!(
        matches!(&events[..], [Event::Disconnected { .. }, Event::Reconnected { server }] if server.port == 2),
        "{events:?}"
    );
}

#[test]
fn a_lame_duck_mark_does_not_keep_the_configured_server_from_being_dialed_again() {
    // One INFO marks the only configured server lame duck and names a server that never
    // answers: the mark kept the connection dialing that one alone, forever.
    let mut h = Harness::new(Harness::options("a:1"));
    h.connect();
    h.events();
    h.conn.receive(
        b"INFO {\"ldm\":true,\"connect_urls\":[\"192.0.2.1:4222\"]}\r\n",
        h.now,
    );
    assert!(h.conn.poll_close(), "moves away from the lame duck");
    let mut dialed = Vec::new();
    for _ in 0..50 {
        h.advance(Duration::from_secs(5));
        if let Some(addr) = h.conn.poll_connect(h.now) {
            if addr.port == 1 {
                // The mark guided the move it caused, once.
                assert_eq!(dialed, ["192.0.2.1:4222"]);
                return;
            }
            dialed.push(addr.to_string());
            h.conn.on_transport_closed(h.now, "refused");
        }
    }
    panic!("a:1 never dialed again; dialed {dialed:?}");
}

#[test]
fn after_two_lame_duck_moves_a_restarted_server_is_dialed_when_the_last_one_is_down() {
    // a goes lame duck: on to b. a restarts healthy; b goes lame duck: on to c, which is
    // down. a stayed marked, and only c was dialed from then on.
    let mut h = Harness::new(Harness::options("a:1,b:2,c:3"));
    h.connect();
    let ldm = b"INFO {\"ldm\":true}\r\n";
    h.conn.receive(ldm, h.now);
    assert!(h.conn.poll_close());
    h.advance(Duration::from_secs(5));
    assert_eq!(h.conn.poll_connect(h.now).map(|a| a.port), Some(2));
    h.conn.on_transport_open(h.now);
    h.conn.receive(INFO.as_bytes(), h.now);
    h.conn.receive(b"PONG\r\n", h.now);
    h.take_output();
    h.advance(Duration::from_secs(30));
    h.conn.receive(ldm, h.now);
    h.take_output();
    assert!(h.conn.poll_close());
    let mut dialed = Vec::new();
    for _ in 0..10 {
        h.advance(Duration::from_secs(5));
        if let Some(addr) = h.conn.poll_connect(h.now) {
            dialed.push(addr.port);
            if addr.port == 1 {
                break;
            }
            h.conn.on_transport_closed(h.now, "refused");
        }
    }
    assert_eq!(dialed, [3, 1]);
}

#[test]
fn the_latest_connect_urls_replace_the_discovered_servers_but_the_one_in_use() {
    let mut h = Harness::new(Harness::options("a:1"));
    h.connect();
    h.events();
    let many: Vec<String> = (1..=64).map(|i| format!("\"10.9.0.{i}:4222\"")).collect();
    let info = format!("INFO {{\"connect_urls\":[{}]}}\r\n", many.join(","));
    h.conn.receive(info.as_bytes(), h.now);
    assert_eq!(h.conn.discovered_servers().len(), 64);
    // Those pods are gone: before, they stayed for good, and the cap counted them, so b
    // was never learned.
    h.conn
        .receive(b"INFO {\"connect_urls\":[\"b:2\"]}\r\n", h.now);
    let names = |servers: Vec<ServerAddr>| -> Vec<String> {
        servers.iter().map(ToString::to_string).collect()
    };
    assert_eq!(names(h.conn.discovered_servers()), ["b:2"]);
    assert_eq!(names(h.conn.servers()), ["a:1", "b:2"], "configured stay");
    // On b, a list without b keeps it while it is the one in use.
    h.conn.receive(b"INFO {\"ldm\":true}\r\n", h.now);
    assert!(h.conn.poll_close());
    h.advance(Duration::from_secs(5));
    assert_eq!(h.conn.poll_connect(h.now).map(|a| a.port), Some(2));
    h.conn.on_transport_open(h.now);
    h.conn.receive(INFO.as_bytes(), h.now);
    h.conn.receive(b"PONG\r\n", h.now);
    h.conn
        .receive(b"INFO {\"connect_urls\":[\"c:3\"]}\r\n", h.now);
    assert_eq!(names(h.conn.discovered_servers()), ["b:2", "c:3"]);
    assert_eq!(
        h.conn.connected_server().map(ToString::to_string),
        Some("b:2".into())
    );
    // An INFO that names no servers (a lame duck notice, a server outside a cluster)
    // leaves them as they are.
    h.conn.receive(b"INFO {\"max_payload\":1048576}\r\n", h.now);
    assert_eq!(names(h.conn.discovered_servers()), ["b:2", "c:3"]);
}

#[test]
fn slow_consumer_drops_beyond_the_pending_bound_and_reports_it() {
    let mut o = Harness::options("h:1");
    o.max_pending_messages = 2;
    let mut h = Harness::new(o);
    h.connect();
    h.events();
    let sid = h.conn.subscribe("s", None).expect("sub");
    for _ in 0..5 {
        h.conn
            .receive(format!("MSG s {sid} 1\r\nx\r\n").as_bytes(), h.now);
    }
    let events = h.events();
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!(events[2], Event::SlowConsumer { dropped: 3 });
    assert_eq!(h.conn.stats().dropped_msgs, 3);
}

#[test]
fn handshake_timeout_fails_the_attempt() {
    let mut o = Harness::options("h:1");
    o.connect_timeout = Duration::from_secs(2);
    o.retry_on_failed_connect = true;
    let mut h = Harness::new(o);
    h.conn.poll_connect(h.now).expect("dial");
    h.conn.on_transport_open(h.now);
    h.advance(Duration::from_secs(2));
    assert!(h.conn.poll_close());
    assert!(!h.conn.is_closed());
}

#[test]
fn user_ping_is_answered_by_its_pong_event() {
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let id = h.conn.ping().expect("ping");
    assert_eq!(ops(&h.take_output()), ["PING"]);
    h.conn.receive(b"PONG\r\n", h.now);
    assert_eq!(h.events(), [Event::Pong(id)]);
}

#[test]
fn an_unparsable_url_is_the_reason_the_connection_closes() {
    let mut h = Harness::new(Options::new("http://h:1"));
    assert!(h.conn.is_closed());
    assert!(matches!(
        &h.events()[..],
        [Event::Closed { reason: Error::InvalidUrl(u) }] if u.contains("http://h:1")
    ));
    let mut h = Harness::new(Options::default());
    assert_eq!(
        h.events(),
        [Event::Closed {
            reason: Error::NoServers
        }]
    );
}

#[test]
fn an_ack_to_a_delivered_reply_is_written_as_publish_and_request_write_it() {
    let mut h = Harness::new(Harness::options("nats://a:4222"));
    h.connect();
    let sid = h.conn.subscribe("in", None).expect("sub");
    h.take_output();
    let ack = "$JS.ACK.S.C.1.7.7.1700000000000000000.0";
    // Not a subject `deliverable` lets through: never handed on, so never acked.
    h.conn.receive(
        format!("MSG in {} a..b 2\r\nhi\r\n", sid.0).as_bytes(),
        h.now,
    );
    h.conn.receive(
        format!("MSG in {} {ack} 2\r\nhi\r\n", sid.0).as_bytes(),
        h.now,
    );
    let events = h.events();
    let [
        Event::Connected { .. },
        Event::InvalidMessages { dropped: 1 },
        Event::Message { msg, .. },
    ] = &events[..]
    else {
        panic!("{events:?}");
    };
    let reply = msg.reply.clone().expect("a reply");
    assert_eq!(reply, ack);
    h.conn
        .publish(&reply, None, None, b"+ACK")
        .expect("publish");
    let checked = h.take_output();
    h.conn
        .publish_to_reply(&reply, b"+ACK")
        .expect("publish_to_reply");
    assert_eq!(h.take_output(), checked);
    h.conn
        .request(&reply, None, b"+ACK", Duration::from_secs(5), h.now)
        .expect("request");
    let first = ops(&h.take_output());
    h.conn
        .request_to_reply(&reply, b"+ACK", Duration::from_secs(5), h.now)
        .expect("request_to_reply");
    let second = ops(&h.take_output());
    // The first also subscribed the replies' inbox; the reply subjects differ by
    // request number alone, and `ops` leaves them out.
    assert_eq!(first.last(), second.last());
    assert_eq!(second, [format!("PUB {ack} +ACK")]);
    assert_eq!(h.conn.pending_requests(), 2);
}

#[test]
fn owned_text_is_the_check_in_place_then_copy_it_replaced() {
    let reference = |bytes: &[u8]| match std::str::from_utf8(bytes) {
        Ok(s) => s.to_owned(),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    };
    let symbols: &[&[u8]] = &[
        b"a",
        b".",
        b"\xc3\xa9",
        b"\xc3",
        b"\xff",
        b"\xe2\x82\xac",
        b"\x80",
    ];
    // Random strings of those symbols, at every offset of a buffer (as subjects lie in
    // the read buffer), of lengths on both sides of the word loops' steps.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..20_000 {
        let mut text = vec![b'x'; (next() % 8) as usize];
        let offset = text.len();
        for _ in 0..next() % 40 {
            // Mostly ASCII, as subjects are.
            let r = next();
            let symbol = if r % 4 == 0 {
                symbols[(r >> 8) as usize % symbols.len()]
            } else {
                b"b"
            };
            text.extend_from_slice(symbol);
        }
        let bytes = &text[offset..];
        assert_eq!(
            super::connection::owned_text(bytes),
            reference(bytes),
            "{bytes:?}"
        );
    }
}

#[test]
fn deliverable_in_one_pass_is_the_subject_rules_plus_no_control_bytes_and_utf8() {
    use crate::proto::subject::validate_subject;
    let reference = |s: &[u8]| {
        validate_subject(s).is_ok()
            && !s.iter().any(|&b| b < 0x20 || b == 0x7f)
            && std::str::from_utf8(s).is_ok()
    };
    // Every string of up to 5 symbols over an alphabet holding each rule's edge.
    let alphabet: &[&[u8]] = &[
        b"a",
        b".",
        b"*",
        b">",
        b" ",
        b"\t",
        b"\x7f",
        b"\x1f",
        b"\xc3\xa9",
        b"\xc3",
        b"\xff",
    ];
    let mut cases: Vec<Vec<u8>> = vec![Vec::new()];
    let mut checked = 0;
    for _ in 0..5 {
        let mut next = Vec::new();
        for case in &cases {
            for symbol in alphabet {
                let mut longer = case.clone();
                longer.extend_from_slice(symbol);
                // Also past a word's worth of plain bytes, before and after, so each
                // edge falls in the word-at-a-time scan as well as in its tail.
                for padded in [
                    longer.clone(),
                    [b"abcdefghi".as_slice(), &longer].concat(),
                    [&longer, b"abcdefghi".as_slice()].concat(),
                    [b"abcdefghijklmno".as_slice(), &longer].concat(),
                    [&longer, b"abcdefghijklmno".as_slice()].concat(),
                ] {
                    assert_eq!(
                        super::connection::deliverable(&padded),
                        reference(&padded),
                        "{padded:?}"
                    );
                    checked += 1;
                }
                next.push(longer);
            }
        }
        cases = next;
    }
    assert!(!super::connection::deliverable(b""));
    assert!(checked > 100_000, "{checked}");
}

const TLS_INFO: &str = "INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576,\"tls_required\":true}\r\n";

fn closed_reason(events: &[Event]) -> Option<&Error> {
    events.iter().find_map(|e| match e {
        Event::Closed { reason } => Some(reason),
        _ => None,
    })
}

#[test]
fn tls_starts_after_the_info_that_offers_it_and_connect_says_so() {
    let mut h = Harness::new(Harness::options("tls://127.0.0.1:1"));
    h.conn.poll_connect(h.now).expect("dial");
    h.conn.on_transport_open(h.now);
    assert_eq!(
        h.conn.poll_start_tls(),
        None,
        "not before INFO without handshake_first"
    );
    h.conn.receive(TLS_INFO.as_bytes(), h.now);
    assert_eq!(h.conn.poll_start_tls().as_deref(), Some("127.0.0.1"));
    assert!(h.conn.is_tls());
    let out = ops(&h.take_output());
    assert!(out[0].contains("\"tls_required\":true"), "{out:?}");
    h.conn.receive(b"PONG\r\n", h.now);
    assert!(h.conn.is_connected());
}

#[test]
fn servers_named_in_the_plaintext_info_before_tls_are_not_learned() {
    // Anyone on the path can rewrite the INFO that precedes the TLS handshake: a server
    // it names would get the next connection and its credentials. Learned only from an
    // INFO that came under TLS.
    let mut h = Harness::new(Harness::options("tls://127.0.0.1:1"));
    h.conn.poll_connect(h.now).expect("dial");
    h.conn.on_transport_open(h.now);
    let forged = TLS_INFO.replace(
        "\"tls_required\":true",
        "\"tls_required\":true,\"connect_urls\":[\"evil.example:4222\"]",
    );
    h.conn.receive(forged.as_bytes(), h.now);
    assert_eq!(h.conn.poll_start_tls().as_deref(), Some("127.0.0.1"));
    h.conn.receive(b"PONG\r\n", h.now);
    assert!(h.conn.is_connected());
    assert!(
        h.conn.discovered_servers().is_empty(),
        "learnt in plaintext"
    );
    let under_tls = "INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576,\"connect_urls\":[\"10.0.0.2:4222\"]}\r\n";
    h.conn.receive(under_tls.as_bytes(), h.now);
    assert_eq!(h.conn.discovered_servers().len(), 1);
}

#[test]
fn a_server_without_tls_is_refused_when_tls_was_asked_for_never_downgraded() {
    let mut h = Harness::new(Harness::options("tls://h:1"));
    h.conn.poll_connect(h.now).expect("dial");
    h.conn.on_transport_open(h.now);
    h.conn.receive(INFO.as_bytes(), h.now);
    assert_eq!(h.conn.poll_start_tls(), None);
    assert!(h.conn.poll_close(), "the plaintext transport is dropped");
    assert!(h.take_output().is_empty(), "no CONNECT in plaintext");
    let events = h.events();
    assert!(
        matches!(closed_reason(&events), Some(Error::Tls(r)) if r.contains("offers no TLS")),
        "{events:?}"
    );
}

#[test]
fn a_server_requiring_tls_is_a_clear_error_without_tls_configured() {
    let mut h = Harness::new(Harness::options("nats://h:1"));
    h.conn.poll_connect(h.now).expect("dial");
    h.conn.on_transport_open(h.now);
    h.conn.receive(TLS_INFO.as_bytes(), h.now);
    assert!(h.take_output().is_empty());
    let events = h.events();
    assert!(
        matches!(closed_reason(&events), Some(Error::Tls(r)) if r.contains("requires TLS")),
        "{events:?}"
    );
}

#[test]
fn plaintext_injected_after_the_info_that_starts_tls_is_refused() {
    let mut h = Harness::new(Harness::options("tls://h:1"));
    h.conn.poll_connect(h.now).expect("dial");
    h.conn.on_transport_open(h.now);
    let injected = format!("{TLS_INFO}PONG\r\n");
    h.conn.receive(injected.as_bytes(), h.now);
    assert_eq!(
        h.conn.poll_start_tls(),
        None,
        "no session for this transport"
    );
    assert!(h.conn.poll_close());
    assert!(!h.conn.is_connected());
    let events = h.events();
    assert!(
        matches!(closed_reason(&events), Some(Error::Tls(r)) if r.contains("plaintext after")),
        "{events:?}"
    );
}

#[test]
fn handshake_first_starts_tls_at_once_and_servers_learned_later_keep_tls() {
    let mut o = Harness::options("tls://a:1");
    o.tls_handshake_first = true;
    let mut h = Harness::new(o);
    h.conn.poll_connect(h.now).expect("dial");
    h.conn.on_transport_open(h.now);
    assert_eq!(h.conn.poll_start_tls().as_deref(), Some("a"));
    let info = TLS_INFO.replace(
        "\"tls_required\":true",
        "\"tls_required\":true,\"connect_urls\":[\"10.0.0.2:4222\"]",
    );
    h.conn.receive(info.as_bytes(), h.now);
    h.take_output();
    h.conn.receive(b"PONG\r\n", h.now);
    assert!(h.conn.is_connected());
    assert!(h.conn.servers().iter().any(|s| s.host == "10.0.0.2"));

    // Lost; the learned server is dialled with TLS first as well, verified by its IP.
    h.conn.on_transport_closed(h.now, "gone");
    for _ in 0..4 {
        h.advance(Duration::from_secs(5));
        if let Some(addr) = h.conn.poll_connect(h.now) {
            h.conn.on_transport_open(h.now);
            assert_eq!(h.conn.poll_start_tls(), Some(addr.host.clone()), "{addr}");
            if addr.host == "10.0.0.2" {
                return;
            }
            h.conn.on_transport_closed(h.now, "refused");
        }
    }
    panic!("the learned server was never dialled");
}

#[test]
fn a_jetstream_delivery_read_before_its_subscription_ended_is_polled_as_unread() {
    // One read brought a message that ends a subscription (a durable's take-over) and a
    // delivery of that subscription behind it: the delivery was polled as a message to a
    // subscription nobody held any more and dropped, to wait out its ack wait.
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let control = h.conn.subscribe("control", None).expect("sub");
    let sid = h.conn.subscribe("pull.in", None).expect("sub");
    let ack = "$JS.ACK.AMP_TOPICS_dev.dsub_1_a_d.1.3.3.1700000000000000000.0";
    h.conn.receive(
        format!("MSG control {control} 4\r\nstop\r\nMSG pull.in {sid} {ack} 1\r\nx\r\nMSG pull.in {sid} 1\r\ny\r\n")
            .as_bytes(),
        h.now,
    );
    assert!(matches!(h.conn.poll_event(), Some(Event::Message { sid: s, .. }) if s == control));
    h.conn.unsubscribe(sid, None).expect("unsub");
    let rest: Vec<Event> = std::iter::from_fn(|| h.conn.poll_event()).collect();
    assert!(
        matches!(&rest[..], [Event::Unread { sid: s, msg }, Event::Message { sid: p, .. }]
            if *s == sid && *p == sid && msg.reply.as_deref() == Some(ack)),
        "{rest:?}"
    );
    // Once the events read before the end are polled, the end is forgotten.
    assert!(h.conn.ended_while_queued.is_empty());
}

#[test]
fn a_jetstream_delivery_after_unsubscribe_is_handed_over_as_unread() {
    // Found by the simulator (seeds 0x5a6, 0x6bf): an event the server sent to a durable
    // subscription's pull inbox just before the UNSUB reached it was dropped here, so it
    // waited out its ack wait (30 s) and a session resuming sooner started past it.
    let mut h = Harness::new(Harness::options("h:1"));
    h.connect();
    h.events();
    let sid = h.conn.subscribe("pull.in", None).expect("sub");
    h.conn.unsubscribe(sid, None).expect("unsub");
    let ack = "$JS.ACK.AMP_TOPICS_dev.dsub_1_a_d.1.3.3.1700000000000000000.0";
    h.conn.receive(
        format!("MSG pull.in {sid} {ack} 1\r\nx\r\n").as_bytes(),
        h.now,
    );
    // A plain message on an ended subscription is still nobody's: dropped, and said so.
    h.conn
        .receive(format!("MSG pull.in {sid} 1\r\ny\r\n").as_bytes(), h.now);
    let events = h.events();
    assert!(
        matches!(&events[..], [Event::Unread { sid: s, msg }, Event::AfterUnsubscribe { dropped: 1 }]
            if *s == sid && msg.reply.as_deref() == Some(ack)),
        "{events:?}"
    );
}

/// SUB, UNSUB and PING lines went into the write buffer unchecked: a server that did not
/// read, with the broker subscribing and unsubscribing again and again (topic
/// subscriptions, offer watches, MIG), grew it without end.
#[test]
fn control_lines_count_against_the_write_buffer_bound() {
    let mut o = Harness::options("h:1");
    o.max_write_buffer = 1000;
    let mut h = Harness::new(o);
    h.connect();
    h.events();
    let early = h.conn.subscribe("early", None).expect("room");
    h.conn.publish("a", None, None, &[0; 950]).expect("fits");
    let mut refused = 0;
    for i in 0..1000 {
        match h.conn.subscribe(&format!("churn.{i}"), None) {
            Ok(sid) => h.conn.unsubscribe(sid, None).expect("ends"),
            Err(e) => {
                assert_eq!(e, Error::WriteBufferFull { capacity: 1000 });
                refused += 1;
            }
        }
        if let Err(e) = h.conn.ping() {
            assert_eq!(e, Error::WriteBufferFull { capacity: 1000 });
        }
        assert!(
            h.conn.output().len() <= 1000,
            "{} bytes unwritten",
            h.conn.output().len()
        );
    }
    assert!(refused > 990, "{refused}");
    // An UNSUB with no room still ends the subscription here; its line waits for room.
    h.conn.unsubscribe(early, None).expect("ends");
    assert!(h.conn.output().len() <= 1000);
    let written = ops(&h.take_output());
    assert!(
        !written.iter().any(|op| op.starts_with("SUB churn")),
        "{written:?}"
    );
    assert_eq!(ops(&h.take_output()), [format!("UNSUB {early} None")]);
    // What was refused was never live: the reconnect restores none of it.
    h.now += Duration::from_secs(5);
    h.conn.on_transport_closed(h.now, "reset by peer");
    h.events();
    h.connect();
    let restored = ops(&h.take_output());
    assert!(
        !restored.iter().any(|op| op.starts_with("SUB")),
        "{restored:?}"
    );
}

/// The silence probe's tests: 1.5 s probe and `limit`, connected, the keepalive out of
/// the way (their PINGs are the probe's).
const PROBE: Duration = Duration::from_millis(1500);

fn probed(limit: Option<Duration>) -> Harness {
    let mut o = Harness::options("h:1");
    o.silence_probe = Some(PROBE);
    o.silence_limit = limit;
    o.ping_interval = Duration::from_secs(600);
    let mut h = Harness::new(o);
    h.connect();
    h.events();
    h
}

#[test]
fn a_quiet_connection_is_probed_and_silent_until_it_reads_again() {
    // A link that dies without a word was found only by the keepalive: stale after two
    // unanswered PINGs, 60 to 90 s. The broker's main connection is probed sooner, and
    // its ingresses follow it being silent.
    let probe = PROBE;
    let mut h = probed(None);
    h.conn.subscribe("s", None).expect("sub");
    h.take_output();
    h.conn.receive(b"MSG s 1 2\r\nhi\r\n", h.now);

    // Writing and reading, the connection is not probed.
    for _ in 0..10 {
        h.conn.publish("p", None, None, b"x").expect("publish");
        assert_eq!(ops(&h.take_output()), ["PUB p x"]);
        h.advance(Duration::from_secs(1));
        h.conn.receive(b"MSG s 1 2\r\nhi\r\n", h.now);
    }
    // Nor is it with nothing written, however long.
    h.advance(Duration::from_secs(20));
    assert!(h.take_output().is_empty());

    // Written after a quiet spell: a PING with it; unanswered for as long, silent. Its
    // time is the write's, not one already past (the event loop took that for a stall,
    // and `/livez` answered 503 after every quiet spell of the broker's).
    h.conn.publish("p", None, None, b"x").expect("publish");
    h.take_output();
    assert_eq!(h.conn.poll_timeout(), Some(h.now), "due at the write");
    h.advance(Duration::ZERO);
    assert_eq!(ops(&h.take_output()), ["PING"]);
    h.advance(probe - Duration::from_millis(1));
    assert!(!h.conn.is_silent());
    h.advance(Duration::from_millis(1));
    assert!(h.conn.is_silent());
    assert!(h.conn.is_connected(), "left to the keepalive");
    assert!(h.take_output().is_empty(), "one probe at a time");
    h.advance(Duration::from_secs(5));
    assert!(h.take_output().is_empty(), "one probe at a time");

    // Anything read ends it, ahead of the PONG too; silent again once that much
    // time has passed without the PONG or any other read.
    h.conn.receive(b"MSG s 1 2\r\nhi\r\n", h.now);
    assert!(!h.conn.is_silent());
    h.advance(probe - Duration::from_millis(1));
    assert!(!h.conn.is_silent());
    h.advance(Duration::from_millis(1));
    assert!(h.conn.is_silent());
    // Input the shell holds unread counts as heard: the silence is the caller's.
    h.conn.input_held(h.now);
    assert!(!h.conn.is_silent());
    h.conn.receive(b"PONG\r\n", h.now);
    h.advance(Duration::from_secs(5));
    assert!(!h.conn.is_silent());
    assert!(h.take_output().is_empty(), "answered: no probe");
    let events = h.events();
    assert!(
        events.iter().all(|e| matches!(e, Event::Message { .. })),
        "the probe's PONG reaches no caller: {events:?}"
    );

    // A new transport starts heard.
    h.conn.publish("p", None, None, b"x").expect("publish");
    h.take_output();
    h.advance(Duration::ZERO);
    h.advance(probe);
    assert!(h.conn.is_silent());
    h.conn.on_transport_closed(h.now, "gone");
    assert!(!h.conn.is_silent());
    h.connect();
    h.advance(probe * 4);
    assert!(!h.conn.is_silent());
}

#[test]
fn a_connection_silent_for_its_limit_is_given_up_as_a_stale_one() {
    // Silent, it was given up only by the keepalive, 60 to 90 s on: meanwhile every
    // request went into the dead link and waited out its own timeout.
    let (probe, limit) = (PROBE, Duration::from_secs(10));
    let mut h = probed(Some(limit));
    let id = h
        .conn
        .request("q", None, b"x", Duration::from_secs(60), h.now)
        .expect("request");
    h.take_output();
    h.advance(probe);
    assert_eq!(ops(&h.take_output()), ["PING"]);
    h.advance(probe);
    assert!(h.conn.is_silent());
    assert_eq!(
        h.conn.silent_since(),
        Some(h.now - probe * 2),
        "its last read"
    );

    // A read within the limit ends it; silent again, the limit counts from then.
    h.advance(limit - Duration::from_millis(1));
    assert!(h.conn.is_connected());
    h.conn.receive(b"+OK\r\n", h.now);
    assert!(!h.conn.is_silent());
    h.advance(probe);
    assert!(h.conn.is_silent());
    h.advance(limit - Duration::from_millis(1));
    assert!(h.conn.is_connected());
    h.advance(Duration::from_millis(1));
    assert!(!h.conn.is_connected());
    assert!(h.conn.poll_close(), "the shell must drop the socket");
    let events = h.events();
    let quiet = (probe + limit).as_millis();
    assert!(
        matches!(
            &events[..],
            [
                Event::Disconnected { reason },
                Event::RequestFailed { id: failed, error: RequestError::Disconnected },
            ] if *failed == id
                && reason == &format!("stale connection: nothing read for {quiet} ms, a PING unanswered")
        ),
        "as on any loss: {events:?}"
    );
    assert!(h.conn.poll_connect(h.now).is_some(), "redialed at once");

    // Woken once, late, past both deadlines: silent and given up in that one call, not
    // left with a deadline already past (the loop takes one for a stall).
    h.conn.on_transport_open(h.now);
    h.conn.receive(INFO.as_bytes(), h.now);
    h.take_output();
    h.conn.receive(b"PONG\r\n", h.now);
    assert!(h.conn.is_connected());
    h.conn.publish("p", None, None, b"x").expect("publish");
    h.take_output();
    h.advance(probe);
    assert_eq!(ops(&h.take_output()), ["PING"]);
    h.advance(probe + limit * 2);
    assert!(!h.conn.is_connected());
    assert!(h.conn.poll_close());
}

#[test]
fn a_silent_connection_says_so_to_who_would_refuse_a_request_and_keeps_those_written() {
    // Silent until given up (10 s on), each new session request went into the dead link
    // all the same and waited out its own timeout: a session heard `unavailable` 4 s
    // after its send instead of at once. The broker's session queue asks `check_heard`.
    let probe = PROBE;
    let mut h = probed(Some(Duration::from_secs(10)));
    let timeout = Duration::from_secs(4);
    let written = h
        .conn
        .request("q", None, b"x", timeout, h.now)
        .expect("request");
    let out = ops(&h.take_output());
    let sub = out[0].split(' ').collect::<Vec<_>>();
    let (prefix, sid) = (sub[1].trim_end_matches('*').to_string(), sub[3].to_string());
    h.advance(probe);
    assert_eq!(ops(&h.take_output()), ["PING"]);
    h.advance(probe);
    assert!(h.conn.is_silent());

    let refused = h.conn.check_heard(h.now);
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("silent")),
        "while silent: {refused:?}"
    );
    assert!(h.take_output().is_empty());
    assert_eq!(h.conn.pending_requests(), 1, "the one written still waits");
    assert!(h.events().is_empty());

    // Anything read ends the silence: the written one's reply comes, and requests go
    // out again.
    let reply = format!("MSG {prefix}{} {sid} 2\r\nok\r\n", written.0);
    h.conn.receive(reply.as_bytes(), h.now);
    assert!(!h.conn.is_silent());
    assert!(h.conn.check_heard(h.now).is_ok());
    let events = h.events();
    assert!(
        matches!(&events[..], [Event::Response { id, .. }] if *id == written),
        "{events:?}"
    );
    h.conn
        .request("q", None, b"z", timeout, h.now)
        .expect("a request once it reads again");
    assert_eq!(ops(&h.take_output()), ["PUB q z"]);
}

#[test]
fn a_ping_behind_a_backlog_the_link_takes_is_not_unanswered_yet() {
    // A slow link taking a large backlog reads nothing back while the PING waits behind
    // it: the server cannot answer what it has not been sent.
    let (probe, limit) = (PROBE, Duration::from_secs(10));
    let mut h = probed(Some(limit));
    h.conn
        .publish("p", None, None, &vec![b'x'; 100_000])
        .expect("publish");
    h.conn.consume_output_at(1000, h.now);
    h.advance(probe);
    h.advance(probe);
    assert!(
        h.conn.is_silent(),
        "the link took nothing since the PING was queued"
    );
    // 1000 bytes a second, 30 s: far past the limit, still taken, and not silent.
    for _ in 0..30 {
        h.advance(Duration::from_secs(1));
        h.conn.consume_output_at(1000, h.now);
        assert!(!h.conn.is_silent());
    }
    assert!(h.conn.is_connected());
    // The link takes no more (a dead one, its socket buffer full): silent `probe` after
    // its last write, given up the limit after that.
    let last = h.now;
    h.advance(probe);
    assert!(h.conn.is_silent());
    h.advance(limit - Duration::from_millis(1));
    assert!(h.conn.is_connected());
    h.advance(Duration::from_millis(1));
    assert!(
        !h.conn.is_connected(),
        "{:?} after its last write",
        h.now - last - probe
    );
    assert!(h.conn.poll_close());

    // Its PING written, unanswered `probe` from then, and given up the limit after that.
    h.connect();
    h.events();
    h.conn
        .publish("p", None, None, &vec![b'x'; 100_000])
        .expect("publish");
    h.conn.consume_output_at(1000, h.now);
    h.advance(probe);
    h.advance(probe + Duration::from_secs(3));
    let rest = h.conn.output().len();
    h.conn.consume_output_at(rest, h.now);
    h.advance(probe - Duration::from_millis(1));
    assert!(!h.conn.is_silent());
    h.advance(Duration::from_millis(1));
    assert!(h.conn.is_silent());
    h.advance(limit - Duration::from_millis(1));
    assert!(h.conn.is_connected());
    h.advance(Duration::from_millis(1));
    assert!(!h.conn.is_connected());
}

#[test]
fn without_a_silence_probe_only_the_keepalive_pings() {
    let mut o = Harness::options("h:1");
    o.ping_interval = Duration::from_secs(30);
    let mut h = Harness::new(o);
    h.connect();
    h.conn.publish("p", None, None, b"x").expect("publish");
    h.take_output();
    h.advance(Duration::from_secs(29));
    assert!(h.take_output().is_empty());
    assert!(!h.conn.is_silent());
    h.advance(Duration::from_secs(1));
    assert_eq!(ops(&h.take_output()), ["PING"]);
}

#[test]
fn a_link_still_taking_the_backlog_ahead_of_its_ping_is_not_silent() {
    // The limit waited for a PING behind a backlog the link is still taking, but
    // `is_silent`/`check_heard` did not: 3 s after the publish, with the PING not even
    // written and the link taking 1,000 bytes a second, a session's send, ack or
    // subscribe was refused `unavailable` and /readyz answered 503.
    let mut h = probed(Some(Duration::from_secs(10)));
    h.conn
        .publish("p", None, None, &vec![b'x'; 100_000])
        .expect("publish");
    h.conn.consume_output_at(1000, h.now);
    for _ in 0..6 {
        h.advance(Duration::from_millis(500));
        h.conn.consume_output_at(500, h.now);
    }
    assert!(
        !h.conn.output().is_empty(),
        "the PING still waits to be written"
    );
    assert!(
        h.conn.check_heard(h.now).is_ok(),
        "refused while the link takes what is ahead of the PING: {:?}",
        h.conn.check_heard(h.now)
    );
}
