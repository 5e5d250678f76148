//! Replays the byte streams recorded from a real nats-server (`proto-fixtures/`, made by
//! `scripts/capture-fixtures.py`) through the parser: whole, split in two at every byte
//! boundary, and one byte at a time the way a socket reader feeds it. Then pins what
//! specific recordings must contain. Values that differ per capture (server ids, nonces,
//! ports, timestamps) are never compared against constants.

use std::path::{Path, PathBuf};

use amp_broker::proto::headers::Headers;
use amp_broker::proto::info::{ConnectOptions, ServerInfo};
use amp_broker::proto::{Op, ParseError, Parsed, Parser, Role};

/// An operation with its fields copied out, so runs over different buffers compare.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Owned {
    Info(Vec<u8>),
    Connect(Vec<u8>),
    Pub {
        subject: Vec<u8>,
        reply: Option<Vec<u8>>,
        payload: Vec<u8>,
    },
    Hpub {
        subject: Vec<u8>,
        reply: Option<Vec<u8>>,
        headers: Vec<u8>,
        payload: Vec<u8>,
    },
    Sub {
        subject: Vec<u8>,
        queue: Option<Vec<u8>>,
        sid: Vec<u8>,
    },
    Unsub {
        sid: Vec<u8>,
        max_msgs: Option<u64>,
    },
    Msg {
        subject: Vec<u8>,
        sid: Vec<u8>,
        reply: Option<Vec<u8>>,
        payload: Vec<u8>,
    },
    Hmsg {
        subject: Vec<u8>,
        sid: Vec<u8>,
        reply: Option<Vec<u8>>,
        headers: Vec<u8>,
        payload: Vec<u8>,
    },
    Ping,
    Pong,
    Ok,
    Err(Vec<u8>),
}

fn own(op: &Op<'_>) -> Owned {
    let v = |s: &[u8]| s.to_vec();
    let o = |s: Option<&[u8]>| s.map(<[u8]>::to_vec);
    match *op {
        Op::Info(j) => Owned::Info(v(j)),
        Op::Connect(j) => Owned::Connect(v(j)),
        Op::Pub {
            subject,
            reply,
            payload,
        } => Owned::Pub {
            subject: v(subject),
            reply: o(reply),
            payload: v(payload),
        },
        Op::Hpub {
            subject,
            reply,
            headers,
            payload,
        } => Owned::Hpub {
            subject: v(subject),
            reply: o(reply),
            headers: v(headers),
            payload: v(payload),
        },
        Op::Sub {
            subject,
            queue,
            sid,
        } => Owned::Sub {
            subject: v(subject),
            queue: o(queue),
            sid: v(sid),
        },
        Op::Unsub { sid, max_msgs } => Owned::Unsub {
            sid: v(sid),
            max_msgs,
        },
        Op::Msg {
            subject,
            sid,
            reply,
            payload,
        } => Owned::Msg {
            subject: v(subject),
            sid: v(sid),
            reply: o(reply),
            payload: v(payload),
        },
        Op::Hmsg {
            subject,
            sid,
            reply,
            headers,
            payload,
        } => Owned::Hmsg {
            subject: v(subject),
            sid: v(sid),
            reply: o(reply),
            headers: v(headers),
            payload: v(payload),
        },
        Op::Ping => Owned::Ping,
        Op::Pong => Owned::Pong,
        Op::Ok => Owned::Ok,
        Op::Err(t) => Owned::Err(v(t)),
    }
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("proto-fixtures")
}

/// The parser role for a fixture file, from its name: `s2c-` was sent by the server
/// (we parse it as a client), `c2s-` by the client (we parse it as a server).
fn role_for(name: &str) -> Role {
    if name.starts_with("s2c-") {
        Role::Client
    } else if name.starts_with("c2s-") {
        Role::Server
    } else {
        panic!("{name}: fixture names start with s2c- or c2s- (see proto-fixtures/README.md)")
    }
}

/// Every `.bin` file in proto-fixtures/, sorted by name.
fn all_fixtures() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(fixture_dir()).expect("read proto-fixtures/") {
        let path = entry.expect("directory entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("bin") {
            continue;
        }
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("fixture file names are UTF-8")
            .to_string();
        let data = std::fs::read(&path).expect("read fixture");
        out.push((name, data));
    }
    out.sort();
    out
}

fn load(name: &str) -> Vec<u8> {
    std::fs::read(fixture_dir().join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}; run python3 scripts/capture-fixtures.py"))
}

/// Parses a complete recording from one buffer; it must end exactly on an operation
/// boundary.
fn parse_whole(role: Role, data: &[u8]) -> Result<Vec<Owned>, (usize, ParseError)> {
    let parser = Parser::new(role);
    let mut ops = Vec::new();
    let mut start = 0;
    while start < data.len() {
        match parser.parse(&data[start..]).map_err(|e| (start, e))? {
            Parsed::Complete(op, used) => {
                assert!(used > 0, "an operation used no bytes at offset {start}");
                ops.push(own(&op));
                start += used;
            }
            Parsed::Partial { needed } => {
                panic!(
                    "the recording ends inside an operation at offset {start} (needed {needed:?})"
                )
            }
        }
    }
    Ok(ops)
}

/// Feeds `chunks` as a socket reader would: append to a buffer, parse every complete
/// operation from its front, drain what was used, keep the rest for the next read.
/// Checks that `needed` is a true lower bound of the operation's length.
fn replay(role: Role, chunks: &[&[u8]]) -> Result<Vec<Owned>, ParseError> {
    let parser = Parser::new(role);
    let mut buf: Vec<u8> = Vec::new();
    let mut ops = Vec::new();
    let mut announced: Option<usize> = None;
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            match parser.parse(&buf)? {
                Parsed::Complete(op, used) => {
                    assert!(
                        used > 0 && used <= buf.len(),
                        "used {used} of {}",
                        buf.len()
                    );
                    if let Some(n) = announced.take() {
                        assert!(
                            n <= used,
                            "Partial announced {n} bytes, operation used {used}"
                        );
                    }
                    ops.push(own(&op));
                    buf.drain(..used);
                }
                Parsed::Partial { needed } => {
                    if let Some(n) = needed {
                        assert!(
                            n > buf.len(),
                            "Partial needs {n} but {} are buffered",
                            buf.len()
                        );
                        announced = Some(announced.map_or(n, |a| a.max(n)));
                    }
                    break;
                }
            }
        }
    }
    assert!(
        buf.is_empty(),
        "{} bytes left over after the last chunk",
        buf.len()
    );
    Ok(ops)
}

fn ops_of(name: &str) -> Vec<Owned> {
    parse_whole(role_for(name), &load(name))
        .unwrap_or_else(|(at, e)| panic!("{name}: {e} at offset {at}"))
}

#[test]
fn every_fixture_parses_whole_without_error() {
    let fixtures = all_fixtures();
    assert!(
        fixtures.len() >= 20,
        "proto-fixtures/ holds only {} recordings",
        fixtures.len()
    );
    for (name, data) in &fixtures {
        let ops = parse_whole(role_for(name), data)
            .unwrap_or_else(|(at, e)| panic!("{name}: {e} at offset {at}"));
        assert!(!ops.is_empty(), "{name}: no operations");
        if name.starts_with("s2c-") {
            assert!(
                matches!(ops.first(), Some(Owned::Info(_))),
                "{name}: a server stream starts with INFO"
            );
        } else {
            assert!(
                matches!(ops.first(), Some(Owned::Connect(_))),
                "{name}: a client stream starts with CONNECT"
            );
        }
    }
}

#[test]
fn every_fixture_split_in_two_at_every_byte_gives_the_same_operations() {
    for (name, data) in all_fixtures() {
        let role = role_for(&name);
        let whole =
            parse_whole(role, &data).unwrap_or_else(|(at, e)| panic!("{name}: {e} at {at}"));
        for cut in 0..=data.len() {
            let (a, b) = data.split_at(cut);
            let split =
                replay(role, &[a, b]).unwrap_or_else(|e| panic!("{name} cut at {cut}: {e}"));
            assert_eq!(split, whole, "{name} cut at {cut}");
        }
    }
}

#[test]
fn every_fixture_fed_one_byte_at_a_time_gives_the_same_operations() {
    for (name, data) in all_fixtures() {
        let role = role_for(&name);
        let whole =
            parse_whole(role, &data).unwrap_or_else(|(at, e)| panic!("{name}: {e} at {at}"));
        let bytes: Vec<&[u8]> = data.chunks(1).collect();
        let trickled = replay(role, &bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(trickled, whole, "{name} fed byte by byte");
    }
}

// ---------------------------------------------------------------------------
// What particular recordings hold.

fn infos(ops: &[Owned]) -> Vec<ServerInfo> {
    ops.iter()
        .filter_map(|op| match op {
            Owned::Info(json) => {
                Some(serde_json::from_slice(json).expect("INFO JSON parses into ServerInfo"))
            }
            _ => None,
        })
        .collect()
}

fn errs(ops: &[Owned]) -> Vec<String> {
    ops.iter()
        .filter_map(|op| match op {
            Owned::Err(t) => Some(String::from_utf8_lossy(t).into_owned()),
            _ => None,
        })
        .collect()
}

/// An HMSG whose header block starts with a status line (`NATS/1.0 404 No Messages`).
#[derive(Debug)]
struct Status {
    code: u16,
    description: String,
    reply: Option<Vec<u8>>,
    headers: Vec<u8>,
}

/// The status messages of a stream, in order.
fn statuses(ops: &[Owned]) -> Vec<Status> {
    ops.iter()
        .filter_map(|op| match op {
            Owned::Hmsg { reply, headers, .. } => {
                let h = Headers::parse(headers).expect("header block parses");
                Some(Status {
                    code: h.status()?,
                    description: h.description().unwrap_or_default().to_string(),
                    reply: reply.clone(),
                    headers: headers.clone(),
                })
            }
            _ => None,
        })
        .collect()
}

fn single_status(name: &str) -> Status {
    let all = statuses(&ops_of(name));
    assert_eq!(
        all.len(),
        1,
        "{name}: expected one status message, got {all:?}"
    );
    all.into_iter().next().expect("one status")
}

#[test]
fn jetstream_server_info_announces_jetstream_and_headers() {
    let info = infos(&ops_of("s2c-info-jetstream.bin"));
    let first = info.first().expect("INFO");
    assert!(first.jetstream);
    assert!(first.headers);
    assert_eq!(first.version, "2.15.1");
    assert_eq!(first.max_payload, 1024 * 1024);
    assert!(first.nonce.is_none());
    assert!(!first.server_id.is_empty());
}

#[test]
fn info_of_an_nkey_server_requires_auth_and_carries_a_nonce() {
    for name in ["s2c-info-nonce-nkey.bin", "s2c-info-nonce-user-pass.bin"] {
        let ops = ops_of(name);
        let info = infos(&ops);
        let first = info.first().expect("INFO");
        assert!(first.auth_required, "{name}");
        let nonce = first.nonce.as_deref().expect("nonce");
        assert!(!nonce.is_empty(), "{name}");
        assert!(
            ops.contains(&Owned::Pong),
            "{name}: the server accepted CONNECT"
        );
    }
}

/// Decodes an NKey (RFC 4648 base32 without padding: prefix byte, 32-byte key, CRC16).
fn nkey_public_bytes(key: &str) -> [u8; 32] {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut bits: u64 = 0;
    let mut nbits = 0;
    let mut raw = Vec::new();
    for c in key.bytes() {
        let v = ALPHABET
            .iter()
            .position(|&a| a == c)
            .expect("base32 character") as u64;
        bits = (bits << 5) | v;
        nbits += 5;
        if nbits >= 8 {
            nbits -= 8;
            raw.push((bits >> nbits) as u8);
            bits &= (1 << nbits) - 1;
        }
    }
    assert_eq!(raw.len(), 35, "prefix + key + crc");
    assert_eq!(raw[0], 20 << 3, "a user public key starts with U");
    raw[1..33].try_into().expect("32 key bytes")
}

#[test]
fn recorded_nkey_connect_signs_the_recorded_nonce() {
    use base64::Engine as _;
    use ed25519_dalek::{Signature, Verifier, VerifyingKey};

    let info = infos(&ops_of("s2c-info-nonce-nkey.bin"));
    let nonce = info.first().and_then(|i| i.nonce.clone()).expect("nonce");
    let connect = ops_of("c2s-info-nonce-nkey.bin")
        .into_iter()
        .find_map(|op| match op {
            Owned::Connect(json) => Some(json),
            _ => None,
        })
        .expect("CONNECT");
    let opts: ConnectOptions = serde_json::from_slice(&connect).expect("CONNECT JSON");
    let key = VerifyingKey::from_bytes(&nkey_public_bytes(opts.nkey.as_deref().expect("nkey")))
        .expect("ed25519 public key");
    let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(opts.sig.as_deref().expect("sig"))
        .expect("base64url signature");
    let sig = Signature::from_slice(&sig).expect("64-byte signature");
    key.verify(nonce.as_bytes(), &sig)
        .expect("the signature in CONNECT is over the INFO nonce");
}

#[test]
fn lame_duck_mode_sends_an_async_info_with_ldm() {
    let info = infos(&ops_of("s2c-info-async-lame-duck.bin"));
    assert!(info.len() >= 2, "initial and async INFO");
    assert!(!info[0].ldm);
    assert!(info.last().is_some_and(|i| i.ldm));
}

#[test]
fn a_route_coming_up_sends_an_async_info_with_the_new_connect_url() {
    let info = infos(&ops_of("s2c-info-async-cluster.bin"));
    assert!(info.len() >= 2, "initial and async INFO");
    assert!(info[0].connect_urls.is_empty());
    let last = info.last().expect("async INFO");
    assert_eq!(last.connect_urls.len(), 2, "{:?}", last.connect_urls);
    let own_url = format!("127.0.0.1:{}", info[0].port);
    assert!(last.connect_urls.contains(&own_url));
}

#[test]
fn msg_and_hmsg_deliveries_keep_replies_headers_and_payload_bytes() {
    let ops = ops_of("s2c-msg-hmsg.bin");
    let mut shapes = Vec::new();
    for op in &ops {
        match op {
            Owned::Msg { reply, .. } => shapes.push(("MSG", reply.is_some())),
            Owned::Hmsg { reply, .. } => shapes.push(("HMSG", reply.is_some())),
            _ => {}
        }
    }
    for shape in [
        ("MSG", false),
        ("MSG", true),
        ("HMSG", false),
        ("HMSG", true),
    ] {
        assert!(shapes.contains(&shape), "{shape:?} missing from {shapes:?}");
    }
    assert!(ops.contains(&Owned::Msg {
        subject: b"fix.msg.reply".to_vec(),
        sid: b"2".to_vec(),
        reply: Some(b"_INBOX.fix.1".to_vec()),
        payload: b"with reply".to_vec(),
    }));
    assert!(ops.contains(&Owned::Msg {
        subject: b"fix.other".to_vec(),
        sid: b"1".to_vec(),
        reply: None,
        payload: b"".to_vec(),
    }));
    assert!(ops.contains(&Owned::Msg {
        subject: b"fix.other".to_vec(),
        sid: b"1".to_vec(),
        reply: None,
        payload: b"line one\r\nline two\r\n".to_vec(),
    }));
    let multi = ops
        .iter()
        .find_map(|op| match op {
            Owned::Hmsg {
                headers, payload, ..
            } if payload.as_slice() == b"headers and payload" => Some(headers.clone()),
            _ => None,
        })
        .expect("HMSG with headers and payload");
    let h = Headers::parse(&multi).expect("header block");
    assert_eq!(h.status(), None);
    assert_eq!(h.get_all("X-Trace").collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(h.get("Content-Type"), Some("text/plain"));
    let header_only = ops
        .iter()
        .find_map(|op| match op {
            Owned::Hmsg {
                reply: Some(_),
                headers,
                payload,
                ..
            } => Some((headers.clone(), payload.clone())),
            _ => None,
        })
        .expect("HMSG with reply");
    assert!(header_only.1.is_empty());
    assert_eq!(
        Headers::parse(&header_only.0)
            .expect("header block")
            .get("X-Only"),
        Some("header")
    );
}

#[test]
fn deliveries_with_crs_and_control_bytes_in_subjects_parse_with_the_bytes_as_data() {
    let delivered: Vec<(Vec<u8>, Option<Vec<u8>>)> = ops_of("s2c-msg-odd-subjects.bin")
        .into_iter()
        .filter_map(|op| match op {
            Owned::Msg { subject, reply, .. } | Owned::Hmsg { subject, reply, .. } => {
                Some((subject, reply))
            }
            _ => None,
        })
        .collect();
    let want: Vec<(&[u8], Option<&[u8]>)> = vec![
        (b"fix.odd.x\r", None),
        (b"fix.odd.\rx", None),
        (b"fix.odd.x\r\r", None),
        (b"fix.odd.\x00x", None),
        (b"fix.odd.x\x01", None),
        (b"fix.odd.\x1bx", None),
        (b"fix.odd.x\x0b", None),
        (b"fix.odd.x\x0c", None),
        (b"fix.odd.x\x7f", None),
        (b"fix.odd.\xff\xfe", None),
        (b"fix.odd.r", Some(b"_INBOX.x\r")),
        (b"fix.odd.h\r", None),
        (b"fix.odd.t", Some(b"x")),
    ];
    let want: Vec<(Vec<u8>, Option<Vec<u8>>)> = want
        .into_iter()
        .map(|(s, r)| (s.to_vec(), r.map(<[u8]>::to_vec)))
        .collect();
    assert_eq!(delivered, want);
}

#[test]
fn verbose_server_answers_every_client_operation_with_ok() {
    let ops = ops_of("s2c-verbose-ok.bin");
    let oks = ops.iter().filter(|op| **op == Owned::Ok).count();
    // CONNECT, SUB, queue SUB, UNSUB with max, PUB x2, HPUB x2, UNSUB.
    assert_eq!(oks, 9);
    assert_eq!(ops.last(), Some(&Owned::Pong));
}

#[test]
fn client_stream_holds_every_client_operation_shape() {
    let ops = ops_of("c2s-verbose-ok.bin");
    assert!(matches!(ops.first(), Some(Owned::Connect(_))));
    assert!(ops.contains(&Owned::Sub {
        subject: b"fix.q".to_vec(),
        queue: Some(b"workers".to_vec()),
        sid: b"2".to_vec(),
    }));
    assert!(ops.contains(&Owned::Unsub {
        sid: b"2".to_vec(),
        max_msgs: Some(10),
    }));
    assert!(ops.contains(&Owned::Unsub {
        sid: b"1".to_vec(),
        max_msgs: None,
    }));
    assert!(ops.contains(&Owned::Pub {
        subject: b"fix.a".to_vec(),
        reply: None,
        payload: b"no reply".to_vec(),
    }));
    assert!(ops.contains(&Owned::Pub {
        subject: b"fix.a".to_vec(),
        reply: Some(b"_INBOX.fix.1".to_vec()),
        payload: b"with reply".to_vec(),
    }));
    let hpubs: Vec<_> = ops
        .iter()
        .filter_map(|op| match op {
            Owned::Hpub {
                reply,
                headers,
                payload,
                ..
            } => Some((reply.is_some(), headers.clone(), payload.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(hpubs.len(), 2);
    assert!(hpubs.iter().any(|h| h.0) && hpubs.iter().any(|h| !h.0));
    for (_, headers, payload) in &hpubs {
        assert_eq!(headers.as_slice(), b"NATS/1.0\r\nA: 1\r\n\r\n");
        assert_eq!(payload.as_slice(), b"h");
    }
    assert!(ops.contains(&Owned::Ping));
    assert!(ops.contains(&Owned::Pong));
}

#[test]
fn request_without_responders_gets_status_503() {
    let status = single_status("s2c-no-responders-503.bin");
    assert_eq!(status.code, 503);
    assert_eq!(status.reply, None);
}

#[test]
fn jetstream_deliveries_carry_ack_reply_subjects() {
    let ops = ops_of("s2c-js-pull-deliveries.bin");
    let replies: Vec<Vec<u8>> = ops
        .iter()
        .filter_map(|op| match op {
            Owned::Msg { reply, .. } | Owned::Hmsg { reply, .. } => reply.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(replies.len(), 2, "two deliveries");
    for reply in &replies {
        assert!(
            reply.starts_with(b"$JS.ACK.FIX.pull."),
            "{}",
            String::from_utf8_lossy(reply)
        );
    }
    let acked = ops_of("c2s-js-pull-deliveries.bin")
        .into_iter()
        .find_map(|op| match op {
            Owned::Pub {
                subject, payload, ..
            } if payload.as_slice() == b"+ACK" => Some(subject),
            _ => None,
        })
        .expect("+ACK publish");
    assert_eq!(acked, replies[0]);
}

#[test]
fn pull_no_wait_on_empty_stream_gets_404_no_messages() {
    let status = single_status("s2c-js-404-no-messages.bin");
    assert_eq!(
        (status.code, status.description.as_str()),
        (404, "No Messages")
    );
}

#[test]
fn expired_pull_gets_408_request_timeout_with_pending_counts() {
    let status = single_status("s2c-js-408-request-timeout.bin");
    assert_eq!(
        (status.code, status.description.as_str()),
        (408, "Request Timeout")
    );
    let h = Headers::parse(&status.headers).expect("header block");
    assert!(h.get("Nats-Pending-Messages").is_some());
    assert!(h.get("Nats-Pending-Bytes").is_some());
}

#[test]
fn pull_conflicts_get_409_with_their_reason() {
    for (name, reason) in [
        ("s2c-js-409-max-bytes.bin", "Message Size Exceeds MaxBytes"),
        ("s2c-js-409-exceeded-max-waiting.bin", "Exceeded MaxWaiting"),
        ("s2c-js-409-consumer-deleted.bin", "Consumer Deleted"),
    ] {
        let status = single_status(name);
        assert_eq!(
            (status.code, status.description.as_str()),
            (409, reason),
            "{name}"
        );
    }
}

#[test]
fn pull_with_idle_heartbeat_gets_100_heartbeats_before_the_408() {
    let all = statuses(&ops_of("s2c-js-100-idle-heartbeat.bin"));
    let (last, beats) = all.split_last().expect("status messages");
    assert_eq!(
        (last.code, last.description.as_str()),
        (408, "Request Timeout")
    );
    assert!(!beats.is_empty());
    for Status {
        code,
        description: desc,
        reply,
        headers,
    } in beats
    {
        assert_eq!((*code, desc.as_str()), (100, "Idle Heartbeat"));
        assert_eq!(*reply, None, "heartbeats need no answer");
        assert!(
            Headers::parse(headers)
                .expect("header block")
                .get("Nats-Last-Consumer")
                .is_some()
        );
    }
}

#[test]
fn flow_control_request_has_status_100_and_a_reply_subject_the_client_answers() {
    let all = statuses(&ops_of("s2c-js-100-flow-control.bin"));
    let fc: Vec<_> = all
        .iter()
        .filter(|s| s.code == 100 && s.description == "FlowControl Request")
        .collect();
    assert!(!fc.is_empty(), "{all:?}");
    let reply = fc[0].reply.clone().expect("flow control reply subject");
    assert!(reply.starts_with(b"$JS.FC.FIX.push."));
    assert!(
        all.iter()
            .any(|s| s.code == 100 && s.description == "Idle Heartbeat")
    );
    let answered = ops_of("c2s-js-100-flow-control.bin").contains(&Owned::Pub {
        subject: reply,
        reply: None,
        payload: Vec::new(),
    });
    assert!(
        answered,
        "the client answers the flow control request with an empty PUB"
    );
}

#[test]
fn server_error_texts_are_the_ones_nats_server_sends() {
    for (name, text, fatal) in [
        (
            "s2c-err-authorization-violation.bin",
            "Authorization Violation",
            true,
        ),
        ("s2c-err-auth-timeout.bin", "Authentication Timeout", true),
        (
            "s2c-err-unknown-protocol.bin",
            "Unknown Protocol Operation",
            true,
        ),
        ("s2c-err-max-payload.bin", "Maximum Payload Violation", true),
        (
            "s2c-err-max-control-line.bin",
            "maximum control line exceeded",
            true,
        ),
        ("s2c-err-stale-connection.bin", "Stale Connection", true),
        ("s2c-err-invalid-subject.bin", "Invalid Subject", false),
        (
            "s2c-err-invalid-subject.bin",
            "Invalid Publish Subject",
            false,
        ),
        (
            "s2c-err-permissions.bin",
            "Permissions Violation for Publish to \"denied.pub\"",
            false,
        ),
        (
            "s2c-err-permissions.bin",
            "Permissions Violation for Subscription to \"denied.sub\"",
            false,
        ),
        (
            "s2c-err-permissions.bin",
            "Permissions Violation for Subscription to \"denied.sub\" using queue \"q\"",
            false,
        ),
    ] {
        let ops = ops_of(name);
        assert!(
            errs(&ops).iter().any(|e| e == text),
            "{name}: {:?}",
            errs(&ops)
        );
        if fatal {
            assert_eq!(
                ops.last(),
                Some(&Owned::Err(text.as_bytes().to_vec())),
                "{name}"
            );
        } else {
            assert_eq!(
                ops.last(),
                Some(&Owned::Pong),
                "{name}: the connection stays usable"
            );
        }
    }
}

#[test]
fn parse_error_texts_match_what_the_server_sends_for_the_same_violation() {
    let sent = |name| errs(&ops_of(name)).pop().expect("-ERR");
    assert_eq!(
        ParseError::UnknownOperation.to_string(),
        sent("s2c-err-unknown-protocol.bin")
    );
    assert_eq!(
        ParseError::MaxPayloadViolation.to_string(),
        sent("s2c-err-max-payload.bin")
    );
    // nats-server 2.15 sends this one in lower case, and so does Display.
    assert_eq!(
        ParseError::MaxControlLineExceeded.to_string(),
        sent("s2c-err-max-control-line.bin")
    );
}

#[test]
fn a_client_that_never_answers_pings_is_closed_as_stale() {
    let ops = ops_of("s2c-err-stale-connection.bin");
    let ping = ops
        .iter()
        .position(|op| *op == Owned::Ping)
        .expect("server PING");
    let stale = ops
        .iter()
        .position(|op| *op == Owned::Err(b"Stale Connection".to_vec()))
        .expect("-ERR 'Stale Connection'");
    assert!(ping < stale);
}

#[test]
fn server_pings_are_answered_with_pongs() {
    let server = ops_of("s2c-server-ping.bin");
    let client = ops_of("c2s-server-ping.bin");
    let pings = server.iter().filter(|op| **op == Owned::Ping).count();
    let pongs = client.iter().filter(|op| **op == Owned::Pong).count();
    assert!(pings >= 2);
    assert_eq!(pongs, 2);
}

#[test]
fn jetstream_api_replies_are_json_payloads_of_plain_msgs() {
    let replies: Vec<serde_json::Value> = ops_of("s2c-js-api-replies.bin")
        .into_iter()
        .filter_map(|op| match op {
            Owned::Msg { payload, .. } => {
                Some(serde_json::from_slice(&payload).expect("reply payload is JSON"))
            }
            _ => None,
        })
        .collect();
    assert_eq!(replies.len(), 5);
    assert_eq!(
        replies[0]["type"],
        "io.nats.jetstream.api.v1.stream_create_response"
    );
    assert_eq!(replies[1]["seq"], 1);
    assert_eq!(replies[2]["seq"], 2);
    assert_eq!(replies[3]["duplicate"], true);
    assert_eq!(replies[4]["error"]["err_code"], 10059);
}
