//! Each edge case cites the nats-server (server/parser.go, server/client.go) or nats.go
//! (parser.go) behaviour it mirrors.

use super::*;

fn server() -> Parser {
    Parser::new(Role::Server)
}

fn client() -> Parser {
    Parser::new(Role::Client)
}

fn one<'a>(p: &Parser, buf: &'a [u8]) -> Op<'a> {
    match p.parse(buf) {
        Ok(Parsed::Complete(op, used)) => {
            assert_eq!(
                used,
                buf.len(),
                "whole input used for {:?}",
                String::from_utf8_lossy(buf)
            );
            op
        }
        other => panic!(
            "expected one op from {:?}, got {other:?}",
            String::from_utf8_lossy(buf)
        ),
    }
}

fn err(p: &Parser, buf: &[u8]) -> ParseError {
    match p.parse(buf) {
        Err(e) => e,
        other => panic!(
            "expected an error from {:?}, got {other:?}",
            String::from_utf8_lossy(buf)
        ),
    }
}

fn partial(p: &Parser, buf: &[u8]) -> Option<usize> {
    match p.parse(buf) {
        Ok(Parsed::Partial { needed }) => needed,
        other => panic!(
            "expected partial from {:?}, got {other:?}",
            String::from_utf8_lossy(buf)
        ),
    }
}

#[test]
fn parses_every_client_operation() {
    let p = server();
    assert_eq!(
        one(&p, b"CONNECT {\"verbose\":false}\r\n"),
        Op::Connect(b"{\"verbose\":false}")
    );
    assert_eq!(
        one(&p, b"PUB foo 5\r\nhello\r\n"),
        Op::Pub {
            subject: b"foo",
            reply: None,
            payload: b"hello"
        }
    );
    assert_eq!(
        one(&p, b"PUB foo _INBOX.1 5\r\nhello\r\n"),
        Op::Pub {
            subject: b"foo",
            reply: Some(b"_INBOX.1"),
            payload: b"hello"
        }
    );
    assert_eq!(
        one(&p, b"HPUB foo 12 14\r\nNATS/1.0\r\n\r\nhi\r\n"),
        Op::Hpub {
            subject: b"foo",
            reply: None,
            headers: b"NATS/1.0\r\n\r\n",
            payload: b"hi"
        }
    );
    assert_eq!(
        one(&p, b"HPUB foo r 12 14\r\nNATS/1.0\r\n\r\nhi\r\n"),
        Op::Hpub {
            subject: b"foo",
            reply: Some(b"r"),
            headers: b"NATS/1.0\r\n\r\n",
            payload: b"hi"
        }
    );
    assert_eq!(
        one(&p, b"SUB foo 1\r\n"),
        Op::Sub {
            subject: b"foo",
            queue: None,
            sid: b"1"
        }
    );
    assert_eq!(
        one(&p, b"SUB foo workers 1\r\n"),
        Op::Sub {
            subject: b"foo",
            queue: Some(b"workers"),
            sid: b"1"
        }
    );
    assert_eq!(
        one(&p, b"UNSUB 1\r\n"),
        Op::Unsub {
            sid: b"1",
            max_msgs: None
        }
    );
    assert_eq!(
        one(&p, b"UNSUB 1 5\r\n"),
        Op::Unsub {
            sid: b"1",
            max_msgs: Some(5)
        }
    );
    assert_eq!(one(&p, b"PING\r\n"), Op::Ping);
    assert_eq!(one(&p, b"PONG\r\n"), Op::Pong);
}

#[test]
fn parses_every_server_operation() {
    let p = client();
    assert_eq!(
        one(&p, b"INFO {\"server_id\":\"x\"}\r\n"),
        Op::Info(b"{\"server_id\":\"x\"}")
    );
    assert_eq!(
        one(&p, b"MSG foo 1 5\r\nhello\r\n"),
        Op::Msg {
            subject: b"foo",
            sid: b"1",
            reply: None,
            payload: b"hello"
        }
    );
    assert_eq!(
        one(&p, b"MSG foo 1 bar 5\r\nhello\r\n"),
        Op::Msg {
            subject: b"foo",
            sid: b"1",
            reply: Some(b"bar"),
            payload: b"hello"
        }
    );
    assert_eq!(
        one(&p, b"HMSG foo 1 12 14\r\nNATS/1.0\r\n\r\nhi\r\n"),
        Op::Hmsg {
            subject: b"foo",
            sid: b"1",
            reply: None,
            headers: b"NATS/1.0\r\n\r\n",
            payload: b"hi"
        }
    );
    assert_eq!(
        one(&p, b"HMSG foo 1 bar 12 14\r\nNATS/1.0\r\n\r\nhi\r\n"),
        Op::Hmsg {
            subject: b"foo",
            sid: b"1",
            reply: Some(b"bar"),
            headers: b"NATS/1.0\r\n\r\n",
            payload: b"hi"
        }
    );
    assert_eq!(one(&p, b"PING\r\n"), Op::Ping);
    assert_eq!(one(&p, b"PONG\r\n"), Op::Pong);
    assert_eq!(one(&p, b"+OK\r\n"), Op::Ok);
    assert_eq!(
        one(&p, b"-ERR 'Authorization Violation'\r\n"),
        Op::Err(b"Authorization Violation")
    );
}

#[test]
fn operation_names_are_case_insensitive() {
    // parser.go matches every name byte with `case 'P', 'p'` style arms.
    let p = server();
    assert_eq!(
        one(&p, b"pub foo 1\r\nx\r\n"),
        Op::Pub {
            subject: b"foo",
            reply: None,
            payload: b"x"
        }
    );
    assert_eq!(one(&p, b"pInG\r\n"), Op::Ping);
    assert_eq!(
        one(&p, b"sub foo 1\r\n"),
        Op::Sub {
            subject: b"foo",
            queue: None,
            sid: b"1"
        }
    );
    assert_eq!(one(&p, b"connect {}\r\n"), Op::Connect(b"{}"));
    let c = client();
    assert_eq!(
        one(&c, b"msg foo 1 1\r\nx\r\n"),
        Op::Msg {
            subject: b"foo",
            sid: b"1",
            reply: None,
            payload: b"x"
        }
    );
    assert_eq!(one(&c, b"+ok\r\n"), Op::Ok);
    assert_eq!(one(&c, b"-err 'x'\r\n"), Op::Err(b"x"));
}

#[test]
fn fields_are_separated_by_any_run_of_spaces_and_tabs() {
    // OP_PUB_SPC skips ' ' and '\t'; processPub splits on runs of both; trailing blanks
    // produce no extra field.
    let p = server();
    assert_eq!(
        one(&p, b"PUB \t  foo\t\t bar   3 \t\r\nabc\r\n"),
        Op::Pub {
            subject: b"foo",
            reply: Some(b"bar"),
            payload: b"abc"
        }
    );
    assert_eq!(
        one(&p, b"SUB\tfoo  q\t9  \r\n"),
        Op::Sub {
            subject: b"foo",
            queue: Some(b"q"),
            sid: b"9"
        }
    );
}

#[test]
fn bare_lf_ends_a_control_line() {
    // The '\n' arm ends the argument; '\r' only sets `drop`.
    let p = server();
    assert_eq!(
        one(&p, b"PUB foo 2\nhi\r\n"),
        Op::Pub {
            subject: b"foo",
            reply: None,
            payload: b"hi"
        }
    );
    assert_eq!(one(&p, b"PING\n"), Op::Ping);
    assert_eq!(
        one(&p, b"SUB foo 1\n"),
        Op::Sub {
            subject: b"foo",
            queue: None,
            sid: b"1"
        }
    );
}

#[test]
fn payload_must_be_followed_by_crlf() {
    // MSG_END_R / MSG_END_N `goto parseErr`, which sends 'Unknown Protocol Operation';
    // a bare LF after the payload is not enough there.
    let p = server();
    assert_eq!(
        err(&p, b"PUB foo 2\r\nhix\r\n"),
        ParseError::UnknownOperation
    );
    assert_eq!(err(&p, b"PUB foo 2\r\nhi\nX"), ParseError::UnknownOperation);
    assert_eq!(err(&p, b"PUB foo 2\r\nhi\rx"), ParseError::UnknownOperation);
    // Detected once the two bytes after the payload are there (`needed` stays exact).
    assert_eq!(partial(&p, b"PUB foo 2\r\nhix"), Some(15));
    assert_eq!(
        ParseError::UnknownOperation.to_string(),
        "Unknown Protocol Operation"
    );
}

#[test]
fn zero_length_payloads_are_accepted() {
    let p = server();
    assert_eq!(
        one(&p, b"PUB foo 0\r\n\r\n"),
        Op::Pub {
            subject: b"foo",
            reply: None,
            payload: b""
        }
    );
    let c = client();
    assert_eq!(
        one(&c, b"MSG foo 1 0\r\n\r\n"),
        Op::Msg {
            subject: b"foo",
            sid: b"1",
            reply: None,
            payload: b""
        }
    );
}

#[test]
fn header_length_equal_to_total_means_empty_payload() {
    let p = server();
    assert_eq!(
        one(&p, b"HPUB foo 12 12\r\nNATS/1.0\r\n\r\n\r\n"),
        Op::Hpub {
            subject: b"foo",
            reply: None,
            headers: b"NATS/1.0\r\n\r\n",
            payload: b""
        }
    );
    let c = client();
    assert_eq!(
        one(&c, b"HMSG foo 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"),
        Op::Hmsg {
            subject: b"foo",
            sid: b"1",
            reply: None,
            headers: b"NATS/1.0 503\r\n\r\n",
            payload: b""
        }
    );
}

#[test]
fn header_length_larger_than_total_is_a_parser_error() {
    // processHeaderPub: "Header Size larger then TotalSize"; nats.go: "Bad or Missing Header Size".
    assert_eq!(
        err(&server(), b"HPUB foo 13 12\r\n"),
        ParseError::Parser(Malformed::HeaderSizeExceedsTotal)
    );
    assert_eq!(
        err(&client(), b"HMSG foo 1 13 12\r\n"),
        ParseError::Parser(Malformed::HeaderSizeExceedsTotal)
    );
    assert_eq!(
        ParseError::Parser(Malformed::Size).to_string(),
        "Parser Error"
    );
}

#[test]
fn negative_overflowing_or_non_numeric_sizes_are_parser_errors() {
    // parseSize returns -1 for a sign, any non-digit, or more than 9 digits.
    let p = server();
    for bad in [
        &b"PUB foo -1\r\n"[..],
        b"PUB foo 1x\r\n",
        b"PUB foo 1234567890\r\n",
        b"PUB foo +1\r\n",
    ] {
        assert_eq!(
            err(&p, bad),
            ParseError::Parser(Malformed::Size),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
    assert_eq!(
        err(&p, b"HPUB foo -1 5\r\n"),
        ParseError::Parser(Malformed::HeaderSize)
    );
    assert_eq!(
        err(&p, b"HPUB foo 1 99999999999999999999\r\n"),
        ParseError::Parser(Malformed::Size)
    );
    assert_eq!(
        err(&client(), b"MSG foo 1 -5\r\n"),
        ParseError::Parser(Malformed::Size)
    );
    // Nine digits parse (and then meet the payload limit).
    assert_eq!(
        err(&p, b"PUB foo 999999999\r\n"),
        ParseError::MaxPayloadViolation
    );
}

#[test]
fn wrong_argument_counts_are_parser_errors() {
    let p = server();
    for bad in [
        &b"PUB foo\r\n"[..],
        b"PUB a b c 1\r\n",
        b"HPUB foo 1\r\n",
        b"SUB foo\r\n",
        b"SUB a b c d\r\n",
        b"UNSUB\t \r\n",
        b"UNSUB 1 2 3\r\n",
    ] {
        assert_eq!(
            err(&p, bad),
            ParseError::Parser(Malformed::ArgumentCount),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
    let c = client();
    assert_eq!(
        err(&c, b"MSG foo 1\r\n"),
        ParseError::Parser(Malformed::ArgumentCount)
    );
    assert_eq!(
        err(&c, b"HMSG foo 1 2\r\n"),
        ParseError::Parser(Malformed::ArgumentCount)
    );
}

#[test]
fn msg_sid_must_be_numeric_on_the_client_side() {
    // nats.go processMsgArgs: parseInt64(sid) < 0 is "Bad or Missing Sid".
    assert_eq!(
        err(&client(), b"MSG foo x1 1\r\n"),
        ParseError::Parser(Malformed::Sid)
    );
}

#[test]
fn unsub_with_zero_or_invalid_max_behaves_as_plain_unsub() {
    // processUnsub: max = parseSize(arg) (-1 when invalid); max > 0 sets the limit,
    // anything else unsubscribes at once.
    let p = server();
    assert_eq!(
        one(&p, b"UNSUB 1 0\r\n"),
        Op::Unsub {
            sid: b"1",
            max_msgs: None
        }
    );
    assert_eq!(
        one(&p, b"UNSUB 1 x\r\n"),
        Op::Unsub {
            sid: b"1",
            max_msgs: None
        }
    );
}

#[test]
fn ping_pong_and_ok_ignore_anything_before_the_line_end() {
    // OP_PING / OP_PONG / OP_PLUS_OK only react to '\n'.
    let p = server();
    assert_eq!(one(&p, b"PING foo\r\n"), Op::Ping);
    assert_eq!(one(&p, b"PONGx\r\n"), Op::Pong);
    assert_eq!(one(&client(), b"+OK  \r\n"), Op::Ok);
}

#[test]
fn connect_and_server_side_info_need_no_space_after_the_name() {
    // OP_CONNECT / OP_INFO in server/parser.go skip blanks but do not require one.
    let p = server();
    assert_eq!(one(&p, b"CONNECT{}\r\n"), Op::Connect(b"{}"));
    assert_eq!(one(&p, b"INFO{}\r\n"), Op::Info(b"{}"));
    assert_eq!(one(&p, b"CONNECT\r\n"), Op::Connect(b""));
    // nats.go's OP_INFO requires a blank.
    assert_eq!(err(&client(), b"INFO{}\r\n"), ParseError::UnknownOperation);
}

#[test]
fn names_must_be_followed_by_a_blank() {
    // OP_PUB, OP_SUB, OP_MSG, ... `goto parseErr` on anything but ' ' or '\t'.
    assert_eq!(err(&server(), b"PUB\r\n"), ParseError::UnknownOperation);
    assert_eq!(
        err(&server(), b"PUBX foo 1\r\n"),
        ParseError::UnknownOperation
    );
    assert_eq!(
        err(&client(), b"MSGfoo 1 1\r\n"),
        ParseError::UnknownOperation
    );
    assert_eq!(err(&client(), b"-ERR'x'\r\n"), ParseError::UnknownOperation);
}

#[test]
fn unknown_operations_are_rejected_early() {
    // parseErr as soon as a byte does not continue a known name.
    let p = server();
    assert_eq!(err(&p, b"X"), ParseError::UnknownOperation);
    assert_eq!(err(&p, b"PX"), ParseError::UnknownOperation);
    assert_eq!(err(&p, b"CONX"), ParseError::UnknownOperation);
    assert_eq!(err(&p, b"\r\n"), ParseError::UnknownOperation);
    assert_eq!(err(&p, b" PING\r\n"), ParseError::UnknownOperation);
}

#[test]
fn each_role_rejects_the_other_sides_operations() {
    // nats-server's OP_START has no arm for 'M'; nats.go has none for PUB/SUB/CONNECT.
    assert_eq!(
        err(&server(), b"MSG foo 1 1\r\nx\r\n"),
        ParseError::UnknownOperation
    );
    assert_eq!(
        err(&server(), b"HMSG foo 1 0 0\r\n\r\n"),
        ParseError::UnknownOperation
    );
    for bad in [
        &b"PUB foo 0\r\n\r\n"[..],
        b"SUB foo 1\r\n",
        b"UNSUB 1\r\n",
        b"CONNECT {}\r\n",
        b"HPUB x 0 0\r\n",
    ] {
        assert_eq!(err(&client(), bad), ParseError::UnknownOperation);
    }
    // nats-server accepts +OK, -ERR and INFO from clients.
    assert_eq!(one(&server(), b"+OK\r\n"), Op::Ok);
    assert_eq!(one(&server(), b"-ERR 'x'\r\n"), Op::Err(b"x"));
}

#[test]
fn a_client_takes_every_msg_nats_server_delivers_with_odd_bytes_as_data() {
    // Recorded from nats-server 2.15.1 (proto-fixtures/s2c-msg-odd-subjects.bin): any
    // client may publish these, and the server delivers them to matching subscriptions.
    // Fields are split on spaces and tabs only; every other byte is the field's.
    let c = client();
    for subject in [
        &b"amp.acme.topic.x\r"[..],
        b"amp.acme.topic.\rx",
        b"amp.acme.topic.x\r\r",
        b"amp.acme.topic.x\x01",
        b"amp.acme.topic.\x00x",
        b"amp.acme.topic.x\x7f",
        b"amp.acme.topic.\x1bx",
        b"amp.acme.topic.x\x0b",
        b"amp.acme.topic.x\x0c",
        b"amp.acme.topic.\xff\xfe",
        b"_INBOX.abc.\r",
    ] {
        let mut wire = b"MSG ".to_vec();
        wire.extend_from_slice(subject);
        wire.extend_from_slice(b" 1 2\r\nhi\r\n");
        assert_eq!(
            one(&c, &wire),
            Op::Msg {
                subject,
                sid: b"1",
                reply: None,
                payload: b"hi"
            },
            "{wire:?}"
        );
    }
    assert_eq!(
        one(&c, b"MSG amp.acme.topic.r 1 _INBOX.x\r 2\r\nhi\r\n"),
        Op::Msg {
            subject: b"amp.acme.topic.r",
            sid: b"1",
            reply: Some(b"_INBOX.x\r"),
            payload: b"hi"
        }
    );
    assert_eq!(
        one(
            &c,
            b"HMSG amp.acme.topic.h\r 1 12 14\r\nNATS/1.0\r\n\r\nhi\r\n"
        ),
        Op::Hmsg {
            subject: b"amp.acme.topic.h\r",
            sid: b"1",
            reply: None,
            headers: b"NATS/1.0\r\n\r\n",
            payload: b"hi"
        }
    );
    // A CR in the size is still not a size.
    assert_eq!(
        err(&c, b"MSG a 1 2\r\r\nhi\r\n"),
        ParseError::Parser(Malformed::Size)
    );
}

#[test]
fn a_stray_carriage_return_in_arguments_is_a_parser_error() {
    assert_eq!(
        err(&server(), b"PUB fo\ro 1\r\nx\r\n"),
        ParseError::Parser(Malformed::StrayCarriageReturn)
    );
    assert_eq!(
        err(&server(), b"PUB foo 1\r\r\nx\r\n"),
        ParseError::Parser(Malformed::StrayCarriageReturn)
    );
}

#[test]
fn err_text_is_unquoted_like_nats_go() {
    // nats.go normalizeErr: TrimSpace, then trim quotes.
    let c = client();
    assert_eq!(
        one(&c, b"-ERR   'Stale Connection'  \r\n"),
        Op::Err(b"Stale Connection")
    );
    assert_eq!(one(&c, b"-ERR unquoted\r\n"), Op::Err(b"unquoted"));
    assert_eq!(one(&c, b"-ERR ''\r\n"), Op::Err(b""));
}

#[test]
fn control_line_limit_counts_the_arguments() {
    // overMaxControlLineLimit(arg): len(arg) > mcl, arg being what follows the name and blanks.
    let mut p = server();
    p.max_control_line = 16;
    let ok = b"SUB 0123456789abcd 1\r\n"; // argument: 16 bytes
    assert_eq!(
        one(&p, ok),
        Op::Sub {
            subject: b"0123456789abcd",
            queue: None,
            sid: b"1"
        }
    );
    assert_eq!(
        err(&p, b"SUB 0123456789abcde 1\r\n"),
        ParseError::MaxControlLineExceeded
    );
    // Also before the line end arrives (nats-server checks at the end of every read).
    assert_eq!(
        err(&p, b"SUB 0123456789abcdefgh"),
        ParseError::MaxControlLineExceeded
    );
    assert_eq!(partial(&p, b"SUB 0123456789abcd 1\r"), None);
    // nats-server 2.15's wire text, in lower case (proto-fixtures/s2c-err-max-control-line.bin).
    assert_eq!(
        ParseError::MaxControlLineExceeded.to_string(),
        "maximum control line exceeded"
    );
}

#[test]
fn control_line_limit_bounds_blank_runs_and_ping_junk() {
    // nats-server would skip these forever; a bounded buffer needs a limit.
    let mut p = server();
    p.max_control_line = 8;
    assert_eq!(
        err(&p, b"PUB           "),
        ParseError::MaxControlLineExceeded
    );
    assert_eq!(
        err(&p, b"PING0123456789"),
        ParseError::MaxControlLineExceeded
    );
    assert_eq!(partial(&p, b"PING0123"), None);
}

#[test]
fn payload_over_the_limit_is_a_max_payload_violation() {
    let mut p = server();
    p.max_payload = 4;
    assert_eq!(
        one(&p, b"PUB foo 4\r\nabcd\r\n"),
        Op::Pub {
            subject: b"foo",
            reply: None,
            payload: b"abcd"
        }
    );
    assert_eq!(err(&p, b"PUB foo 5\r\n"), ParseError::MaxPayloadViolation);
    // HPUB counts headers plus payload.
    assert_eq!(
        err(&p, b"HPUB foo 3 5\r\n"),
        ParseError::MaxPayloadViolation
    );
    assert_eq!(
        ParseError::MaxPayloadViolation.to_string(),
        "Maximum Payload Violation"
    );
}

#[test]
fn partial_input_reports_the_needed_length_once_known() {
    let p = server();
    assert_eq!(partial(&p, b""), None);
    assert_eq!(partial(&p, b"P"), None);
    assert_eq!(partial(&p, b"PU"), None);
    assert_eq!(partial(&p, b"PUB"), None);
    assert_eq!(partial(&p, b"PUB foo 5\r"), None);
    assert_eq!(partial(&p, b"PUB foo 5\r\n"), Some(18));
    assert_eq!(partial(&p, b"PUB foo 5\r\nhel"), Some(18));
    assert_eq!(partial(&p, b"PUB foo 5\r\nhello\r"), Some(18));
}

#[test]
fn a_payload_split_over_many_reads_parses_once_whole() {
    let p = server();
    let full = b"PUB foo 10\r\n0123456789\r\nPING\r\n";
    let mut buf = Vec::new();
    let mut ops = Vec::new();
    let mut start = 0;
    for &b in full.iter() {
        buf.push(b);
        loop {
            match p.parse(&buf[start..]).expect("valid stream") {
                Parsed::Complete(op, used) => {
                    assert!(used > 0);
                    ops.push(format!("{op:?}"));
                    start += used;
                }
                Parsed::Partial { needed } => {
                    if let Some(n) = needed {
                        assert!(n > buf.len() - start);
                    }
                    break;
                }
            }
        }
    }
    assert_eq!(start, full.len());
    assert_eq!(ops.len(), 2);
    assert!(ops[0].contains("Pub"));
    assert_eq!(ops[1], "Ping");
}

#[test]
fn consecutive_operations_are_parsed_one_at_a_time() {
    let p = client();
    let stream = b"PING\r\nMSG a 1 2\r\nhi\r\n+OK\r\n";
    let Ok(Parsed::Complete(Op::Ping, 6)) = p.parse(stream) else {
        panic!("ping first")
    };
    let Ok(Parsed::Complete(Op::Msg { payload: b"hi", .. }, 15)) = p.parse(&stream[6..]) else {
        panic!("msg second")
    };
    assert_eq!(one(&p, &stream[21..]), Op::Ok);
}

#[test]
fn huge_limits_do_not_overflow() {
    let mut p = server();
    p.max_control_line = usize::MAX;
    p.max_payload = usize::MAX;
    assert_eq!(one(&p, b"PING\r\n"), Op::Ping);
    assert_eq!(
        one(&p, b"SUB a 1\r\n"),
        Op::Sub {
            subject: b"a",
            queue: None,
            sid: b"1"
        }
    );
    assert_eq!(partial(&p, b"PUB a 999999999\r\n"), Some(1_000_000_018));
}

#[test]
fn fast_path_agrees_with_the_general_path() {
    // The one-pass field scanner must accept only what the general path accepts, with the
    // same fields and length; everything else falls through to the general path.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let text = b"ab1 ";
    let odd = b"\t\r\n\0\xff ";
    let mut agreed = [0, 0];
    let mut p = server();
    for round in 0..300_000 {
        // Short limits, and lines around the 64 or 128 bytes the fast path looks at.
        p.max_control_line = [12, 70, 4096][round % 3];
        let len = 1 + (next() % 150) as usize;
        let mut line = vec![b' '];
        line.extend((0..len).map(|_| text[(next() % text.len() as u64) as usize]));
        // A few odd bytes anywhere, then a line end (or not).
        for _ in 0..next() % 3 {
            let at = (next() % line.len() as u64) as usize;
            line.insert(at, odd[(next() % odd.len() as u64) as usize]);
        }
        line.extend_from_slice([&b"\r\n"[..], b"\n", b"\r", b""][(next() % 4) as usize]);
        let mut fast: [[&[u8]; 4]; 2] = [[&[]; 4]; 2];
        let accepted = [
            p.fast_fields::<u64>(&line, 0, &mut fast[0]),
            p.fast_fields::<u128>(&line, 0, &mut fast[1]),
        ];
        for (window, (accepted, fast)) in accepted.into_iter().zip(fast).enumerate() {
            let Some((n, used)) = accepted else {
                continue;
            };
            let (s, e, used_slow) = p
                .control_line(&line, 0)
                .expect("general path accepts")
                .expect("general path complete");
            // Both splits (a client's, where a CR is data, and a server's) agree with it.
            for cr_is_data in [false, true] {
                let mut slow: [&[u8]; 4] = [&[]; 4];
                let n_slow =
                    split_fields(&line[s..e], &mut slow, cr_is_data).expect("general path splits");
                assert_eq!(
                    (n, used, fast),
                    (n_slow, used_slow, slow),
                    "{:?}",
                    String::from_utf8_lossy(&line)
                );
            }
            agreed[window] += 1;
        }
    }
    assert!(
        agreed[0] > 10_000 && agreed[1] > agreed[0],
        "both windows were exercised ({agreed:?})"
    );
}

#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[test]
fn the_portable_byte_scan_agrees_with_the_sse2_one() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..100_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Bytes around the classes' edges, and lines shorter than a chunk.
        let edges = [
            0u8, 9, 10, 13, 31, 32, 33, 0x7f, 0x80, 0x9f, 0xa0, 0xff, b'a',
        ];
        let len = (state % 20) as usize;
        let line: Vec<u8> = (0..len)
            .map(|i| edges[((state >> (i * 3)) % edges.len() as u64) as usize])
            .collect();
        let (lo, hi) = (scan::swar(&line, 0), scan::swar(&line, 8));
        assert_eq!(
            scan::chunk(&line, 0),
            (lo.0 | hi.0 << 8, lo.1 | hi.1 << 8),
            "{line:?}"
        );
    }
}
