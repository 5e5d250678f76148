//! The stable error codes of spec section 2.6 and the error a rejected frame carries.

use std::borrow::Cow;
use std::fmt;

/// An AMP error code. Clients switch on the string form, so it never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// Not JSON, not an object, no `op`, or an unknown `op`.
    BadFrame,
    /// Fails the JSON Schema; `path` points at the offending member.
    Schema,
    Unauthenticated,
    /// An address permission does not allow the request.
    Forbidden,
    NotFound,
    Conflict,
    LeaseLost,
    /// Comes with `retry_after_ms`.
    RateLimited,
    BudgetExhausted,
    TooLarge,
    /// JetStream unreachable or timing out; safe to retry with the same `idem`/`task`.
    Unavailable,
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 12] = [
        ErrorCode::BadFrame,
        ErrorCode::Schema,
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::LeaseLost,
        ErrorCode::RateLimited,
        ErrorCode::BudgetExhausted,
        ErrorCode::TooLarge,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadFrame => "bad_frame",
            ErrorCode::Schema => "schema",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::LeaseLost => "lease_lost",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::BudgetExhausted => "budget_exhausted",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        }
    }

    pub fn parse(s: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a request failed, as the `error` reply frame will say it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmpError {
    pub code: ErrorCode,
    pub message: Cow<'static, str>,
    /// JSON pointer of the offending member (`schema` errors); `""` means the whole frame.
    pub path: Option<String>,
    pub retry_after_ms: Option<u64>,
}

impl AmpError {
    pub fn new(code: ErrorCode, message: impl Into<Cow<'static, str>>) -> Self {
        AmpError {
            code,
            message: message.into(),
            path: None,
            retry_after_ms: None,
        }
    }

    pub fn with_path(mut self, path: impl Into<String>) -> Self {
        self.path = Some(path.into());
        self
    }

    pub fn budget_exhausted() -> Self {
        AmpError::new(
            ErrorCode::BudgetExhausted,
            "the task budget of this window is spent",
        )
    }

    pub fn rate_limited(retry_after_ms: u64) -> Self {
        AmpError {
            code: ErrorCode::RateLimited,
            message: Cow::Borrowed("rate limit exceeded"),
            path: None,
            retry_after_ms: Some(retry_after_ms),
        }
    }
}

impl fmt::Display for AmpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)?;
        if let Some(path) = &self.path {
            write!(f, " at {path:?}")?;
        }
        Ok(())
    }
}

impl std::error::Error for AmpError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_code_strings_are_the_spec_strings_and_round_trip() {
        let strings: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            strings,
            [
                "bad_frame",
                "schema",
                "unauthenticated",
                "forbidden",
                "not_found",
                "conflict",
                "lease_lost",
                "rate_limited",
                "budget_exhausted",
                "too_large",
                "unavailable",
                "internal"
            ]
        );
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
        }
        assert_eq!(ErrorCode::parse("nope"), None);
    }
}
