//! AMP frames, JSON Schema validation and error codes.
//!
//! Incoming text goes through [`schema::FrameValidator::decode`], which classifies it
//! (`bad_frame` / `schema`) and yields a typed [`frame::ClientFrame`]; replies are built
//! with [`reply`].

pub mod body;
pub mod error;
pub mod fast;
pub mod frame;
pub mod quick_json;
pub mod reply;
pub mod schema;

pub use body::Body;
pub use error::{AmpError, ErrorCode};
pub use frame::{ClientFrame, Op};
pub use schema::{FrameValidator, Rejected, SCHEMA_JSON};
