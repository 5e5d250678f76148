//! NATS wire protocol: an incremental zero-copy parser, header blocks, an encoder and
//! subject validation/matching. No IO, no clock, no allocation per parsed operation.
//!
//! Driving the parser by hand:
//!
//! ```
//! use amp_broker::proto::{Op, Parsed, Parser, Role};
//!
//! let parser = Parser::new(Role::Client);
//! let mut buf = b"MSG orders.1 7 5\r\nhello\r\nPING\r\nMSG orders.2 7 5\r\nwor".to_vec();
//! let mut start = 0;
//! let mut seen = Vec::new();
//! loop {
//!     match parser.parse(&buf[start..]) {
//!         Ok(Parsed::Complete(op, used)) => {
//!             if let Op::Msg { subject, payload, .. } = op {
//!                 seen.push((subject.to_vec(), payload.to_vec()));
//!             }
//!             start += used; // ops borrow `buf`: handle them before reading more
//!         }
//!         // `needed` (when known) is the length to wait for before parsing again.
//!         Ok(Parsed::Partial { needed }) => {
//!             assert_eq!(needed, Some(25));
//!             break;
//!         }
//!         Err(e) => panic!("protocol violation: {e}"), // e.g. "Maximum Payload Violation"
//!     }
//! }
//! buf.drain(..start); // keep the partial MSG, then read more after it
//! assert_eq!(seen, [(b"orders.1".to_vec(), b"hello".to_vec())]);
//! assert_eq!(buf, b"MSG orders.2 7 5\r\nwor");
//! ```

pub mod encode;
pub mod headers;
pub mod info;
pub mod parser;
pub mod subject;

pub use headers::{HeaderError, HeaderMap, Headers};
pub use info::{ConnectOptions, ServerInfo};
pub use parser::{Malformed, Op, ParseError, Parsed, Parser, Role};
pub use subject::SubjectError;
