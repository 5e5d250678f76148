//! The JetStream binding of spec section 4: names and subjects, the exact configuration of
//! every stream, bucket and consumer the broker creates, and the check that decides whether
//! an existing one can be adopted.
//!
//! Configurations are JSON values in the `$JS.API` wire form, so what the broker sends is
//! exactly what is written here, and a configuration read back from the server can be
//! compared field by field.

use serde_json::{Value, json};

use crate::deadline::secs_as_nanos;

/// History kept per task in the task store (the most KV allows).
pub const TASK_STATE_HISTORY: u64 = 64;
pub const TASK_STATE_BUCKET: &str = "AMP_TASK_STATE";

pub fn inbox_stream(ns: &str) -> String {
    format!("AMP_INBOX_{ns}")
}
pub fn inbox_subject(ns: &str, name: &str) -> String {
    format!("amp.{ns}.inbox.{name}")
}
pub fn inbox_consumer(name: &str) -> String {
    format!("inbox_{name}")
}
pub fn topics_stream(ns: &str) -> String {
    format!("AMP_TOPICS_{ns}")
}
pub fn topic_subject(ns: &str, topic: &str) -> String {
    format!("amp.{ns}.topic.{topic}")
}
pub fn tasks_stream(ns: &str) -> String {
    format!("AMP_TASKS_{ns}")
}
pub fn job_subject(ns: &str, job: &str) -> String {
    format!("amp.{ns}.job.{job}")
}
pub fn dlq_stream(ns: &str) -> String {
    format!("AMP_DLQ_{ns}")
}
pub fn dlq_subject(ns: &str, job: &str) -> String {
    format!("amp.{ns}.dlq.{job}")
}
pub fn job_consumer(job: &str) -> String {
    format!("job_{job}")
}
/// The consumer of participant `name`'s durable subscription `sub`, in the namespace's
/// topics stream. Both parts come from clients and may contain `_`, so the name's length
/// is written first: `dsub_<len>_<name>_<sub>` splits one way only. The prefix differs
/// from the `sub_<name>_<sub>` of earlier releases, so a new name can never be an old one.
pub fn durable_sub_consumer(name: &str, sub: &str) -> String {
    format!("{}{sub}", durable_sub_prefix(name))
}
/// What every durable consumer of participant `name` starts with, and no other's does.
pub fn durable_sub_prefix(name: &str) -> String {
    format!("dsub_{}_{name}_", name.len())
}
pub fn registry_bucket(ns: &str) -> String {
    format!("AMP_REGISTRY_{ns}")
}
pub fn task_key(ns: &str, task: &str) -> String {
    format!("{ns}.{task}")
}

/// Settings shared by every stream the broker creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamSettings {
    /// 1 on a single server; 3 on a cluster.
    pub replicas: u32,
    /// Window in which a repeated `Nats-Msg-Id` is answered as a duplicate.
    pub duplicate_window_s: u64,
}

impl Default for StreamSettings {
    fn default() -> Self {
        StreamSettings {
            replicas: 1,
            duplicate_window_s: 120,
        }
    }
}

fn base_stream(name: &str, subjects: Value, retention: &str, s: StreamSettings) -> Value {
    json!({
        "name": name,
        "subjects": subjects,
        "retention": retention,
        "storage": "file",
        "num_replicas": s.replicas,
        "discard": "old",
        "duplicate_window": secs_as_nanos(s.duplicate_window_s),
    })
}

pub fn inbox_stream_config(ns: &str, max_age_s: u64, s: StreamSettings) -> Value {
    let mut c = base_stream(
        &inbox_stream(ns),
        json!([format!("amp.{ns}.inbox.*")]),
        "limits",
        s,
    );
    c["max_age"] = json!(secs_as_nanos(max_age_s));
    c
}

/// `max_consumers` is the hard backstop behind the broker's own caps on subscriptions:
/// however many participants and brokers there are, the namespace's topics never hold
/// more consumers than this.
pub fn topics_stream_config(
    ns: &str,
    max_age_s: u64,
    max_bytes: u64,
    max_consumers: u64,
    s: StreamSettings,
) -> Value {
    let mut c = base_stream(
        &topics_stream(ns),
        json!([format!("amp.{ns}.topic.>")]),
        "limits",
        s,
    );
    aged(&mut c, max_age_s, max_bytes);
    c["max_consumers"] = json!(max_consumers);
    c
}

/// A limits stream's `max_age` and `max_bytes` (0: unlimited for either).
fn aged(c: &mut Value, max_age_s: u64, max_bytes: u64) {
    c["max_age"] = json!(secs_as_nanos(max_age_s));
    c["max_bytes"] = if max_bytes == 0 {
        json!(-1)
    } else {
        json!(max_bytes)
    };
}

pub fn tasks_stream_config(ns: &str, s: StreamSettings) -> Value {
    base_stream(
        &tasks_stream(ns),
        json!([format!("amp.{ns}.job.*")]),
        "workqueue",
        s,
    )
}

/// Dead letters are kept for inspection and redrive, not consumed: limits retention,
/// oldest out first.
pub fn dlq_stream_config(ns: &str, max_age_s: u64, max_bytes: u64, s: StreamSettings) -> Value {
    let mut c = base_stream(
        &dlq_stream(ns),
        json!([format!("amp.{ns}.dlq.*")]),
        "limits",
        s,
    );
    aged(&mut c, max_age_s, max_bytes);
    c
}

/// A KV bucket's stream as ADR-8 lays it out.
fn kv_stream_config(bucket: &str, history: u64, s: StreamSettings) -> Value {
    json!({
        "name": format!("KV_{bucket}"),
        "subjects": [format!("$KV.{bucket}.>")],
        "retention": "limits",
        "storage": "file",
        "num_replicas": s.replicas,
        "discard": "new",
        "max_msgs_per_subject": history,
        "allow_rollup_hdrs": true,
        "deny_delete": true,
        "allow_direct": true,
        "duplicate_window": secs_as_nanos(s.duplicate_window_s),
    })
}

/// The registry: one key per participant with a per-key TTL; when a key expires the server
/// leaves a delete marker (kept for `ttl_s`) that watchers see as `down`.
pub fn registry_stream_config(ns: &str, ttl_s: u64, s: StreamSettings) -> Value {
    let mut c = kv_stream_config(&registry_bucket(ns), 1, s);
    c["allow_msg_ttl"] = json!(true);
    c["subject_delete_marker_ttl"] = json!(secs_as_nanos(ttl_s));
    c
}

pub fn task_state_stream_config(s: StreamSettings) -> Value {
    kv_stream_config(TASK_STATE_BUCKET, TASK_STATE_HISTORY, s)
}

/// The durable pull consumer of one participant's inbox.
pub fn inbox_consumer_config(ns: &str, name: &str, ack_wait_s: u64, window: u32) -> Value {
    json!({
        "durable_name": inbox_consumer(name),
        "filter_subject": inbox_subject(ns, name),
        "deliver_policy": "all",
        "ack_policy": "explicit",
        "ack_wait": secs_as_nanos(ack_wait_s),
        "max_deliver": -1,
        "max_ack_pending": window,
    })
}

/// The durable pull consumer of one job: AckWait is the lease; deliveries are unlimited
/// because declines count as deliveries and attempts live in the task store.
pub fn job_consumer_config(ns: &str, job: &str, lease_s: u64) -> Value {
    json!({
        "durable_name": job_consumer(job),
        "filter_subject": job_subject(ns, job),
        "deliver_policy": "all",
        "ack_policy": "explicit",
        "ack_wait": secs_as_nanos(lease_s),
        "max_deliver": -1,
    })
}

/// The durable pull consumer of participant `name`'s subscription `sub` to `filter`:
/// every event must be acked; JetStream deletes it once nobody has pulled or acked for
/// `inactive_s` (a subscriber that does not come back).
pub fn durable_sub_config(
    name: &str,
    sub: &str,
    filter: &str,
    ack_wait_s: u64,
    window: u32,
    inactive_s: u64,
) -> Value {
    json!({
        "durable_name": durable_sub_consumer(name, sub),
        "filter_subject": filter,
        "ack_policy": "explicit",
        "ack_wait": secs_as_nanos(ack_wait_s),
        "max_deliver": -1,
        "max_ack_pending": window,
        "deliver_policy": "all",
        "inactive_threshold": secs_as_nanos(inactive_s),
    })
}

/// What an existing stream or consumer must agree on for the broker to adopt it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// Must be equal: the broker's semantics depend on it.
    Same,
    /// The existing subject list must include every subject of ours.
    CoversSubjects,
    /// Must be a positive number (any value works, none does not).
    Positive,
    /// May differ: an operator's tuning (replicas, limits) is kept as it is.
    Tunable,
}

fn rule(field: &str) -> Rule {
    match field {
        "subjects" => Rule::CoversSubjects,
        "subject_delete_marker_ttl" => Rule::Positive,
        "num_replicas" | "max_age" | "max_bytes" | "max_consumers" | "duplicate_window"
        | "discard" | "storage" => Rule::Tunable,
        _ => Rule::Same,
    }
}

/// Checks an existing configuration (as the server reports it) against ours. Fields the
/// server omits take the JetStream defaults (`false`, `0`, empty). Returns the first
/// incompatible field with both values.
pub fn check_compatible(desired: &Value, existing: &Value) -> Result<(), Incompatible> {
    let Some(fields) = desired.as_object() else {
        return Ok(());
    };
    for (field, want) in fields {
        let have = existing
            .get(field)
            .cloned()
            .unwrap_or_else(|| default_of(want));
        let ok = match rule(field) {
            Rule::Tunable => true,
            Rule::Same => same(want, &have),
            Rule::Positive => have.as_u64().is_some_and(|n| n > 0),
            Rule::CoversSubjects => {
                let have: Vec<&str> = have
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                want.as_array().is_some_and(|w| {
                    w.iter()
                        .filter_map(Value::as_str)
                        .all(|s| have.contains(&s))
                })
            }
        };
        if !ok {
            return Err(Incompatible {
                field: field.clone(),
                want: want.clone(),
                have,
            });
        }
    }
    Ok(())
}

fn default_of(v: &Value) -> Value {
    match v {
        Value::Bool(_) => Value::Bool(false),
        Value::Number(_) => json!(0),
        Value::String(_) => json!(""),
        Value::Array(_) => json!([]),
        _ => Value::Null,
    }
}

/// Numbers compare by value (the server writes `-1` where we write `-1`, but may write
/// `0` as `0` or omit it); everything else structurally.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Incompatible {
    pub field: String,
    pub want: Value,
    pub have: Value,
}

impl std::fmt::Display for Incompatible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "field `{}` is {} but the broker needs {}",
            self.field, self.have, self.want
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_follow_the_spec_mapping() {
        let s = StreamSettings::default();
        let inbox = inbox_stream_config("acme", 0, s);
        assert_eq!(inbox["name"], "AMP_INBOX_acme");
        assert_eq!(inbox["subjects"], json!(["amp.acme.inbox.*"]));
        assert_eq!(inbox["retention"], "limits");
        let tasks = tasks_stream_config("acme", s);
        assert_eq!(tasks["retention"], "workqueue");
        assert_eq!(tasks["subjects"], json!(["amp.acme.job.*"]));
        let topics = topics_stream_config("acme", 3600, 0, 10, s);
        assert_eq!(topics["subjects"], json!(["amp.acme.topic.>"]));
        assert_eq!(topics["max_age"], json!(3600 * 1_000_000_000u64));
        let registry = registry_stream_config("acme", 15, s);
        assert_eq!(registry["name"], "KV_AMP_REGISTRY_acme");
        assert_eq!(registry["allow_msg_ttl"], true);
        assert_eq!(
            registry["subject_delete_marker_ttl"],
            json!(15 * 1_000_000_000u64)
        );
        assert_eq!(
            task_state_stream_config(s)["max_msgs_per_subject"],
            json!(64)
        );
        let job = job_consumer_config("acme", "render", 30);
        assert_eq!(job["ack_wait"], json!(30 * 1_000_000_000u64));
        assert_eq!(job["max_deliver"], json!(-1));
        assert_eq!(
            inbox_consumer_config("acme", "w1", 30, 64)["max_ack_pending"],
            json!(64)
        );
    }

    #[test]
    fn durations_beyond_the_go_range_saturate_instead_of_wrapping() {
        let max = json!(i64::MAX);
        let s = StreamSettings::default();
        assert_eq!(
            inbox_consumer_config("acme", "a", u64::MAX, 64)["ack_wait"],
            max
        );
        assert_eq!(job_consumer_config("acme", "r", u64::MAX)["ack_wait"], max);
        assert_eq!(inbox_stream_config("acme", u64::MAX, s)["max_age"], max);
        assert_eq!(
            topics_stream_config("acme", 18_446_744_074, 0, 10, s)["max_age"],
            max
        );
        assert_eq!(
            registry_stream_config("acme", u64::MAX, s)["subject_delete_marker_ttl"],
            max
        );
    }

    #[test]
    fn durable_names_split_one_way_only() {
        assert_eq!(durable_sub_consumer("a", "b_c"), "dsub_1_a_b_c");
        assert_eq!(durable_sub_consumer("a_b", "c"), "dsub_3_a_b_c");
        let names = ["a", "a_b", "a_b_c", "1_a", "_", "-", "b"];
        let mut seen = std::collections::HashMap::new();
        for name in names {
            for sub in names {
                let consumer = durable_sub_consumer(name, sub);
                assert_eq!(
                    seen.insert(consumer.clone(), (name, sub)),
                    None,
                    "{consumer}"
                );
                assert!(consumer.starts_with(&durable_sub_prefix(name)));
                for other in names.iter().filter(|o| **o != name) {
                    assert!(
                        !consumer.starts_with(&durable_sub_prefix(other)),
                        "{consumer}"
                    );
                }
            }
        }
        // The longest possible name stays a short plain token.
        let long = "x".repeat(64);
        let c = durable_sub_consumer(&long, &long);
        assert!(c.len() <= 140, "{}", c.len());
        assert!(!c.starts_with("sub_"));
    }

    #[test]
    fn adopts_a_stream_with_extra_subjects_and_tuned_limits() {
        let desired = inbox_stream_config("acme", 0, StreamSettings::default());
        let mut existing = desired.clone();
        existing["subjects"] = json!(["amp.acme.inbox.*", "legacy.>"]);
        existing["num_replicas"] = json!(3);
        existing["max_age"] = json!(86_400 * 1_000_000_000u64);
        existing["sealed"] = json!(false);
        assert_eq!(check_compatible(&desired, &existing), Ok(()));
    }

    #[test]
    fn names_the_field_that_prevents_adoption() {
        let desired = tasks_stream_config("acme", StreamSettings::default());
        let mut existing = desired.clone();
        existing["retention"] = json!("limits");
        let e = check_compatible(&desired, &existing).expect_err("retention differs");
        assert_eq!(e.field, "retention");
        assert_eq!(
            e.to_string(),
            "field `retention` is \"limits\" but the broker needs \"workqueue\""
        );

        let desired = registry_stream_config("acme", 15, StreamSettings::default());
        let mut existing = desired.clone();
        existing.as_object_mut().map(|o| o.remove("allow_msg_ttl"));
        assert_eq!(
            check_compatible(&desired, &existing)
                .expect_err("ttl off")
                .field,
            "allow_msg_ttl"
        );
        existing = desired.clone();
        existing["subject_delete_marker_ttl"] = json!(0);
        assert_eq!(
            check_compatible(&desired, &existing)
                .expect_err("no markers")
                .field,
            "subject_delete_marker_ttl"
        );
        existing = desired.clone();
        existing["subjects"] = json!(["$KV.OTHER.>"]);
        assert_eq!(
            check_compatible(&desired, &existing)
                .expect_err("subjects")
                .field,
            "subjects"
        );
    }
}
