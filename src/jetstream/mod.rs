//! Typed `$JS.API` requests and responses, pull consumers, acks and KV.
