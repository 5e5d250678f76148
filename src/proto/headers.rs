//! NATS header blocks (ADR-4): a `NATS/1.0` line with an optional inline status and
//! description, then `Name: value` lines, then an empty line; every line ends in CRLF.
//!
//! Names keep their case and are compared exactly (as nats.go's `Header.Get`); a name may
//! repeat, each occurrence adding a value. `Headers` is a zero-copy view validated once;
//! `HeaderMap` is the owned, editable form.

use std::fmt;

const VERSION: &[u8] = b"NATS/1.0";

/// Inline statuses used by the server and JetStream.
pub mod status {
    pub const IDLE_HEARTBEAT_OR_FLOW_CONTROL: u16 = 100;
    pub const NO_MESSAGES: u16 = 404;
    pub const REQUEST_TIMEOUT: u16 = 408;
    pub const CONFLICT: u16 = 409;
    pub const NO_RESPONDERS: u16 = 503;
}

/// Why a header block was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// The block does not start with `NATS/1.0`.
    MissingVersion,
    /// The inline status is not three digits, or is not separated by a space.
    BadStatus,
    /// A line does not end in CRLF, or the block lacks its final empty line, or has bytes
    /// after it.
    BadLineEnd,
    /// A header line without a colon.
    MissingColon,
    /// An empty name, or one holding whitespace, control bytes or a colon.
    BadName,
    /// A value holding CR, LF or another control byte other than tab.
    BadValue,
    /// The block is not UTF-8.
    NotUtf8,
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HeaderError::MissingVersion => "header block does not start with NATS/1.0",
            HeaderError::BadStatus => "bad inline status in header block",
            HeaderError::BadLineEnd => {
                "header block lines must end in CRLF and the block in an empty line"
            }
            HeaderError::MissingColon => "header line without a colon",
            HeaderError::BadName => "bad header name",
            HeaderError::BadValue => "bad header value",
            HeaderError::NotUtf8 => "header block is not UTF-8",
        })
    }
}

impl std::error::Error for HeaderError {}

/// A validated, borrowed header block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers<'a> {
    status: Option<u16>,
    description: Option<&'a str>,
    /// The `Name: value` lines, each with its CRLF, without the final empty line.
    fields: &'a str,
}

impl<'a> Headers<'a> {
    /// Validates `block` (as carried by HPUB/HMSG: version line through final CRLFCRLF).
    pub fn parse(block: &'a [u8]) -> Result<Headers<'a>, HeaderError> {
        let rest = block
            .strip_prefix(VERSION)
            .ok_or(HeaderError::MissingVersion)?;
        let block = std::str::from_utf8(block).map_err(|_| HeaderError::NotUtf8)?;
        let rest_start = VERSION.len();
        let first_end = find_crlf(rest).ok_or(HeaderError::BadLineEnd)?;
        let (status, description) = parse_status_line(&block[rest_start..rest_start + first_end])?;
        let fields_start = rest_start + first_end + 2;
        let fields_all = &block[fields_start..];
        // Walk the field lines, validating each, until the empty line.
        let mut pos = 0;
        loop {
            let line_rest = &fields_all.as_bytes()[pos..];
            let end = find_crlf(line_rest).ok_or(HeaderError::BadLineEnd)?;
            if end == 0 {
                if pos + 2 != fields_all.len() {
                    return Err(HeaderError::BadLineEnd);
                }
                break;
            }
            split_field(&fields_all[pos..pos + end])?;
            pos += end + 2;
        }
        Ok(Headers {
            status,
            description,
            fields: &fields_all[..pos],
        })
    }

    /// The inline status (`NATS/1.0 404 ...` gives 404).
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// The inline description after the status (`No Messages`).
    pub fn description(&self) -> Option<&'a str> {
        self.description
    }

    /// First value of `name` (exact case).
    pub fn get(&self, name: &str) -> Option<&'a str> {
        self.get_all(name).next()
    }

    /// Every value of `name` (exact case), in order.
    pub fn get_all<'n>(&self, name: &'n str) -> impl Iterator<Item = &'a str> + use<'a, 'n> {
        self.iter().filter(move |(n, _)| *n == name).map(|(_, v)| v)
    }

    /// `(name, value)` pairs in block order.
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, &'a str)> + use<'a> {
        crlf_lines(self.fields).filter_map(|line| split_field(line).ok())
    }

    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }
}

/// The lines of validated fields, each `name: value\r\n`, without their CRLF. Neither
/// part holds CR or LF, so every LF ends a line: one byte search per line instead of
/// the two-byte pattern search of `split_terminator("\r\n")`.
fn crlf_lines(fields: &str) -> impl Iterator<Item = &str> {
    let mut rest = fields;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = memchr::memchr(b'\n', rest.as_bytes()).unwrap_or(rest.len());
        let line = rest.get(..end).unwrap_or_default();
        rest = rest.get(end + 1..).unwrap_or_default();
        Some(line.strip_suffix('\r').unwrap_or(line))
    })
}

/// Owned, insertion-ordered, case-preserving, multi-value headers.
///
/// The fields live in one string in their wire form, `name: value\r\n` each (leading
/// blanks of a value dropped), so a map read from the wire (one for every message a
/// connection receives) is one allocation and, as servers write it, one copy, and
/// encoding it is one copy again. Names hold no `:` and neither holds CR or LF, so the
/// form splits one way only.
#[derive(Clone, Default)]
pub struct HeaderMap {
    status: Option<u16>,
    description: Option<String>,
    text: String,
    /// The length of the block the map was read from, 0 for one built here: what the
    /// server counted of it (a pull's `max_bytes`), even when only the status was kept.
    wire_len: usize,
}

impl HeaderMap {
    pub fn new() -> Self {
        HeaderMap::default()
    }

    /// An empty map with room for `fields` fields of `bytes` of names and values.
    pub fn with_capacity(bytes: usize, fields: usize) -> Self {
        HeaderMap {
            text: String::with_capacity(bytes + 4 * fields),
            ..HeaderMap::default()
        }
    }

    /// Empties the map, keeping its room.
    pub fn clear(&mut self) {
        self.status = None;
        self.description = None;
        self.text.clear();
    }

    /// A map whose version line carries `status` and, when not empty, `description`.
    /// The description must not hold CR or LF.
    pub fn with_status(status: u16, description: &str) -> Result<Self, HeaderError> {
        if status > 999 {
            return Err(HeaderError::BadStatus);
        }
        check_value(description)?;
        let description = description.trim();
        Ok(HeaderMap {
            status: Some(status),
            description: (!description.is_empty()).then(|| description.to_owned()),
            ..HeaderMap::default()
        })
    }

    /// Validates `block` as [`Headers::parse`] does and copies it, in one pass: the
    /// fields as one piece when they are already in the stored form (`name: value`, as
    /// nats-server and this crate write them), else each as it is checked.
    pub fn parse(block: &[u8]) -> Result<HeaderMap, HeaderError> {
        let rest = block
            .strip_prefix(VERSION)
            .ok_or(HeaderError::MissingVersion)?;
        let block = std::str::from_utf8(block).map_err(|_| HeaderError::NotUtf8)?;
        let rest_start = VERSION.len();
        let first_end = find_crlf(rest).ok_or(HeaderError::BadLineEnd)?;
        let status_line = block
            .get(rest_start..rest_start + first_end)
            .ok_or(HeaderError::BadLineEnd)?;
        let (status, description) = parse_status_line(status_line)?;
        let fields_all = block
            .get(rest_start + first_end + 2..)
            .ok_or(HeaderError::BadLineEnd)?;
        let mut map = HeaderMap {
            status,
            description: description.map(str::to_owned),
            text: String::new(),
            wire_len: block.len(),
        };
        // Whether every field so far is in the stored form, and so is the text as is.
        let mut stored_form = true;
        let mut pos = 0;
        loop {
            let line_rest = fields_all.as_bytes().get(pos..).unwrap_or_default();
            let end = find_crlf(line_rest).ok_or(HeaderError::BadLineEnd)?;
            if end == 0 {
                if pos + 2 != fields_all.len() {
                    return Err(HeaderError::BadLineEnd);
                }
                break;
            }
            let line = fields_all
                .get(pos..pos + end)
                .ok_or(HeaderError::BadLineEnd)?;
            let (name, value) = split_field(line)?;
            let spaced = line.len() == name.len() + 2 + value.len()
                && line.as_bytes().get(name.len() + 1) == Some(&b' ');
            if stored_form && !spaced {
                // Another spacing after the colon: from here on each field is rebuilt.
                stored_form = false;
                map.text = String::with_capacity(fields_all.len() + 2);
                map.text.push_str(fields_all.get(..pos).unwrap_or_default());
            }
            if !stored_form {
                map.push(name, value);
            }
            pos += end + 2;
        }
        if stored_form {
            map.text = fields_all.get(..pos).unwrap_or_default().to_owned();
        }
        Ok(map)
    }

    /// Only the inline status and description of `block`'s version line; the fields that
    /// follow are neither checked nor kept.
    pub fn parse_status(block: &[u8]) -> Result<HeaderMap, HeaderError> {
        let rest = block
            .strip_prefix(VERSION)
            .ok_or(HeaderError::MissingVersion)?;
        let first_end = find_crlf(rest).ok_or(HeaderError::BadLineEnd)?;
        let line = rest.get(..first_end).ok_or(HeaderError::BadLineEnd)?;
        let line = std::str::from_utf8(line).map_err(|_| HeaderError::NotUtf8)?;
        let (status, description) = parse_status_line(line)?;
        Ok(HeaderMap {
            status,
            description: description.map(str::to_owned),
            text: String::new(),
            wire_len: block.len(),
        })
    }

    /// The length of the block the map was read from; 0 for a map built here.
    pub fn wire_len(&self) -> usize {
        self.wire_len
    }

    /// Sets `name` to the single value `value`, replacing earlier values (the first
    /// occurrence keeps its position). Leading blanks of `value` are dropped, as a parser
    /// would drop them.
    pub fn insert(&mut self, name: &str, value: &str) -> Result<(), HeaderError> {
        check_name(name)?;
        check_value(value)?;
        let value = value.trim_start_matches([' ', '\t']);
        let first = self.iter().position(|(n, _)| n == name);
        match first {
            Some(first) => {
                let fields: Vec<(String, String)> = self
                    .iter()
                    .enumerate()
                    .filter(|(i, (n, _))| *i == first || *n != name)
                    .map(|(i, (n, v))| {
                        (n.to_owned(), if i == first { value } else { v }.to_owned())
                    })
                    .collect();
                self.replace_fields(&fields);
            }
            None => self.push(name, value),
        }
        Ok(())
    }

    /// Adds a value to `name`, keeping earlier ones. Leading blanks are dropped.
    pub fn append(&mut self, name: &str, value: &str) -> Result<(), HeaderError> {
        check_name(name)?;
        check_value(value)?;
        self.push(name, value.trim_start_matches([' ', '\t']));
        Ok(())
    }

    /// [`append`](Self::append) for a name and value the caller made itself (a constant
    /// name; an id, a configured name or a constant for value): checked in debug builds
    /// only, as a message stamp is written for every message stored.
    pub fn append_trusted(&mut self, name: &str, value: &str) {
        debug_assert!(check_name(name).is_ok(), "header name {name:?}");
        debug_assert!(
            check_value(value).is_ok() && !value.starts_with([' ', '\t']),
            "header value {value:?}"
        );
        self.push(name, value);
    }

    /// Removes every value of `name`; true when there was one.
    pub fn remove(&mut self, name: &str) -> bool {
        let kept: Vec<(String, String)> = self
            .iter()
            .filter(|(n, _)| *n != name)
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
            .collect();
        let removed = kept.len() != self.len();
        if removed {
            self.replace_fields(&kept);
        }
        removed
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_all(name).next()
    }

    pub fn get_all<'s, 'n>(&'s self, name: &'n str) -> impl Iterator<Item = &'s str> + use<'s, 'n> {
        self.iter().filter(move |(n, _)| *n == name).map(|(_, v)| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        crlf_lines(&self.text).map(|line| {
            let colon = memchr::memchr(b':', line.as_bytes()).unwrap_or(line.len());
            (
                line.get(..colon).unwrap_or_default(),
                line.get(colon + 2..).unwrap_or_default(),
            )
        })
    }

    pub fn status(&self) -> Option<u16> {
        self.status
    }

    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    pub fn len(&self) -> usize {
        memchr::memchr_iter(b'\n', self.text.as_bytes()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    /// Length of the block `encode_into` writes.
    pub fn encoded_len(&self) -> usize {
        let mut n = VERSION.len() + 2 + 2;
        if self.status.is_some() {
            n += 4;
            if let Some(d) = &self.description {
                n += 1 + d.len();
            }
        }
        n + self.text.len()
    }

    /// Appends the block (version line through the final empty line) to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        out.extend_from_slice(VERSION);
        if let Some(s) = self.status {
            out.push(b' ');
            out.extend_from_slice(&[
                b'0' + (s / 100 % 10) as u8,
                b'0' + (s / 10 % 10) as u8,
                b'0' + (s % 10) as u8,
            ]);
            if let Some(d) = &self.description {
                out.push(b' ');
                out.extend_from_slice(d.as_bytes());
            }
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(self.text.as_bytes());
        out.extend_from_slice(b"\r\n");
    }

    /// The encoded block as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out
    }

    /// Adds a field already checked.
    fn push(&mut self, name: &str, value: &str) {
        self.text.reserve(name.len() + value.len() + 4);
        self.text.push_str(name);
        self.text.push_str(": ");
        self.text.push_str(value);
        self.text.push_str("\r\n");
    }

    fn replace_fields(&mut self, fields: &[(String, String)]) {
        self.text.clear();
        for (name, value) in fields {
            self.push(name, value);
        }
    }
}

impl PartialEq for HeaderMap {
    fn eq(&self, other: &Self) -> bool {
        self.status == other.status
            && self.description == other.description
            && self.iter().eq(other.iter())
    }
}

impl Eq for HeaderMap {}

impl fmt::Debug for HeaderMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeaderMap")
            .field("status", &self.status)
            .field("description", &self.description)
            .field("fields", &self.iter().collect::<Vec<_>>())
            .finish()
    }
}

impl From<&Headers<'_>> for HeaderMap {
    fn from(h: &Headers<'_>) -> Self {
        let mut map = HeaderMap {
            status: h.status,
            description: h.description.map(str::to_owned),
            text: String::with_capacity(h.fields.len() + 2),
            wire_len: 0,
        };
        for (name, value) in h.iter() {
            map.push(name, value);
        }
        map
    }
}

fn find_crlf(s: &[u8]) -> Option<usize> {
    let lf = memchr::memchr(b'\n', s)?;
    match lf.checked_sub(1) {
        Some(cr) if s[cr] == b'\r' => Some(cr),
        _ => None,
    }
}

/// What follows `NATS/1.0` on the first line: nothing, or ` 404`, or ` 404 No Messages`.
fn parse_status_line(rest: &str) -> Result<(Option<u16>, Option<&str>), HeaderError> {
    if rest.is_empty() {
        return Ok((None, None));
    }
    if !rest.starts_with([' ', '\t']) {
        return Err(HeaderError::BadStatus);
    }
    let rest = rest.trim_matches([' ', '\t']);
    if rest.is_empty() {
        return Ok((None, None));
    }
    let b = rest.as_bytes();
    if b.len() < 3 || !b[..3].iter().all(u8::is_ascii_digit) {
        return Err(HeaderError::BadStatus);
    }
    let code = (b[0] - b'0') as u16 * 100 + (b[1] - b'0') as u16 * 10 + (b[2] - b'0') as u16;
    let tail = &rest[3..];
    if tail.is_empty() {
        return Ok((Some(code), None));
    }
    if !tail.starts_with([' ', '\t']) {
        return Err(HeaderError::BadStatus);
    }
    check_value(tail)?;
    let d = tail.trim_matches([' ', '\t']);
    Ok((Some(code), (!d.is_empty()).then_some(d)))
}

/// Splits `Name: value` (value without leading blanks, as nats.go).
fn split_field(line: &str) -> Result<(&str, &str), HeaderError> {
    let colon = memchr::memchr(b':', line.as_bytes()).ok_or(HeaderError::MissingColon)?;
    let name = &line[..colon];
    check_name(name)?;
    let value = &line[colon + 1..];
    check_value(value)?;
    Ok((name, value.trim_start_matches([' ', '\t'])))
}

fn check_name(name: &str) -> Result<(), HeaderError> {
    let name = name.as_bytes();
    if name.is_empty() || crate::scan::run_len(name, 0x21, [b':', 0x7f]) != name.len() {
        return Err(HeaderError::BadName);
    }
    Ok(())
}

/// Whether `value` is one a header line can carry: no CR, LF or other control byte but tab.
pub fn check_value(value: &str) -> Result<(), HeaderError> {
    let value = value.as_bytes();
    // Word at a time up to the first control byte; a tab there (allowed) sends the rest
    // through the byte loop.
    let plain = crate::scan::run_len(value, 0x20, [0x7f]);
    let rest = value.get(plain..).unwrap_or_default();
    if rest.iter().any(|&b| (b < b' ' && b != b'\t') || b == 0x7f) {
        return Err(HeaderError::BadValue);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_keeps_its_fields_in_the_stored_form_whatever_the_spacing_read() {
        let block = b"NATS/1.0\r\nA: 1\r\nB:2\r\nC:  3\r\nD:\tx y\r\nE:\r\nF: a:b\r\n\r\n";
        let map = HeaderMap::parse(block).expect("valid");
        let fields: Vec<_> = map.iter().collect();
        assert_eq!(
            fields,
            [
                ("A", "1"),
                ("B", "2"),
                ("C", "3"),
                ("D", "x y"),
                ("E", ""),
                ("F", "a:b")
            ]
        );
        assert_eq!(map.len(), 6);
        let encoded = map.to_bytes();
        assert_eq!(
            encoded,
            b"NATS/1.0\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: x y\r\nE: \r\nF: a:b\r\n\r\n"
        );
        assert_eq!(encoded.len(), map.encoded_len());
        assert_eq!(HeaderMap::parse(&encoded).expect("again"), map);
        // As servers write it, the block is the stored form already.
        let stored = b"NATS/1.0 503\r\nNats-Msg-Id: x\r\nAMP-From: a/b\r\n\r\n";
        let map = HeaderMap::parse(stored).expect("valid");
        assert_eq!(map.to_bytes(), stored);
        assert_eq!(map.get("AMP-From"), Some("a/b"));
        let empty = HeaderMap::parse(b"NATS/1.0 408 Request Timeout\r\n\r\n").expect("status");
        assert!(empty.is_empty());
        assert_eq!(empty.len(), 0);
        assert_eq!(empty.to_bytes().len(), empty.encoded_len());
    }

    #[test]
    fn names_and_values_are_checked_byte_for_byte_as_the_rules_say() {
        let name_ok =
            |n: &[u8]| !n.is_empty() && !n.iter().any(|&b| b <= b' ' || b == b':' || b == 0x7f);
        let value_ok = |v: &[u8]| !v.iter().any(|&b| (b < b' ' && b != b'\t') || b == 0x7f);
        for special in 0..=0x7fu8 {
            for at in [0, 3, 8, 12, 16] {
                for len in [at + 1, 17] {
                    let mut text = vec![b'a'; len];
                    text[at] = special;
                    let Ok(t) = std::str::from_utf8(&text) else {
                        continue;
                    };
                    assert_eq!(check_name(t).is_ok(), name_ok(&text), "{text:?}");
                    assert_eq!(check_value(t).is_ok(), value_ok(&text), "{text:?}");
                    // After a tab, the rest still counts.
                    let mut tabbed = text.clone();
                    tabbed[0] = b'\t';
                    let t = std::str::from_utf8(&tabbed).expect("ascii");
                    assert_eq!(check_value(t).is_ok(), value_ok(&tabbed), "{tabbed:?}");
                }
            }
        }
    }

    #[test]
    fn plain_block_with_multi_value_headers_keeps_case_and_order() {
        let block = b"NATS/1.0\r\nNats-Msg-Id: 1\r\nX-Tag: a\r\nx-tag: lower\r\nX-Tag:b\r\n\r\n";
        let h = Headers::parse(block).expect("valid");
        assert_eq!(h.status(), None);
        assert_eq!(h.description(), None);
        assert_eq!(h.get("Nats-Msg-Id"), Some("1"));
        assert_eq!(h.get_all("X-Tag").collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(h.get("x-tag"), Some("lower"));
        assert_eq!(h.get("NATS-MSG-ID"), None);
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            [
                ("Nats-Msg-Id", "1"),
                ("X-Tag", "a"),
                ("x-tag", "lower"),
                ("X-Tag", "b")
            ]
        );
    }

    #[test]
    fn inline_statuses_and_descriptions_are_parsed() {
        let cases: [(&[u8], u16, Option<&str>); 6] = [
            (b"NATS/1.0 404 No Messages\r\n\r\n", 404, Some("No Messages")),
            (b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 3\r\nNats-Last-Stream: 9\r\n\r\n", 100, Some("Idle Heartbeat")),
            (b"NATS/1.0 100 FlowControl Request\r\n\r\n", 100, Some("FlowControl Request")),
            (b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\nNats-Pending-Bytes: 0\r\n\r\n", 408, Some("Request Timeout")),
            (b"NATS/1.0 409 Message Size Exceeds MaxBytes\r\n\r\n", 409, Some("Message Size Exceeds MaxBytes")),
            (b"NATS/1.0 503\r\n\r\n", 503, None),
        ];
        for (block, status, description) in cases {
            let h = Headers::parse(block).expect("valid");
            assert_eq!(h.status(), Some(status));
            assert_eq!(h.description(), description);
        }
        let hb = Headers::parse(cases[1].0).expect("valid");
        assert_eq!(hb.get("Nats-Last-Stream"), Some("9"));
    }

    #[test]
    fn the_status_alone_is_the_full_parse_s_status_and_ignores_the_fields() {
        let blocks: [&[u8]; 6] = [
            b"NATS/1.0 404 No Messages\r\n\r\n",
            b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 3\r\n\r\n",
            b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\n\r\n",
            b"NATS/1.0 503\r\n\r\n",
            b"NATS/1.0\r\nNats-Msg-Id: 1\r\nAMP-From: acme/a\r\n\r\n",
            b"NATS/1.0  409   Consumer Deleted \r\n\r\n",
        ];
        for block in blocks {
            let full = HeaderMap::parse(block).expect("valid");
            let status = HeaderMap::parse_status(block).expect("valid");
            assert_eq!(status.status(), full.status(), "{block:?}");
            assert_eq!(status.description(), full.description(), "{block:?}");
            assert!(status.is_empty(), "{block:?}");
        }
        // Fields are not looked at; a bad version line still is.
        let odd_fields = HeaderMap::parse_status(b"NATS/1.0 408\r\nno colon\r\n\r\n");
        assert_eq!(odd_fields.map(|h| h.status()), Ok(Some(408)));
        for (block, want) in [
            (&b"NATS/2.0 408\r\n\r\n"[..], HeaderError::MissingVersion),
            (b"NATS/1.0 408", HeaderError::BadLineEnd),
            (b"NATS/1.0 40\r\n\r\n", HeaderError::BadStatus),
            (b"NATS/1.0 408 \xff\r\n\r\n", HeaderError::NotUtf8),
        ] {
            assert_eq!(
                HeaderMap::parse_status(block).err(),
                Some(want),
                "{block:?}"
            );
        }
    }

    #[test]
    fn a_trusted_append_writes_what_a_checked_one_writes() {
        let (mut checked, mut trusted) = (HeaderMap::new(), HeaderMap::new());
        for (name, value) in [
            ("Nats-Msg-Id", "b7x2k9q4m1z8c3v6"),
            ("AMP-From", "acme/worker-1"),
            ("AMP-Kind", "message"),
            ("Empty", ""),
        ] {
            checked.append(name, value).expect("valid");
            trusted.append_trusted(name, value);
        }
        assert_eq!(trusted, checked);
        assert_eq!(trusted.to_bytes(), checked.to_bytes());
    }

    #[test]
    #[should_panic(expected = "header value")]
    #[cfg(debug_assertions)]
    fn a_trusted_append_of_a_line_break_fails_in_debug_builds() {
        HeaderMap::new().append_trusted("A", "x\r\nB: y");
    }

    #[test]
    fn values_lose_leading_blanks_only() {
        let h = Headers::parse(b"NATS/1.0\r\nA:   x y \r\nB:\r\n\r\n").expect("valid");
        assert_eq!(h.get("A"), Some("x y "));
        assert_eq!(h.get("B"), Some(""));
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let cases: [(&[u8], HeaderError); 12] = [
            (b"", HeaderError::MissingVersion),
            (b"NATS/2.0\r\n\r\n", HeaderError::MissingVersion),
            (b"NATS/1.0", HeaderError::BadLineEnd),
            (b"NATS/1.0\r\n", HeaderError::BadLineEnd),
            (b"NATS/1.0\n\n", HeaderError::BadLineEnd),
            (b"NATS/1.0\r\nA: b\r\n", HeaderError::BadLineEnd),
            (b"NATS/1.0\r\n\r\nextra", HeaderError::BadLineEnd),
            (b"NATS/1.0x\r\n\r\n", HeaderError::BadStatus),
            (b"NATS/1.0 40\r\n\r\n", HeaderError::BadStatus),
            (b"NATS/1.0\r\nno colon\r\n\r\n", HeaderError::MissingColon),
            (b"NATS/1.0\r\n: v\r\n\r\n", HeaderError::BadName),
            (b"NATS/1.0\r\nA B: v\r\n\r\n", HeaderError::BadName),
        ];
        for (block, want) in cases {
            assert_eq!(
                Headers::parse(block),
                Err(want),
                "{:?}",
                String::from_utf8_lossy(block)
            );
        }
        assert_eq!(
            Headers::parse(b"NATS/1.0\r\nA: \xff\r\n\r\n"),
            Err(HeaderError::NotUtf8)
        );
        assert_eq!(
            Headers::parse(b"NATS/1.0\r\nA: \x01\r\n\r\n"),
            Err(HeaderError::BadValue)
        );
    }

    #[test]
    fn header_map_parse_agrees_with_the_view() {
        let blocks: [&[u8]; 14] = [
            b"NATS/1.0\r\nNats-Msg-Id: 1\r\nX-Tag: a\r\nx-tag: lower\r\nX-Tag:b\r\n\r\n",
            b"NATS/1.0 404 No Messages\r\n\r\n",
            b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 3\r\n\r\n",
            b"NATS/1.0\r\nA:   x y \r\nB:\r\n\r\n",
            b"",
            b"NATS/1.0",
            b"NATS/1.0\r\nA: b\r\n",
            b"NATS/1.0\r\n\r\nextra",
            b"NATS/1.0 40\r\n\r\n",
            b"NATS/1.0\r\nno colon\r\n\r\n",
            b"NATS/1.0\r\n: v\r\n\r\n",
            b"NATS/1.0\r\nA: \xff\r\n\r\n",
            b"NATS/1.0\r\nA: \x01\r\n\r\n",
            b"NATS/1.0\r\nA: b\r\nC: d\n\r\n",
        ];
        for block in blocks {
            assert_eq!(
                HeaderMap::parse(block),
                Headers::parse(block).map(|h| HeaderMap::from(&h)),
                "{:?}",
                String::from_utf8_lossy(block)
            );
        }
    }

    #[test]
    fn header_map_insert_replaces_and_append_adds() {
        let mut m = HeaderMap::new();
        m.append("A", "1").expect("valid");
        m.append("B", "2").expect("valid");
        m.append("A", "3").expect("valid");
        assert_eq!(m.get_all("A").collect::<Vec<_>>(), ["1", "3"]);
        m.insert("A", "9").expect("valid");
        assert_eq!(m.iter().collect::<Vec<_>>(), [("A", "9"), ("B", "2")]);
        assert!(m.remove("B"));
        assert!(!m.remove("B"));
        assert_eq!(m.insert("A", "x\r\nB: y"), Err(HeaderError::BadValue));
        assert_eq!(m.append("A:", "x"), Err(HeaderError::BadName));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn header_map_encodes_what_parses_back() {
        let mut m = HeaderMap::with_status(408, "Request Timeout").expect("valid");
        m.append("Nats-Pending-Messages", "1").expect("valid");
        m.append("X", "a").expect("valid");
        m.append("X", "b").expect("valid");
        let block = m.to_bytes();
        assert_eq!(
            block,
            b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\nX: a\r\nX: b\r\n\r\n"
        );
        assert_eq!(m.encoded_len(), block.len());
        assert_eq!(HeaderMap::parse(&block), Ok(m));
        let empty = HeaderMap::new();
        assert_eq!(empty.to_bytes(), b"NATS/1.0\r\n\r\n");
        assert_eq!(empty.encoded_len(), 12);
        let s = HeaderMap::with_status(503, "").expect("valid");
        assert_eq!(s.to_bytes(), b"NATS/1.0 503\r\n\r\n");
        assert_eq!(s.encoded_len(), 16);
    }
}
