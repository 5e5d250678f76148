//! Errors of the NATS client.

use std::fmt;

/// An operation the caller asked for could not be done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    InvalidUrl(String),
    /// No server URL configured.
    NoServers,
    /// A subject, queue group or reply subject that NATS would refuse.
    InvalidSubject(String),
    /// Headers plus payload larger than the server's `max_payload`; nothing was sent.
    MaxPayloadExceeded {
        size: usize,
        max: usize,
    },
    /// Disconnected and the reconnect buffer cannot take this publish; nothing was queued.
    ReconnectBufferFull {
        capacity: usize,
    },
    /// Connected but the server is not reading fast enough: unwritten output would exceed
    /// `max_write_buffer`; nothing was queued.
    WriteBufferFull {
        capacity: usize,
    },
    /// The connection is silent (`Connection::check_heard`).
    Silent {
        /// How long nothing has been read.
        quiet: std::time::Duration,
    },
    TooManySubscriptions {
        max: usize,
    },
    TooManyRequests {
        max: usize,
    },
    UnknownSubscription(u64),
    /// Bad credentials configuration (creds file, seed).
    Credentials(String),
    /// The server refused our credentials (`-ERR 'Authorization Violation'` and kin).
    Authorization(String),
    /// The server closed the connection with this `-ERR`.
    Server(String),
    /// No connection could be made; the last reason.
    ConnectFailed(String),
    /// The connection is closed for good (closed by the user, or out of reconnect attempts).
    Closed(String),
    /// A blocking call's time ran out.
    Timeout,
    /// The socket failed (blocking client).
    Io(String),
    /// TLS was asked for and the server did not offer it, or the server requires TLS and
    /// none was configured (a TLS handshake that fails is a `ConnectFailed`).
    Tls(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidUrl(u) => write!(f, "invalid server URL {u}"),
            Error::NoServers => f.write_str("no server URL configured"),
            Error::InvalidSubject(s) => write!(f, "invalid subject {s:?}"),
            Error::MaxPayloadExceeded { size, max } => {
                write!(
                    f,
                    "message of {size} bytes exceeds the server's max_payload of {max}"
                )
            }
            Error::ReconnectBufferFull { capacity } => {
                write!(
                    f,
                    "reconnect buffer full ({capacity} bytes): publish refused"
                )
            }
            Error::WriteBufferFull { capacity } => {
                write!(
                    f,
                    "write buffer full ({capacity} bytes): server not keeping up"
                )
            }
            Error::Silent { quiet } => write!(
                f,
                "connection silent: nothing read for {} ms, a PING unanswered",
                quiet.as_millis()
            ),
            Error::TooManySubscriptions { max } => write!(f, "more than {max} subscriptions"),
            Error::TooManyRequests { max } => write!(f, "more than {max} pending requests"),
            Error::UnknownSubscription(sid) => write!(f, "no subscription with sid {sid}"),
            Error::Credentials(e) => write!(f, "credentials: {e}"),
            Error::Authorization(e) => write!(f, "authorization refused by server: {e}"),
            Error::Server(e) => write!(f, "server error: {e}"),
            Error::ConnectFailed(e) => write!(f, "could not connect: {e}"),
            Error::Closed(e) => write!(f, "connection closed: {e}"),
            Error::Timeout => f.write_str("timed out"),
            Error::Io(e) => write!(f, "i/o: {e}"),
            Error::Tls(e) => write!(f, "TLS: {e}"),
        }
    }
}

impl std::error::Error for Error {}

/// Why a request ended without a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// No reply before the request's deadline.
    Timeout,
    /// The server answered with status 503: nobody subscribes to the subject.
    NoResponders,
    /// The connection the request went out on was lost; a reply can no longer arrive.
    Disconnected,
    /// The connection is closed for good.
    Closed,
    /// The request could not be sent.
    Send(Error),
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::Timeout => f.write_str("request timed out"),
            RequestError::NoResponders => f.write_str("no responders for the request subject"),
            RequestError::Disconnected => {
                f.write_str("connection lost while the request was in flight")
            }
            RequestError::Closed => f.write_str("connection closed"),
            RequestError::Send(e) => write!(f, "request not sent: {e}"),
        }
    }
}

impl std::error::Error for RequestError {}

impl From<Error> for RequestError {
    fn from(e: Error) -> RequestError {
        RequestError::Send(e)
    }
}

/// How the client treats a `-ERR` from the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrKind {
    /// The server keeps the connection (permissions, an invalid subject, a subscription
    /// limit): reported as an event, nothing else happens.
    Recoverable,
    /// Credentials refused or expired; the server closes the connection.
    Authorization,
    /// Any other: the server closes the connection (stale connection, parser errors,
    /// maximum connections or payload exceeded, ...); we reconnect.
    Fatal,
}

/// Classifies a `-ERR` text the way nats-server sends them: only the listed ones leave the
/// connection open.
pub fn classify_err(text: &str) -> ErrKind {
    let lower = text.to_ascii_lowercase();
    if lower.starts_with("permissions violation")
        || lower.starts_with("invalid subject")
        || lower.starts_with("invalid publish subject")
        || lower.starts_with("maximum subscriptions exceeded")
    {
        ErrKind::Recoverable
    } else if lower.starts_with("authorization violation")
        || lower.starts_with("authentication")
        || lower.starts_with("user authentication")
        || lower.starts_with("account authentication")
    {
        ErrKind::Authorization
    } else {
        ErrKind::Fatal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errs_that_keep_the_connection_are_recoverable() {
        for text in [
            "Permissions Violation for Publish to \"x\"",
            "Permissions Violation for Subscription to \"y\"",
            "Invalid Subject",
            "Invalid Publish Subject",
            "Maximum Subscriptions Exceeded",
        ] {
            assert_eq!(classify_err(text), ErrKind::Recoverable, "{text}");
        }
    }

    #[test]
    fn errs_that_close_the_connection_are_fatal_or_authorization() {
        for text in [
            "Stale Connection",
            "Maximum Connections Exceeded",
            "Unknown Protocol Operation",
            "Parser Error",
            "Maximum Payload Violation",
            "Maximum Control Line Exceeded",
            "Secure Connection - TLS Required",
            "Slow Consumer",
        ] {
            assert_eq!(classify_err(text), ErrKind::Fatal, "{text}");
        }
        for text in [
            "Authorization Violation",
            "Authentication Timeout",
            "Authentication Expired",
            "User Authentication Revoked",
            "Account Authentication Expired",
        ] {
            assert_eq!(classify_err(text), ErrKind::Authorization, "{text}");
        }
    }
}
