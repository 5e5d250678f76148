//! HTTP/1.1 endpoints and WebSocket sessions over non-blocking sockets.
//!
//! [`connection::Connection`] is the sans-IO machine of one client connection;
//! [`server::WsServer`] is the thin `mio` shell that accepts connections and moves bytes
//! between sockets and machines, embeddable in the broker's own event loop.

pub mod connect_rate;
pub mod connection;
pub mod decoder;
pub mod http;
pub mod metrics;
pub mod origin;
pub mod pending;
pub mod server;

pub use connection::{ConnEvent, Connection, HttpHost, SendError, WsConfig, close_code};
pub use server::{SessionEvent, SessionId, WsServer};
