//! Test support compiled only with the `testing` feature: a deterministic, sans-IO model
//! of nats-server with JetStream that integration tests and simulators drive in memory.

pub mod harness;
pub mod nats_model;
pub mod sim;
