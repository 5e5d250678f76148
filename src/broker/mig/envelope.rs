//! MIG envelopes (mig-nats.md section 3): the liberal request header, reply headers, the
//! NATS header duplication and the error model with its AMP mapping.

use serde_json::{Map, Value, json};

use crate::proto::headers::HeaderMap;

/// The one version this broker speaks.
pub const MIG_VERSION: &str = "0.1";
/// Bound of `message_id`, `session_id` and `idempotency_key`.
pub const MAX_ID_CHARS: usize = 128;
/// Bound of `traceparent`: W3C's version 00 is 55 characters, later versions may append
/// fields, and every reply echoes it twice (body and NATS header), so it is bounded with
/// room to spare rather than by the request's size.
pub const MAX_TRACEPARENT_BYTES: usize = 256;
/// The header fields duplicated as NATS headers of the same names.
pub const DUPLICATED: &[&str] = &[
    "mig_version",
    "message_id",
    "tenant_id",
    "session_id",
    "traceparent",
    "idempotency_key",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Code {
    InvalidRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    UnsupportedCapability,
    VersionMismatch,
    Timeout,
    RateLimited,
    Backpressure,
    Unavailable,
    Internal,
}

pub const ALL_CODES: &[Code] = &[
    Code::InvalidRequest,
    Code::Unauthorized,
    Code::Forbidden,
    Code::NotFound,
    Code::UnsupportedCapability,
    Code::VersionMismatch,
    Code::Timeout,
    Code::RateLimited,
    Code::Backpressure,
    Code::Unavailable,
    Code::Internal,
];

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidRequest => "MIG_INVALID_REQUEST",
            Code::Unauthorized => "MIG_UNAUTHORIZED",
            Code::Forbidden => "MIG_FORBIDDEN",
            Code::NotFound => "MIG_NOT_FOUND",
            Code::UnsupportedCapability => "MIG_UNSUPPORTED_CAPABILITY",
            Code::VersionMismatch => "MIG_VERSION_MISMATCH",
            Code::Timeout => "MIG_TIMEOUT",
            Code::RateLimited => "MIG_RATE_LIMITED",
            Code::Backpressure => "MIG_BACKPRESSURE",
            Code::Unavailable => "MIG_UNAVAILABLE",
            Code::Internal => "MIG_INTERNAL",
        }
    }

    pub fn parse(s: &str) -> Option<Code> {
        ALL_CODES.iter().copied().find(|c| c.as_str() == s)
    }

    pub fn retryable(self) -> bool {
        matches!(
            self,
            Code::Timeout | Code::RateLimited | Code::Backpressure | Code::Unavailable
        )
    }

    /// The MIG code of an AMP error code (mig-nats.md section 3).
    pub fn from_amp(amp: &str) -> Code {
        match amp {
            "schema" | "bad_frame" | "too_large" | "conflict" => Code::InvalidRequest,
            "unauthenticated" => Code::Unauthorized,
            "forbidden" => Code::Forbidden,
            "not_found" => Code::NotFound,
            "rate_limited" | "budget_exhausted" => Code::RateLimited,
            "unavailable" => Code::Unavailable,
            _ => Code::Internal,
        }
    }
}

/// A MIG error on its way to the caller.
#[derive(Debug, Clone, PartialEq)]
pub struct MigError {
    pub code: Code,
    pub message: String,
    /// `retryable` when it is not the code's own (a cancelled invoke's `MIG_TIMEOUT`).
    pub retryable: Option<bool>,
    pub details: Map<String, Value>,
}

impl MigError {
    pub fn new(code: Code, message: impl Into<String>) -> MigError {
        MigError {
            code,
            message: message.into(),
            retryable: None,
            details: Map::new(),
        }
    }

    pub fn detail(mut self, key: &str, value: Value) -> MigError {
        self.details.insert(key.to_string(), value);
        self
    }

    /// An AMP error answer (`{"code","message","retry_after_ms"?}`) as a MIG error.
    pub fn from_amp_error(e: &Value) -> MigError {
        let amp = e.get("code").and_then(Value::as_str).unwrap_or("internal");
        let message = e.get("message").and_then(Value::as_str).unwrap_or(amp);
        let mut m = MigError::new(Code::from_amp(amp), message).detail("amp_code", json!(amp));
        if let Some(ms) = e.get("retry_after_ms").and_then(Value::as_u64) {
            m = m.detail("retry_after_ms", json!(ms));
        }
        m
    }

    /// The error [`MigError::to_value`] wrote (another broker's answer).
    pub fn from_value(v: &Value) -> MigError {
        let code = v
            .get("code")
            .and_then(Value::as_str)
            .and_then(Code::parse)
            .unwrap_or(Code::Internal);
        let message = v.get("message").and_then(Value::as_str).unwrap_or_default();
        let mut e = MigError::new(code, message);
        e.retryable = v.get("retryable").and_then(Value::as_bool);
        if let Some(d) = v.get("details").and_then(Value::as_object) {
            e.details = d.clone();
        }
        e
    }

    pub fn to_value(&self) -> Value {
        json!({
            "code": self.code.as_str(),
            "message": self.message,
            "retryable": self.retryable.unwrap_or(self.code.retryable()),
            "details": Value::Object(self.details.clone()),
        })
    }
}

/// A request header after the liberal defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub message_id: String,
    /// Whether the caller sent the message id (an NKey signature needs it).
    pub message_id_given: bool,
    pub timestamp: Option<String>,
    pub tenant_id: String,
    pub session_id: Option<String>,
    pub traceparent: Option<String>,
    pub idempotency_key: Option<String>,
    pub deadline_ms: Option<u64>,
}

/// What is wrong with a request before it is looked at further.
#[derive(Debug, Clone, PartialEq)]
pub enum HeaderError {
    Invalid(String),
    Version(String),
}

fn string_field<'a>(h: &'a Map<String, Value>, name: &str) -> Result<Option<&'a str>, HeaderError> {
    match h.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(HeaderError::Invalid(format!(
            "header.{name} must be a string"
        ))),
    }
}

/// A body holding only the `header` member of `payload` (none when it has none), read
/// without the rest: before a credential is proved only the header is of use (a
/// signature's id and time, the echo of a refusal), and building the whole body of up to
/// the server's max_payload for each of a flood of forged requests was work anyone
/// could make the broker do. Reading stops after the header; members before it are
/// skipped without being kept, so a body costs no more than the bytes NATS brought (JSON
/// does not order members: a client may put `header` anywhere). `None` when the body is
/// no JSON object or breaks off before its header ends.
pub fn peek_header(payload: &[u8]) -> Option<Map<String, Value>> {
    use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};

    /// Whether a member's name is `header`, read without keeping it.
    struct IsHeader(bool);
    impl<'de> serde::Deserialize<'de> for IsHeader {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Name;
            impl Visitor<'_> for Name {
                type Value = IsHeader;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a member name")
                }
                fn visit_str<E>(self, v: &str) -> Result<IsHeader, E> {
                    Ok(IsHeader(v == "header"))
                }
            }
            d.deserialize_str(Name)
        }
    }

    struct Seek<'s>(&'s mut Option<Map<String, Value>>);
    impl<'de> Visitor<'de> for Seek<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut body = Map::new();
            while let Some(IsHeader(header)) = map.next_key()? {
                if header {
                    body.insert("header".into(), map.next_value()?);
                    break;
                }
                map.next_value::<IgnoredAny>()?;
            }
            *self.0 = Some(body);
            Ok(())
        }
    }

    let mut found = None;
    // Stopping after the header leaves the object unclosed, which the deserializer then
    // reports: what was found before is all that is wanted.
    let _ = serde_json::Deserializer::from_slice(payload).deserialize_map(Seek(&mut found));
    found
}

/// Reads `body.header`, taking absent fields from the NATS headers of the same names, and
/// refusing a NATS header that disagrees with the JSON one.
pub fn parse_header(
    body: &Map<String, Value>,
    nats: Option<&HeaderMap>,
    fresh_id: impl FnOnce() -> String,
) -> Result<Header, HeaderError> {
    let empty = Map::new();
    let h = match body.get("header") {
        Some(Value::Object(h)) => h,
        None | Some(Value::Null) => &empty,
        Some(_) => return Err(HeaderError::Invalid("header must be an object".into())),
    };
    let mut fields: Vec<Option<String>> = Vec::with_capacity(DUPLICATED.len());
    for name in DUPLICATED {
        let json = string_field(h, name)?;
        let from_nats = nats.and_then(|n| n.get(name));
        if let (Some(j), Some(n)) = (json, from_nats)
            && j != n
        {
            return Err(HeaderError::Invalid(format!(
                "NATS header {name} disagrees with header.{name}"
            )));
        }
        let value = json.or(from_nats).map(str::to_string);
        if let Some(v) = &value {
            // Every message the broker publishes for the request duplicates these as NATS
            // headers (spec section 3): one they cannot carry would be dropped from them.
            if crate::proto::headers::check_value(v).is_err() {
                return Err(HeaderError::Invalid(format!(
                    "header.{name} holds a control character no NATS header can carry"
                )));
            }
            match *name {
                "mig_version" => {}
                "traceparent" if v.len() > MAX_TRACEPARENT_BYTES => {
                    return Err(HeaderError::Invalid(format!(
                        "header.traceparent must be at most {MAX_TRACEPARENT_BYTES} bytes"
                    )));
                }
                "traceparent" => {}
                _ if v.is_empty() || v.chars().count() > MAX_ID_CHARS => {
                    return Err(HeaderError::Invalid(format!(
                        "header.{name} must be 1 to {MAX_ID_CHARS} characters"
                    )));
                }
                _ => {}
            }
        }
        fields.push(value);
    }
    let [version, message_id, tenant, session, trace, idem]: [Option<String>; 6] = fields
        .try_into()
        .map_err(|_| HeaderError::Invalid("header".into()))?;
    if let Some(v) = &version
        && v != MIG_VERSION
    {
        return Err(HeaderError::Version(v.clone()));
    }
    let Some(tenant_id) = tenant else {
        return Err(HeaderError::Invalid("header.tenant_id is required".into()));
    };
    let deadline_ms = match h.get("deadline_ms") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64().filter(|&d| d >= 1) {
            Some(d) => Some(d),
            None => {
                return Err(HeaderError::Invalid(
                    "header.deadline_ms must be a positive integer".into(),
                ));
            }
        },
    };
    if let Some(Value::String(t)) = h.get("timestamp")
        && crate::rfc3339::parse_nanos(t).is_none()
    {
        return Err(HeaderError::Invalid(
            "header.timestamp must be an RFC 3339 date-time".into(),
        ));
    }
    let message_id_given = message_id.is_some();
    Ok(Header {
        message_id: message_id.unwrap_or_else(fresh_id),
        message_id_given,
        timestamp: string_field(h, "timestamp")?.map(str::to_string),
        tenant_id,
        session_id: session,
        traceparent: trace,
        idempotency_key: idem,
        deadline_ms,
    })
}

/// What a reply echoes: the request's correlation fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Echo {
    pub tenant_id: String,
    pub message_id: Option<String>,
    pub session_id: Option<String>,
    pub traceparent: Option<String>,
    pub idempotency_key: Option<String>,
}

impl Echo {
    pub fn of(h: &Header) -> Echo {
        Echo {
            tenant_id: h.tenant_id.clone(),
            message_id: Some(h.message_id.clone()),
            session_id: h.session_id.clone(),
            traceparent: h.traceparent.clone(),
            idempotency_key: h.idempotency_key.clone(),
        }
    }

    /// The JSON `header` of a reply, stamped `timestamp` now.
    pub fn header(&self, timestamp: &str) -> Value {
        let mut h = json!({
            "mig_version": MIG_VERSION,
            "tenant_id": self.tenant_id,
            "timestamp": timestamp,
        });
        for (k, v) in [
            ("message_id", &self.message_id),
            ("session_id", &self.session_id),
            ("traceparent", &self.traceparent),
            ("idempotency_key", &self.idempotency_key),
        ] {
            if let Some(v) = v {
                h[k] = json!(v);
            }
        }
        h
    }

    /// The same fields as NATS headers. A value a NATS header cannot carry is left out.
    pub fn nats_headers(&self) -> HeaderMap {
        let mut m = HeaderMap::new();
        let _ = m.insert("mig_version", MIG_VERSION);
        let _ = m.insert("tenant_id", &self.tenant_id);
        for (k, v) in [
            ("message_id", &self.message_id),
            ("session_id", &self.session_id),
            ("traceparent", &self.traceparent),
            ("idempotency_key", &self.idempotency_key),
        ] {
            if let Some(v) = v {
                let _ = m.insert(k, v);
            }
        }
        m
    }
}

/// `{"header":..., "error":{...}}`.
pub fn error_body(echo: &Echo, timestamp: &str, e: &MigError) -> Vec<u8> {
    json!({"header": echo.header(timestamp), "error": e.to_value()})
        .to_string()
        .into_bytes()
}

/// A success body: `fields` with the reply header put in front.
pub fn success_body(echo: &Echo, timestamp: &str, fields: Value) -> Vec<u8> {
    let mut out = Map::new();
    out.insert("header".into(), echo.header(timestamp));
    if let Value::Object(f) = fields {
        out.extend(f);
    }
    Value::Object(out).to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn a_header_with_only_the_tenant_gets_the_defaults() {
        let h = parse_header(
            &body(json!({"header": {"tenant_id": "acme"}})),
            None,
            || "gen".into(),
        )
        .expect("ok");
        assert_eq!(h.message_id, "gen");
        assert!(!h.message_id_given);
        assert_eq!(h.deadline_ms, None);
    }

    #[test]
    fn another_version_is_a_mismatch_and_disagreeing_nats_headers_are_invalid() {
        let e = parse_header(
            &body(json!({"header": {"tenant_id": "acme", "mig_version": "0.2"}})),
            None,
            String::new,
        );
        assert_eq!(e, Err(HeaderError::Version("0.2".into())));
        let mut nats = HeaderMap::new();
        nats.insert("message_id", "b").expect("header");
        let e = parse_header(
            &body(json!({"header": {"tenant_id": "acme", "message_id": "a"}})),
            Some(&nats),
            String::new,
        );
        assert!(matches!(e, Err(HeaderError::Invalid(_))));
        let h = parse_header(
            &body(json!({"header": {"tenant_id": "acme"}})),
            Some(&nats),
            String::new,
        )
        .expect("ok");
        assert_eq!(h.message_id, "b");
        let tp = "t".repeat(MAX_TRACEPARENT_BYTES + 1);
        let e = parse_header(
            &body(json!({"header": {"tenant_id": "acme", "traceparent": tp}})),
            None,
            String::new,
        );
        assert!(matches!(e, Err(HeaderError::Invalid(_))), "{e:?}");
        for (name, v) in [("traceparent", "00-a\u{1}"), ("session_id", "s\u{7f}")] {
            let e = parse_header(
                &body(json!({"header": {"tenant_id": "acme", name: v}})),
                None,
                String::new,
            );
            assert!(matches!(e, Err(HeaderError::Invalid(_))), "{name}: {e:?}");
        }
        let long = "x".repeat(129);
        let e = parse_header(
            &body(json!({"header": {"tenant_id": "acme", "idempotency_key": long}})),
            None,
            String::new,
        );
        assert!(matches!(e, Err(HeaderError::Invalid(_))));
    }

    #[test]
    fn retryable_exactly_for_the_four_transient_codes() {
        let retryable: Vec<&str> = ALL_CODES
            .iter()
            .filter(|c| c.retryable())
            .map(|c| c.as_str())
            .collect();
        assert_eq!(
            retryable,
            [
                "MIG_TIMEOUT",
                "MIG_RATE_LIMITED",
                "MIG_BACKPRESSURE",
                "MIG_UNAVAILABLE"
            ]
        );
        let e = MigError::from_amp_error(
            &json!({"code": "rate_limited", "message": "slow", "retry_after_ms": 20}),
        );
        let v = e.to_value();
        assert_eq!(v["code"], "MIG_RATE_LIMITED");
        assert_eq!(v["details"]["retry_after_ms"], 20);
        assert_eq!(v["details"]["amp_code"], "rate_limited");
    }

    #[test]
    fn the_header_is_read_without_the_rest_of_the_body() {
        let header = json!({"tenant_id": "acme", "message_id": "m1"});
        // Not read past the header: what follows may be anything.
        let body = format!(r#"{{"header": {header}, "payload": {{"x": [1, 2"#);
        let got = peek_header(body.as_bytes()).expect("a header");
        assert_eq!(got.get("header"), Some(&header));
        let after = format!(r#"{{"a": 1, "header": {header}}}"#);
        assert_eq!(
            peek_header(after.as_bytes()).and_then(|b| b.get("header").cloned()),
            Some(header.clone())
        );
        assert_eq!(peek_header(br#"{"a": 1}"#), Some(Map::new()));
        assert_eq!(peek_header(b"[1]"), None);
        assert_eq!(peek_header(b"nope"), None);
        // Anywhere in a large body.
        let late = format!(
            r#"{{"pad": "{}", "header": {header}}}"#,
            "p".repeat(1 << 20)
        );
        assert_eq!(
            peek_header(late.as_bytes()).and_then(|b| b.get("header").cloned()),
            Some(header.clone())
        );
    }
}
