//! Typed AMP frames. A client frame is validated against the schema of its `op` first
//! (see [`super::schema`]); only then is it turned into a [`ClientFrame`], so the types
//! here carry no validation of their own.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::body::Body;

/// The `op` of a client frame (spec section 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Hello,
    Ping,
    Bye,
    Send,
    Ack,
    Nak,
    Publish,
    Subscribe,
    Unsubscribe,
    Serve,
    Submit,
    Claim,
    Decline,
    Heartbeat,
    Complete,
    Fail,
    Status,
    Cancel,
    Who,
    Watch,
    DeadLetters,
    Redrive,
}

impl Op {
    pub const ALL: [Op; 22] = [
        Op::Hello,
        Op::Ping,
        Op::Bye,
        Op::Send,
        Op::Ack,
        Op::Nak,
        Op::Publish,
        Op::Subscribe,
        Op::Unsubscribe,
        Op::Serve,
        Op::Submit,
        Op::Claim,
        Op::Decline,
        Op::Heartbeat,
        Op::Complete,
        Op::Fail,
        Op::Status,
        Op::Cancel,
        Op::Who,
        Op::Watch,
        Op::DeadLetters,
        Op::Redrive,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::Ping => "ping",
            Op::Bye => "bye",
            Op::Send => "send",
            Op::Ack => "ack",
            Op::Nak => "nak",
            Op::Publish => "publish",
            Op::Subscribe => "subscribe",
            Op::Unsubscribe => "unsubscribe",
            Op::Serve => "serve",
            Op::Submit => "submit",
            Op::Claim => "claim",
            Op::Decline => "decline",
            Op::Heartbeat => "heartbeat",
            Op::Complete => "complete",
            Op::Fail => "fail",
            Op::Status => "status",
            Op::Cancel => "cancel",
            Op::Who => "who",
            Op::Watch => "watch",
            Op::DeadLetters => "dead_letters",
            Op::Redrive => "redrive",
        }
    }

    pub fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.as_str() == s)
    }

    /// Whether a frame of this op must carry an `id` (all but `ack` and `nak`).
    pub const fn requires_id(self) -> bool {
        !matches!(self, Op::Ack | Op::Nak)
    }
}

/// The `op`s the broker sends: replies and frames on its own initiative.
pub mod server_op {
    pub const OK: &str = "ok";
    pub const ERROR: &str = "error";
    pub const CHALLENGE: &str = "challenge";
    pub const MESSAGE: &str = "message";
    pub const EVENT: &str = "event";
    pub const OFFER: &str = "offer";
    pub const REVOKED: &str = "revoked";
    pub const PRESENCE: &str = "presence";

    /// Every op, numbered by its place here ([`index`]).
    pub const ALL: [&str; 8] = [
        OK, ERROR, CHALLENGE, MESSAGE, EVENT, OFFER, REVOKED, PRESENCE,
    ];

    /// `op`'s place in [`ALL`].
    pub fn index(op: &str) -> Option<usize> {
        // A `match`: a length test and a word compare, no search of `ALL`.
        match op {
            OK => Some(0),
            ERROR => Some(1),
            CHALLENGE => Some(2),
            MESSAGE => Some(3),
            EVENT => Some(4),
            OFFER => Some(5),
            REVOKED => Some(6),
            PRESENCE => Some(7),
            _ => None,
        }
    }
}

pub type Headers = BTreeMap<String, String>;
pub type Labels = BTreeMap<String, String>;

/// A client frame that passed the schema of its op.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ClientFrame {
    Hello(Hello),
    Ping { id: String },
    Bye { id: String },
    Send(Send),
    Ack(Ack),
    Nak(Nak),
    Publish(Publish),
    Subscribe(Subscribe),
    Unsubscribe { id: String, sub: String },
    Serve { id: String, job: String, slots: u32 },
    Submit(Submit),
    Claim(TaskRef),
    Decline(TaskRef),
    Heartbeat(Heartbeat),
    Complete(Complete),
    Fail(Fail),
    Status(TaskRef),
    Cancel(TaskRef),
    Who { id: String, job: Option<String> },
    Watch { id: String },
    DeadLetters(DeadLetters),
    Redrive { id: String, job: String, seq: u64 },
}

impl ClientFrame {
    pub fn op(&self) -> Op {
        match self {
            ClientFrame::Hello(_) => Op::Hello,
            ClientFrame::Ping { .. } => Op::Ping,
            ClientFrame::Bye { .. } => Op::Bye,
            ClientFrame::Send(_) => Op::Send,
            ClientFrame::Ack(_) => Op::Ack,
            ClientFrame::Nak(_) => Op::Nak,
            ClientFrame::Publish(_) => Op::Publish,
            ClientFrame::Subscribe(_) => Op::Subscribe,
            ClientFrame::Unsubscribe { .. } => Op::Unsubscribe,
            ClientFrame::Serve { .. } => Op::Serve,
            ClientFrame::Submit(_) => Op::Submit,
            ClientFrame::Claim(_) => Op::Claim,
            ClientFrame::Decline(_) => Op::Decline,
            ClientFrame::Heartbeat(_) => Op::Heartbeat,
            ClientFrame::Complete(_) => Op::Complete,
            ClientFrame::Fail(_) => Op::Fail,
            ClientFrame::Status(_) => Op::Status,
            ClientFrame::Cancel(_) => Op::Cancel,
            ClientFrame::Who { .. } => Op::Who,
            ClientFrame::Watch { .. } => Op::Watch,
            ClientFrame::DeadLetters(_) => Op::DeadLetters,
            ClientFrame::Redrive { .. } => Op::Redrive,
        }
    }

    /// The request id (`None` only for `ack`/`nak` sent without one).
    pub fn id(&self) -> Option<&str> {
        match self {
            ClientFrame::Hello(f) => Some(&f.id),
            ClientFrame::Ping { id }
            | ClientFrame::Bye { id }
            | ClientFrame::Unsubscribe { id, .. }
            | ClientFrame::Serve { id, .. }
            | ClientFrame::Who { id, .. }
            | ClientFrame::Watch { id }
            | ClientFrame::Redrive { id, .. } => Some(id),
            ClientFrame::DeadLetters(f) => Some(&f.id),
            ClientFrame::Send(f) => Some(&f.id),
            ClientFrame::Ack(f) => f.id.as_deref(),
            ClientFrame::Nak(f) => f.id.as_deref(),
            ClientFrame::Publish(f) => Some(&f.id),
            ClientFrame::Subscribe(f) => Some(&f.id),
            ClientFrame::Submit(f) => Some(&f.id),
            ClientFrame::Claim(f)
            | ClientFrame::Decline(f)
            | ClientFrame::Status(f)
            | ClientFrame::Cancel(f) => Some(&f.id),
            ClientFrame::Heartbeat(f) => Some(&f.id),
            ClientFrame::Complete(f) => Some(&f.id),
            ClientFrame::Fail(f) => Some(&f.id),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Hello {
    pub id: String,
    pub ns: String,
    pub name: String,
    pub auth: Auth,
    #[serde(default)]
    pub serve: Vec<ServeSlots>,
    #[serde(default)]
    pub labels: Labels,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Auth {
    Token {
        token: String,
    },
    /// `sig` is base64url of the Ed25519 signature of the raw nonce, padded or not.
    Nkey {
        nkey: String,
        sig: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ServeSlots {
    pub job: String,
    pub slots: u32,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Send {
    pub id: String,
    pub to: String,
    pub body: Body,
    #[serde(default)]
    pub headers: Headers,
    pub idem: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Ack {
    pub id: Option<String>,
    pub seq: u64,
    /// Set when acknowledging an event of a durable subscription.
    pub sub: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Nak {
    pub id: Option<String>,
    pub seq: u64,
    pub delay_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Publish {
    pub id: String,
    pub topic: String,
    pub body: Body,
    #[serde(default)]
    pub headers: Headers,
    pub idem: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Subscribe {
    pub id: String,
    /// A topic pattern: `*` matches one token, a trailing `>` the rest.
    pub topic: String,
    pub sub: Option<String>,
    #[serde(default)]
    pub from: From,
    #[serde(default)]
    pub durable: bool,
}

/// Where a subscription starts (`from`); the default is `new`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(untagged)]
pub enum From {
    #[default]
    #[serde(skip)]
    New,
    Named(FromName),
    Seq {
        seq: u64,
    },
    /// RFC 3339 time, as the client sent it.
    Time {
        time: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FromName {
    New,
    All,
    Last,
}

impl From {
    /// `"new"` spelled out and the default are the same thing.
    pub fn normalized(self) -> From {
        match self {
            From::Named(FromName::New) => From::New,
            other => other,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Submit {
    pub id: String,
    pub job: String,
    pub body: Body,
    pub task: Option<String>,
    pub max_attempts: Option<u32>,
    pub eligible: Option<Eligible>,
    #[serde(default)]
    pub headers: Headers,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Eligible {
    pub names: Option<Vec<String>>,
    pub labels: Option<Labels>,
}

/// `dead_letters`: a page of a job's dead letters from `from.seq` on.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DeadLetters {
    pub id: String,
    pub job: String,
    pub from: Option<SeqFrom>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct SeqFrom {
    pub seq: u64,
}

/// `claim`, `decline`, `status` and `cancel`: a request about one task.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TaskRef {
    pub id: String,
    pub task: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Heartbeat {
    pub id: String,
    pub task: String,
    pub progress: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Complete {
    pub id: String,
    pub task: String,
    pub result: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Fail {
    pub id: String,
    pub task: String,
    pub error: FailError,
    pub retry: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct FailError {
    pub code: String,
    pub message: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_strings_round_trip() {
        for op in Op::ALL {
            assert_eq!(Op::parse(op.as_str()), Some(op));
        }
        assert_eq!(Op::parse("ok"), None);
        assert!(!Op::Ack.requires_id() && !Op::Nak.requires_id() && Op::Send.requires_id());
    }
}
