//! The `$JS.API` subject space: prefix and domain, request values and the response
//! envelope shared by every API call.

use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::error::{ApiError, JsError};

/// The default JetStream API prefix.
pub const DEFAULT_API_PREFIX: &str = "$JS.API";

/// Where the JetStream API lives: `$JS.API`, `$JS.<domain>.API` or an imported prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiPrefix {
    prefix: String,
}

impl Default for ApiPrefix {
    fn default() -> Self {
        ApiPrefix {
            prefix: DEFAULT_API_PREFIX.to_string(),
        }
    }
}

impl ApiPrefix {
    /// The account's own JetStream (`$JS.API`).
    pub fn new() -> ApiPrefix {
        ApiPrefix::default()
    }

    /// The JetStream of a domain (`$JS.<domain>.API`), e.g. a hub reached from a leaf node.
    pub fn domain(domain: &str) -> Result<ApiPrefix, JsError> {
        if domain.is_empty() {
            return Ok(ApiPrefix::new());
        }
        if !is_token(domain) {
            return Err(JsError::Invalid(format!(
                "invalid JetStream domain {domain:?}"
            )));
        }
        Ok(ApiPrefix {
            prefix: format!("$JS.{domain}.API"),
        })
    }

    /// An explicit prefix (an import from another account); a trailing dot is dropped.
    pub fn custom(prefix: &str) -> Result<ApiPrefix, JsError> {
        let prefix = prefix.strip_suffix('.').unwrap_or(prefix);
        if prefix.is_empty() || prefix.split('.').any(|t| !is_token(t)) {
            return Err(JsError::Invalid(format!("invalid API prefix {prefix:?}")));
        }
        Ok(ApiPrefix {
            prefix: prefix.to_string(),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.prefix
    }

    /// Where a write of `key` in `bucket` is published. A bucket in another domain is
    /// written through that domain's prefix (`$JS.<domain>.API.$KV.<bucket>.<key>`, which
    /// nats-server forwards to the domain and stores under the plain key subject): plain
    /// `$KV.>` subjects do not cross a leaf connection between domains, and a bucket of
    /// the same name in the local domain would capture them. nats.go does the same.
    pub fn kv_write_subject(&self, bucket: &str, key: &str) -> String {
        kv_write_subject(&self.prefix, bucket, key)
    }

    /// `<prefix>.<suffix>`.
    pub fn subject(&self, suffix: &str) -> String {
        let mut s = String::with_capacity(self.prefix.len() + 1 + suffix.len());
        s.push_str(&self.prefix);
        s.push('.');
        s.push_str(suffix);
        s
    }
}

/// [`ApiPrefix::kv_write_subject`] for a prefix held as text.
pub fn kv_write_subject(prefix: &str, bucket: &str, key: &str) -> String {
    if prefix == DEFAULT_API_PREFIX {
        format!("$KV.{bucket}.{key}")
    } else {
        format!("{prefix}.$KV.{bucket}.{key}")
    }
}

/// A literal subject token: non-empty, no dots, wildcards or whitespace.
pub(crate) fn is_token(t: &str) -> bool {
    !t.is_empty()
        && t.bytes()
            .all(|b| !matches!(b, b'.' | b'*' | b'>' | b' ' | b'\t' | b'\r' | b'\n' | 0))
}

/// A stream or consumer name as ADR-6 allows it: a token that is also a safe file name.
pub fn validate_name(kind: &str, name: &str) -> Result<(), JsError> {
    let ok = is_token(name)
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b > 0x20 && b != 0x7f && !b"/\\".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(JsError::Invalid(format!("invalid {kind} name {name:?}")))
    }
}

/// A request to send: subject, optional headers, payload. Sent with a reply inbox (a
/// request/reply), except where noted.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub subject: String,
    pub headers: Option<crate::proto::headers::HeaderMap>,
    pub payload: Vec<u8>,
}

impl Request {
    pub(crate) fn new(subject: String, payload: Vec<u8>) -> Request {
        Request {
            subject,
            headers: None,
            payload,
        }
    }

    pub(crate) fn json<T: serde::Serialize>(subject: String, body: &T) -> Request {
        // Serialising these plain structs into a Vec cannot fail.
        let payload = serde_json::to_vec(body).unwrap_or_default();
        Request::new(subject, payload)
    }
}

#[derive(Deserialize)]
struct Envelope {
    #[serde(default)]
    error: Option<ApiError>,
}

/// Decodes a JetStream API reply: the typed body, or the error it carries.
pub fn parse_response<T: DeserializeOwned>(payload: &[u8]) -> Result<T, JsError> {
    check_error(payload)?;
    serde_json::from_slice(payload).map_err(JsError::malformed)
}

/// Returns the reply's `error` as a typed error, if it has one.
pub fn check_error(payload: &[u8]) -> Result<(), JsError> {
    let env: Envelope = serde_json::from_slice(payload).map_err(JsError::malformed)?;
    match env.error {
        Some(e) => Err(JsError::from_api(e)),
        None => Ok(()),
    }
}

/// `{"success": true}` replies (deletes, message deletes).
#[derive(Debug, Clone, Deserialize)]
pub struct SuccessResponse {
    #[serde(default)]
    pub success: bool,
}

/// Maps the status of a reply with no JSON body (503 no responders) for an API request.
pub fn api_status_error(status: Option<u16>) -> Option<JsError> {
    match status {
        Some(503) => Some(JsError::NotEnabled),
        Some(408) => Some(JsError::Timeout),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_follows_the_domain() {
        assert_eq!(ApiPrefix::new().subject("INFO"), "$JS.API.INFO");
        assert_eq!(
            ApiPrefix::domain("hub").expect("domain").subject("INFO"),
            "$JS.hub.API.INFO"
        );
        assert_eq!(ApiPrefix::domain("").expect("empty").as_str(), "$JS.API");
        assert!(ApiPrefix::domain("a.b").is_err());
        assert_eq!(
            ApiPrefix::custom("$JS.other.API.")
                .expect("prefix")
                .as_str(),
            "$JS.other.API"
        );
        assert!(ApiPrefix::custom("a..b").is_err());
    }

    #[test]
    fn error_replies_become_typed_errors() {
        let r: Result<SuccessResponse, _> = parse_response(
            br#"{"type":"io.nats.jetstream.api.v1.stream_delete_response","error":{"code":404,"err_code":10059,"description":"stream not found"}}"#,
        );
        assert!(
            matches!(r, Err(JsError::StreamNotFound(ref e)) if e.description == "stream not found")
        );
        let ok: SuccessResponse = parse_response(br#"{"success":true}"#).expect("ok");
        assert!(ok.success);
        assert!(matches!(
            parse_response::<SuccessResponse>(b"not json"),
            Err(JsError::Malformed(_))
        ));
    }

    #[test]
    fn a_peers_text_in_an_error_is_cut_and_its_control_characters_replaced() {
        use crate::jetstream::error::MAX_PEER_TEXT;
        // Whoever answers the API first chooses JetStream's description, and the value
        // a refused field holds, which serde quotes: each up to max_payload, went whole
        // into every frame and log line the error reached.
        let forged = format!("x\nINFO  forged\u{1b}[2J\u{202e}{}", "é".repeat(300_000));
        let refusal =
            serde_json::json!({"error":{"code":400,"err_code":10012,"description":forged}});
        let not_a_code = serde_json::json!({"error":{"code":forged}});
        for body in [refusal, not_a_code] {
            let e = check_error(body.to_string().as_bytes()).expect_err("an error");
            let text = e.to_string();
            let hidden = text
                .chars()
                .filter(|&c| c.is_control() || c == '\u{202e}')
                .count();
            assert!(
                text.len() <= MAX_PEER_TEXT + 64 && hidden == 0 && text.contains("é…"),
                "{} bytes, {hidden} control characters: {:?}...",
                text.len(),
                text.chars().take(80).collect::<String>()
            );
        }
        let e = check_error(br#"{"error":{"code":400,"description":"a\nb\u202ec"}}"#);
        let description = e
            .err()
            .and_then(|e| Some(e.api_error()?.description.clone()));
        assert_eq!(description.as_deref(), Some("a\u{fffd}b\u{fffd}c"));
    }

    #[test]
    fn names_with_dots_wildcards_or_slashes_are_refused() {
        assert!(validate_name("stream", "ORDERS_1-x").is_ok());
        for bad in ["", "a.b", "a*", ">", "a b", "a/b"] {
            assert!(validate_name("stream", bad).is_err(), "{bad}");
        }
    }
}
