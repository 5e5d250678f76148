//! Subject validation and wildcard matching, shared by permissions and dispatch.
//!
//! Rules as nats-server's `IsValidSubject`/`IsValidLiteralSubject`: tokens are separated
//! by `.` and never empty; no whitespace anywhere; `*` (one token) and `>` (one or more
//! trailing tokens) are wildcards only as whole tokens, and `>` only as the last token.
//! A token such as `a*` is an ordinary literal.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubjectError {
    Empty,
    /// Leading, trailing or doubled `.`.
    EmptyToken,
    /// Space, tab, CR, LF or form feed.
    Whitespace,
    /// A `*` or `>` token where only literals are allowed.
    Wildcard,
    /// A `>` token that is not the last one.
    FullWildcardNotLast,
}

impl fmt::Display for SubjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SubjectError::Empty => "empty subject",
            SubjectError::EmptyToken => "empty token in subject",
            SubjectError::Whitespace => "whitespace in subject",
            SubjectError::Wildcard => "wildcard in a literal subject",
            SubjectError::FullWildcardNotLast => "'>' is not the last token",
        })
    }
}

impl std::error::Error for SubjectError {}

#[inline]
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r' | b'\n' | 0x0c)
}

/// A subject or pattern: wildcards allowed as whole tokens, `>` last.
pub fn validate_pattern(s: &[u8]) -> Result<(), SubjectError> {
    if s.is_empty() {
        return Err(SubjectError::Empty);
    }
    let mut tokens = s.split(|&b| b == b'.').peekable();
    while let Some(t) = tokens.next() {
        if t.is_empty() {
            return Err(SubjectError::EmptyToken);
        }
        if t.iter().any(|&b| is_space(b)) {
            return Err(SubjectError::Whitespace);
        }
        if t == b">" && tokens.peek().is_some() {
            return Err(SubjectError::FullWildcardNotLast);
        }
    }
    Ok(())
}

/// A literal subject (what PUB may carry): a valid pattern without wildcard tokens.
pub fn validate_subject(s: &[u8]) -> Result<(), SubjectError> {
    // Most subjects hold no whitespace, `*` or `>` byte at all: one scan says so and
    // finds dots in a row, and only the ends are left to check.
    let stops = [b' ', b'\t', b'\r', b'\n', 0x0c, b'*', b'>'];
    if let Some(double_dot) = crate::scan::double_dot_unless(s, stops) {
        return match s {
            [] => Err(SubjectError::Empty),
            [b'.', ..] | [.., b'.'] => Err(SubjectError::EmptyToken),
            _ if double_dot => Err(SubjectError::EmptyToken),
            _ => Ok(()),
        };
    }
    validate_pattern(s)?;
    if s.split(|&b| b == b'.').any(|t| t == b"*" || t == b">") {
        return Err(SubjectError::Wildcard);
    }
    Ok(())
}

/// True when `s` is a valid literal subject.
pub fn is_literal(s: &[u8]) -> bool {
    validate_subject(s).is_ok()
}

/// Does the literal `subject` match `pattern`? Both are assumed valid; on invalid input
/// the answer is simply false or token-wise, never a panic.
pub fn matches(pattern: &[u8], subject: &[u8]) -> bool {
    let mut p = pattern.split(|&b| b == b'.');
    let mut s = subject.split(|&b| b == b'.');
    loop {
        match (p.next(), s.next()) {
            (Some(b">"), Some(_)) => return true,
            (Some(pt), Some(st)) => {
                if pt != b"*" && pt != st {
                    return false;
                }
            }
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literal_subjects_are_validated() {
        for ok in ["foo", "foo.bar", "$JS.API.INFO", "a*.b>", "_INBOX.x-y"] {
            assert_eq!(validate_subject(ok.as_bytes()), Ok(()), "{ok}");
        }
        let cases = [
            ("", SubjectError::Empty),
            (".foo", SubjectError::EmptyToken),
            ("foo.", SubjectError::EmptyToken),
            ("foo..bar", SubjectError::EmptyToken),
            ("foo bar", SubjectError::Whitespace),
            ("foo\tbar", SubjectError::Whitespace),
            ("foo\r\n", SubjectError::Whitespace),
            ("foo.*", SubjectError::Wildcard),
            ("foo.>", SubjectError::Wildcard),
            ("foo.>.bar", SubjectError::FullWildcardNotLast),
        ];
        for (s, want) in cases {
            assert_eq!(validate_subject(s.as_bytes()), Err(want), "{s:?}");
        }
    }

    #[test]
    fn the_fast_literal_check_answers_as_the_token_walk() {
        let walk = |s: &[u8]| {
            validate_pattern(s)?;
            if s.split(|&b| b == b'.').any(|t| t == b"*" || t == b">") {
                return Err(SubjectError::Wildcard);
            }
            Ok(())
        };
        let alphabet: &[&[u8]] = &[b"a", b".", b"*", b">", b" ", b"\t", b"\r", b"\x0c", b"\x01"];
        let mut cases: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..5 {
            let mut next = Vec::new();
            for case in &cases {
                for symbol in alphabet {
                    let longer = [case.as_slice(), symbol].concat();
                    for padded in [
                        longer.clone(),
                        [b"abcdefghi".as_slice(), &longer].concat(),
                        [&longer, b"abcdefghi".as_slice()].concat(),
                    ] {
                        assert_eq!(validate_subject(&padded), walk(&padded), "{padded:?}");
                    }
                    next.push(longer);
                }
            }
            cases = next;
        }
        // Bytes the one-pass scan could confuse (a zero like its tail's padding, DEL,
        // non-ASCII, LF), placed across the end of the first 16-byte chunk and in the tail.
        let alphabet = [b'a', b'.', b'*', b'>', b'\n', 0, 0x7f, 0xff, 0x0c, b' '];
        let mut cases: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..4 {
            cases = cases
                .iter()
                .flat_map(|c| alphabet.iter().map(move |&b| [c.as_slice(), &[b]].concat()))
                .collect();
            for case in &cases {
                for pad in [1, 11, 12, 13, 14, 15, 16, 17, 28, 31] {
                    let mut padded: Vec<u8> = (0..pad).map(|i| b"a.b"[i % 3]).collect();
                    padded.extend_from_slice(case);
                    assert_eq!(validate_subject(&padded), walk(&padded), "{padded:?}");
                }
            }
        }
    }

    #[test]
    fn patterns_allow_whole_token_wildcards_with_full_wildcard_last() {
        for ok in ["*", ">", "foo.*", "foo.>", "*.*.bar", "foo.*.>"] {
            assert_eq!(validate_pattern(ok.as_bytes()), Ok(()), "{ok}");
        }
        assert_eq!(
            validate_pattern(b">.foo"),
            Err(SubjectError::FullWildcardNotLast)
        );
        assert_eq!(validate_pattern(b"foo.*."), Err(SubjectError::EmptyToken));
    }

    #[test]
    fn matching_follows_token_wildcards() {
        let yes = [
            ("foo", "foo"),
            ("foo.*", "foo.bar"),
            ("*.bar", "foo.bar"),
            ("foo.>", "foo.bar"),
            ("foo.>", "foo.bar.baz"),
            (">", "foo"),
            ("foo.*.baz", "foo.x.baz"),
            ("a*", "a*"),
        ];
        for (p, s) in yes {
            assert!(matches(p.as_bytes(), s.as_bytes()), "{p} ~ {s}");
        }
        let no = [
            ("foo", "foo.bar"),
            ("foo.bar", "foo"),
            ("foo.*", "foo"),
            ("foo.*", "foo.bar.baz"),
            ("foo.>", "foo"),
            ("*", "foo.bar"),
            ("a*", "ab"),
            ("foo.bar", "foo.baz"),
        ];
        for (p, s) in no {
            assert!(!matches(p.as_bytes(), s.as_bytes()), "{p} !~ {s}");
        }
    }
}
