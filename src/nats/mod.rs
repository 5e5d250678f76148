//! NATS client: a sans-IO [`Connection`] (handshake, authentication, keepalive,
//! subscriptions, request/reply over one wildcard inbox, reconnect with backoff, bounded
//! buffers), the mio [`Driver`] that moves its bytes over a socket inside any `mio::Poll`
//! loop, and [`Client`], a blocking convenience for tests, benchmarks and tools.
//!
//! ```no_run
//! use amp_broker::nats::{Client, Options};
//! use std::time::Duration;
//! let mut client = Client::connect(Options::new("nats://127.0.0.1:4222"))?;
//! let sid = client.subscribe("greet.*", None)?;
//! client.publish("greet.joe", None, None, b"hello")?;
//! let msg = client.next_message(sid, Duration::from_secs(1))?;
//! let reply = client.request("svc.echo", None, b"hi", Duration::from_secs(1));
//! # Ok::<(), amp_broker::nats::Error>(())
//! ```
//!
//! Refinements of the agreed shape (for code written against it):
//! - The shell also calls [`Connection::poll_close`] after every call: true means the
//!   connection abandoned its socket (stale, fatal `-ERR`, lame duck move, handshake
//!   timeout, `close()`); drop it without calling `on_transport_closed`. [`Driver`] does
//!   this.
//! - `Event::Closed { reason }` carries an [`Error`] (e.g. `Error::Authorization`), not a
//!   string. Extra events: `Event::Pong(PingId)` answers [`Connection::ping`] (what
//!   `Client::flush` waits for) and `Event::SlowConsumer { dropped }`.
//! - `RequestError` has `Timeout`, `NoResponders`, `Disconnected` (the connection the
//!   request went out on was lost), `Closed` and `Send(Error)`. A request made while
//!   disconnected waits in the reconnect buffer and is not failed by that disconnect.
//! - [`Connection::cancel_request`] forgets a request; `pending_requests()` counts them.
//! - `Client::next_message` returns `Result<Option<Message>, Error>` (`None`: timeout);
//!   `Client::wait_response(id, deadline)` waits for a request started with
//!   `connection_mut().request(..)`; `Client::take_events` drains without waiting.

pub mod backoff;
pub mod client;
pub mod connection;
pub mod creds;
pub mod driver;
pub mod error;
pub mod options;
pub mod requests;
pub mod subscriptions;

pub use crate::proto::headers::HeaderMap;
pub use crate::proto::info::ServerInfo;
pub use client::Client;
pub use connection::{Connection, Event, Message, PingId, Stats};
pub use driver::Driver;
pub use error::{Error, RequestError};
pub use options::{Auth, Options, ServerAddr, ServerUrl, redacted};
pub use requests::RequestId;
pub use subscriptions::Sid;

#[cfg(test)]
mod tests;
