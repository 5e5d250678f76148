//! Incremental parser for the NATS client protocol, in both directions.

/// Which side's operations the parser accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// We are a client: parse what a server sends (INFO, MSG, HMSG, PING, PONG, +OK, -ERR).
    Client,
    /// We are a server: parse what a client sends (CONNECT, PUB, HPUB, SUB, UNSUB, PING, PONG).
    Server,
}

/// One operation, borrowing every field from the input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op<'a> {
    /// Raw JSON of `INFO {...}`.
    Info(&'a [u8]),
    /// Raw JSON of `CONNECT {...}`.
    Connect(&'a [u8]),
    Pub {
        subject: &'a [u8],
        reply: Option<&'a [u8]>,
        payload: &'a [u8],
    },
    Hpub {
        subject: &'a [u8],
        reply: Option<&'a [u8]>,
        headers: &'a [u8],
        payload: &'a [u8],
    },
    Sub {
        subject: &'a [u8],
        queue: Option<&'a [u8]>,
        sid: &'a [u8],
    },
    Unsub {
        sid: &'a [u8],
        max_msgs: Option<u64>,
    },
    Msg {
        subject: &'a [u8],
        sid: &'a [u8],
        reply: Option<&'a [u8]>,
        payload: &'a [u8],
    },
    Hmsg {
        subject: &'a [u8],
        sid: &'a [u8],
        reply: Option<&'a [u8]>,
        headers: &'a [u8],
        payload: &'a [u8],
    },
    Ping,
    Pong,
    Ok,
    /// Text of `-ERR '...'` without the quotes.
    Err(&'a [u8]),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// An operation and the number of input bytes it used (always > 0).
    Complete(Op<'a>, usize),
    /// More input is needed; `needed` is a lower bound of the total input length, when known.
    Partial { needed: Option<usize> },
}

/// A protocol violation. `Display` gives nats-server's own wording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    MaxControlLineExceeded,
    MaxPayloadViolation,
    UnknownOperation,
    /// Malformed arguments, a bad size, a payload not followed by CRLF, ...
    Parser,
}

#[derive(Debug, Clone)]
pub struct Parser {
    pub role: Role,
    pub max_control_line: usize,
    pub max_payload: usize,
}
