//! The model on a virtual clock, driven with raw protocol bytes: no sockets, no sleeps.

use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

use super::{ClientId, ModelOptions, Server};

struct Harness {
    server: Server,
    now: Instant,
}

const CONNECT: &[u8] = b"CONNECT {\"verbose\":false,\"headers\":true,\"no_responders\":true}\r\n";

impl Harness {
    fn new() -> Harness {
        let now = Instant::now();
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        Harness {
            server: Server::new(ModelOptions::new(start), now),
            now,
        }
    }

    fn client(&mut self) -> ClientId {
        let c = self.server.accept(self.now);
        let info = self.server.take_output(c);
        assert!(
            info.starts_with(b"INFO {"),
            "{}",
            String::from_utf8_lossy(&info)
        );
        self.server.receive(c, CONNECT, self.now);
        c
    }

    fn send(&mut self, c: ClientId, bytes: &[u8]) -> String {
        self.server.receive(c, bytes, self.now);
        self.out(c)
    }

    fn out(&mut self, c: ClientId) -> String {
        String::from_utf8_lossy(&self.server.take_output(c)).into_owned()
    }

    /// Moves the virtual clock, firing every timer on the way at its own instant.
    fn advance(&mut self, d: Duration) {
        let until = self.now + d;
        while let Some(t) = self.server.poll_timeout().filter(|t| *t <= until) {
            self.now = t.max(self.now);
            self.server.handle_timeout(self.now);
        }
        self.now = until;
        self.server.handle_timeout(self.now);
    }

    /// A request on `subject`; the JSON body of its reply.
    fn api(&mut self, c: ClientId, subject: &str, body: &str) -> Value {
        self.send(c, b"SUB _R 99\r\n");
        let req = format!("PUB {subject} _R {}\r\n{body}\r\n", body.len());
        let out = self.send(c, req.as_bytes());
        self.send(c, b"UNSUB 99\r\n");
        let json = out.split("\r\n").nth(1).unwrap_or_default();
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    fn hpub(
        &mut self,
        c: ClientId,
        subject: &str,
        headers: &[(&str, &str)],
        payload: &str,
    ) -> Value {
        let mut h = String::from("NATS/1.0\r\n");
        for (k, v) in headers {
            h.push_str(&format!("{k}: {v}\r\n"));
        }
        h.push_str("\r\n");
        self.send(c, b"SUB _A 98\r\n");
        let req = format!(
            "HPUB {subject} _A {} {}\r\n{h}{payload}\r\n",
            h.len(),
            h.len() + payload.len()
        );
        let out = self.send(c, req.as_bytes());
        self.send(c, b"UNSUB 98\r\n");
        let json = out.split("\r\n").nth(1).unwrap_or_default();
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    fn stream(&mut self, c: ClientId, config: &str) {
        let name: Value = serde_json::from_str(config).expect("config");
        let name = name["name"].as_str().expect("name").to_string();
        let r = self.api(c, &format!("$JS.API.STREAM.CREATE.{name}"), config);
        assert!(r.get("error").is_none(), "{r}");
    }

    fn consumer(&mut self, c: ClientId, stream: &str, config: &str) {
        let body = format!("{{\"stream_name\":\"{stream}\",\"config\":{config}}}");
        let r = self.api(c, &format!("$JS.API.CONSUMER.CREATE.{stream}"), &body);
        assert!(r.get("error").is_none(), "{r}");
    }

    /// A pull on the consumer; what arrives on its inbox.
    fn pull(&mut self, c: ClientId, stream: &str, consumer: &str, body: &str) -> String {
        self.send(c, b"SUB _P.* 97\r\n");
        let req = format!(
            "PUB $JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer} _P.1 {}\r\n{body}\r\n",
            body.len()
        );
        self.send(c, req.as_bytes())
    }
}

/// The ack reply subjects in some output.
fn acks(out: &str) -> Vec<String> {
    out.split("\r\n")
        .filter(|l| l.starts_with("MSG ") || l.starts_with("HMSG "))
        .filter_map(|l| {
            l.split(' ')
                .find(|t| t.starts_with("$JS.ACK."))
                .map(String::from)
        })
        .collect()
}

#[test]
fn pub_sub_ping_and_wildcards() {
    let mut h = Harness::new();
    let c = h.client();
    assert_eq!(h.send(c, b"PING\r\n"), "PONG\r\n");
    let out = h.send(
        c,
        b"SUB a.* 1\r\nSUB a.> 2\r\nSUB b 3\r\nPUB a.x 2\r\nhi\r\nPUB a.x.y 0\r\n\r\n",
    );
    assert_eq!(
        out,
        "MSG a.x 1 2\r\nhi\r\nMSG a.x 2 2\r\nhi\r\nMSG a.x.y 2 0\r\n\r\n"
    );
    let out = h.send(c, b"UNSUB 2\r\nPUB a.x r 1\r\nz\r\n");
    assert_eq!(out, "MSG a.x 1 r 1\r\nz\r\n");
}

#[test]
fn the_same_inputs_give_the_same_bytes() {
    let run = || {
        let mut h = Harness::new();
        let c = h.client();
        h.stream(c, r#"{"name":"S","subjects":["s.>"]}"#);
        h.consumer(c, "S", r#"{"ack_policy":"explicit"}"#);
        let mut all = String::new();
        for i in 0..3 {
            all += &h.send(c, format!("PUB s.{i} 1\r\n{i}\r\n").as_bytes());
        }
        all += &h.api(c, "$JS.API.STREAM.INFO.S", "").to_string();
        all
    };
    assert_eq!(run(), run());
}

#[test]
fn a_queue_group_gives_each_message_to_one_member() {
    let mut h = Harness::new();
    let (a, b) = (h.client(), h.client());
    h.send(a, b"SUB q g 1\r\n");
    h.send(b, b"SUB q g 1\r\n");
    let p = h.client();
    for _ in 0..4 {
        h.send(p, b"PUB q 1\r\nx\r\n");
    }
    assert_eq!(h.out(a).matches("MSG q").count(), 2);
    assert_eq!(h.out(b).matches("MSG q").count(), 2);
}

#[test]
fn a_request_nobody_hears_gets_a_503_status() {
    let mut h = Harness::new();
    let c = h.client();
    let out = h.send(c, b"SUB _INBOX.x 1\r\nPUB nobody _INBOX.x 0\r\n\r\n");
    assert_eq!(out, "HMSG _INBOX.x 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n");
    // Without no_responders in CONNECT there is no answer.
    let quiet = h.server.accept(h.now);
    h.server.take_output(quiet);
    let out = h.send(
        quiet,
        b"CONNECT {}\r\nSUB _INBOX.y 1\r\nPUB nobody _INBOX.y 0\r\n\r\n",
    );
    assert_eq!(out, "");
}

#[test]
fn a_protocol_error_is_answered_and_closes_the_connection() {
    let mut h = Harness::new();
    let c = h.client();
    assert_eq!(
        h.send(c, b"BOGUS\r\n"),
        "-ERR 'Unknown Protocol Operation'\r\n"
    );
    assert!(h.server.is_closed(c));
    assert_eq!(h.send(c, b"PING\r\n"), "");
    let c = h.client();
    assert_eq!(h.send(c, b"SUB a..b 1\r\n"), "-ERR 'Invalid Subject'\r\n");
    assert!(!h.server.is_closed(c));
}

#[test]
fn arbitrary_bytes_never_panic_and_buffers_stay_bounded() {
    let mut h = Harness::new();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let pieces: [&[u8]; 10] = [
        b"PUB a 3\r\nabc\r\n",
        b"HPUB $JS.API.STREAM.CREATE.S _R 12 14\r\nNATS/1.0\r\n\r\n{}\r\n",
        b"SUB > 1\r\n",
        b"HPUB s 5 5\r\nNATS/\r\n",
        b"PUB $JS.API.CONSUMER.CREATE.S _R 2\r\n{}\r\n",
        b"PUB $JS.ACK.S.X.1.1.1.1.0 0\r\n\r\n",
        b"PUB $JS.API.CONSUMER.MSG.NEXT.S.X _R 1\r\n5\r\n",
        b"UNSUB 1 3\r\n",
        b"\r\n\r\n",
        b"PUB x 999999999\r\n",
    ];
    for _ in 0..200 {
        let c = h.client();
        for _ in 0..50 {
            let r = next();
            let mut bytes = pieces[(r % 10) as usize].to_vec();
            if r % 7 == 0 {
                let at = (r >> 8) as usize % bytes.len();
                bytes[at] = (r >> 16) as u8;
            }
            h.server.receive(c, &bytes, h.now);
            assert!(h.server.output(c).len() <= h.server.options().max_pending_output);
            if h.server.is_closed(c) {
                break;
            }
        }
        h.advance(Duration::from_millis(100));
        h.server.disconnect(c, h.now);
    }
}

#[test]
fn a_msg_id_seen_within_the_window_is_a_duplicate() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(
        c,
        r#"{"name":"S","subjects":["s"],"duplicate_window":1000000000}"#,
    );
    let first = h.hpub(c, "s", &[("Nats-Msg-Id", "m1")], "x");
    let again = h.hpub(c, "s", &[("Nats-Msg-Id", "m1")], "x");
    assert_eq!(first, serde_json::json!({"stream": "S", "seq": 1}));
    assert_eq!(
        again,
        serde_json::json!({"stream": "S", "seq": 1, "duplicate": true})
    );
    h.advance(Duration::from_secs(2));
    let later = h.hpub(c, "s", &[("Nats-Msg-Id", "m1")], "x");
    assert_eq!(later["seq"], 2);
}

#[test]
fn expected_last_sequences_guard_the_write() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(c, r#"{"name":"S","subjects":["s.>"]}"#);
    h.hpub(c, "s.a", &[], "1");
    let wrong = h.hpub(c, "s.b", &[("Nats-Expected-Last-Sequence", "5")], "2");
    assert_eq!(wrong["error"]["err_code"], 10071, "{wrong}");
    let ok = h.hpub(
        c,
        "s.a",
        &[("Nats-Expected-Last-Subject-Sequence", "1")],
        "3",
    );
    assert_eq!(ok["seq"], 2);
    let cas = h.hpub(
        c,
        "s.a",
        &[("Nats-Expected-Last-Subject-Sequence", "1")],
        "4",
    );
    assert_eq!(cas["error"]["description"], "wrong last sequence: 2");
    let fresh = h.hpub(
        c,
        "s.new",
        &[("Nats-Expected-Last-Subject-Sequence", "0")],
        "5",
    );
    assert_eq!(fresh["seq"], 3);
}

#[test]
fn a_message_ttl_expires_and_leaves_a_marker_when_asked() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(
        c,
        r#"{"name":"T","subjects":["t.>"],"allow_msg_ttl":true,"subject_delete_marker_ttl":5000000000,"allow_direct":true}"#,
    );
    let ack = h.hpub(c, "t.a", &[("Nats-TTL", "1s")], "v");
    assert_eq!(ack["seq"], 1);
    h.advance(Duration::from_millis(999));
    let got = h.api(c, "$JS.API.STREAM.MSG.GET.T", r#"{"seq":1}"#);
    assert!(got.get("message").is_some(), "{got}");
    h.advance(Duration::from_millis(1));
    let gone = h.api(c, "$JS.API.STREAM.MSG.GET.T", r#"{"seq":1}"#);
    assert_eq!(gone["error"]["err_code"], 10037);
    h.send(c, b"SUB _D 5\r\n");
    let marker = h.send(c, b"PUB $JS.API.DIRECT.GET.T.t.a _D 0\r\n\r\n");
    assert!(marker.contains("Nats-Marker-Reason: MaxAge"), "{marker}");
    assert!(marker.contains("Nats-Sequence: 2"), "{marker}");
    h.advance(Duration::from_secs(5));
    let info = h.api(c, "$JS.API.STREAM.INFO.T", "");
    assert_eq!(info["state"]["messages"], 0, "{info}");
}

#[test]
fn ack_wait_in_progress_nak_delay_and_term() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(c, r#"{"name":"A","subjects":["a"]}"#);
    h.send(c, b"PUB a 2\r\nm0\r\nPUB a 2\r\nm1\r\n");
    h.consumer(
        c,
        "A",
        r#"{"durable_name":"C","ack_policy":"explicit","ack_wait":1000000000}"#,
    );
    let out = h.pull(c, "A", "C", r#"{"batch":2}"#);
    let first = acks(&out);
    assert_eq!(first.len(), 2, "{out}");
    assert!(first[0].starts_with("$JS.ACK.A.C.1.1.1."), "{}", first[0]);
    h.send(c, format!("PUB {} 5\r\n+TERM\r\n", first[1]).as_bytes());
    // +WPI restarts the ack wait.
    h.advance(Duration::from_millis(900));
    h.send(c, format!("PUB {} 4\r\n+WPI\r\n", first[0]).as_bytes());
    h.advance(Duration::from_millis(900));
    assert!(
        h.pull(c, "A", "C", r#"{"batch":1,"no_wait":true}"#)
            .contains("404 No Messages")
    );
    h.advance(Duration::from_millis(200));
    let again = acks(&h.pull(c, "A", "C", r#"{"batch":5,"no_wait":true}"#));
    assert_eq!(again.len(), 1);
    assert!(again[0].starts_with("$JS.ACK.A.C.2.1.3."), "{}", again[0]);
    // -NAK with a delay holds it back that long.
    let nak = r#"-NAK {"delay":3000000000}"#;
    h.send(
        c,
        format!("PUB {} {}\r\n{nak}\r\n", again[0], nak.len()).as_bytes(),
    );
    h.advance(Duration::from_millis(2900));
    assert!(
        h.pull(c, "A", "C", r#"{"batch":1,"no_wait":true}"#)
            .contains("404")
    );
    h.advance(Duration::from_millis(100));
    let third = acks(&h.pull(c, "A", "C", r#"{"batch":1,"no_wait":true}"#));
    assert!(third[0].starts_with("$JS.ACK.A.C.3.1.4."), "{third:?}");
    h.send(c, format!("PUB {} 4\r\n+ACK\r\n", third[0]).as_bytes());
    let info = h.api(c, "$JS.API.CONSUMER.INFO.A.C", "");
    assert_eq!(info["num_ack_pending"], 0, "{info}");
    assert_eq!(info["ack_floor"]["stream_seq"], 2, "{info}");
}

#[test]
fn pull_statuses_timeout_heartbeat_and_max_waiting() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(c, r#"{"name":"P","subjects":["p"]}"#);
    h.consumer(c, "P", r#"{"durable_name":"C","max_waiting":1}"#);
    let out = h.pull(
        c,
        "P",
        "C",
        r#"{"batch":3,"expires":1000000000,"idle_heartbeat":400000000}"#,
    );
    assert_eq!(out, "");
    let refused = h.pull(c, "P", "C", r#"{"batch":1,"expires":1000000000}"#);
    assert!(
        refused.contains("NATS/1.0 409 Exceeded MaxWaiting"),
        "{refused}"
    );
    h.advance(Duration::from_millis(400));
    assert!(h.out(c).contains("NATS/1.0 100 Idle Heartbeat"));
    assert_eq!(acks(&h.send(c, b"PUB p 1\r\nx\r\n")).len(), 1);
    h.advance(Duration::from_millis(600));
    let end = h.out(c);
    assert!(
        end.contains("NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 2\r\n"),
        "{end}"
    );
}

#[test]
fn a_work_queue_forgets_what_was_acked() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(
        c,
        r#"{"name":"W","subjects":["w"],"retention":"workqueue"}"#,
    );
    h.send(c, b"PUB w 1\r\n1\r\nPUB w 1\r\n2\r\n");
    h.consumer(c, "W", r#"{"durable_name":"C"}"#);
    let got = acks(&h.pull(c, "W", "C", r#"{"batch":2}"#));
    h.send(c, format!("PUB {} 0\r\n\r\n", got[0]).as_bytes());
    let info = h.api(c, "$JS.API.STREAM.INFO.W", "");
    assert_eq!(info["state"]["messages"], 1);
    assert_eq!(info["state"]["first_seq"], 2);
}

#[test]
fn kv_update_is_compare_and_set_and_purge_rolls_up() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(
        c,
        r#"{"name":"KV_b","subjects":["$KV.b.>"],"max_msgs_per_subject":5,"allow_rollup_hdrs":true,"deny_delete":true,"allow_direct":true,"discard":"new"}"#,
    );
    let r1 = h.hpub(c, "$KV.b.k", &[], "1")["seq"].as_u64().expect("seq");
    let r2 = h.hpub(
        c,
        "$KV.b.k",
        &[("Nats-Expected-Last-Subject-Sequence", &r1.to_string())],
        "2",
    );
    assert_eq!(r2["seq"], 2);
    let stale = h.hpub(
        c,
        "$KV.b.k",
        &[("Nats-Expected-Last-Subject-Sequence", &r1.to_string())],
        "3",
    );
    assert_eq!(stale["error"]["err_code"], 10071);
    let purge = h.hpub(
        c,
        "$KV.b.k",
        &[("KV-Operation", "PURGE"), ("Nats-Rollup", "sub")],
        "",
    );
    assert_eq!(purge["seq"], 3);
    let info = h.api(c, "$JS.API.STREAM.INFO.KV_b", "");
    assert_eq!(info["state"]["messages"], 1);
    let refused = h.api(c, "$JS.API.STREAM.MSG.DELETE.KV_b", r#"{"seq":3}"#);
    assert!(refused.get("error").is_some());
}

#[test]
fn push_consumers_heartbeat_and_wait_for_flow_control() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(c, r#"{"name":"F","subjects":["f"]}"#);
    let chunk = "z".repeat(100 * 1024);
    for _ in 0..4 {
        h.send(
            c,
            format!("PUB f {}\r\n{chunk}\r\n", chunk.len()).as_bytes(),
        );
    }
    h.consumer(
        c,
        "F",
        r#"{"deliver_subject":"deliver","ack_policy":"none","flow_control":true,"idle_heartbeat":1000000000}"#,
    );
    // Nothing is pushed until someone listens on the deliver subject.
    let out = h.send(c, b"SUB deliver 7\r\n");
    assert_eq!(acks(&out).len(), 3, "stops at the flow-control request");
    let fc = out
        .split("\r\n")
        .find(|l| l.starts_with("HMSG deliver 7 $JS.FC."))
        .and_then(|l| l.split(' ').nth(3))
        .expect("flow control request")
        .to_string();
    assert_eq!(
        acks(&h.send(c, format!("PUB {fc} 0\r\n\r\n").as_bytes())).len(),
        1
    );
    h.advance(Duration::from_secs(1));
    let hb = h.out(c);
    assert!(
        hb.contains("100 Idle Heartbeat\r\nNats-Last-Consumer: 4\r\nNats-Last-Stream: 4"),
        "{hb}"
    );
}

#[test]
fn an_ephemeral_consumer_goes_after_its_inactive_threshold() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(c, r#"{"name":"E","subjects":["e"]}"#);
    h.consumer(c, "E", r#"{"name":"eph","inactive_threshold":2000000000}"#);
    h.advance(Duration::from_millis(1900));
    assert!(
        h.api(c, "$JS.API.CONSUMER.INFO.E.eph", "")
            .get("error")
            .is_none()
    );
    h.advance(Duration::from_millis(100));
    let gone = h.api(c, "$JS.API.CONSUMER.INFO.E.eph", "");
    assert_eq!(gone["error"]["err_code"], 10014);
}

#[test]
fn restart_drops_clients_and_keeps_streams() {
    let mut h = Harness::new();
    let c = h.client();
    h.stream(c, r#"{"name":"R","subjects":["r"]}"#);
    h.send(c, b"PUB r 1\r\nx\r\n");
    h.server.restart(h.now);
    assert!(h.server.is_closed(c));
    let c = h.client();
    let info = h.api(c, "$JS.API.STREAM.INFO.R", "");
    assert_eq!(info["state"]["messages"], 1);
}
