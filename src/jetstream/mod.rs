//! Typed `$JS.API` requests and responses, pull consumers, acks and KV.
//!
//! The core is sans-IO: request builders return a [`Request`] (subject, headers,
//! payload) and parsers turn a reply's bytes into `Result<T, JsError>`, so the broker's
//! event loop can send a request, park a continuation under its request id and finish
//! it when the reply arrives. [`KvWatcher`](kv::KvWatcher) is a state machine fed with
//! messages and timer ticks.

pub mod account;
pub mod ack;
pub mod api;
pub mod consumer;
pub mod context;
pub mod error;
pub mod kv;
pub mod message;
pub mod publish;
pub mod pull;
pub mod stream;
mod wire;

pub use account::AccountInfo;
pub use ack::{AckKind, AckMetadata};
pub use api::{ApiPrefix, Request, SuccessResponse, parse_response};
pub use consumer::{
    AckPolicy, ConsumerAction, ConsumerConfig, ConsumerInfo, DeliverFrom, DeliverPolicy,
    ReplayPolicy,
};
pub use context::{BlockingWatch, Context, Fetched};
pub use error::{ApiError, JsError};
pub use message::Delivery;
pub use publish::{MsgTtl, PubAck, PublishOptions};
pub use pull::{Inbound, PullRequest, classify};
pub use stream::{
    DiscardPolicy, MsgSelector, NamesPage, PurgeRequest, PurgeResponse, RetentionPolicy,
    StorageType, StoredMessage, StreamConfig, StreamInfo, StreamState,
};
pub use wire::Extra;
