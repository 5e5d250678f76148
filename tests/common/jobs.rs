//! Jobs test support shared by the broker-process tests: a namespace `acme` with one
//! job `render`, participants logging in with `<name>-token`.
#![allow(dead_code)]

use serde_json::{Value, json};

use super::amp::{Broker, Client, open_config};

pub fn config(names: &[&str], lease_s: u64, offer_ms: u64) -> Value {
    let mut c = open_config(names);
    c["namespaces"]["acme"]["jobs"] =
        json!({"render": {"lease_s": lease_s, "offer_ms": offer_ms, "max_attempts": 3}});
    c
}

pub fn login(broker: &Broker, name: &str) -> Client {
    Client::login(broker, "acme", name, &format!("{name}-token"))
}

/// Logs in announcing `serve` of `render` in the hello.
pub fn login_serving(broker: &Broker, name: &str, slots: u32) -> Client {
    let mut c = Client::connect(broker);
    let ok = c.request(json!({
        "op":"hello","ns":"acme","name":name,
        "auth":{"type":"token","token":format!("{name}-token")},
        "serve":[{"job":"render","slots":slots}]
    }));
    assert_eq!(ok["op"], "ok", "hello: {ok}");
    c
}

pub fn status(c: &mut Client, task: &str) -> Value {
    let r = c.request(json!({"op":"status","task":task}));
    assert_eq!(r["op"], "ok", "status: {r}");
    r["task"].clone()
}
