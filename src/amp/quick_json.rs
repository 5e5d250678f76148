//! A recogniser for the JSON that bodies almost always are, faster than serde's walk.
//!
//! Every `send` body is checked twice (as one value when the frame is read, strictly
//! when it becomes a [`Body`](super::Body)) and once more when the stored envelope is
//! read back for delivery; serde's visitors cost about six instructions a byte there.
//! [`certainly_strict`] walks the text once, string runs eight bytes at a time, and
//! answers `true` only for text that is one JSON value (RFC 8259, surrounding whitespace
//! allowed) that `serde_json::Value` also takes. Everything it is unsure of (numbers with
//! an exponent or more than [`MAX_NUMBER`] characters, which may fall outside `f64`;
//! `\u` escapes of surrogates, which may be unpaired; nesting past [`MAX_DEPTH`]) and
//! everything invalid is `false`, and the caller asks serde, so the answers never
//! differ, only their cost (`tests` and the `amp_frame` fuzz target compare the two).

use crate::scan::run_len;

/// Levels of arrays and objects it follows, as a body may nest (see `body.rs`).
const MAX_DEPTH: usize = 126;
/// Longest number it takes: far below the 309 digits where `f64` ends.
const MAX_NUMBER: usize = 100;

/// True when `text` is certainly one JSON value that `Value` takes; false when serde
/// must decide (it may still be valid).
pub fn certainly_strict(text: &str) -> bool {
    let s = text.as_bytes();
    value_end(s, skip_ws(s, 0)).is_some_and(|end| skip_ws(s, end) == s.len())
}

/// Where the value starting at `i` ends, when it is certainly one that `Value` takes
/// (as [`certainly_strict`] judges); `None` when serde must decide.
pub fn value_end(s: &[u8], mut i: usize) -> Option<usize> {
    // The open containers, innermost last: whether each is an object.
    let mut open = [false; MAX_DEPTH];
    let mut depth = 0;
    loop {
        // A value starts at `i`.
        match *s.get(i)? {
            c @ (b'{' | b'[') => {
                let object = c == b'{';
                *open.get_mut(depth)? = object;
                depth += 1;
                i = skip_ws(s, i + 1);
                let close = if object { b'}' } else { b']' };
                if s.get(i) == Some(&close) {
                    depth -= 1;
                    i += 1;
                } else {
                    if object {
                        i = member_name(s, i)?;
                    }
                    continue;
                }
            }
            b'"' => i = string(s, i)?,
            b't' => i = literal(s, i, b"true")?,
            b'f' => i = literal(s, i, b"false")?,
            b'n' => i = literal(s, i, b"null")?,
            b'-' | b'0'..=b'9' => i = number(s, i)?,
            _ => return None,
        }
        // After a value: the end, a next member or element, or closers.
        loop {
            let Some(top) = depth.checked_sub(1) else {
                return Some(i);
            };
            i = skip_ws(s, i);
            let object = *open.get(top)?;
            match *s.get(i)? {
                b',' => {
                    i = skip_ws(s, i + 1);
                    if object {
                        i = member_name(s, i)?;
                    }
                    break;
                }
                b'}' if object => {
                    depth = top;
                    i += 1;
                }
                b']' if !object => {
                    depth = top;
                    i += 1;
                }
                _ => return None,
            }
        }
    }
}

pub fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while matches!(s.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// A member's name and its `:`; returns where its value starts.
fn member_name(s: &[u8], i: usize) -> Option<usize> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let i = skip_ws(s, string(s, i)?);
    (s.get(i) == Some(&b':')).then(|| skip_ws(s, i + 1))
}

/// A string starting at its opening quote; returns the index after its closing one.
fn string(s: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        j += run_len(s.get(j..)?, 0x20, [b'"', b'\\']);
        match *s.get(j)? {
            b'"' => return Some(j + 1),
            b'\\' => match *s.get(j + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => j += 2,
                b'u' => {
                    let hex = s.get(j + 2..j + 6)?;
                    let text = std::str::from_utf8(hex).ok()?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return None;
                    }
                    let unit = u16::from_str_radix(text, 16).ok()?;
                    if (0xd800..=0xdfff).contains(&unit) {
                        return None;
                    }
                    j += 6;
                }
                _ => return None,
            },
            // A control character.
            _ => return None,
        }
    }
}

fn literal(s: &[u8], i: usize, word: &[u8]) -> Option<usize> {
    s.get(i..)?.starts_with(word).then_some(i + word.len())
}

/// `-? (0 | [1-9][0-9]*) (. [0-9]+)?`, no exponent; returns the index after it.
fn number(s: &[u8], i: usize) -> Option<usize> {
    let digits = |from: usize| {
        s.get(from..)
            .map_or(0, |r| r.iter().take_while(|b| b.is_ascii_digit()).count())
    };
    let mut j = i + usize::from(s.get(i) == Some(&b'-'));
    let whole = digits(j);
    if whole == 0 || (whole > 1 && s.get(j) == Some(&b'0')) {
        return None;
    }
    j += whole;
    if s.get(j) == Some(&b'.') {
        let fraction = digits(j + 1);
        if fraction == 0 {
            return None;
        }
        j += 1 + fraction;
    }
    if matches!(s.get(j), Some(b'e' | b'E')) || j - i > MAX_NUMBER {
        return None;
    }
    Some(j)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What serde says: one value that `Value` takes.
    fn serde_takes(text: &str) -> bool {
        serde_json::from_str::<serde_json::Value>(text).is_ok()
    }

    #[test]
    fn what_it_takes_serde_takes_and_the_common_bodies_it_takes_itself() {
        for text in [
            r#"{"n":1}"#,
            r#" {"pad":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx","n":-12.50} "#,
            r#"[1, 2.5, -0, 0.0, true, false, null, "a\"b\\c\/\b\f\n\r\t\u00e9", {}, []]"#,
            r#"{"a":{"b":[{"c":[]}]},"d":"日本"}"#,
            "\"\u{7f}\"",
            "0",
            r#""\uE000\uFFFF""#,
        ] {
            assert!(certainly_strict(text), "{text}");
            assert!(serde_takes(text), "{text}");
        }
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(certainly_strict(&deep));
        assert!(serde_takes(&deep));
    }

    #[test]
    fn what_it_leaves_to_serde_includes_everything_serde_refuses() {
        for text in [
            "",
            " ",
            "{",
            "}",
            "[1,]",
            "[,1]",
            r#"{"a":1,}"#,
            r#"{"a" 1}"#,
            r#"{1:2}"#,
            "01",
            "-",
            "1.",
            ".5",
            "+1",
            "1e5",
            "1E400",
            "tru",
            "nul",
            "[1 2]",
            "1 2",
            "\"a",
            "\"\u{1}\"",
            r#""\x""#,
            r#""\u12""#,
            r#""\u12G4""#,
            r#""\ud800""#,
            r#""\ud83d\ude00""#,
            "[1]]",
            "{}}",
            r#"{"a":1]"#,
            "[}",
            &"9".repeat(400),
            &format!("{}{}", "[".repeat(127), "]".repeat(127)),
        ] {
            assert!(!certainly_strict(text), "{text}");
        }
    }

    fn next(rng: &mut u64, n: u64) -> u64 {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng % n
    }

    /// A random value from JSON's grammar (within what it takes), as text.
    fn value(rng: &mut u64, depth: u32, out: &mut String) {
        let pick = if depth > 4 {
            next(rng, 5)
        } else {
            next(rng, 7)
        };
        match pick {
            0 => out.push_str(["true", "false", "null"][next(rng, 3) as usize]),
            1 => out.push_str(&format!("{}", next(rng, 1 << 40) as i64 - (1 << 39))),
            2 => out.push_str(&format!("-{}.{:03}", next(rng, 1000), next(rng, 1000))),
            3 | 4 => {
                out.push('"');
                for _ in 0..next(rng, 12) {
                    out.push_str(
                        ["a", "é", "\\n", "\\\"", "\\u00e9", " ", "\u{7f}", "日"]
                            [next(rng, 8) as usize],
                    );
                }
                out.push('"');
            }
            5 => {
                out.push('[');
                for i in 0..next(rng, 4) {
                    if i > 0 {
                        out.push_str([",", " , "][next(rng, 2) as usize]);
                    }
                    value(rng, depth + 1, out);
                }
                out.push(']');
            }
            _ => {
                out.push('{');
                for i in 0..next(rng, 4) {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&format!("\"k{}\" : ", next(rng, 3)));
                    value(rng, depth + 1, out);
                }
                out.push('}');
            }
        }
    }

    #[test]
    fn generated_values_are_taken_and_their_mutations_never_wrongly() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            let mut text = String::new();
            value(&mut rng, 0, &mut text);
            assert!(certainly_strict(&text), "{text}");
            assert!(serde_takes(&text), "{text}");
            // One byte changed, dropped or doubled: whatever it takes, serde takes.
            let bytes = text.as_bytes();
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let at = (rng % bytes.len() as u64) as usize;
            let noise = b"{}[],:\"\\0-.e 9tu"[(rng >> 32) as usize % 16];
            for mutated in [
                [&bytes[..at], &[noise], &bytes[at + 1..]].concat(),
                [&bytes[..at], &bytes[at + 1..]].concat(),
                [&bytes[..at], &bytes[at..]].concat(),
            ] {
                if let Ok(m) = std::str::from_utf8(&mutated)
                    && certainly_strict(m)
                {
                    assert!(serde_takes(m), "{m}");
                }
            }
        }
    }

    #[test]
    fn over_every_short_text_it_never_takes_what_serde_refuses() {
        // Every string of up to 4 symbols over an alphabet of JSON's pieces.
        let alphabet = [
            "{", "}", "[", "]", ",", ":", "\"", "\"a\"", "1", "-", "0", ".", "e", " ", "\\",
            "true", "u",
        ];
        let mut cases = vec![String::new()];
        for _ in 0..4 {
            let mut next = Vec::new();
            for case in &cases {
                for symbol in alphabet {
                    let text = format!("{case}{symbol}");
                    if certainly_strict(&text) {
                        assert!(serde_takes(&text), "{text}");
                    }
                    next.push(text);
                }
            }
            cases = next;
        }
    }
}
