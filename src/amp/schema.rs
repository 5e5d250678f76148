//! Validation of client frames against the project's JSON Schema (`amp-v1.schema.json`,
//! draft 2020-12, served at `GET /amp/schema`).
//!
//! A frame is first classified (not JSON, not an object, no `op`, unknown `op` ->
//! `bad_frame`), then validated against the definition of its own op only
//! (`#/$defs/<op>`), so the first error names the member that is wrong, not a branch of a
//! `oneOf` over all ops.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use jsonschema::{Draft, ValidationError, Validator, error::ValidationErrorKind};
use serde_json::Value;

use super::body::{Body, top_level_body};
use super::error::{AmpError, ErrorCode};
use super::frame::{ClientFrame, Hello, Op, Publish, Send, Submit};
use super::reply;

/// The schema of every client frame, as served at `/amp/schema`.
pub const SCHEMA_JSON: &str = include_str!("amp-v1.schema.json");

/// Longest human text of an error message; the text never echoes client data at length.
const MAX_MESSAGE_LEN: usize = 200;

/// A frame the broker answers with an `error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The frame's `id` when it had a string one: the reply's `re`.
    pub re: Option<String>,
    /// The frame's op when it was a known one.
    pub op: Option<Op>,
    pub error: AmpError,
}

impl Rejected {
    /// The `error` reply frame.
    pub fn reply(&self) -> String {
        reply::error(self.re.as_deref(), &self.error)
    }
}

/// Compiled validators, one per client op. Build it once at start-up.
pub struct FrameValidator {
    /// Compiled once per process and shared: compiling takes a large part of a second in
    /// a debug build, and the simulator and fuzzers build many brokers.
    by_op: Arc<HashMap<Op, Validator>>,
}

impl std::fmt::Debug for FrameValidator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameValidator")
            .field("ops", &self.by_op.len())
            .finish()
    }
}

impl FrameValidator {
    /// Compiles the embedded schema. It is part of the program, so an error here is a
    /// build defect; it is still returned rather than panicking.
    pub fn new() -> Result<Self, String> {
        static COMPILED: OnceLock<Result<Arc<HashMap<Op, Validator>>, String>> = OnceLock::new();
        let by_op = COMPILED
            .get_or_init(|| Self::compile().map(Arc::new))
            .clone()?;
        Ok(FrameValidator { by_op })
    }

    fn compile() -> Result<HashMap<Op, Validator>, String> {
        let schema: Value =
            serde_json::from_str(SCHEMA_JSON).map_err(|e| format!("schema is not JSON: {e}"))?;
        let map = jsonschema::options()
            .with_draft(Draft::Draft202012)
            .build_map(&schema)
            .map_err(|e| format!("schema does not compile: {e}"))?;
        let mut by_op = HashMap::with_capacity(Op::ALL.len());
        for op in Op::ALL {
            let pointer = format!("#/$defs/{}", op.as_str());
            let validator = map
                .get(&pointer)
                .ok_or_else(|| format!("schema has no definition {pointer}"))?;
            by_op.insert(op, validator.clone());
        }
        Ok(by_op)
    }

    /// Classifies and validates one text frame, returning its op and parsed value.
    pub fn check(&self, text: &str) -> Result<(Op, Value), Rejected> {
        let value: Value = serde_json::from_str(text).map_err(|_| Rejected {
            re: None,
            op: None,
            error: AmpError::new(ErrorCode::BadFrame, "frame is not JSON"),
        })?;
        let Value::Object(members) = &value else {
            return Err(Rejected {
                re: None,
                op: None,
                error: AmpError::new(ErrorCode::BadFrame, "frame is not a JSON object"),
            });
        };
        let re = match members.get("id") {
            Some(Value::String(id)) => Some(id.clone()),
            _ => None,
        };
        let op = match members.get("op") {
            Some(Value::String(op)) => match Op::parse(op) {
                Some(op) => op,
                None => {
                    return Err(Rejected {
                        re,
                        op: None,
                        error: AmpError::new(ErrorCode::BadFrame, "unknown op").with_path("/op"),
                    });
                }
            },
            Some(_) => {
                return Err(Rejected {
                    re,
                    op: None,
                    error: AmpError::new(ErrorCode::BadFrame, "op is not a string")
                        .with_path("/op"),
                });
            }
            None => {
                return Err(Rejected {
                    re,
                    op: None,
                    error: AmpError::new(ErrorCode::BadFrame, "frame has no op").with_path("/op"),
                });
            }
        };
        let Some(validator) = self.by_op.get(&op) else {
            return Err(Rejected {
                re,
                op: Some(op),
                error: AmpError::new(ErrorCode::Internal, "no schema for op"),
            });
        };
        if let Err(err) = validator.validate(&value) {
            return Err(Rejected {
                re,
                op: Some(op),
                error: schema_error(&err),
            });
        }
        Ok((op, value))
    }

    /// [`check`](Self::check), then the typed frame. The common frames take
    /// [`super::fast`] when it can vouch for them, with the same outcome.
    pub fn decode(&self, text: &str) -> Result<ClientFrame, Rejected> {
        match super::fast::decode(text) {
            Some(frame) => Ok(frame),
            None => self.decode_full(text),
        }
    }

    /// [`decode`](Self::decode) through the JSON Schema validator, whatever the frame.
    pub fn decode_full(&self, text: &str) -> Result<ClientFrame, Rejected> {
        let (op, value) = self.check(text)?;
        let re = value.get("id").and_then(Value::as_str).map(str::to_owned);
        let mut frame: ClientFrame = serde_json::from_value(value).map_err(|e| Rejected {
            re,
            op: Some(op),
            // The schema admits only what the types can hold; reaching this is a
            // mismatch between the two, reported as the whole frame being wrong.
            error: AmpError::new(ErrorCode::Schema, truncate(e.to_string())).with_path(""),
        })?;
        // The body as the client wrote it, not the `Value`'s rendering (the parse above
        // has checked it as JSON, so taking its text as it stands is safe).
        if let ClientFrame::Send(Send { body, .. })
        | ClientFrame::Publish(Publish { body, .. })
        | ClientFrame::Submit(Submit { body, .. }) = &mut frame
            && let Some(raw) = top_level_body(text)
        {
            *body = Body::from_trusted(raw);
        }
        Ok(frame)
    }
}

impl FrameValidator {
    /// The first frame of a session (spec 2.7, "Before `hello`"): anything that is not a
    /// JSON object with an `op` is `bad_frame`; any other frame that is not a valid
    /// `hello` is `unauthenticated`, without saying what was wrong. Either way the
    /// broker then closes with 1008.
    pub fn decode_hello(&self, text: &str) -> Result<Hello, Rejected> {
        match self.decode(text) {
            Ok(ClientFrame::Hello(hello)) => Ok(hello),
            Ok(frame) => Err(unauthenticated(
                frame.id().map(str::to_owned),
                Some(frame.op()),
            )),
            Err(rejected) if rejected.error.code == ErrorCode::BadFrame && !has_op(text) => {
                Err(rejected)
            }
            Err(rejected) => Err(unauthenticated(rejected.re, rejected.op)),
        }
    }
}

/// A JSON object with an `op` member (of any value); parsed again only on this error path.
fn has_op(text: &str) -> bool {
    serde_json::from_str::<Value>(text)
        .ok()
        .is_some_and(|v| v.as_object().is_some_and(|m| m.contains_key("op")))
}

fn unauthenticated(re: Option<String>, op: Option<Op>) -> Rejected {
    Rejected {
        re,
        op,
        error: AmpError::new(ErrorCode::Unauthenticated, "authentication failed"),
    }
}

/// Turns a schema failure into a `schema` error whose path is the offending member.
fn schema_error(err: &ValidationError<'_>) -> AmpError {
    let mut path = err.instance_path().as_str().to_owned();
    let message: Cow<'static, str> = match err.kind() {
        ValidationErrorKind::AdditionalProperties { unexpected } => {
            if let Some(name) = unexpected.first() {
                push_segment(&mut path, name);
            }
            Cow::Borrowed("unknown member")
        }
        ValidationErrorKind::Required { property } => {
            if let Value::String(name) = property {
                push_segment(&mut path, name);
            }
            Cow::Borrowed("missing required member")
        }
        ValidationErrorKind::PropertyNames { error } => {
            if let Value::String(name) = error.instance().as_ref() {
                push_segment(&mut path, name);
            }
            Cow::Borrowed("member name not allowed")
        }
        ValidationErrorKind::Type { kind } => Cow::Owned(format!("wrong type, expected {kind:?}")),
        ValidationErrorKind::Pattern { .. } => Cow::Borrowed("does not match the allowed pattern"),
        ValidationErrorKind::MinLength { limit } => {
            Cow::Owned(format!("string shorter than {limit} characters"))
        }
        ValidationErrorKind::MaxLength { limit } => {
            Cow::Owned(format!("string longer than {limit} characters"))
        }
        ValidationErrorKind::Minimum { limit } => Cow::Owned(format!("less than {limit}")),
        ValidationErrorKind::Maximum { limit } => Cow::Owned(format!("greater than {limit}")),
        ValidationErrorKind::MaxItems { limit } => Cow::Owned(format!("more than {limit} items")),
        ValidationErrorKind::Enum { .. } | ValidationErrorKind::Constant { .. } => {
            Cow::Borrowed("not one of the allowed values")
        }
        ValidationErrorKind::OneOfNotValid { .. } | ValidationErrorKind::AnyOf { .. } => {
            Cow::Borrowed("not any of the allowed forms")
        }
        _ => Cow::Owned(truncate(err.to_string())),
    };
    AmpError::new(ErrorCode::Schema, message).with_path(path)
}

/// Appends one reference token to a JSON pointer (RFC 6901 escaping).
fn push_segment(path: &mut String, name: &str) {
    path.push('/');
    for c in name.chars() {
        match c {
            '~' => path.push_str("~0"),
            '/' => path.push_str("~1"),
            c => path.push(c),
        }
    }
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_MESSAGE_LEN {
        let mut end = MAX_MESSAGE_LEN;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}
