//! The fast path for common frames (`amp::fast`) against the JSON Schema path: over
//! generated frames (valid ones and near misses of every rule, in shuffled member order,
//! with escapes, duplicates, `null`s and wrong types) and the fixture frames, `decode`
//! (fast path first) must give exactly what `decode_full` (schema only) gives: the same
//! typed frame, or the same error with the same code, path and text. And the fast path
//! must really take the frames the broker sees on every message.

use amp_broker::amp::FrameValidator;
use amp_broker::amp::fast;

fn validator() -> FrameValidator {
    FrameValidator::new().expect("embedded schema compiles")
}

/// A small deterministic generator (xorshift64*), so a failure names a reproducible case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() % items.len() as u64) as usize]
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

const IDS: &[&str] = &[
    r#""s1""#,
    r#""0""#,
    r#""""#,
    r#""aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa""#,
    r#""aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa""#,
    // 40 characters, 80 bytes: valid to the schema, too long for the byte check.
    r#""éééééééééééééééééééééééééééééééééééééééé""#,
    r#""a\"b""#,
    r#""tab\there""#,
    r#""\u0041""#,
    "null",
    "7",
    r#"["x"]"#,
];

const NAMES: &[&str] = &[
    r#""worker-2""#,
    r#""r0-1""#,
    r#""A_z-9""#,
    r#""""#,
    r#""a.b""#,
    r#""a b""#,
    r#""a/b""#,
    r#""ä""#,
    r#""aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa""#,
    r#""aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa""#,
    r#""a\n""#,
    r#""\u0062""#,
    "null",
    "1",
];

const BODIES: &[&str] = &[
    "null",
    "1",
    "2.50",
    "-0",
    "1e3",
    r#""text""#,
    r#"{"t":12345678901234567890,"pad":"xxxxxxxx"}"#,
    r#"{"op":"ack","seq":1}"#,
    r#"{"b": [1, 2.50, null], "a": {"op":"send"}}"#,
    r#"[true,false,{},[]]"#,
    r#""\ud83d\ude00""#,
    r#"{"dup":1,"dup":2}"#,
];

const SEQS: &[&str] = &[
    "1",
    "42",
    "9007199254740991",
    "9007199254740992",
    "0",
    "-1",
    "1.0",
    "1.5",
    "1e2",
    r#""1""#,
    "null",
    "18446744073709551616",
];

const DELAYS: &[&str] = &[
    "0", "500", "86400000", "86400001", "-5", "1.0", "null", r#""1""#,
];

const IDEMS: &[&str] = &[
    r#""k-1""#,
    r#""!~""#,
    r#""""#,
    r#""a b""#,
    r#""é""#,
    r#""\u0021""#,
    "null",
    "3",
];

const HEADERS: &[&str] = &[
    "{}",
    r#"{"traceparent":"00-ab-cd-01"}"#,
    r#"{"k":"v","k2":""}"#,
    r#"{"a:b":"v"}"#,
    r#"{"":"v"}"#,
    r#"{"a b":"v"}"#,
    r#"{"k":"line\nbreak"}"#,
    r#"{"k":"cr\rhere"}"#,
    r#"{"k":"tab\tok"}"#,
    r#"{"k\u0041":"v"}"#,
    r#"{"k":1}"#,
    r#"{"k":null}"#,
    r#"{"k":"a","k":"b"}"#,
    r#"{"é":"v"}"#,
    "null",
    r#"["k"]"#,
];

const TASKS: &[&str] = &[
    r#""t-1""#,
    r#""T_9""#,
    r#""aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa""#,
    r#""aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa""#,
    r#""""#,
    r#""a.b""#,
    r#""a/b""#,
    r#""t""#,
    "null",
    "5",
];

const ATTEMPTS: &[&str] = &[
    "3",
    "1",
    "1000",
    "1001",
    "0",
    "-1",
    "1.0",
    "2.5",
    r#""3""#,
    "null",
    "4294967296",
];

const ELIGIBLE: &[&str] = &[
    r#"{"names":["w1"]}"#,
    r#"{"labels":{"gpu":"a100"}}"#,
    "{}",
    r#"{"names":["a b"]}"#,
    "null",
];

const OPS: &[&str] = &[
    r#""send""#,
    r#""ack""#,
    r#""nak""#,
    r#""ping""#,
    r#""submit""#,
    r#""claim""#,
    r#""complete""#,
    r#""bye""#,
    r#""publish""#,
    r#""Send""#,
    r#""ok""#,
    "null",
];

/// One frame: members chosen from the lists (mostly valid ones), sometimes one left
/// out, an unknown or duplicate one added, the order shuffled, spaces between tokens.
fn generate(rng: &mut Rng) -> String {
    let op = if rng.chance(90) {
        rng.pick(&OPS[..7])
    } else {
        rng.pick(OPS)
    };
    let mostly = |rng: &mut Rng, list: &[&'static str]| {
        if rng.chance(75) {
            list[0]
        } else {
            rng.pick(list)
        }
    };
    let mut members: Vec<(&str, String)> = vec![("op", op.to_string())];
    let optional = |rng: &mut Rng, members: &mut Vec<(&str, String)>, key, list| {
        let value = mostly(rng, list).to_string();
        if rng.chance(50) {
            members.push((key, value));
        }
    };
    match op {
        r#""send""# | r#""publish""# => {
            members.push(("id", mostly(rng, IDS).to_string()));
            members.push(("to", mostly(rng, NAMES).to_string()));
            members.push(("body", rng.pick(BODIES).to_string()));
            optional(rng, &mut members, "headers", HEADERS);
            optional(rng, &mut members, "idem", IDEMS);
        }
        r#""ack""# => {
            optional(rng, &mut members, "id", IDS);
            members.push(("seq", mostly(rng, SEQS).to_string()));
            optional(rng, &mut members, "sub", NAMES);
        }
        r#""nak""# => {
            optional(rng, &mut members, "id", IDS);
            members.push(("seq", mostly(rng, SEQS).to_string()));
            optional(rng, &mut members, "delay_ms", DELAYS);
        }
        r#""submit""# => {
            members.push(("id", mostly(rng, IDS).to_string()));
            members.push(("job", mostly(rng, NAMES).to_string()));
            members.push(("body", rng.pick(BODIES).to_string()));
            optional(rng, &mut members, "task", TASKS);
            optional(rng, &mut members, "max_attempts", ATTEMPTS);
            optional(rng, &mut members, "headers", HEADERS);
            if rng.chance(10) {
                members.push(("eligible", rng.pick(ELIGIBLE).to_string()));
            }
        }
        r#""claim""# | r#""complete""# => {
            members.push(("id", mostly(rng, IDS).to_string()));
            members.push(("task", mostly(rng, TASKS).to_string()));
            if op == r#""complete""# {
                optional(rng, &mut members, "result", BODIES);
            }
        }
        _ => members.push(("id", mostly(rng, IDS).to_string())),
    }
    if rng.chance(8) && members.len() > 1 {
        let i = (rng.next() % members.len() as u64) as usize;
        members.remove(i);
    }
    if rng.chance(6) {
        members.push(("from", r#""acme/x""#.to_string()));
    }
    if rng.chance(6) {
        let i = (rng.next() % members.len() as u64) as usize;
        let again = members[i].clone();
        members.push(again);
    }
    if rng.chance(30) {
        for i in (1..members.len()).rev() {
            let j = (rng.next() % (i as u64 + 1)) as usize;
            members.swap(i, j);
        }
    }
    let spaced = rng.chance(5);
    let (colon, comma) = if spaced { (" : ", " , ") } else { (":", ",") };
    let inner: Vec<String> = members
        .iter()
        .map(|(k, v)| format!("\"{k}\"{colon}{v}"))
        .collect();
    let mut text = format!("{{{}}}", inner.join(comma));
    match rng.next() % 50 {
        0 => text.push_str(" \n"),
        1 => text.push('x'),
        2 => text.insert(0, ' '),
        3 => {
            text.pop();
        }
        _ => {}
    }
    text
}

fn assert_same(v: &FrameValidator, text: &str) -> bool {
    let fast_taken = fast::decode(text).is_some();
    assert_eq!(
        v.decode(text),
        v.decode_full(text),
        "fast path and schema differ on {text}"
    );
    fast_taken
}

#[test]
fn fast_path_and_schema_agree_on_generated_frames() {
    let v = validator();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut taken, mut valid) = (0, 0);
    let total = 20_000;
    for _ in 0..total {
        let text = generate(&mut rng);
        if assert_same(&v, &text) {
            taken += 1;
        }
        if v.decode_full(&text).is_ok() {
            valid += 1;
        }
    }
    // Most valid generated frames are plain ones the fast path must take; the rest are
    // its deliberate refusals (escapes, multi-byte ids, a repeated header name, a
    // submit with `eligible`).
    assert!(
        taken * 4 >= valid * 3,
        "fast path took {taken} of {valid} valid frames ({total} generated)"
    );
    assert!(
        valid * 4 >= total && valid < total,
        "{valid} of {total} valid"
    );
}

#[test]
fn fast_path_and_schema_agree_on_fixture_frames() {
    let v = validator();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/seeds/amp_frame");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).expect("amp_frame seeds") {
        let bytes = std::fs::read(entry.expect("seed").path()).expect("read seed");
        if let Ok(text) = std::str::from_utf8(&bytes) {
            assert_same(&v, text);
            seen += 1;
        }
    }
    assert!(seen >= 5, "{seen} seeds");
    let fixtures = [
        r#"{"op":"send","id":"s1","to":"worker-2","body":{"x":1}}"#,
        r#"{"op":"send","id":"s1","to":"worker-2","body":null,"headers":{"traceparent":"00-ab-cd-01"},"idem":"k-1"}"#,
        r#"{"body":{"x":1},"id":"s1","op":"send","to":"worker-2"}"#,
        r#"{"op":"ack","seq":42}"#,
        r#"{"op":"ack","id":"a1","seq":42}"#,
        r#"{"op":"ack","sub":"orders-eu","seq":7}"#,
        r#"{"op":"nak","seq":42}"#,
        r#"{"op":"nak","id":"n1","seq":42,"delay_ms":500}"#,
        r#"{"op":"ping","id":"p"}"#,
        r#"{"op":"submit","id":"s1","job":"render","body":{"n":1}}"#,
        r#"{"op":"submit","id":"s1","job":"render","body":null,"task":"t-1","max_attempts":5,"headers":{"traceparent":"00-ab-cd-01"}}"#,
        r#"{"op":"claim","id":"c1","task":"t-1"}"#,
        r#"{"op":"complete","id":"k1","task":"t-1"}"#,
        r#"{"op":"complete","id":"k1","task":"t-1","result":{"ok":[1,2.50]}}"#,
        r#"{"op":"complete","id":"k1","task":"t-1","result":null}"#,
    ];
    for text in fixtures {
        assert!(assert_same(&v, text), "fast path should take {text}");
    }
    let refused_by_both = [
        r#"{"op":"send","id":"s1","to":"worker-2"}"#,
        r#"{"op":"send","id":"s1","to":"w","body":1,"from":"acme/x"}"#,
        r#"{"op":"send","id":"s1","to":"w","body":1,"idem":null}"#,
        r#"{"op":"send","id":"s1","to":"w","body":1,"headers":null}"#,
        r#"{"op":"send","id":"s1","to":"w","body":1,"headers":{"a:b":"v"}}"#,
        r#"{"op":"ack","seq":0}"#,
        r#"{"op":"ack","seq":9007199254740992}"#,
        r#"{"op":"ack","seq":1,"id":null}"#,
        r#"{"op":"nak","seq":1,"delay_ms":86400001}"#,
        r#"{"op":"ping","id":""}"#,
        r#"{"op":"submit","id":"s1","job":"render"}"#,
        r#"{"op":"submit","id":"s1","job":"render","body":1,"max_attempts":0}"#,
        r#"{"op":"submit","id":"s1","job":"render","body":1,"task":"a.b"}"#,
        r#"{"op":"claim","id":"c1"}"#,
        r#"{"op":"claim","id":"c1","task":"t","result":1}"#,
        r#"{"op":"complete","id":"k1","task":""}"#,
    ];
    for text in refused_by_both {
        assert!(!assert_same(&v, text), "fast path must not take {text}");
        assert!(v.decode_full(text).is_err(), "schema refuses {text}");
    }
    // Valid, but not what the fast path vouches for: the schema decides them.
    let left_to_the_schema = [
        r#"{"op":"ping","id":"p","op":"ping"}"#,
        r#"{"op":"ping","id":"\u0070"}"#,
        r#"{"op":"send","id":"ééééééééééééééééééééééééééééééééééé","to":"w","body":1}"#,
        r#"{"op" : "ack","seq":1}"#,
        r#"{"op":"submit","id":"s1","job":"render","body":1,"eligible":{"names":["w1"]}}"#,
    ];
    for text in left_to_the_schema {
        assert!(!assert_same(&v, text), "fast path must not take {text}");
        assert!(v.decode_full(text).is_ok(), "schema accepts {text}");
    }
}

/// `op` where the fast path's guess at it can be wrong: twice, with an escaped name or
/// value, spaced, inside another member's string or a nested object, and every other
/// member repeated, escaped or unknown, each placed at every position of every common
/// frame. The guess must never make the fast path take what the schema reads otherwise.
#[test]
fn fast_path_and_schema_agree_wherever_op_and_odd_members_sit() {
    let v = validator();
    let frames: &[&[&str]] = &[
        &[
            r#""op":"send""#,
            r#""id":"s1""#,
            r#""to":"w""#,
            r#""body":1"#,
        ],
        &[r#""op":"ack""#, r#""seq":5"#],
        &[r#""op":"nak""#, r#""seq":5"#, r#""delay_ms":1"#],
        &[r#""op":"ping""#, r#""id":"p""#],
        &[
            r#""op":"submit""#,
            r#""id":"s1""#,
            r#""job":"j""#,
            r#""body":{}"#,
        ],
        &[r#""op":"claim""#, r#""id":"c""#, r#""task":"t""#],
        &[r#""op":"complete""#, r#""id":"c""#, r#""task":"t""#],
    ];
    let odd = [
        r#""op":"send""#,
        r#""op":"ack""#,
        r#""op":"ping""#,
        r#""op":"hello""#,
        r#""op":null"#,
        r#""o\u0070":"send""#,
        r#""\u006fp":"ack""#,
        r#""op":"s\u0065nd""#,
        r#""op":"send\"""#,
        r#""op" : "ack""#,
        r#""x":"{\"op\":\"send\"""#,
        r#""x":"{\"op\":\"ack\",\"seq\":1}""#,
        r#""body":{"op":"send","id":"s1","to":"w","body":1}"#,
        r#""body":"\"op\":\"ping\"""#,
        r#""id":"s2""#,
        r#""id":"\u0073""#,
        r#""i\u0064":"s1""#,
        r#""seq":6"#,
        r#""seq":"6""#,
        r#""s\u0065q":6"#,
        r#""to":"w2""#,
        r#""body":2"#,
        r#""task":"t""#,
        r#""idem":"k""#,
        r#""sub":"s""#,
        r#""headers":{}"#,
        r#""OP":"send""#,
        r#""op ":"send""#,
        r#""":1"#,
    ];
    let mut checked = 0;
    for members in frames {
        let mut variants: Vec<Vec<&str>> = vec![members.to_vec()];
        // The frame with its op moved to every position.
        for at in 1..members.len() {
            let mut moved = members[1..].to_vec();
            moved.insert(at, members[0]);
            variants.push(moved);
        }
        for base in variants {
            for extra in odd {
                for at in 0..=base.len() {
                    let mut m = base.clone();
                    m.insert(at, extra);
                    for (open, sep, close) in
                        [("{", ",", "}"), (" { ", " , ", " } "), ("{", ",\n", "}")]
                    {
                        let text = format!("{open}{}{close}", m.join(sep));
                        assert_same(&v, &text);
                        checked += 1;
                    }
                }
                // The odd member in place of the op.
                let mut m = base.clone();
                if let Some(op) = m.iter().position(|s| s.starts_with(r#""op""#)) {
                    m[op] = extra;
                    assert_same(&v, &format!("{{{}}}", m.join(",")));
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 1000, "{checked}");
}
