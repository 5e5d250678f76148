//! A hostile NATS client: nats-server (not pedantic) accepts any byte but a blank or LF in
//! a published subject and delivers it to matching subscriptions. Such a message reaching
//! one of the broker's subscriptions must be dropped and counted, never break the broker's
//! NATS connection (which every session shares).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::amp::{Broker, Client, http_get, open_config};
use common::{NatsServer, wait_until};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

/// A plain NATS client on a raw socket.
fn raw_client(nats: &NatsServer) -> TcpStream {
    let mut s = TcpStream::connect(nats.addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    s.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1}\r\nPING\r\n")
        .expect("write");
    s
}

fn metric(broker: &Broker, name: &str) -> Option<f64> {
    let (_, body) = http_get(broker.addr, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

fn round_trip(a: &mut Client, b: &mut Client, n: u64) {
    let ok = a.request(json!({"op":"send","to":"b","body":{"n":n}}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let m = b.next_op("message", WAIT).expect("delivery");
    assert_eq!(m["body"]["n"], n);
    b.send(&json!({"op":"ack","seq":m["seq"]}));
}

/// Subjects the broker's connection subscribes to, learned from the reply subjects of its
/// JetStream API requests and pull requests (each `_AMP_BROKER.<token>.<n>` under a
/// wildcard subscription: the request inbox's, and one per pull loop).
fn sniff_broker_subjects(sniffer: &mut TcpStream, a: &mut Client, b: &mut Client) -> Vec<String> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 65536];
    let deadline = Instant::now() + WAIT;
    let mut n = 0;
    while Instant::now() < deadline {
        n += 1;
        round_trip(a, b, n);
        while let Ok(got) = sniffer.read(&mut buf) {
            if got == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..got]);
        }
        let text = String::from_utf8_lossy(&seen);
        let mut subjects: Vec<String> = text
            .split([' ', '\r', '\n'])
            .filter(|t| t.starts_with("_AMP_BROKER."))
            .map(str::to_string)
            .collect();
        subjects.sort();
        subjects.dedup();
        let mut prefixes: Vec<&str> = subjects
            .iter()
            .filter_map(|s| s.rsplit_once('.').map(|(prefix, _)| prefix))
            .collect();
        prefixes.dedup();
        // The request inbox and at least one pull loop's.
        if prefixes.len() >= 2 {
            return subjects;
        }
    }
    panic!(
        "no broker subjects seen: {}",
        String::from_utf8_lossy(&seen)
    );
}

#[test]
fn a_cr_in_a_delivered_subject_is_dropped_and_counted_and_the_nats_link_survives() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");

    let mut sniffer = raw_client(&nats);
    sniffer.write_all(b"SUB > 1\r\nPING\r\n").expect("sub");
    let subjects = sniff_broker_subjects(&mut sniffer, &mut a, &mut b);
    assert_eq!(metric(&broker, "amp_nats_reconnects_total"), Some(0.0));

    let mut attacker = raw_client(&nats);
    let mut attack = Vec::new();
    for s in &subjects {
        // Under a wildcard subscription: a CR or a control byte as the last token matches
        // it; the subject itself is delivered as is with a CR in the reply subject.
        if let Some((prefix, _)) = s.rsplit_once('.') {
            attack.extend_from_slice(format!("PUB {prefix}.\r 2\r\nhi\r\n").as_bytes());
            attack.extend_from_slice(format!("PUB {prefix}.\x01 2\r\nhi\r\n").as_bytes());
        }
        attack.extend_from_slice(format!("PUB {s} _INBOX.x\r 2\r\nhi\r\n").as_bytes());
    }
    attack.extend_from_slice(b"PING\r\n");
    attacker.write_all(&attack).expect("attack");

    assert!(
        wait_until(WAIT, || metric(&broker, "amp_nats_invalid_messages_total")
            .is_some_and(|n| n >= 2.0)),
        "the bad messages are counted; reconnects {:?}; log:\n{}",
        metric(&broker, "amp_nats_reconnects_total"),
        broker.log()
    );
    round_trip(&mut a, &mut b, 1000);
    assert_eq!(
        metric(&broker, "amp_nats_reconnects_total"),
        Some(0.0),
        "the broker's NATS connection never dropped; log:\n{}",
        broker.log()
    );
    assert_eq!(metric(&broker, "amp_nats_connected"), Some(1.0));
    assert!(!broker.log().contains("protocol error"), "{}", broker.log());
}

#[test]
fn a_stored_event_with_a_cr_in_its_subject_is_terminated_not_redelivered_forever() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["p", "s"]));
    let mut p = Client::login(&broker, "acme", "p", "p-token");
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    let ok = s.request(json!({"op":"subscribe","topic":"d.>","sub":"keep","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");

    // The topics stream (`amp.acme.topic.>`) stores what a plain client publishes there,
    // CR and all, and the durable consumer delivers it to the broker.
    let mut attacker = raw_client(&nats);
    attacker
        .write_all(b"PUB amp.acme.topic.d.x\r 2\r\nhi\r\nPING\r\n")
        .expect("attack");
    let ok = p.request(json!({"op":"publish","topic":"d.ok","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let event = s.next_op("event", WAIT).expect("the good event");
    assert_eq!(event["topic"], "d.ok", "{event}");
    s.send(&json!({"op":"ack","sub":"keep","seq":event["seq"]}));

    let mut js = amp_broker::jetstream::Context::new(
        amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&nats.url()))
            .expect("connect"),
    );
    let consumer = amp_broker::broker::binding::durable_sub_consumer("s", "keep");
    let mut last = None;
    let settled = wait_until(WAIT, || {
        let info = js.consumer_info("AMP_TOPICS_acme", &consumer);
        let done = info
            .as_ref()
            .is_ok_and(|i| i.num_ack_pending == 0 && i.delivered.stream_seq >= 2);
        last = Some(format!("{info:?}"));
        done
    });
    assert!(
        settled,
        "nothing stays pending (the bad event was terminated): {last:?}"
    );
    assert!(metric(&broker, "amp_nats_invalid_messages_total").is_some_and(|n| n >= 1.0));
    assert_eq!(metric(&broker, "amp_nats_reconnects_total"), Some(0.0));
}

#[test]
fn a_delivery_forged_on_a_pull_subject_is_not_taken_for_jetstreams() {
    // A peer that learnt a job queue's pull subject (a leaf site's hub sees every pull a
    // site sends into its domain; here a plain client sees all) puts a task there with a
    // reply subject of its own (nats-server refuses a `$JS.ACK` one from a client): the
    // broker took it for a delivery, read the task store for it and answered on the
    // forger's subject. A delivery is one whose ack subject names the pull's stream and
    // consumer.
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["w"]));
    let mut w = Client::login(&broker, "acme", "w", "w-token");
    let mut sniffer = raw_client(&nats);
    sniffer
        .write_all(b"SUB $JS.API.CONSUMER.MSG.NEXT.AMP_TASKS_acme.job_j 1\r\nPING\r\n")
        .expect("sub");
    let ok = w.request(json!({"op":"serve","job":"j","slots":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let mut seen = Vec::new();
    let mut buf = [0u8; 65536];
    let deadline = Instant::now() + WAIT;
    let reply = loop {
        while let Ok(got) = sniffer.read(&mut buf) {
            if got == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..got]);
        }
        let text = String::from_utf8_lossy(&seen);
        let reply = text.split("\r\n").find_map(|line| {
            let mut parts = line.split(' ');
            (parts.next() == Some("MSG")).then_some(())?;
            parts.nth(2).map(str::to_string)
        });
        if let Some(reply) = reply {
            break reply;
        }
        assert!(Instant::now() < deadline, "no pull seen: {text}");
    };
    let mut attacker = raw_client(&nats);
    attacker
        .write_all(b"SUB _INBOX.evil.> 1\r\nPING\r\n")
        .expect("sub");
    let forged = json!({"id":"t-forged","kind":"task","from":"acme/ceo","job":"j",
        "ts":"2026-12-07T00:00:00Z","headers":{},"body":"wire the money"})
    .to_string();
    attacker
        .write_all(
            format!(
                "PUB {reply} _INBOX.evil.1 {}\r\n{forged}\r\nPING\r\n",
                forged.len()
            )
            .as_bytes(),
        )
        .expect("attack");
    let offer = w.next_op("offer", Duration::from_secs(1));
    assert!(offer.is_none(), "{offer:?}");
    let mut answered = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        if let Ok(got) = attacker.read(&mut buf) {
            answered.extend_from_slice(&buf[..got]);
        }
    }
    let answered = String::from_utf8_lossy(&answered);
    assert!(
        !answered.contains("MSG _INBOX.evil"),
        "the broker acted on the forged delivery: {answered}"
    );
}

/// A MIG `hello` of participant `name` (its token, its reply prefix) over plain NATS.
fn mig_hello(nats: &NatsServer, name: &str) -> Result<serde_json::Value, String> {
    mig_hello_within(nats, name, WAIT)
}

/// [`mig_hello`], waiting at most `wait` for the answer.
fn mig_hello_within(
    nats: &NatsServer,
    name: &str,
    wait: Duration,
) -> Result<serde_json::Value, String> {
    let options = amp_broker::nats::Options::new(&nats.url())
        .with_inbox_prefix(&format!("_INBOX_acme_{name}"));
    let mut nc = amp_broker::nats::Client::connect(options).map_err(|e| e.to_string())?;
    let mut h = amp_broker::nats::HeaderMap::new();
    h.insert("Authorization", &format!("Bearer {name}-token"))
        .map_err(|e| e.to_string())?;
    let body = json!({"header": {"tenant_id": "acme"}}).to_string();
    let r = nc
        .request("mig.v0_1.acme.hello", Some(&h), body.as_bytes(), wait)
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&r.payload).map_err(|e| e.to_string())
}

/// Takes and acks `b`'s messages until the one with body `{"n": n}`; false if none came.
/// A send that timed out may have been stored all the same: its delivery is passed over.
fn delivered(b: &mut Client, n: u64) -> bool {
    while let Some(m) = b.next_op("message", WAIT) {
        b.send(&json!({"op":"ack","seq":m["seq"]}));
        if m["body"]["n"] == n {
            return true;
        }
    }
    false
}

/// With MIG on, any participant with a NATS credential may publish on the MIG request
/// subjects, and nats-server delivers what it publishes there to a broker as fast as it
/// is sent. Those subjects were subscribed on the broker's only NATS connection, the one
/// that carries every session's JetStream replies: a flood of empty requests queued in
/// nats-server ahead of them, sends timed out ('JetStream is unavailable: request timed
/// out' after 4 s) and the server cut the connection as a slow consumer, every session's
/// JetStream traffic with it. They now come on a second connection, read a little each
/// loop turn: the flood delays (or gets cut) only that one.
#[test]
fn a_flood_on_the_mig_request_subjects_does_not_hold_up_sessions_jetstream_replies() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["mig"] = json!({"enabled": true});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    round_trip(&mut a, &mut b, 0);
    let hello = mig_hello(&nats, "a").expect("MIG answers");
    assert_eq!(hello["selected_version"], "0.1", "{hello}");

    let flooding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut attacker = raw_client(&nats);
    let flood = {
        let flooding = flooding.clone();
        std::thread::spawn(move || {
            let one = b"PUB mig.v0_1.acme.invoke.x 0\r\n\r\n";
            let chunk = one.repeat((1 << 20) / one.len());
            while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                // nats-server may cut this connection too; the flood then ends early.
                if attacker.write_all(&chunk).is_err() {
                    break;
                }
            }
        })
    };
    let started = Instant::now();
    let mut worst = Duration::ZERO;
    let mut failed = Vec::new();
    let mut n = 0;
    while started.elapsed() < Duration::from_secs(10) {
        n += 1;
        let t = Instant::now();
        let ok = a.request(json!({"op":"send","to":"b","body":{"n":n}}));
        if ok["op"] != "ok" {
            failed.push(format!("send {n} after {:?}: {ok}", t.elapsed()));
        } else if !delivered(&mut b, n) {
            failed.push(format!("send {n} not delivered"));
        }
        worst = worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(100).saturating_sub(t.elapsed()));
    }
    flooding.store(false, std::sync::atomic::Ordering::Relaxed);
    flood.join().expect("flood thread");
    let reached = metric(
        &broker,
        "amp_mig_rejected_total{reason=\"no_reply_subject\"}",
    );
    eprintln!(
        "{n} round trips, worst {worst:?}; {reached:?} flood messages reached MIG; \
         ingress reconnects {:?}",
        metric(
            &broker,
            "amp_nats_ingress_reconnects_total{connection=\"requests\"}"
        )
    );
    assert!(
        reached.is_some_and(|d| d > 1000.0),
        "the flood reached the broker: {reached:?}"
    );
    assert!(
        failed.is_empty() && worst < Duration::from_secs(1),
        "{n} round trips, worst {worst:?}, failed: {failed:?}; log:\n{}",
        broker.log()
    );
    assert_eq!(
        metric(&broker, "amp_nats_reconnects_total"),
        Some(0.0),
        "log:\n{}",
        broker.log()
    );
    assert!(
        !broker.log().contains("NATS connection down"),
        "{}",
        broker.log()
    );
    // Busy, the main connection reads all the time: never taken for silent, its
    // ingresses never unsubscribed.
    assert!(
        !broker.log().contains("NATS connection silent"),
        "{}",
        broker.log()
    );
    // Whether or not the server cut the ingress connection, MIG answers again, once
    // what the server had queued for it is read (up to its 64 MiB `max_pending`: about
    // 10 s for a debug build on two busy cores).
    let mut answer = Err(String::new());
    let after = Instant::now();
    let answered = wait_until(Duration::from_secs(60), || {
        answer = mig_hello(&nats, "a");
        answer.is_ok()
    });
    assert!(answered, "MIG answers after the flood: {answer:?}");
    eprintln!("MIG answered {:?} after the flood", after.elapsed());
}

/// The ingress connection comes back with the server as the main one does, its
/// subscriptions with it, and MIG answers again (through the main connection).
#[test]
fn mig_requests_are_answered_again_after_the_server_restarts() {
    let mut nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["mig"] = json!({"enabled": true});
    let broker = Broker::start(&nats.url(), &config);
    let hello = mig_hello(&nats, "a").expect("MIG answers");
    assert_eq!(hello["selected_version"], "0.1", "{hello}");
    assert_eq!(
        metric(
            &broker,
            "amp_nats_ingress_connected{connection=\"requests\"}"
        ),
        Some(1.0)
    );

    nats.kill();
    assert!(
        wait_until(WAIT, || metric(&broker, "amp_nats_connected") == Some(0.0)
            && ["requests", "events"].iter().all(|c| metric(
                &broker,
                &format!("amp_nats_ingress_connected{{connection=\"{c}\"}}")
            ) == Some(0.0))),
        "the three connections seen down; log:\n{}",
        broker.log()
    );
    nats.start_again();
    let mut answer = Err(String::new());
    let answered = wait_until(Duration::from_secs(30), || {
        answer = mig_hello(&nats, "a");
        answer.is_ok()
    });
    assert!(answered, "{answer:?}; log:\n{}", broker.log());
    // Each ingress once (the events one may still be on its way back).
    for c in ["requests", "events"] {
        let name = format!("amp_nats_ingress_reconnects_total{{connection=\"{c}\"}}");
        wait_until(WAIT, || metric(&broker, &name) >= Some(1.0));
        assert_eq!(metric(&broker, &name), Some(1.0), "{name}");
    }
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    round_trip(&mut a, &mut b, 1);
}

/// MIG `hello`s `broker` answered.
fn hellos_answered(broker: &Broker) -> u64 {
    http_get(broker.addr, "/metrics")
        .map(|(_, body)| body)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("amp_mig_requests_total{op=\"hello\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Whether the server at monitoring address `monitor` holds a broker's requests ingress
/// connection with no subscription: it has that broker's UNSUBs.
fn an_ingress_unsubscribed(monitor: &str) -> bool {
    let connz = (|| {
        let mut s = TcpStream::connect(monitor).ok()?;
        s.set_read_timeout(Some(WAIT)).ok()?;
        // HTTP/1.0: the answer ends with the connection, never chunked.
        s.write_all(b"GET /connz HTTP/1.0\r\n\r\n").ok()?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).ok()?;
        let (_, body) = answer.split_once("\r\n\r\n")?;
        serde_json::from_str::<serde_json::Value>(body).ok()
    })();
    connz
        .as_ref()
        .and_then(|c| c["connections"].as_array())
        .is_some_and(|conns| {
            conns.iter().any(|c| {
                c["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with(" ingress requests"))
                    && c["subscriptions"] == 0
            })
        })
}

/// What a broker's ingress connection brings is answered on its main connection. With
/// the main connection down, the ingress kept its queue group subscriptions: the server
/// went on handing the broker its share of MIG requests (and of callout requests), which
/// it dropped, and their callers waited out their timeouts while another broker could
/// have answered every one.
#[test]
fn with_its_main_connection_down_a_broker_leaves_mig_requests_to_the_others() {
    let monitor = format!("127.0.0.1:{}", common::free_port());
    let nats = NatsServer::with_config(&format!("http: \"{monitor}\""));
    let relay = common::relay::Relay::start(&nats.addr());
    let mut config = open_config(&["a", "b"]);
    config["mig"] = json!({"enabled": true});
    let a = Broker::start(&format!("nats://{}", relay.addr()), &config);
    let b = Broker::start(&nats.url(), &config);
    // Both in the queue group: each has answered one.
    let mut asked = 0;
    while hellos_answered(&a) == 0 || hellos_answered(&b) == 0 {
        assert!(asked < 100, "one broker answered none of {asked} hellos");
        mig_hello(&nats, "a").expect("MIG answers");
        asked += 1;
    }

    // Only A's main connection (and the one it set the streams up on at start, closed
    // already): its ingress connections stay up.
    let cut = relay.cut_where(|said| said.starts_with("CONNECT") && !said.contains(" ingress "));
    assert!(cut >= 1, "A's main connection");
    assert!(
        wait_until(WAIT, || metric(&a, "amp_nats_connected") == Some(0.0)),
        "A's main connection seen down; log:\n{}",
        a.log()
    );
    assert_eq!(
        metric(&a, "amp_nats_ingress_connected{connection=\"requests\"}"),
        Some(1.0)
    );
    // What the server handed A before it had A's UNSUBs is dropped (and counted in A's
    // amp_nats_ingress_dropped_total): on a loaded machine that took a hello in 3 of 18
    // runs of this file.
    let seen_down = Instant::now();
    assert!(
        wait_until(WAIT, || an_ingress_unsubscribed(&monitor)),
        "A's UNSUBs reached the server"
    );
    eprintln!(
        "A's UNSUBs seen by the server {:?} after its main connection was seen down",
        seen_down.elapsed()
    );
    let by_b = hellos_answered(&b);
    let mut failed = Vec::new();
    for n in 0..20 {
        let t = Instant::now();
        // Answered in milliseconds; a busy machine's parallel tests may take longer.
        if let Err(e) = mig_hello_within(&nats, "a", Duration::from_secs(5)) {
            failed.push(format!("hello {n} after {:?}: {e}", t.elapsed()));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 20 hellos unanswered; A dropped {:?}: {failed:?}",
        failed.len(),
        metric(&a, "amp_nats_ingress_dropped_total")
    );
    assert_eq!(hellos_answered(&b) - by_b, 20, "B answered them all");

    // A takes its share again once its main connection is back.
    relay.restore();
    assert!(
        wait_until(WAIT, || metric(&a, "amp_nats_connected") == Some(1.0)),
        "A's main connection back; log:\n{}",
        a.log()
    );
    let by_a = hellos_answered(&a);
    let mut asked = 0;
    while hellos_answered(&a) == by_a {
        assert!(asked < 100, "A answered none of {asked} hellos");
        mig_hello(&nats, "a").expect("MIG answers");
        asked += 1;
    }
}

/// A main connection that dies without a word (a partition, a frozen peer: no FIN, no
/// RST) was seen down only by its keepalive, 60 to 90 s later. All that time A's ingress
/// kept its queue group subscriptions, and the server went on handing A its share of MIG
/// requests, answered on the dead link, while B could have answered every one.
#[test]
fn with_its_main_connection_silent_a_broker_leaves_mig_requests_to_the_others() {
    let monitor = format!("127.0.0.1:{}", common::free_port());
    let nats = NatsServer::with_config(&format!("http: \"{monitor}\""));
    let relay = common::relay::Relay::start(&nats.addr());
    let mut config = open_config(&["a", "b"]);
    config["mig"] = json!({"enabled": true});
    let a = Broker::start(&format!("nats://{}", relay.addr()), &config);
    let b = Broker::start(&nats.url(), &config);
    let mut asked = 0;
    while hellos_answered(&a) == 0 || hellos_answered(&b) == 0 {
        assert!(asked < 100, "one broker answered none of {asked} hellos");
        mig_hello(&nats, "a").expect("MIG answers");
        asked += 1;
    }

    // Only A's main link carries nothing from now on; its ingress connections carry on.
    let main = |said: &str| said.starts_with("CONNECT") && !said.contains(" ingress ");
    assert!(relay.freeze_where(main) >= 1, "A's main connection");
    let frozen = Instant::now();
    // Callers keep asking meanwhile; what the server hands A is lost until A leaves the
    // queue group.
    let mut lost = 0;
    let left = wait_until(WAIT, || {
        lost += usize::from(mig_hello_within(&nats, "a", Duration::from_millis(500)).is_err());
        an_ingress_unsubscribed(&monitor)
    });
    assert!(
        left,
        "A's ingress still subscribed {:?} after its main link went silent ({lost} hellos \
         lost meanwhile, A dropped {:?})",
        frozen.elapsed(),
        metric(&a, "amp_nats_ingress_dropped_total")
    );
    eprintln!(
        "A's UNSUBs seen by the server {:?} after its main link went silent; {lost} hellos lost",
        frozen.elapsed()
    );
    assert_eq!(
        metric(&a, "amp_nats_connected"),
        Some(1.0),
        "seen silent, not down: its keepalive has not given up"
    );
    assert!(
        wait_until(WAIT, || a.log().contains("NATS connection silent")),
        "A's log says why:\n{}",
        a.log()
    );
    let by_b = hellos_answered(&b);
    let mut failed = Vec::new();
    for n in 0..20 {
        let t = Instant::now();
        if let Err(e) = mig_hello_within(&nats, "a", Duration::from_secs(5)) {
            failed.push(format!("hello {n} after {:?}: {e}", t.elapsed()));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 20 hellos unanswered: {failed:?}",
        failed.len()
    );
    assert_eq!(hellos_answered(&b) - by_b, 20, "B answered them all");

    // The frozen link dropped bytes mid-stream: it is closed, and A takes its share again
    // once its main connection is back.
    relay.cut_where(main);
    relay.restore();
    let by_a = hellos_answered(&a);
    let mut asked = 0;
    while hellos_answered(&a) == by_a {
        assert!(
            asked < 200,
            "A answered none of {asked} hellos; log:\n{}",
            a.log()
        );
        let _ = mig_hello_within(&nats, "a", Duration::from_millis(500));
        asked += 1;
    }
}

/// A broker whose main connection goes through `relay`, with sessions `a` and `b` of
/// `acme` that have exchanged a message.
fn broker_through(relay: &common::relay::Relay) -> (Broker, Client, Client) {
    let broker = Broker::start(
        &format!("nats://{}", relay.addr()),
        &open_config(&["a", "b"]),
    );
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    round_trip(&mut a, &mut b, 0);
    (broker, a, b)
}

/// From now on the broker's main link carries nothing and closes nothing: a link that
/// died without a word. New links through the relay carry on.
fn freeze_main_link(relay: &common::relay::Relay) {
    let main = |said: &str| said.starts_with("CONNECT") && !said.contains(" ingress ");
    assert!(
        relay.freeze_where(main) >= 1,
        "the broker's main connection"
    );
}

/// `/readyz` answered 200 for 5 to 10 s after the main link went silent, until its own
/// `$JS.API.INFO` timed out: a load balancer went on sending sessions to a broker whose
/// NATS link was dead. An idle broker on a healthy link stays ready meanwhile: what it
/// writes after a quiet spell goes with a PING, answered at once.
#[test]
fn with_its_main_connection_silent_a_broker_is_not_ready() {
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let (broker, mut a, _b) = broker_through(&relay);
    let readyz = || http_get(broker.addr, "/readyz");
    assert!(wait_until(WAIT, || readyz().is_some_and(|(s, _)| s == 200)));
    // Two `/readyz` JetStream probes and their PINGs on an idle broker.
    let mut unready = None;
    let flapped = wait_until(Duration::from_secs(11), || {
        unready = readyz().filter(|(s, _)| *s != 200);
        unready.is_some()
    });
    assert!(!flapped, "an idle broker unready: {unready:?}");

    freeze_main_link(&relay);
    let frozen = Instant::now();
    // Something written into the dead link; its answer does not matter here.
    a.send(&json!({"op":"send","id":"into the dead link","to":"b","body":{"n":1}}));
    let (mut last, mut ready_until) = (None, None);
    let silent = wait_until(WAIT, || {
        last = readyz();
        if last.as_ref().is_some_and(|(s, _)| *s == 200) {
            ready_until = Some(frozen.elapsed());
        }
        last.as_ref()
            .is_some_and(|(s, why)| *s == 503 && why.contains("silent"))
    });
    assert!(
        silent,
        "/readyz {:?} after the main link went silent: {last:?}; 200 until {ready_until:?}",
        frozen.elapsed()
    );
    eprintln!("/readyz {last:?} {:?} after the freeze", frozen.elapsed());
    assert_eq!(
        http_get(broker.addr, "/healthz").map(|(s, _)| s),
        Some(503),
        "/healthz answers as /readyz"
    );
    assert_eq!(
        http_get(broker.addr, "/livez").map(|(s, _)| s),
        Some(200),
        "alive all the same"
    );
}

/// A main connection silent for good was given up only by its keepalive, 60 to 90 s on:
/// all that time every session's send, ack and task operation went into the dead link,
/// each answered only by its own timeout, and the broker did not connect again.
#[test]
fn a_broker_gives_up_a_silent_main_connection_without_waiting_for_the_keepalive() {
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let (broker, mut a, mut b) = broker_through(&relay);
    let ups = || broker.log().matches("NATS connection up").count();
    let ups_before = ups();

    freeze_main_link(&relay);
    let frozen = Instant::now();
    let lost = a.request(json!({"op":"send","to":"b","body":{"n":1}}));
    assert_ne!(lost["op"], "ok", "a send into the dead link: {lost}");
    eprintln!(
        "the send into the dead link answered {:?} after the freeze: {lost}",
        frozen.elapsed()
    );
    // The keepalive gives up 60 s after the freeze at the soonest.
    let again = wait_until(Duration::from_secs(25), || ups() > ups_before);
    assert!(
        again,
        "not connected again {:?} after the main link went silent; log:\n{}",
        frozen.elapsed(),
        broker.log()
    );
    let log = broker.log();
    let down = log.lines().find(|l| l.contains("NATS connection down: "));
    assert!(
        down.is_some_and(|l| l.contains("stale connection")),
        "given up as a stale connection; log:\n{log}"
    );
    eprintln!(
        "connected again {:?} after the freeze, {down:?}",
        frozen.elapsed()
    );
    assert!(wait_until(WAIT, || {
        http_get(broker.addr, "/readyz").is_some_and(|(s, _)| s == 200)
    }));
    round_trip(&mut a, &mut b, 2);
}

/// Silent until given up (10 s on), the main connection took each session's new request
/// into the dead link all the same, answered only by its own timeout, 4 s on. Refused at
/// once now, `unavailable`, while one written before the silence still waits for its
/// answer: it may have landed.
#[test]
fn with_its_main_connection_silent_a_broker_refuses_new_requests_at_once() {
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let (broker, mut a, _b) = broker_through(&relay);

    freeze_main_link(&relay);
    let frozen = Instant::now();
    a.send(&json!({"op":"send","id":"written","to":"b","body":{"n":1}}));
    let silent = wait_until(WAIT, || {
        http_get(broker.addr, "/readyz").is_some_and(|(s, why)| s == 503 && why.contains("silent"))
    });
    assert!(silent, "not silent {:?} after the freeze", frozen.elapsed());

    let asked = Instant::now();
    let refused = a.request(json!({"op":"send","to":"b","body":{"n":2}}));
    let took = asked.elapsed();
    eprintln!(
        "a send {:?} after the freeze, silent, answered {took:?} after it was sent: {refused}",
        asked - frozen
    );
    assert_eq!(refused["code"], "unavailable", "{refused}");
    assert!(
        took < Duration::from_secs(1),
        "a send while silent answered {took:?} after it was sent: {refused}"
    );
    let written = a.answer_to("written");
    assert_eq!(written["code"], "unavailable", "{written}");
    assert!(
        written["message"]
            .as_str()
            .is_some_and(|m| m.contains("timed out")),
        "the send written before the silence waited for its answer: {written}"
    );
}
