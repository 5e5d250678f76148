//! NATS wire protocol: an incremental zero-copy parser, header blocks, an encoder and
//! subject validation/matching. No IO, no clock, no allocation per parsed operation.

pub mod parser;

pub use parser::{Op, ParseError, Parsed, Parser, Role};
