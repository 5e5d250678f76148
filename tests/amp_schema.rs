//! The client-frame schema against a table of valid and invalid frames for every op:
//! the expected error code and the JSON pointer of the offending member.

use amp_broker::amp::frame::{Auth, ClientFrame, From, FromName, Op};
use amp_broker::amp::{ErrorCode, FrameValidator, SCHEMA_JSON};
use serde_json::{Value, json};

const NKEY: &str = "UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4";

fn sig() -> String {
    "A".repeat(86)
}

fn validator() -> FrameValidator {
    FrameValidator::new().expect("embedded schema compiles")
}

fn valid_frames() -> Vec<Value> {
    vec![
        json!({"op":"hello","id":"h1","ns":"acme","name":"worker-1","auth":{"type":"token","token":"t0k"}}),
        json!({"op":"hello","id":"h1","ns":"acme","name":"worker-1",
               "auth":{"type":"nkey","nkey":NKEY,"sig":sig()},
               "serve":[{"job":"render","slots":2}],"labels":{"gpu":"a100"}}),
        json!({"op":"hello","id":"h1","ns":"acme","name":"w","auth":{"type":"nkey","nkey":NKEY,"sig":format!("{}==", sig())}}),
        json!({"op":"ping","id":"p"}),
        json!({"op":"bye","id":"b"}),
        json!({"op":"send","id":"s1","to":"worker-2","body":{"x":1}}),
        json!({"op":"send","id":"s1","to":"worker-2","body":null,"headers":{"traceparent":"00-ab-cd-01"},"idem":"k-1"}),
        json!({"op":"ack","seq":42}),
        json!({"op":"ack","id":"a1","seq":42}),
        json!({"op":"ack","sub":"orders-eu","seq":7}),
        json!({"op":"nak","seq":42}),
        json!({"op":"nak","id":"n1","seq":42,"delay_ms":500}),
        json!({"op":"publish","id":"p1","topic":"orders.eu.created","body":[1,2]}),
        json!({"op":"publish","id":"p1","topic":"orders","body":"x","headers":{},"idem":"k"}),
        json!({"op":"subscribe","id":"u1","topic":"orders.*.created"}),
        json!({"op":"subscribe","id":"u1","topic":"orders.>","sub":"orders-eu","from":"all","durable":true}),
        json!({"op":"subscribe","id":"u1","topic":">","from":"new"}),
        json!({"op":"subscribe","id":"u1","topic":"a.b","from":"last"}),
        json!({"op":"subscribe","id":"u1","topic":"a.b","from":{"seq":5}}),
        json!({"op":"subscribe","id":"u1","topic":"a.b","from":{"time":"2026-01-02T03:04:05.678Z"}}),
        json!({"op":"unsubscribe","id":"u2","sub":"orders-eu"}),
        json!({"op":"serve","id":"v1","job":"render","slots":2}),
        json!({"op":"serve","id":"v1","job":"render","slots":0}),
        json!({"op":"submit","id":"t1","job":"render","body":{}}),
        json!({"op":"submit","id":"t1","job":"render","body":null,"task":"T-1","max_attempts":3,
               "eligible":{"names":["w1","w2"],"labels":{"gpu":"a100"}},"headers":{"k":"v"}}),
        json!({"op":"claim","id":"c1","task":"T"}),
        json!({"op":"decline","id":"d1","task":"T"}),
        json!({"op":"heartbeat","id":"b1","task":"T"}),
        json!({"op":"heartbeat","id":"b1","task":"T","progress":{"pct":50}}),
        json!({"op":"complete","id":"k1","task":"T"}),
        json!({"op":"complete","id":"k1","task":"T","result":[1]}),
        json!({"op":"fail","id":"f1","task":"T","error":{"code":"oom","message":"out of memory"}}),
        json!({"op":"fail","id":"f1","task":"T","error":{"code":"oom"},"retry":true}),
        json!({"op":"status","id":"q1","task":"T"}),
        json!({"op":"cancel","id":"x1","task":"T"}),
        json!({"op":"who","id":"w1"}),
        json!({"op":"who","id":"w1","job":"render"}),
        json!({"op":"watch","id":"w2"}),
        json!({"op":"dead_letters","id":"l1","job":"render"}),
        json!({"op":"dead_letters","id":"l1","job":"render","from":{"seq":3}}),
        json!({"op":"redrive","id":"r1","job":"render","seq":3}),
    ]
}

#[test]
fn every_valid_frame_passes_and_decodes_to_its_op() {
    let v = validator();
    let mut ops_seen = std::collections::BTreeSet::new();
    for frame in valid_frames() {
        let text = frame.to_string();
        let decoded = v
            .decode(&text)
            .unwrap_or_else(|r| panic!("{text} rejected: {:?}", r.error));
        assert_eq!(
            decoded.op().as_str(),
            frame["op"].as_str().unwrap_or_default(),
            "{text}"
        );
        assert_eq!(
            decoded.id(),
            frame.get("id").and_then(Value::as_str),
            "{text}"
        );
        ops_seen.insert(decoded.op());
    }
    assert_eq!(ops_seen.len(), Op::ALL.len(), "the table covers every op");
}

/// (frame, expected code, expected path, expected `re`).
fn invalid_frames() -> Vec<(
    String,
    ErrorCode,
    Option<&'static str>,
    Option<&'static str>,
)> {
    use ErrorCode::{BadFrame, Schema};
    let j = |v: Value| v.to_string();
    vec![
        ("not json".into(), BadFrame, None, None),
        ("{\"op\":\"ping\",".into(), BadFrame, None, None),
        ("[1,2]".into(), BadFrame, None, None),
        ("\"ping\"".into(), BadFrame, None, None),
        (j(json!({"id":"x"})), BadFrame, Some("/op"), Some("x")),
        (
            j(json!({"op":7,"id":"x"})),
            BadFrame,
            Some("/op"),
            Some("x"),
        ),
        (
            j(json!({"op":"ok","id":"x"})),
            BadFrame,
            Some("/op"),
            Some("x"),
        ),
        (
            j(json!({"op":"dance","id":"x"})),
            BadFrame,
            Some("/op"),
            Some("x"),
        ),
        // hello
        (
            j(json!({"op":"hello","id":"h","ns":"acme","name":"w"})),
            Schema,
            Some("/auth"),
            Some("h"),
        ),
        (
            j(
                json!({"op":"hello","id":"h","ns":"ac me","name":"w","auth":{"type":"token","token":"t"}}),
            ),
            Schema,
            Some("/ns"),
            Some("h"),
        ),
        (
            j(
                json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"type":"password","token":"t"}}),
            ),
            Schema,
            Some("/auth/type"),
            Some("h"),
        ),
        (
            j(json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"token":"t"}})),
            Schema,
            Some("/auth/type"),
            Some("h"),
        ),
        (
            j(json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"type":"token"}})),
            Schema,
            Some("/auth/token"),
            Some("h"),
        ),
        (
            j(
                json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"type":"token","token":"t","sig":"x"}}),
            ),
            Schema,
            Some("/auth/sig"),
            Some("h"),
        ),
        (
            j(
                json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"type":"nkey","nkey":"NOPE","sig":sig()}}),
            ),
            Schema,
            Some("/auth/nkey"),
            Some("h"),
        ),
        (
            j(
                json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"type":"nkey","nkey":NKEY,"sig":"abc"}}),
            ),
            Schema,
            Some("/auth/sig"),
            Some("h"),
        ),
        (
            j(
                json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"type":"token","token":"t"},"serve":[{"job":"r","slots":-1}]}),
            ),
            Schema,
            Some("/serve/0/slots"),
            Some("h"),
        ),
        (
            j(
                json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"type":"token","token":"t"},"labels":{"gpu":1}}),
            ),
            Schema,
            Some("/labels/gpu"),
            Some("h"),
        ),
        (
            // At most 64 labels: they go into the registry entry every broker mirrors and
            // every watcher is told, at each serve change.
            {
                let labels: serde_json::Map<String, Value> =
                    (0..65).map(|i| (format!("l{i}"), json!("v"))).collect();
                j(
                    json!({"op":"hello","id":"h","ns":"acme","name":"w","auth":{"type":"token","token":"t"},"labels":labels}),
                )
            },
            Schema,
            Some("/labels"),
            Some("h"),
        ),
        // ping / bye / id rules
        (j(json!({"op":"ping"})), Schema, Some("/id"), None),
        (
            j(json!({"op":"ping","id":""})),
            Schema,
            Some("/id"),
            Some(""),
        ),
        (
            j(
                json!({"op":"ping","id":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}),
            ),
            Schema,
            Some("/id"),
            Some("xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"),
        ),
        (j(json!({"op":"ping","id":5})), Schema, Some("/id"), None),
        (
            j(json!({"op":"bye","id":"b","now":true})),
            Schema,
            Some("/now"),
            Some("b"),
        ),
        // send
        (
            j(json!({"op":"send","id":"s","to":"w2","body":1,"from":"acme/w1"})),
            Schema,
            Some("/from"),
            Some("s"),
        ),
        (
            j(json!({"op":"send","id":"s","body":1})),
            Schema,
            Some("/to"),
            Some("s"),
        ),
        (
            j(json!({"op":"send","id":"s","to":"w2"})),
            Schema,
            Some("/body"),
            Some("s"),
        ),
        (
            j(json!({"op":"send","id":"s","to":"acme/w2","body":1})),
            Schema,
            Some("/to"),
            Some("s"),
        ),
        (
            j(json!({"op":"send","id":"s","to":"w2","body":1,"headers":{"k":1}})),
            Schema,
            Some("/headers/k"),
            Some("s"),
        ),
        (
            j(json!({"op":"send","id":"s","to":"w2","body":1,"headers":{"k":"a\r\nb"}})),
            Schema,
            Some("/headers/k"),
            Some("s"),
        ),
        (
            j(json!({"op":"send","id":"s","to":"w2","body":1,"headers":{"bad:name":"v"}})),
            Schema,
            Some("/headers/bad:name"),
            Some("s"),
        ),
        (
            j(json!({"op":"send","id":"s","to":"w2","body":1,"idem":""})),
            Schema,
            Some("/idem"),
            Some("s"),
        ),
        // ack / nak
        (j(json!({"op":"ack"})), Schema, Some("/seq"), None),
        (
            j(json!({"op":"ack","seq":"42"})),
            Schema,
            Some("/seq"),
            None,
        ),
        (j(json!({"op":"ack","seq":0})), Schema, Some("/seq"), None),
        (
            j(json!({"op":"ack","seq":1,"sub":"a.b"})),
            Schema,
            Some("/sub"),
            None,
        ),
        (
            j(json!({"op":"nak","seq":1,"delay_ms":-5})),
            Schema,
            Some("/delay_ms"),
            None,
        ),
        (
            j(json!({"op":"nak","seq":1,"sub":"s"})),
            Schema,
            Some("/sub"),
            None,
        ),
        // publish
        (
            j(json!({"op":"publish","id":"p","topic":"a..b","body":1})),
            Schema,
            Some("/topic"),
            Some("p"),
        ),
        (
            j(json!({"op":"publish","id":"p","topic":"a.*","body":1})),
            Schema,
            Some("/topic"),
            Some("p"),
        ),
        (
            j(json!({"op":"publish","id":"p","topic":vec!["t"; 17].join("."),"body":1})),
            Schema,
            Some("/topic"),
            Some("p"),
        ),
        (
            j(json!({"op":"publish","id":"p","topic":"a"})),
            Schema,
            Some("/body"),
            Some("p"),
        ),
        // subscribe
        (
            j(json!({"op":"subscribe","id":"u","topic":"a.>.b"})),
            Schema,
            Some("/topic"),
            Some("u"),
        ),
        (
            j(json!({"op":"subscribe","id":"u","topic":"a.b","from":"first"})),
            Schema,
            Some("/from"),
            Some("u"),
        ),
        (
            j(json!({"op":"subscribe","id":"u","topic":"a.b","from":{"seq":1,"time":"x"}})),
            Schema,
            Some("/from"),
            Some("u"),
        ),
        (
            j(json!({"op":"subscribe","id":"u","topic":"a.b","from":{"time":"yesterday"}})),
            Schema,
            Some("/from"),
            Some("u"),
        ),
        (
            j(json!({"op":"subscribe","id":"u","topic":"a.b","durable":"yes"})),
            Schema,
            Some("/durable"),
            Some("u"),
        ),
        (
            j(json!({"op":"subscribe","id":"u","topic":"a.b","sub":""})),
            Schema,
            Some("/sub"),
            Some("u"),
        ),
        // unsubscribe / serve
        (
            j(json!({"op":"unsubscribe","id":"u"})),
            Schema,
            Some("/sub"),
            Some("u"),
        ),
        (
            j(json!({"op":"serve","id":"v","job":"render"})),
            Schema,
            Some("/slots"),
            Some("v"),
        ),
        (
            j(json!({"op":"serve","id":"v","job":"render","slots":1.5})),
            Schema,
            Some("/slots"),
            Some("v"),
        ),
        // submit
        (
            j(
                json!({"op":"submit","id":"t","job":"render","body":1,"eligible":{"labels":{"gpu":true}}}),
            ),
            Schema,
            Some("/eligible/labels/gpu"),
            Some("t"),
        ),
        (
            j(
                json!({"op":"submit","id":"t","job":"render","body":1,"eligible":{"names":["ok","not ok"]}}),
            ),
            Schema,
            Some("/eligible/names/1"),
            Some("t"),
        ),
        (
            j(json!({"op":"submit","id":"t","job":"render","body":1,"eligible":{"zone":"eu"}})),
            Schema,
            Some("/eligible/zone"),
            Some("t"),
        ),
        (
            j(json!({"op":"submit","id":"t","job":"render","body":1,"max_attempts":0})),
            Schema,
            Some("/max_attempts"),
            Some("t"),
        ),
        (
            j(json!({"op":"submit","id":"t","job":"render","body":1,"task":"x".repeat(129)})),
            Schema,
            Some("/task"),
            Some("t"),
        ),
        (
            j(json!({"op":"submit","id":"t","job":"re.nder","body":1})),
            Schema,
            Some("/job"),
            Some("t"),
        ),
        // tasks
        (
            j(json!({"op":"claim","id":"c"})),
            Schema,
            Some("/task"),
            Some("c"),
        ),
        (
            j(json!({"op":"decline","id":"d","task":"a/b"})),
            Schema,
            Some("/task"),
            Some("d"),
        ),
        (
            j(json!({"op":"heartbeat","id":"b","task":"T","lease_s":9})),
            Schema,
            Some("/lease_s"),
            Some("b"),
        ),
        (
            j(json!({"op":"complete","id":"k","task":"T","error":{}})),
            Schema,
            Some("/error"),
            Some("k"),
        ),
        (
            j(json!({"op":"fail","id":"f","task":"T"})),
            Schema,
            Some("/error"),
            Some("f"),
        ),
        (
            j(json!({"op":"fail","id":"f","task":"T","error":{"message":"m"}})),
            Schema,
            Some("/error/code"),
            Some("f"),
        ),
        (
            j(json!({"op":"fail","id":"f","task":"T","error":{"code":"c","stack":"s"}})),
            Schema,
            Some("/error/stack"),
            Some("f"),
        ),
        (
            j(json!({"op":"fail","id":"f","task":"T","error":{"code":"c"},"retry":1})),
            Schema,
            Some("/retry"),
            Some("f"),
        ),
        (
            j(json!({"op":"status","id":"q","task":""})),
            Schema,
            Some("/task"),
            Some("q"),
        ),
        (
            j(json!({"op":"cancel","id":"x","task":"T","reason":"r"})),
            Schema,
            Some("/reason"),
            Some("x"),
        ),
        // registry
        (
            j(json!({"op":"who","id":"w","job":"*"})),
            Schema,
            Some("/job"),
            Some("w"),
        ),
        (
            j(json!({"op":"watch","id":"w","job":"render"})),
            Schema,
            Some("/job"),
            Some("w"),
        ),
        // dead letters
        (
            j(json!({"op":"dead_letters","id":"l","job":"render","from":{"seq":0}})),
            Schema,
            Some("/from/seq"),
            Some("l"),
        ),
        (
            j(json!({"op":"redrive","id":"r","job":"render"})),
            Schema,
            Some("/seq"),
            Some("r"),
        ),
    ]
}

#[test]
fn every_invalid_frame_is_rejected_with_its_code_path_and_re() {
    let v = validator();
    for (text, code, path, re) in invalid_frames() {
        let rejected = match v.check(&text) {
            Ok(_) => panic!("{text} was accepted"),
            Err(r) => r,
        };
        assert_eq!(rejected.error.code, code, "{text}: {:?}", rejected.error);
        assert_eq!(
            rejected.error.path.as_deref(),
            path,
            "{text}: {:?}",
            rejected.error
        );
        assert_eq!(rejected.re.as_deref(), re, "{text}");
        let reply: Value = serde_json::from_str(&rejected.reply()).expect("reply is JSON");
        assert_eq!(reply["op"], "error");
        assert_eq!(reply["code"], code.as_str());
        assert_eq!(reply.get("re").and_then(Value::as_str), re, "{text}");
        assert_eq!(reply.get("path").and_then(Value::as_str), path, "{text}");
    }
}

#[test]
fn every_op_has_a_rejected_case_in_the_table() {
    let covered: std::collections::BTreeSet<String> = invalid_frames()
        .into_iter()
        .filter_map(|(text, ..)| {
            serde_json::from_str::<Value>(&text)
                .ok()?
                .get("op")?
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    for op in Op::ALL {
        assert!(
            covered.contains(op.as_str()),
            "no invalid case for {}",
            op.as_str()
        );
    }
}

#[test]
fn null_body_is_a_body() {
    let frame = validator()
        .decode(r#"{"op":"send","id":"s","to":"w","body":null}"#)
        .expect("null body is valid");
    let ClientFrame::Send(send) = frame else {
        panic!("not a send: {frame:?}")
    };
    assert_eq!(send.body.get(), "null");
}

/// The body a receiver gets is the text the sender wrote: key order, whitespace, number
/// spelling and escapes, on the fast path and on the schema path, for every op with one.
#[test]
fn bodies_are_kept_as_written() {
    let v = validator();
    let body =
        r#"{ "z" : 1.50, "a":[1 , 2e0],"big":123456789012345678901234567890,"s":"\u00e9\n\/" }"#;
    let frames = [
        format!(r#"{{"op":"send","id":"s","to":"w","body":{body}}}"#),
        format!(r#"{{"op":"send","id":"s","to":"w","body" :	{body} , "headers":{{}}}}"#),
        format!(r#"{{"op":"publish","id":"p","topic":"t.a","body":{body}}}"#),
        format!(r#"{{"op":"submit","id":"j","job":"render","body":{body}}}"#),
        // Written twice: the last one counts, as it did for the parsed value.
        format!(r#"{{"op":"send","id":"s","to":"w","body":[0],"body":{body}}}"#),
    ];
    for frame in &frames {
        for decoded in [v.decode(frame), v.decode_full(frame)] {
            let got = match decoded.expect("valid") {
                ClientFrame::Send(f) => f.body,
                ClientFrame::Publish(f) => f.body,
                ClientFrame::Submit(f) => f.body,
                other => panic!("unexpected {other:?}"),
            };
            assert_eq!(got.get(), body, "{frame}");
            assert_eq!(
                got.to_value(),
                serde_json::from_str::<Value>(body).expect("json")
            );
        }
    }
}

/// What a body may hold did not change with it being kept as text: the fast path still
/// refuses exactly what the parsed value refused, with the same error.
#[test]
fn bodies_are_checked_as_strictly_as_before() {
    let v = validator();
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let mut bodies: Vec<String> = [
        r#""\ud800""#,
        r#""\udc00 x""#,
        r#"{"\ud83d":1}"#,
        "1e999",
        "-1e400",
        "[1,]",
        "{\"a\":1,}",
        "\"tab\tinside\"",
        "01",
        "nul",
        r#""\x41""#,
    ]
    .map(str::to_owned)
    .to_vec();
    bodies.extend([deep(125), deep(126), deep(127), deep(128)]);
    for body in &bodies {
        let frame = format!(r#"{{"op":"send","id":"s","to":"w","body":{body}}}"#);
        let old = serde_json::from_str::<Value>(&frame).is_ok();
        let fast = v.decode(&frame);
        assert_eq!(fast.is_ok(), old, "{body}");
        assert_eq!(fast.err(), v.decode_full(&frame).err(), "{body}");
    }
    let frame = r#"{"op":"send","id":"s","to":"w","body":"\ud800"}"#;
    let err = v.decode(frame).expect_err("lone surrogate");
    assert_eq!(err.error.code, ErrorCode::BadFrame);
}

#[test]
fn typed_frames_carry_auth_and_from_forms() {
    let v = validator();
    let hello = v
        .decode(&json!({"op":"hello","id":"h","ns":"a","name":"b","auth":{"type":"nkey","nkey":NKEY,"sig":sig()}}).to_string())
        .expect("valid hello");
    let ClientFrame::Hello(hello) = hello else {
        panic!("not hello")
    };
    assert_eq!(
        hello.auth,
        Auth::Nkey {
            nkey: NKEY.into(),
            sig: sig()
        }
    );
    let from = |f: Value| {
        let text = json!({"op":"subscribe","id":"u","topic":"a","from":f}).to_string();
        match v.decode(&text) {
            Ok(ClientFrame::Subscribe(s)) => s.from.normalized(),
            other => panic!("{text}: {other:?}"),
        }
    };
    assert_eq!(from(json!("new")), From::New);
    assert_eq!(from(json!("all")), From::Named(FromName::All));
    assert_eq!(from(json!("last")), From::Named(FromName::Last));
    assert_eq!(from(json!({"seq":9})), From::Seq { seq: 9 });
    assert_eq!(
        from(json!({"time":"2026-01-01T00:00:00Z"})),
        From::Time {
            time: "2026-01-01T00:00:00Z".into()
        }
    );
    let text = json!({"op":"subscribe","id":"u","topic":"a"}).to_string();
    let Ok(ClientFrame::Subscribe(s)) = v.decode(&text) else {
        panic!("{text}")
    };
    assert_eq!(s.from, From::New);
    assert!(!s.durable);
}

#[test]
fn served_schema_is_a_valid_2020_12_schema_that_accepts_every_valid_frame_as_a_whole() {
    let schema: Value = serde_json::from_str(SCHEMA_JSON).expect("schema is JSON");
    assert_eq!(
        schema["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    assert!(jsonschema::meta::is_valid(&schema));
    let whole = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .build(&schema)
        .expect("compiles");
    for frame in valid_frames() {
        assert!(whole.is_valid(&frame), "{frame}");
    }
    for (text, ..) in invalid_frames() {
        if let Ok(frame) = serde_json::from_str::<Value>(&text) {
            assert!(!whole.is_valid(&frame), "{text}");
        }
    }
}

#[test]
fn every_fixed_shape_object_in_the_schema_forbids_unknown_members() {
    fn walk(v: &Value, at: &str) {
        match v {
            Value::Object(m) => {
                if m.contains_key("properties") && !at.ends_with("/if") {
                    // A discriminated object closes itself in each `then` branch.
                    let closed_by_branches =
                        m.get("allOf").and_then(Value::as_array).is_some_and(|b| {
                            b.iter()
                                .all(|c| c["then"]["additionalProperties"] == Value::Bool(false))
                        });
                    assert!(
                        m.get("additionalProperties") == Some(&Value::Bool(false))
                            || closed_by_branches,
                        "{at} lacks additionalProperties: false"
                    );
                }
                for (k, c) in m {
                    walk(c, &format!("{at}/{k}"));
                }
            }
            Value::Array(a) => {
                for (i, c) in a.iter().enumerate() {
                    walk(c, &format!("{at}/{i}"));
                }
            }
            _ => {}
        }
    }
    let schema: Value = serde_json::from_str(SCHEMA_JSON).expect("schema is JSON");
    walk(&schema["$defs"], "/$defs");
}

#[test]
fn first_frame_rules_bad_frame_without_op_else_unauthenticated() {
    let v = validator();
    let hello =
        json!({"op":"hello","id":"h","ns":"a","name":"b","auth":{"type":"token","token":"t"}});
    assert_eq!(
        v.decode_hello(&hello.to_string()).map(|h| h.name),
        Ok("b".to_owned())
    );
    let cases = [
        ("nope".to_owned(), ErrorCode::BadFrame, None),
        ("[]".to_owned(), ErrorCode::BadFrame, None),
        (json!({"id":"x"}).to_string(), ErrorCode::BadFrame, Some("x")),
        (json!({"op":"dance","id":"x"}).to_string(), ErrorCode::Unauthenticated, Some("x")),
        (json!({"op":"ping","id":"p"}).to_string(), ErrorCode::Unauthenticated, Some("p")),
        (json!({"op":"hello","id":"h","ns":"a","name":"b"}).to_string(), ErrorCode::Unauthenticated, Some("h")),
        (json!({"op":"hello","id":"h","ns":"a","name":"b","auth":{"type":"token","token":"t"},"x":1}).to_string(), ErrorCode::Unauthenticated, Some("h")),
    ];
    for (text, code, re) in cases {
        let rejected = v.decode_hello(&text).expect_err(&text);
        assert_eq!(rejected.error.code, code, "{text}");
        assert_eq!(rejected.re.as_deref(), re, "{text}");
        if code == ErrorCode::Unauthenticated {
            assert_eq!(
                rejected.error.message, "authentication failed",
                "says nothing about what was wrong"
            );
            assert_eq!(rejected.error.path, None);
        }
    }
}
