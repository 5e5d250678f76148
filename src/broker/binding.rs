//! The JetStream binding of spec section 4: names and subjects, the exact configuration of
//! every stream, bucket and consumer the broker creates, and the check that decides whether
//! an existing one can be adopted.
//!
//! Configurations are the typed ones of [`crate::jetstream`], which serialise to the
//! `$JS.API` wire form with unset fields left out, so what the broker sends is exactly
//! what is set here; a stream read back from the server is compared field by field with
//! the wire form of ours.

use std::time::Duration;

use serde_json::Value;

use crate::jetstream::{
    AckPolicy, ConsumerConfig, DeliverFrom, DiscardPolicy, RetentionPolicy, StorageType,
    StreamConfig,
};

/// History kept per task in the task store (the most KV allows).
pub const TASK_STATE_HISTORY: u64 = 64;
pub const TASK_STATE_BUCKET: &str = "AMP_TASK_STATE";

// Names and subjects are built with `concat` (one allocation of the exact size, no
// formatting machinery): some are made for every message.
pub fn inbox_stream(ns: &str) -> String {
    ["AMP_INBOX_", ns].concat()
}
pub fn inbox_subject(ns: &str, name: &str) -> String {
    ["amp.", ns, ".inbox.", name].concat()
}
/// Whether `subject` is [`inbox_subject`] of `ns`/`name`.
pub fn is_inbox_subject(subject: &str, ns: &str, name: &str) -> bool {
    subject
        .strip_prefix("amp.")
        .and_then(|s| s.strip_prefix(ns))
        .and_then(|s| s.strip_prefix(".inbox."))
        == Some(name)
}

/// [`inbox_subject`] appended to `out`.
pub fn push_inbox_subject(out: &mut String, ns: &str, name: &str) {
    for part in ["amp.", ns, ".inbox.", name] {
        out.push_str(part);
    }
}
pub fn inbox_consumer(name: &str) -> String {
    ["inbox_", name].concat()
}
pub fn topics_stream(ns: &str) -> String {
    ["AMP_TOPICS_", ns].concat()
}
pub fn topic_subject(ns: &str, topic: &str) -> String {
    ["amp.", ns, ".topic.", topic].concat()
}
pub fn tasks_stream(ns: &str) -> String {
    ["AMP_TASKS_", ns].concat()
}
pub fn job_subject(ns: &str, job: &str) -> String {
    ["amp.", ns, ".job.", job].concat()
}
pub fn dlq_stream(ns: &str) -> String {
    ["AMP_DLQ_", ns].concat()
}
pub fn dlq_subject(ns: &str, job: &str) -> String {
    ["amp.", ns, ".dlq.", job].concat()
}
pub fn job_consumer(job: &str) -> String {
    ["job_", job].concat()
}
/// The namespace and job of a job consumer, from its stream's and its own name (as an
/// ack subject names them): the inverse of [`tasks_stream`] and [`job_consumer`].
pub fn job_of_consumer<'a>(stream: &'a str, consumer: &'a str) -> Option<(&'a str, &'a str)> {
    Some((
        stream.strip_prefix("AMP_TASKS_")?,
        consumer.strip_prefix("job_")?,
    ))
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

/// Every subject of namespace `ns` (with listed participants `names`) that must not cross
/// a leaf link when `ns` lives in the site's own JetStream. Subjects carry no site: two
/// sites each with a namespace of one name would otherwise share its messages, events,
/// registry, tasks, acks and replies through the hub (each site's streams capture the
/// other's publishes, and each site's participants may subscribe to their reply prefix).
/// Reply prefixes of names an `open` entry admits cannot be listed (the name is inside a
/// token).
pub fn site_subjects<'a>(ns: &str, names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut subjects = vec![
        format!("amp.{ns}.>"),
        format!("mig.v0_1.{ns}.>"),
        format!("_AMP_BROKER.DURABLE.{ns}.>"),
        format!("_AMP_BROKER.MIG.CANCEL.{ns}.>"),
        format!("_AMP_BROKER.OFFER.{ns}.>"),
        format!("$KV.{}.>", registry_bucket(ns)),
    ];
    for name in names {
        subjects.push(format!(
            "{}.>",
            crate::broker::scoped_jwt::reply_prefix(ns, name)
        ));
    }
    for bucket in [
        TASK_STATE_BUCKET,
        crate::broker::budget::BUDGET_BUCKET,
        crate::broker::mig::seen::BUCKET,
    ] {
        subjects.push(format!("$KV.{bucket}.{ns}.>"));
    }
    for stream in [
        inbox_stream(ns),
        topics_stream(ns),
        tasks_stream(ns),
        dlq_stream(ns),
    ] {
        subjects.push(format!("$JS.ACK.{stream}.>"));
    }
    subjects
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

/// A count as the wire's signed integer; beyond its range means "as many as there can be".
fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn base_stream(
    name: String,
    subject: String,
    retention: RetentionPolicy,
    s: StreamSettings,
) -> StreamConfig {
    StreamConfig {
        name,
        subjects: vec![subject],
        retention: Some(retention),
        storage: Some(StorageType::File),
        num_replicas: Some(i64::from(s.replicas)),
        discard: Some(DiscardPolicy::Old),
        duplicate_window: Some(Duration::from_secs(s.duplicate_window_s)),
        ..StreamConfig::default()
    }
}

/// `max_consumers` bounds the participants with an inbox consumer; it is always set, as a
/// stream without one gets nats-server's default (1,000 since 2.15). Discard `new`: a
/// byte or message limit an operator sets refuses new sends (`unavailable`) instead of
/// removing messages accepted and not yet taken.
pub fn inbox_stream_config(
    ns: &str,
    max_age_s: u64,
    max_consumers: u64,
    s: StreamSettings,
) -> StreamConfig {
    StreamConfig {
        max_age: Some(Duration::from_secs(max_age_s)),
        max_consumers: Some(count(max_consumers)),
        discard: Some(DiscardPolicy::New),
        ..base_stream(
            inbox_stream(ns),
            format!("amp.{ns}.inbox.*"),
            RetentionPolicy::Limits,
            s,
        )
    }
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
) -> StreamConfig {
    let c = base_stream(
        topics_stream(ns),
        format!("amp.{ns}.topic.>"),
        RetentionPolicy::Limits,
        s,
    );
    StreamConfig {
        max_consumers: Some(count(max_consumers)),
        ..aged(c, max_age_s, max_bytes)
    }
}

/// A limits stream's `max_age` and `max_bytes` (0: unlimited for either).
fn aged(c: StreamConfig, max_age_s: u64, max_bytes: u64) -> StreamConfig {
    StreamConfig {
        max_age: Some(Duration::from_secs(max_age_s)),
        max_bytes: Some(if max_bytes == 0 { -1 } else { count(max_bytes) }),
        ..c
    }
}

/// Job consumers a namespace's task stream holds at most: one per job served anywhere
/// lately (see [`JOB_CONSUMER_INACTIVE`]). Set, as a stream without a limit of its own
/// gets nats-server's default (1,000 since 2.15).
pub const JOB_CONSUMERS: u64 = 10_000;

/// The longest duplicate window the tasks stream keeps (an operator's longer one is
/// lowered to it at start): a minute inside the shortest time a finished task's record is
/// kept (`keep_finished_s`, 300 s at the least). A task id is free again once its record
/// expired, and the next use's message has the same message id, the task id (spec section
/// 4), so a window reaching back to the last use's message took it for a duplicate.
pub const TASKS_DUPLICATE_WINDOW_MAX_S: u64 = 240;

/// Discard `new`, as the inbox: a full task stream refuses new submits instead of removing
/// queued tasks whose records would then wait for good.
pub fn tasks_stream_config(ns: &str, s: StreamSettings) -> StreamConfig {
    StreamConfig {
        max_consumers: Some(count(JOB_CONSUMERS)),
        discard: Some(DiscardPolicy::New),
        ..base_stream(
            tasks_stream(ns),
            format!("amp.{ns}.job.*"),
            RetentionPolicy::WorkQueue,
            s,
        )
    }
}

/// Dead letters are kept for inspection and redrive, not consumed: limits retention,
/// oldest out first.
pub fn dlq_stream_config(
    ns: &str,
    max_age_s: u64,
    max_bytes: u64,
    s: StreamSettings,
) -> StreamConfig {
    let c = base_stream(
        dlq_stream(ns),
        format!("amp.{ns}.dlq.*"),
        RetentionPolicy::Limits,
        s,
    );
    aged(c, max_age_s, max_bytes)
}

/// A KV bucket's stream as ADR-8 lays it out.
pub fn kv_stream_config(bucket: &str, history: u64, s: StreamSettings) -> StreamConfig {
    StreamConfig {
        max_msgs_per_subject: Some(count(history)),
        allow_rollup_hdrs: Some(true),
        deny_delete: Some(true),
        allow_direct: Some(true),
        discard: Some(DiscardPolicy::New),
        ..base_stream(
            format!("KV_{bucket}"),
            format!("$KV.{bucket}.>"),
            RetentionPolicy::Limits,
            s,
        )
    }
}

/// The registry: one key per participant with a per-key TTL; when a key expires the server
/// leaves a delete marker (kept for `ttl_s`) that watchers see as `down`.
pub fn registry_stream_config(ns: &str, ttl_s: u64, s: StreamSettings) -> StreamConfig {
    StreamConfig {
        allow_msg_ttl: Some(true),
        subject_delete_marker_ttl: Some(Duration::from_secs(ttl_s)),
        ..kv_stream_config(&registry_bucket(ns), 1, s)
    }
}

/// Each write after a task's creation rolls its key up to that one revision, and a
/// finished task's last one expires after its job's `keep_finished_s` (per-message TTL):
/// the store holds one record per task that is not finished or finished lately.
pub fn task_state_stream_config(s: StreamSettings) -> StreamConfig {
    StreamConfig {
        allow_msg_ttl: Some(true),
        ..kv_stream_config(TASK_STATE_BUCKET, TASK_STATE_HISTORY, s)
    }
}

/// MIG ids the brokers have taken (`mig::seen`): one key each, gone after its own TTL.
pub fn mig_seen_stream_config(s: StreamSettings) -> StreamConfig {
    use crate::broker::mig::seen;
    let s = StreamSettings {
        duplicate_window_s: s.duplicate_window_s.min(seen::KEEP.as_secs()),
        ..s
    };
    StreamConfig {
        allow_msg_ttl: Some(true),
        ..aged(
            kv_stream_config(seen::BUCKET, 1, s),
            seen::MAX_AGE.as_secs(),
            seen::MAX_BYTES,
        )
    }
}

/// A durable pull consumer of `filter` from the start of the stream, every delivery
/// acked within `ack_wait`, redelivered without limit.
fn durable_all(name: String, filter: String, ack_wait: Duration) -> ConsumerConfig {
    ConsumerConfig {
        durable_name: Some(name),
        filter_subject: Some(filter),
        ack_policy: Some(AckPolicy::Explicit),
        ack_wait: Some(ack_wait),
        max_deliver: Some(-1),
        ..ConsumerConfig::default()
    }
    .deliver_from(DeliverFrom::All)
}

/// The durable pull consumer of one participant's inbox.
pub fn inbox_consumer_config(ns: &str, name: &str, ack_wait_s: u64, window: u32) -> ConsumerConfig {
    ConsumerConfig {
        max_ack_pending: Some(i64::from(window)),
        ..durable_all(
            inbox_consumer(name),
            inbox_subject(ns, name),
            Duration::from_secs(ack_wait_s),
        )
    }
}

/// How long a job consumer nobody pulls from is kept. JetStream counts it from the last
/// pull, or from the latest ack wait of a message still out (a lease being kept), so a
/// job served anywhere keeps its consumer; one nobody serves any more gives its place in
/// [`JOB_CONSUMERS`] back soon (job names come from clients).
pub const JOB_CONSUMER_INACTIVE: Duration = Duration::from_secs(600);

/// The durable pull consumer of one job: AckWait is the lease; deliveries are unlimited
/// because declines count as deliveries and attempts live in the task store. Messages out
/// are unlimited too: a task handed back for want of a taker stays out until its delay
/// has passed, and with nats-server's default of 1,000 that many such tasks stopped every
/// delivery of the job (the brokers themselves never pull more than their free slots).
/// Job names come from clients, so a job nobody has pulled for a while loses its consumer
/// (the tasks stay in the work-queue stream; the next `serve` creates it again, and it
/// delivers them all).
pub fn job_consumer_config(ns: &str, job: &str, lease_s: u64) -> ConsumerConfig {
    ConsumerConfig {
        max_ack_pending: Some(-1),
        inactive_threshold: Some(JOB_CONSUMER_INACTIVE),
        ..durable_all(
            job_consumer(job),
            job_subject(ns, job),
            Duration::from_secs(lease_s),
        )
    }
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
) -> ConsumerConfig {
    ConsumerConfig {
        max_ack_pending: Some(i64::from(window)),
        inactive_threshold: Some(Duration::from_secs(inactive_s)),
        ..durable_all(
            durable_sub_consumer(name, sub),
            filter.to_string(),
            Duration::from_secs(ack_wait_s),
        )
    }
}

/// The consumer of a plain (non-durable) subscription: named by the broker, nothing
/// acked, kept in memory on one server, and removed by JetStream `inactive` after its
/// session stops pulling.
pub fn plain_sub_config(
    consumer: &str,
    filter: &str,
    from: DeliverFrom,
    inactive: Duration,
) -> ConsumerConfig {
    ConsumerConfig {
        name: Some(consumer.to_string()),
        filter_subject: Some(filter.to_string()),
        ack_policy: Some(AckPolicy::None),
        mem_storage: Some(true),
        num_replicas: Some(1),
        inactive_threshold: Some(inactive),
        ..ConsumerConfig::default()
    }
    .deliver_from(from)
}

/// The consumer every broker shares for a tenant's MIG live events: new events only,
/// each acked once it is published on the live subject.
pub fn mig_live_consumer_config(name: &str, max_ack_pending: u32) -> ConsumerConfig {
    ConsumerConfig {
        durable_name: Some(name.to_string()),
        ack_policy: Some(AckPolicy::Explicit),
        max_ack_pending: Some(i64::from(max_ack_pending)),
        ack_wait: Some(Duration::from_secs(30)),
        ..ConsumerConfig::default()
    }
    .deliver_from(DeliverFrom::New)
}

/// What an existing stream must agree on for the broker to adopt it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// Must be equal: the broker's semantics depend on it.
    Same,
    /// The existing subject list must include every subject of ours.
    CoversSubjects,
    /// Must be set and no lower than ours: a lifetime others rely on, where none is not
    /// "no limit" but nothing at all.
    NoShorter,
    /// No limit (0 or -1), or one no lower than ours; where we set none, none.
    AtLeast,
    /// Must be off, empty or absent: the broker's writes would go elsewhere, be refused
    /// or never be acknowledged.
    Unset,
    /// May differ: an operator's tuning, kept as it is and reported.
    Tunable,
}

/// The kinds of stream whose guarantees differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A KV bucket: records the broker reads back (tasks, budgets, MIG ids, presence).
    Bucket,
    /// `AMP_TASKS_<ns>`: each accepted task's only message.
    Tasks,
    /// `AMP_INBOX_<ns>`: accepted messages until their recipient takes them.
    Inbox,
    /// Topics and dead letters, bounded by the operator's choice.
    Other,
}

fn kind(desired: &StreamConfig) -> Kind {
    if desired.name.starts_with("KV_") {
        Kind::Bucket
    } else if desired.retention == Some(RetentionPolicy::WorkQueue) {
        Kind::Tasks
    } else if desired.name.starts_with("AMP_INBOX_") {
        Kind::Inbox
    } else {
        Kind::Other
    }
}

/// A namespace stream whose content clients put there: the inbox, topics and tasks
/// (dead letters are bounded by default, buckets hold records with their own TTLs).
pub fn fed_by_clients(desired: &StreamConfig) -> bool {
    kind(desired) != Kind::Bucket && !desired.name.starts_with("AMP_DLQ_")
}

/// A stream (as the server reports it) without an age, byte or message limit.
pub fn unbounded(config: &Value) -> bool {
    ["max_age", "max_bytes", "max_msgs"]
        .iter()
        .all(|f| config.get(f).is_none_or(unset))
}

/// Fields checked whether the broker sets them or not: an operator or an earlier tool may
/// have set any of them.
const ALWAYS_CHECKED: [&str; 17] = [
    "discard",
    "storage",
    "max_age",
    "max_bytes",
    "max_msgs",
    "max_msgs_per_subject",
    "max_msg_size",
    "duplicate_window",
    "num_replicas",
    "deny_purge",
    "sealed",
    "no_ack",
    "allow_msg_counter",
    "subject_transform",
    "republish",
    "mirror",
    "sources",
];

/// Why each rule is what it is, by field and kind:
/// - a limit with discard `old` removes accepted tasks and messages, and a bucket's
///   records (a queued task, a MIG id inside its replay window), so tasks, inbox and
///   buckets keep discard `new`: full, they refuse new writes instead;
/// - `max_age` on tasks or a bucket removes records no TTL of ours has ended;
/// - `max_msgs_per_subject` removes a subject's oldest even with discard `new`: one job's
///   tasks, or one participant's unacknowledged messages;
/// - `max_msg_size` refuses a task or message the broker accepted within `max_frame`;
/// - a shorter `duplicate_window` stores a client's retry of a send or submit twice;
/// - memory storage forgets tasks and records when the server restarts;
/// - `deny_purge` makes the server refuse the rollups every task-store write carries.
fn rule(kind: Kind, field: &str) -> Rule {
    use Kind::*;
    match (field, kind) {
        ("subjects", _) => Rule::CoversSubjects,
        ("subject_delete_marker_ttl", _) => Rule::NoShorter,
        ("discard", Bucket | Tasks | Inbox) | ("storage", Bucket | Tasks) => Rule::Same,
        ("max_age", Bucket | Tasks) | ("duplicate_window", Tasks | Inbox) => Rule::AtLeast,
        ("max_msgs_per_subject" | "max_msg_size", Tasks | Inbox) | ("deny_purge", Bucket) => {
            Rule::Unset
        }
        ("sealed" | "no_ack" | "allow_msg_counter" | "subject_transform" | "republish", _)
        | ("mirror" | "sources", _) => Rule::Unset,
        ("num_replicas" | "max_age" | "max_bytes" | "max_msgs" | "max_consumers", _)
        | ("duplicate_window" | "discard" | "storage" | "deny_purge", _)
        | ("max_msgs_per_subject" | "max_msg_size", Other) => Rule::Tunable,
        _ => Rule::Same,
    }
}

/// An adopted value other than the one the broker would create.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    pub field: String,
    pub want: Value,
    pub have: Value,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` is {} where the broker would create {}",
            self.field,
            shown(&self.field, &self.have),
            shown(&self.field, &self.want)
        )
    }
}

/// Checks an existing configuration (as the server reports it) against ours. Fields
/// either side omits take the JetStream defaults (`false`, `0`, empty). Returns the
/// first incompatible field with both values, or every tunable the stream has otherwise
/// than ours.
pub fn check_compatible(
    desired: &StreamConfig,
    existing: &Value,
) -> Result<Vec<Difference>, Incompatible> {
    let kind = kind(desired);
    let desired = serde_json::to_value(desired).unwrap_or(Value::Null);
    let Some(ours) = desired.as_object() else {
        return Ok(Vec::new());
    };
    let fields = ours.keys().map(String::as_str).chain(
        ALWAYS_CHECKED
            .into_iter()
            .filter(|f| !ours.contains_key(*f)),
    );
    let mut differences = Vec::new();
    for field in fields {
        let want = ours.get(field).cloned().unwrap_or(Value::Null);
        let have = existing.get(field).cloned().unwrap_or(Value::Null);
        let rule = rule(kind, field);
        let ok = match rule {
            Rule::Tunable => true,
            Rule::Same => same(&want, &have),
            Rule::NoShorter => !unset(&have) && number(&have) >= number(&want),
            Rule::AtLeast => unset(&have) || (!unset(&want) && number(&have) >= number(&want)),
            Rule::Unset => unset(&have),
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
                field: field.to_string(),
                need: match rule {
                    Rule::Unset => "it unset".to_string(),
                    Rule::AtLeast if unset(&want) => "no limit".to_string(),
                    Rule::AtLeast => format!("no limit or at least {}", shown(field, &want)),
                    Rule::NoShorter => format!("at least {}", shown(field, &want)),
                    _ => shown(field, &want),
                },
                have: shown(field, &have),
            });
        }
        if rule != Rule::CoversSubjects && !same(&want, &have) {
            differences.push(Difference {
                field: field.to_string(),
                want,
                have,
            });
        }
    }
    Ok(differences)
}

/// Off, empty, absent, or a limit of none (`0`, `-1`).
fn unset(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64().is_some_and(|n| n <= 0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

fn number(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// Durations in seconds, the way the configuration writes them.
fn shown(field: &str, v: &Value) -> String {
    const DURATIONS: [&str; 3] = ["max_age", "duplicate_window", "subject_delete_marker_ttl"];
    match v.as_f64() {
        Some(n) if DURATIONS.contains(&field) && n > 0.0 => format!("{} s", n / 1e9),
        _ if unset(v) && !v.is_boolean() && !v.is_string() => "none".to_string(),
        _ => v.to_string(),
    }
}

/// Numbers compare by value (the server writes `-1` where we write `-1`, but may write
/// `0` as `0` or omit it), unset values as one; everything else structurally.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        _ if unset(a) && unset(b) => true,
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Incompatible {
    pub field: String,
    /// What the broker needs, in words.
    pub need: String,
    pub have: String,
}

impl std::fmt::Display for Incompatible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "field `{}` is {} but the broker needs {}",
            self.field, self.have, self.need
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_job_consumer_names_its_namespace_and_job_back() {
        let (stream, consumer) = (tasks_stream("acme"), job_consumer("render_x"));
        assert_eq!(
            job_of_consumer(&stream, &consumer),
            Some(("acme", "render_x"))
        );
        assert_eq!(job_of_consumer("AMP_INBOX_acme", &consumer), None);
        assert_eq!(job_of_consumer(&stream, "inbox_render"), None);
        assert!(is_inbox_subject(
            &inbox_subject("acme", "bob"),
            "acme",
            "bob"
        ));
        for other in [
            "amp.acme.inbox.bobby",
            "amp.acme.inbox.bo",
            "amp.acmex.inbox.bob",
        ] {
            assert!(!is_inbox_subject(other, "acme", "bob"), "{other}");
        }
    }

    /// The wire form the server receives.
    fn wire<T: serde::Serialize>(c: &T) -> Value {
        serde_json::to_value(c).expect("config serialises")
    }

    #[test]
    fn streams_follow_the_spec_mapping() {
        let s = StreamSettings::default();
        let inbox = wire(&inbox_stream_config("acme", 0, 10_000, s));
        assert_eq!(inbox["name"], "AMP_INBOX_acme");
        assert_eq!(inbox["subjects"], json!(["amp.acme.inbox.*"]));
        assert_eq!(inbox["retention"], "limits");
        assert_eq!(inbox["max_consumers"], 10_000);
        assert_eq!(inbox["discard"], "new");
        let tasks = wire(&tasks_stream_config("acme", s));
        assert_eq!(tasks["retention"], "workqueue");
        assert_eq!(tasks["discard"], "new");
        assert_eq!(tasks["subjects"], json!(["amp.acme.job.*"]));
        let topics = wire(&topics_stream_config("acme", 3600, 0, 10, s));
        assert_eq!(topics["subjects"], json!(["amp.acme.topic.>"]));
        assert_eq!(topics["max_age"], json!(3600 * 1_000_000_000u64));
        let registry = wire(&registry_stream_config("acme", 15, s));
        assert_eq!(registry["name"], "KV_AMP_REGISTRY_acme");
        assert_eq!(registry["allow_msg_ttl"], true);
        assert_eq!(
            registry["subject_delete_marker_ttl"],
            json!(15 * 1_000_000_000u64)
        );
        assert_eq!(
            wire(&task_state_stream_config(s))["max_msgs_per_subject"],
            json!(64)
        );
        let job = wire(&job_consumer_config("acme", "render", 30));
        assert_eq!(job["ack_wait"], json!(30 * 1_000_000_000u64));
        assert_eq!(job["max_deliver"], json!(-1));
        assert_eq!(
            wire(&inbox_consumer_config("acme", "w1", 30, 64))["max_ack_pending"],
            json!(64)
        );
    }

    #[test]
    fn consumer_configs_are_exactly_the_wire_form() {
        const S: u64 = 1_000_000_000;
        assert_eq!(
            wire(&inbox_consumer_config("acme", "w1", 30, 64)),
            json!({"durable_name": "inbox_w1", "filter_subject": "amp.acme.inbox.w1",
                   "deliver_policy": "all", "ack_policy": "explicit", "ack_wait": 30 * S,
                   "max_deliver": -1, "max_ack_pending": 64})
        );
        assert_eq!(
            wire(&job_consumer_config("acme", "render", 45)),
            json!({"durable_name": "job_render", "filter_subject": "amp.acme.job.render",
                   "deliver_policy": "all", "ack_policy": "explicit", "ack_wait": 45 * S,
                   "max_deliver": -1, "max_ack_pending": -1,
                   "inactive_threshold": 600 * S})
        );
        assert_eq!(
            wire(&durable_sub_config(
                "bob",
                "s1",
                "amp.acme.topic.t.*",
                30,
                128,
                600
            )),
            json!({"durable_name": "dsub_3_bob_s1", "filter_subject": "amp.acme.topic.t.*",
                   "deliver_policy": "all", "ack_policy": "explicit", "ack_wait": 30 * S,
                   "max_deliver": -1, "max_ack_pending": 128, "inactive_threshold": 600 * S})
        );
        let plain = |from| {
            wire(&plain_sub_config(
                "p1",
                "amp.acme.topic.t",
                from,
                Duration::from_secs(5),
            ))
        };
        let base = json!({"name": "p1", "filter_subject": "amp.acme.topic.t",
                          "ack_policy": "none", "mem_storage": true, "num_replicas": 1,
                          "inactive_threshold": 5 * S});
        let with = |extra: Value| {
            let mut v = base.clone();
            for (k, x) in extra.as_object().into_iter().flatten() {
                v[k] = x.clone();
            }
            v
        };
        assert_eq!(
            plain(DeliverFrom::New),
            with(json!({"deliver_policy": "new"}))
        );
        assert_eq!(
            plain(DeliverFrom::LastPerSubject),
            with(json!({"deliver_policy": "last_per_subject"}))
        );
        assert_eq!(
            plain(DeliverFrom::Sequence(7)),
            with(json!({"deliver_policy": "by_start_sequence", "opt_start_seq": 7}))
        );
        assert_eq!(
            plain(DeliverFrom::Time("2026-01-01T00:00:00.000Z".into())),
            with(json!({"deliver_policy": "by_start_time",
                        "opt_start_time": "2026-01-01T00:00:00.000Z"}))
        );
        assert_eq!(
            wire(&mig_live_consumer_config("mig_events", 1000)),
            json!({"durable_name": "mig_events", "deliver_policy": "new",
                   "ack_policy": "explicit", "ack_wait": 30 * S, "max_ack_pending": 1000})
        );
    }

    #[test]
    fn stream_configs_are_exactly_the_wire_form() {
        const S: u64 = 1_000_000_000;
        let s = StreamSettings::default();
        assert_eq!(
            wire(&topics_stream_config("acme", 3600, 0, 10, s)),
            json!({"name": "AMP_TOPICS_acme", "subjects": ["amp.acme.topic.>"],
                   "retention": "limits", "storage": "file", "num_replicas": 1,
                   "discard": "old", "duplicate_window": 120 * S, "max_age": 3600 * S,
                   "max_bytes": -1, "max_consumers": 10})
        );
        assert_eq!(
            wire(&registry_stream_config("acme", 15, s)),
            json!({"name": "KV_AMP_REGISTRY_acme", "subjects": ["$KV.AMP_REGISTRY_acme.>"],
                   "retention": "limits", "storage": "file", "num_replicas": 1,
                   "discard": "new", "max_msgs_per_subject": 1, "allow_rollup_hdrs": true,
                   "deny_delete": true, "allow_direct": true, "duplicate_window": 120 * S,
                   "allow_msg_ttl": true, "subject_delete_marker_ttl": 15 * S})
        );
    }

    #[test]
    fn durations_beyond_the_go_range_saturate_instead_of_wrapping() {
        let max = json!(i64::MAX);
        let s = StreamSettings::default();
        assert_eq!(
            wire(&inbox_consumer_config("acme", "a", u64::MAX, 64))["ack_wait"],
            max
        );
        assert_eq!(
            wire(&job_consumer_config("acme", "r", u64::MAX))["ack_wait"],
            max
        );
        assert_eq!(
            wire(&inbox_stream_config("acme", u64::MAX, 10_000, s))["max_age"],
            max
        );
        assert_eq!(
            wire(&topics_stream_config("acme", 18_446_744_074, 0, 10, s))["max_age"],
            max
        );
        assert_eq!(
            wire(&registry_stream_config("acme", u64::MAX, s))["subject_delete_marker_ttl"],
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
        let desired = inbox_stream_config("acme", 0, 10_000, StreamSettings::default());
        let mut existing = wire(&desired);
        existing["subjects"] = json!(["amp.acme.inbox.*", "legacy.>"]);
        existing["num_replicas"] = json!(3);
        existing["max_age"] = json!(86_400 * 1_000_000_000u64);
        existing["sealed"] = json!(false);
        existing["max_bytes"] = json!(1 << 30);
        let differences = check_compatible(&desired, &existing).expect("adopted");
        let mut shown: Vec<String> = differences.iter().map(ToString::to_string).collect();
        shown.sort();
        assert_eq!(
            shown,
            [
                "`max_age` is 86400 s where the broker would create none",
                "`max_bytes` is 1073741824 where the broker would create none",
                "`num_replicas` is 3 where the broker would create 1",
            ]
        );
    }

    /// Each value that breaks a guarantee of the broker, on the resource where it does:
    /// tasks or inbox messages removed before they are taken, records expiring under a
    /// queued task, rollups refused, writes stored elsewhere or never acknowledged.
    #[test]
    fn refuses_every_value_that_breaks_a_guarantee_naming_its_field() {
        const S: u64 = 1_000_000_000;
        let s = StreamSettings::default();
        let tasks = tasks_stream_config("acme", s);
        let inbox = inbox_stream_config("acme", 0, 10_000, s);
        let topics = topics_stream_config("acme", 0, 0, 10, s);
        let state = task_state_stream_config(s);
        let seen = mig_seen_stream_config(s);
        let cases: Vec<(&StreamConfig, &str, Value)> = vec![
            (&tasks, "max_age", json!(S)),
            (&tasks, "max_msgs_per_subject", json!(5)),
            (&tasks, "max_msg_size", json!(1024)),
            (&tasks, "duplicate_window", json!(10 * S)),
            (&tasks, "storage", json!("memory")),
            (&inbox, "max_msgs_per_subject", json!(10)),
            (&inbox, "max_msg_size", json!(1024)),
            (&inbox, "duplicate_window", json!(10 * S)),
            (&state, "max_age", json!(3600 * S)),
            (&state, "deny_purge", json!(true)),
            (&state, "storage", json!("memory")),
            (&state, "discard", json!("old")),
            (&seen, "max_age", json!(60 * S)),
            (&seen, "discard", json!("old")),
            (&topics, "sealed", json!(true)),
            (&topics, "no_ack", json!(true)),
            (&topics, "allow_msg_counter", json!(true)),
            (
                &topics,
                "subject_transform",
                json!({"src": ">", "dest": "x.>"}),
            ),
            (&topics, "republish", json!({"src": ">", "dest": "copy.>"})),
            (&topics, "mirror", json!({"name": "ELSEWHERE"})),
            (&topics, "sources", json!([{"name": "ELSEWHERE"}])),
        ];
        for (desired, field, value) in cases {
            let mut existing = wire(desired);
            existing[field] = value.clone();
            let e = check_compatible(desired, &existing)
                .err()
                .unwrap_or_else(|| panic!("{} adopted with {field} {value}", desired.name));
            assert_eq!(e.field, field, "{}: {e}", desired.name);
        }
    }

    #[test]
    fn names_the_field_that_prevents_adoption() {
        const S: u64 = 1_000_000_000;
        let desired = tasks_stream_config("acme", StreamSettings::default());
        let mut existing = wire(&desired);
        existing["retention"] = json!("limits");
        let e = check_compatible(&desired, &existing).expect_err("retention differs");
        assert_eq!(e.field, "retention");
        assert_eq!(
            e.to_string(),
            "field `retention` is \"limits\" but the broker needs \"workqueue\""
        );

        let desired = registry_stream_config("acme", 15, StreamSettings::default());
        let mut existing = wire(&desired);
        existing.as_object_mut().map(|o| o.remove("allow_msg_ttl"));
        assert_eq!(
            check_compatible(&desired, &existing)
                .expect_err("ttl off")
                .field,
            "allow_msg_ttl"
        );
        existing = wire(&desired);
        existing["subject_delete_marker_ttl"] = json!(0);
        assert_eq!(
            check_compatible(&desired, &existing)
                .expect_err("no markers")
                .field,
            "subject_delete_marker_ttl"
        );
        // Markers that age out before the entries do: a watch resumed within half of the
        // entries' TTL could miss an expiry.
        existing["subject_delete_marker_ttl"] = json!(14 * S);
        assert_eq!(
            check_compatible(&desired, &existing)
                .expect_err("markers shorter than the entries")
                .to_string(),
            "field `subject_delete_marker_ttl` is 14 s but the broker needs at least 15 s"
        );
        existing["subject_delete_marker_ttl"] = json!(60 * S);
        let kept = check_compatible(&desired, &existing).expect("longer markers");
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert_eq!(kept[0].field, "subject_delete_marker_ttl");
        existing = wire(&desired);
        existing["subjects"] = json!(["$KV.OTHER.>"]);
        assert_eq!(
            check_compatible(&desired, &existing)
                .expect_err("subjects")
                .field,
            "subjects"
        );
    }
}
