//! TLS for both ends of the broker: the listener (wss://, https://) and the NATS
//! connection (tls://). rustls does the protocol; [`TlsSession`] fits it under the
//! existing sans-IO machines as a byte pump, and [`files`] turns PEM files into rustls
//! configurations.

pub mod files;
pub mod session;
pub mod settings;

pub use files::{ClientFiles, ServerFiles};
pub use session::{Received, TlsSession};
pub use settings::{ListenerTls, NatsTls};
