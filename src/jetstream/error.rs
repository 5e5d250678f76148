//! JetStream errors as values with the server's codes.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Stream not found (404).
pub const ERR_STREAM_NOT_FOUND: u32 = 10059;
/// Consumer not found (404).
pub const ERR_CONSUMER_NOT_FOUND: u32 = 10014;
/// A `create` (not update) of a consumer whose name exists with another configuration.
pub const ERR_CONSUMER_EXISTS: u32 = 10148;
/// A consumer's create or update refused, the reason in the description (e.g. "deliver
/// policy can not be updated").
pub const ERR_CONSUMER_CREATE: u32 = 10012;
/// `Nats-Expected-Last-(Subject-)Sequence` did not match (400).
pub const ERR_WRONG_LAST_SEQUENCE: u32 = 10071;
/// The same, as reported by replicated streams without the sequence in the text (400).
pub const ERR_WRONG_LAST_SEQUENCE_CONSTANT: u32 = 10164;
/// No message found (404).
pub const ERR_MESSAGE_NOT_FOUND: u32 = 10037;
/// JetStream not enabled for the account (503).
pub const ERR_NOT_ENABLED_FOR_ACCOUNT: u32 = 10039;
/// JetStream not enabled (503).
pub const ERR_NOT_ENABLED: u32 = 10076;

/// A stream limit with discard `new` or the storage is full: `JSStreamStoreFailedF`
/// (maximum bytes, messages or messages per subject exceeded),
/// `JSInsufficientResourcesErr`, `JSMemoryResourcesExceededErr`,
/// `JSStorageResourcesExceededErr`.
pub const ERRS_STORE_FULL: [u32; 4] = [10077, 10023, 10028, 10047];

/// The most bytes of a peer's text a [`JsError`] keeps (the `…` that marks a cut aside).
pub const MAX_PEER_TEXT: usize = 256;

/// Text a NATS peer chose, as an error keeps it: JetStream's description of a refusal, or a
/// value of its answer that serde quotes. Whoever answers the account's `$JS.API` first
/// chooses it, up to max_payload, and an error is copied into the frame of each session
/// told of it, kept while a refusal lasts, and logged. Cut at [`MAX_PEER_TEXT`] bytes; a
/// control character, or one that reorders or hides what a client shows (as the log sink
/// escapes them), becomes U+FFFD, so the text cannot pass for more lines or for what
/// another participant wrote.
fn bound_peer_text(text: &mut String) {
    let shown = |c: char| {
        if c.is_control() || crate::logging::invisible(c) {
            '\u{fffd}'
        } else {
            c
        }
    };
    if text.len() <= MAX_PEER_TEXT && text.chars().all(|c| shown(c) == c) {
        return;
    }
    let mut kept = String::with_capacity(MAX_PEER_TEXT + '…'.len_utf8());
    for c in text.chars().map(shown) {
        if kept.len() + c.len_utf8() > MAX_PEER_TEXT {
            kept.push('…');
            break;
        }
        kept.push(c);
    }
    *text = kept;
}

/// The `error` object of a JetStream API response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    /// HTTP-like code: 400, 404, 503...
    #[serde(default)]
    pub code: u16,
    /// The specific JetStream code, e.g. 10059; 0 when the server sent none.
    #[serde(default)]
    pub err_code: u32,
    #[serde(default)]
    pub description: String,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (code {}, err_code {})",
            self.description, self.code, self.err_code
        )
    }
}

/// Everything a JetStream call can end with other than success.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsError {
    /// 10059.
    StreamNotFound(ApiError),
    /// 10014.
    ConsumerNotFound(ApiError),
    /// 10071 (or 10164): an expected last (subject) sequence did not hold; for KV a
    /// compare-and-set conflict or a create over an existing key.
    WrongLastSequence(ApiError),
    /// 10037.
    MessageNotFound(ApiError),
    /// 10039: the server runs JetStream but this account has none.
    NotEnabledForAccount(ApiError),
    /// 10076, or nobody answers on the API subject (503 no responders): the server runs
    /// without JetStream.
    NotEnabled,
    /// Any other API error, passed through with its codes and text.
    Api(ApiError),
    /// A publish found no stream listening on its subject (503 no responders).
    NoResponders,
    /// No reply within the deadline.
    Timeout,
    /// The connection failed underneath the request.
    Transport(String),
    /// The server's reply could not be understood.
    Malformed(String),
    /// An argument was refused before anything was sent (bad name, key, TTL...).
    Invalid(String),
    /// KV: the key has no value (never written, deleted or purged).
    KeyNotFound,
    /// KV: the bucket's stream does not exist.
    BucketNotFound,
}

impl JsError {
    /// Classifies an API error by its `err_code`; its description is bounded here, where
    /// every answer's error passes, for all who show it.
    pub fn from_api(mut e: ApiError) -> JsError {
        bound_peer_text(&mut e.description);
        match e.err_code {
            ERR_STREAM_NOT_FOUND => JsError::StreamNotFound(e),
            ERR_CONSUMER_NOT_FOUND => JsError::ConsumerNotFound(e),
            ERR_WRONG_LAST_SEQUENCE | ERR_WRONG_LAST_SEQUENCE_CONSTANT => {
                JsError::WrongLastSequence(e)
            }
            ERR_MESSAGE_NOT_FOUND => JsError::MessageNotFound(e),
            ERR_NOT_ENABLED_FOR_ACCOUNT => JsError::NotEnabledForAccount(e),
            ERR_NOT_ENABLED => JsError::NotEnabled,
            _ => JsError::Api(e),
        }
    }

    /// A reply not understood; `why` (a serde error quotes the value it refused) is
    /// bounded as a description is.
    pub fn malformed(why: impl fmt::Display) -> JsError {
        let mut why = why.to_string();
        bound_peer_text(&mut why);
        JsError::Malformed(why)
    }

    /// The server's error object, when the error came from one.
    pub fn api_error(&self) -> Option<&ApiError> {
        match self {
            JsError::StreamNotFound(e)
            | JsError::ConsumerNotFound(e)
            | JsError::WrongLastSequence(e)
            | JsError::MessageNotFound(e)
            | JsError::NotEnabledForAccount(e)
            | JsError::Api(e) => Some(e),
            _ => None,
        }
    }

    /// A publish JetStream did not store now but may later: a limit or the storage is
    /// full ([`ERRS_STORE_FULL`]), no stream answers for the subject, or no answer came
    /// in time. JetStream's state, not the message's: the same message may be stored
    /// once there is room again.
    pub fn store_unavailable(&self) -> bool {
        self.err_code()
            .is_some_and(|c| ERRS_STORE_FULL.contains(&c))
            || matches!(self, JsError::NoResponders | JsError::Timeout)
    }

    /// Whether a publish answered with this error certainly stored nothing: an error in
    /// its PubAck, or no stream listening. A timeout, a reply lost with the connection or
    /// one not understood may follow a stored message.
    pub fn stored_nothing(&self) -> bool {
        self.api_error().is_some() || matches!(self, JsError::NoResponders)
    }

    /// The JetStream `err_code` (10076 for [`JsError::NotEnabled`]).
    pub fn err_code(&self) -> Option<u32> {
        match self {
            JsError::NotEnabled => Some(ERR_NOT_ENABLED),
            other => other.api_error().map(|e| e.err_code),
        }
    }
}

impl fmt::Display for JsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsError::StreamNotFound(e) => write!(f, "stream not found: {e}"),
            JsError::ConsumerNotFound(e) => write!(f, "consumer not found: {e}"),
            JsError::WrongLastSequence(e) => write!(f, "wrong last sequence: {e}"),
            JsError::MessageNotFound(e) => write!(f, "message not found: {e}"),
            JsError::NotEnabledForAccount(e) => write!(f, "JetStream not enabled for account: {e}"),
            JsError::NotEnabled => write!(f, "JetStream not enabled"),
            JsError::Api(e) => write!(f, "JetStream API error: {e}"),
            JsError::NoResponders => write!(f, "no stream answered (no responders)"),
            JsError::Timeout => write!(f, "JetStream request timed out"),
            JsError::Transport(s) => write!(f, "connection error: {s}"),
            JsError::Malformed(s) => write!(f, "malformed JetStream reply: {s}"),
            JsError::Invalid(s) => write!(f, "invalid argument: {s}"),
            JsError::KeyNotFound => write!(f, "key not found"),
            JsError::BucketNotFound => write!(f, "bucket not found"),
        }
    }
}

impl std::error::Error for JsError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, err_code: u32) -> ApiError {
        ApiError {
            code,
            err_code,
            description: "x".into(),
        }
    }

    #[test]
    fn error_codes_map_to_their_typed_variants() {
        assert!(matches!(
            JsError::from_api(api(404, 10059)),
            JsError::StreamNotFound(_)
        ));
        assert!(matches!(
            JsError::from_api(api(404, 10014)),
            JsError::ConsumerNotFound(_)
        ));
        assert!(matches!(
            JsError::from_api(api(400, 10071)),
            JsError::WrongLastSequence(_)
        ));
        assert!(matches!(
            JsError::from_api(api(400, 10164)),
            JsError::WrongLastSequence(_)
        ));
        assert!(matches!(
            JsError::from_api(api(404, 10037)),
            JsError::MessageNotFound(_)
        ));
        assert!(matches!(
            JsError::from_api(api(503, 10039)),
            JsError::NotEnabledForAccount(_)
        ));
        assert_eq!(JsError::from_api(api(503, 10076)), JsError::NotEnabled);
        let other = JsError::from_api(api(400, 10058));
        assert_eq!(other.err_code(), Some(10058));
        assert_eq!(other.api_error().map(|e| e.code), Some(400));
    }
}
