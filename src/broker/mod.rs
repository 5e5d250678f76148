//! The AMP broker: configuration, the embedded nats-server, and (to come) sessions,
//! inbox, topics, jobs and the registry.

pub mod binding;
pub mod bounded_map;
pub mod budget;
pub mod callout;
pub mod config;
pub mod embedded;
pub mod envelope;
pub mod keygen;
pub mod permissions;
pub mod rate_limit;
pub mod scoped_jwt;
pub mod task_store;
pub mod throttle;
pub mod worker_choice;
