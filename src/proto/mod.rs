//! NATS wire protocol: an incremental zero-copy parser, header blocks, an encoder and
//! subject validation/matching. No IO, no clock, no allocation per parsed operation.

pub mod encode;
pub mod headers;
pub mod info;
pub mod parser;
pub mod subject;

pub use headers::{HeaderError, HeaderMap, Headers};
pub use info::{ConnectOptions, ServerInfo};
pub use parser::{Malformed, Op, ParseError, Parsed, Parser, Role};
pub use subject::SubjectError;
