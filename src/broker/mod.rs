//! The AMP broker: configuration, sessions, inbox, registry,
//! jobs and policy.

pub mod admission;
pub mod api_queue;
pub mod auth;
pub mod binding;
pub mod bounded_map;
pub mod budget;
pub mod callout;
pub mod clock;
pub mod config;
pub mod continuations;
pub mod core;
pub mod dead_letters;
pub mod domains;
pub mod envelope;
pub mod held_bytes;
pub mod in_flight;
pub use crate::id_map;
pub use crate::ids;
pub mod jobs;
pub mod mig;
pub mod outstanding;
pub mod permissions;
pub mod pull_loop;
pub mod rate_limit;
pub mod registry;
pub mod reload;
pub mod remake;
pub mod scoped_jwt;
pub mod setup;
pub mod task_store;
pub mod throttle;
pub mod timers;
pub mod worker_choice;

pub use self::core::{Broker, Footprint, Input, Output, SessionId};
