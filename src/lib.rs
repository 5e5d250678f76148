//! AMP broker: a single-threaded, sans-IO core over a hand-rolled `mio` loop that speaks
//! the NATS wire protocol to `nats-server` with JetStream.

pub mod amp;
pub mod broker;
pub mod cli;
pub mod deadline;
pub mod embedded;
pub mod heap;
pub mod id_map;
pub mod ids;
pub mod jetstream;
pub mod jwt;
pub mod keygen;
pub mod lame_duck;
pub mod logging;
pub mod nats;
pub mod nkeys;
pub mod proto;
pub mod rfc3339;
pub mod runtime;
pub mod scan;
pub mod signals;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod ws;
