//! The NATS client against real nats-server processes: connect, pub/sub with headers,
//! queue groups, auto-unsubscribe, request/reply, no responders, timeouts, limits.

mod common;

use amp_broker::nats::{Client, Error, Event, HeaderMap, Options, RequestError};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(5);

fn client(server: &common::NatsServer) -> Client {
    Client::connect(Options::new(&server.url()).with_name("test")).expect("connect")
}

#[test]
fn connects_and_receives_its_own_publish_with_headers() {
    let server = common::NatsServer::start();
    let mut c = client(&server);
    let info = c.connection().server_info().expect("server info");
    assert!(info.headers);
    assert!(info.jetstream);
    let sid = c.subscribe("greet.*", None).expect("sub");
    let mut headers = HeaderMap::new();
    headers.insert("X-Trace", "abc").expect("header");
    headers.append("X-Multi", "1").expect("header");
    headers.append("X-Multi", "2").expect("header");
    c.publish("greet.joe", Some("reply.here"), Some(&headers), b"hello")
        .expect("publish");
    let msg = c.next_message(sid, WAIT).expect("pump").expect("message");
    assert_eq!(msg.subject, "greet.joe");
    assert_eq!(msg.reply.as_deref(), Some("reply.here"));
    assert_eq!(msg.payload, b"hello");
    assert_eq!(msg.header("X-Trace"), Some("abc"));
    let multi: Vec<&str> = msg
        .headers
        .as_ref()
        .expect("headers")
        .get_all("X-Multi")
        .collect();
    assert_eq!(multi, ["1", "2"]);

    c.publish("greet.ann", None, None, b"")
        .expect("publish empty");
    let msg = c.next_message(sid, WAIT).expect("pump").expect("message");
    assert_eq!(msg.subject, "greet.ann");
    assert!(msg.headers.is_none());
    assert!(msg.payload.is_empty());
}

#[test]
fn request_gets_the_reply_from_a_responder() {
    let server = common::NatsServer::start();
    let mut responder = client(&server);
    let mut requester = client(&server);
    let sid = responder.subscribe("svc.echo", None).expect("sub");
    responder.flush(WAIT).expect("flush");

    let handle = std::thread::spawn(move || {
        for _ in 0..3 {
            let msg = responder
                .next_message(sid, WAIT)
                .expect("pump")
                .expect("request");
            let reply = msg.reply.expect("reply subject");
            let mut h = HeaderMap::new();
            h.insert("Echo", "yes").expect("header");
            let mut body = b"echo:".to_vec();
            body.extend_from_slice(&msg.payload);
            responder
                .publish(&reply, None, Some(&h), &body)
                .expect("respond");
            responder.flush(WAIT).expect("flush");
        }
    });
    for i in 0..3 {
        let payload = format!("ping{i}");
        let reply = requester
            .request("svc.echo", None, payload.as_bytes(), WAIT)
            .expect("reply");
        assert_eq!(reply.payload, format!("echo:ping{i}").as_bytes());
        assert_eq!(reply.header("Echo"), Some("yes"));
    }
    handle.join().expect("responder thread");
}

#[test]
fn request_without_responders_fails_at_once_with_no_responders() {
    let server = common::NatsServer::start();
    let mut c = client(&server);
    let started = std::time::Instant::now();
    let err = c
        .request("nobody.home", None, b"?", Duration::from_secs(10))
        .expect_err("no responders");
    assert_eq!(err, RequestError::NoResponders);
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[test]
fn request_to_a_silent_subscriber_times_out() {
    let server = common::NatsServer::start();
    let mut silent = client(&server);
    silent.subscribe("svc.silent", None).expect("sub");
    silent.flush(WAIT).expect("flush");
    let mut c = client(&server);
    let started = std::time::Instant::now();
    let err = c
        .request("svc.silent", None, b"?", Duration::from_millis(300))
        .expect_err("timeout");
    assert_eq!(err, RequestError::Timeout);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(c.connection().pending_requests(), 0);
}

#[test]
fn queue_group_members_share_the_messages() {
    let server = common::NatsServer::start();
    let mut a = client(&server);
    let mut b = client(&server);
    let sa = a.subscribe("work", Some("workers")).expect("sub a");
    let sb = b.subscribe("work", Some("workers")).expect("sub b");
    a.flush(WAIT).expect("flush");
    b.flush(WAIT).expect("flush");
    let mut p = client(&server);
    for i in 0..100u32 {
        p.publish("work", None, None, &i.to_be_bytes())
            .expect("pub");
    }
    p.flush(WAIT).expect("flush");
    let mut count_a = 0;
    let mut count_b = 0;
    while a
        .next_message(sa, Duration::from_millis(300))
        .expect("pump")
        .is_some()
    {
        count_a += 1;
    }
    while b
        .next_message(sb, Duration::from_millis(300))
        .expect("pump")
        .is_some()
    {
        count_b += 1;
    }
    assert_eq!(count_a + count_b, 100, "each message to exactly one member");
    assert!(count_a > 0 && count_b > 0, "a={count_a} b={count_b}");
}

#[test]
fn auto_unsubscribe_stops_after_max_messages() {
    let server = common::NatsServer::start();
    let mut c = client(&server);
    let sid = c.subscribe("limited", None).expect("sub");
    c.unsubscribe(sid, Some(3)).expect("auto-unsub");
    for i in 0..10u8 {
        c.publish("limited", None, None, &[i]).expect("pub");
    }
    c.flush(WAIT).expect("flush");
    let mut got = Vec::new();
    while let Some(m) = c
        .next_message(sid, Duration::from_millis(300))
        .expect("pump")
    {
        got.push(m.payload[0]);
    }
    assert_eq!(got, [0, 1, 2]);
    assert!(matches!(
        c.unsubscribe(sid, None),
        Err(Error::UnknownSubscription(_))
    ));
}

#[test]
fn oversized_publish_is_refused_locally_and_the_connection_stays() {
    let server = common::NatsServer::with_config("max_payload: 1024");
    let mut c = client(&server);
    assert_eq!(c.connection().max_payload(), 1024);
    let sid = c.subscribe("big", None).expect("sub");
    let err = c
        .publish("big", None, None, &vec![0u8; 1025])
        .expect_err("too big");
    assert_eq!(
        err,
        Error::MaxPayloadExceeded {
            size: 1025,
            max: 1024
        }
    );
    c.publish("big", None, None, &vec![7u8; 1024])
        .expect("at the limit");
    let msg = c.next_message(sid, WAIT).expect("pump").expect("message");
    assert_eq!(msg.payload.len(), 1024);
    assert!(c.is_connected());
}

#[test]
fn invalid_subjects_are_refused_before_sending() {
    let server = common::NatsServer::start();
    let mut c = client(&server);
    for bad in ["", "a..b", "a b", "a.*", "a.>"] {
        assert!(
            matches!(
                c.publish(bad, None, None, b"x"),
                Err(Error::InvalidSubject(_))
            ),
            "{bad:?}"
        );
    }
    assert!(matches!(
        c.subscribe("a.>.b", None),
        Err(Error::InvalidSubject(_))
    ));
    c.flush(WAIT).expect("still connected");
}

#[test]
fn permission_violation_is_reported_and_keeps_the_connection() {
    let server = common::NatsServer::with_config(
        "authorization { users = [ {user: limited, password: pw, permissions: { publish: { deny: [\"secret.>\"] } } } ] }",
    );
    let mut c = Client::connect(Options::new(&server.url()).with_user_password("limited", "pw"))
        .expect("connect");
    c.publish("secret.x", None, None, b"no").expect("sent");
    let mut err = None;
    c.run_until(WAIT, |e| {
        if let Event::ServerError(text) = e {
            err = Some(text.clone());
            true
        } else {
            false
        }
    })
    .expect("pump");
    let err = err.expect("a -ERR event");
    assert!(err.starts_with("Permissions Violation"), "{err}");
    let sid = c.subscribe("open", None).expect("sub");
    c.publish("open", None, None, b"yes").expect("pub");
    assert!(c.next_message(sid, WAIT).expect("pump").is_some());
}

/// A server named by host name is looked up off the caller's loop (a thread of its
/// own), then dialed as an address is.
#[test]
fn a_server_named_by_host_name_is_looked_up_and_connected() {
    let server = common::NatsServer::start();
    let port = server.addr().rsplit(':').next().expect("port").to_string();
    let url = format!("nats://localhost:{port}");
    let mut c = Client::connect(Options::new(&url).with_name("by-name")).expect("connect");
    let sid = c.subscribe("named", None).expect("sub");
    c.publish("named", None, None, b"hi").expect("publish");
    let msg = c.next_message(sid, WAIT).expect("pump").expect("message");
    assert_eq!(msg.payload, b"hi");
}
