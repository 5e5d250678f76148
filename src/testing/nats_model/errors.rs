//! JetStream API errors with nats-server's `code` / `err_code` / description.

use serde_json::{Value, json};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiErr {
    pub code: u16,
    pub err_code: u32,
    pub description: String,
}

impl ApiErr {
    pub fn to_json(&self) -> Value {
        json!({"code": self.code, "err_code": self.err_code, "description": self.description})
    }
}

fn e(code: u16, err_code: u32, description: impl Into<String>) -> ApiErr {
    ApiErr {
        code,
        err_code,
        description: description.into(),
    }
}

pub fn bad_request(why: &str) -> ApiErr {
    e(400, 10003, format!("bad request: {why}"))
}
pub fn stream_not_found() -> ApiErr {
    e(404, 10059, "stream not found")
}
pub fn consumer_not_found() -> ApiErr {
    e(404, 10014, "consumer not found")
}
pub fn stream_name_mismatch() -> ApiErr {
    e(400, 10056, "stream name in subject does not match request")
}
pub fn consumer_name_mismatch() -> ApiErr {
    e(
        400,
        10022,
        "consumer name in subject does not match durable name in request",
    )
}
pub fn stream_exists() -> ApiErr {
    e(
        400,
        10058,
        "stream name already in use with a different configuration",
    )
}
pub fn subjects_overlap() -> ApiErr {
    e(400, 10065, "subjects overlap with an existing stream")
}
pub fn invalid_stream_config(why: &str) -> ApiErr {
    e(400, 10052, format!("invalid stream configuration: {why}"))
}
pub fn invalid_consumer_config(why: &str) -> ApiErr {
    e(400, 10084, format!("consumer config invalid: {why}"))
}
pub fn msg_too_big() -> ApiErr {
    e(400, 10054, "message size exceeds maximum allowed")
}
pub fn stream_not_match() -> ApiErr {
    e(400, 10060, "expected stream does not match")
}
pub fn wrong_last_sequence(seq: u64) -> ApiErr {
    e(400, 10071, format!("wrong last sequence: {seq}"))
}
pub fn wrong_last_msg_id(id: &str) -> ApiErr {
    e(400, 10070, format!("wrong last msg ID: {id}"))
}
pub fn ttl_disabled() -> ApiErr {
    e(400, 10166, "per-message TTL is disabled")
}
pub fn ttl_invalid() -> ApiErr {
    e(400, 10165, "invalid per-message TTL")
}
pub fn rollup_not_permitted() -> ApiErr {
    e(400, 10025, "rollup not permitted")
}
pub fn rollup_invalid() -> ApiErr {
    e(400, 10025, "rollup value invalid")
}
pub fn store_failed(why: &str) -> ApiErr {
    e(503, 10077, why)
}
pub fn no_message_found() -> ApiErr {
    e(404, 10037, "no message found")
}
pub fn msg_delete_failed(why: &str) -> ApiErr {
    e(500, 10057, why)
}
pub fn purge_denied() -> ApiErr {
    e(400, 10056, "stream purge not permitted")
}
pub fn consumer_exists() -> ApiErr {
    e(400, 10148, "consumer already exists")
}
/// `JSConsumerCreateErrF`: the reason is the description.
pub fn consumer_create(why: &str) -> ApiErr {
    e(500, 10012, why)
}
pub fn consumer_missing() -> ApiErr {
    e(400, 10149, "consumer does not exist")
}
pub fn max_consumers() -> ApiErr {
    e(400, 10026, "maximum consumers limit reached")
}
