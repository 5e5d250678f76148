//! Consumers with the 2.9+ API: `CONSUMER.CREATE.<stream>.<name>[.<filter>]` with an
//! `action`, durable and ephemeral, pull and push; info, delete and names.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::api::{ApiPrefix, Request, validate_name};
use super::error::JsError;
use super::wire::{Extra, opt_nanos, vec_nanos, wire_enum};

wire_enum!(
    /// Where in the stream a new consumer starts.
    DeliverPolicy {
        All = "all",
        Last = "last",
        New = "new",
        ByStartSequence = "by_start_sequence",
        ByStartTime = "by_start_time",
        LastPerSubject = "last_per_subject",
    }
);
wire_enum!(
    /// Which deliveries must be acknowledged.
    AckPolicy { None = "none", All = "all", Explicit = "explicit" }
);
wire_enum!(
    /// Deliver as fast as possible, or at the pace messages were stored.
    ReplayPolicy { Instant = "instant", Original = "original" }
);

/// A consumer's configuration; unset fields take the server's defaults, unknown fields
/// are kept in `extra` so that a config read back round-trips.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConsumerConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Set (equal to `name`) for a durable consumer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub durable_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deliver_policy: Option<DeliverPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opt_start_seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opt_start_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_policy: Option<AckPolicy>,
    #[serde(default, with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub ack_wait: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_deliver: Option<i64>,
    #[serde(default, with = "vec_nanos", skip_serializing_if = "Vec::is_empty")]
    pub backoff: Vec<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter_subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter_subjects: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_policy: Option<ReplayPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_bps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_freq: Option<String>,
    /// Pull: how many pull requests may wait at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_waiting: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ack_pending: Option<i64>,
    /// Push: the server asks for flow-control replies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<bool>,
    /// Push: heartbeats when idle.
    #[serde(default, with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub idle_heartbeat: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers_only: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch: Option<i64>,
    #[serde(default, with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub max_expires: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<i64>,
    /// Push consumers deliver here; pull consumers have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deliver_subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deliver_group: Option<String>,
    /// An ephemeral consumer is removed after this long without interest.
    #[serde(default, with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub inactive_threshold: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_replicas: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_storage: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ConsumerConfig {
    /// A durable pull consumer with explicit acks.
    pub fn durable_pull(name: &str) -> ConsumerConfig {
        ConsumerConfig {
            name: Some(name.to_string()),
            durable_name: Some(name.to_string()),
            ack_policy: Some(AckPolicy::Explicit),
            ..ConsumerConfig::default()
        }
    }

    /// A durable push consumer delivering to `deliver_subject`, explicit acks.
    pub fn durable_push(name: &str, deliver_subject: &str) -> ConsumerConfig {
        ConsumerConfig {
            deliver_subject: Some(deliver_subject.to_string()),
            ..ConsumerConfig::durable_pull(name)
        }
    }

    /// The name the create subject carries: `name`, else `durable_name`.
    pub fn effective_name(&self) -> Option<&str> {
        self.name
            .as_deref()
            .or(self.durable_name.as_deref())
            .filter(|n| !n.is_empty())
    }
}

/// Where a new consumer starts: a deliver policy together with the option it needs, so
/// a by-sequence start always has its sequence and a by-time start its time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliverFrom {
    All,
    Last,
    New,
    LastPerSubject,
    /// `by_start_sequence` from this stream sequence.
    Sequence(u64),
    /// `by_start_time` from this RFC 3339 time.
    Time(String),
}

impl ConsumerConfig {
    /// Sets `deliver_policy` with its `opt_start_seq` / `opt_start_time` (clearing the other).
    pub fn deliver_from(mut self, from: DeliverFrom) -> ConsumerConfig {
        self.opt_start_seq = None;
        self.opt_start_time = None;
        self.deliver_policy = Some(match from {
            DeliverFrom::All => DeliverPolicy::All,
            DeliverFrom::Last => DeliverPolicy::Last,
            DeliverFrom::New => DeliverPolicy::New,
            DeliverFrom::LastPerSubject => DeliverPolicy::LastPerSubject,
            DeliverFrom::Sequence(seq) => {
                self.opt_start_seq = Some(seq);
                DeliverPolicy::ByStartSequence
            }
            DeliverFrom::Time(time) => {
                self.opt_start_time = Some(time);
                DeliverPolicy::ByStartTime
            }
        });
        self
    }

    /// Where this configuration starts, if it says so in a way [`DeliverFrom`] expresses.
    pub fn start(&self) -> Option<DeliverFrom> {
        Some(match self.deliver_policy.as_ref()? {
            DeliverPolicy::All => DeliverFrom::All,
            DeliverPolicy::Last => DeliverFrom::Last,
            DeliverPolicy::New => DeliverFrom::New,
            DeliverPolicy::LastPerSubject => DeliverFrom::LastPerSubject,
            DeliverPolicy::ByStartSequence => DeliverFrom::Sequence(self.opt_start_seq?),
            DeliverPolicy::ByStartTime => DeliverFrom::Time(self.opt_start_time.clone()?),
            DeliverPolicy::Other(_) => return None,
        })
    }
}

wire_enum!(
    /// `create` fails if the consumer exists, `update` if it does not; `""` does either.
    ConsumerAction { CreateOrUpdate = "", Create = "create", Update = "update" }
);

#[derive(Serialize)]
struct CreateConsumerRequest<'a> {
    stream_name: &'a str,
    config: &'a ConsumerConfig,
    #[serde(skip_serializing_if = "is_create_or_update")]
    action: &'a ConsumerAction,
}

fn is_create_or_update(a: &&ConsumerAction) -> bool {
    **a == ConsumerAction::CreateOrUpdate
}

/// A consumer's position in its stream.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SequenceInfo {
    #[serde(default)]
    pub consumer_seq: u64,
    #[serde(default)]
    pub stream_seq: u64,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `CONSUMER.CREATE/INFO` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConsumerInfo {
    pub stream_name: String,
    pub name: String,
    #[serde(default)]
    pub created: String,
    pub config: ConsumerConfig,
    #[serde(default)]
    pub delivered: SequenceInfo,
    #[serde(default)]
    pub ack_floor: SequenceInfo,
    #[serde(default)]
    pub num_ack_pending: u64,
    #[serde(default)]
    pub num_redelivered: u64,
    #[serde(default)]
    pub num_waiting: u64,
    #[serde(default)]
    pub num_pending: u64,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ApiPrefix {
    /// `CONSUMER.CREATE.<stream>[.<name>[.<filter>]]` → [`ConsumerInfo`]. Without a
    /// name the server names an ephemeral consumer; a single literal filter subject is
    /// also put in the subject, where permissions can see it.
    pub fn consumer_create(
        &self,
        stream: &str,
        config: &ConsumerConfig,
        action: ConsumerAction,
    ) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        let mut suffix = format!("CONSUMER.CREATE.{stream}");
        if let Some(name) = config.effective_name() {
            validate_name("consumer", name)?;
            suffix.push('.');
            suffix.push_str(name);
            if let Some(filter) = config.filter_subject.as_deref()
                && config.filter_subjects.as_ref().is_none_or(|f| f.is_empty())
                && !filter.is_empty()
                && filter.split('.').all(super::api::is_token)
            {
                suffix.push('.');
                suffix.push_str(filter);
            }
        }
        let body = CreateConsumerRequest {
            stream_name: stream,
            config,
            action: &action,
        };
        Ok(Request::json(self.subject(&suffix), &body))
    }

    /// `CONSUMER.INFO.<stream>.<name>` → [`ConsumerInfo`].
    pub fn consumer_info(&self, stream: &str, consumer: &str) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        validate_name("consumer", consumer)?;
        Ok(Request::new(
            self.subject(&format!("CONSUMER.INFO.{stream}.{consumer}")),
            Vec::new(),
        ))
    }

    /// `CONSUMER.DELETE.<stream>.<name>` → [`SuccessResponse`](super::api::SuccessResponse).
    pub fn consumer_delete(&self, stream: &str, consumer: &str) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        validate_name("consumer", consumer)?;
        Ok(Request::new(
            self.subject(&format!("CONSUMER.DELETE.{stream}.{consumer}")),
            Vec::new(),
        ))
    }

    /// `CONSUMER.NAMES.<stream>` from `offset` → [`NamesPage`](super::stream::NamesPage).
    pub fn consumer_names(&self, stream: &str, offset: u64) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        Ok(Request::json(
            self.subject(&format!("CONSUMER.NAMES.{stream}")),
            &serde_json::json!({ "offset": offset }),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_subject_carries_name_and_single_literal_filter() {
        let api = ApiPrefix::new();
        let mut cfg = ConsumerConfig::durable_pull("C");
        cfg.filter_subject = Some("orders.new".into());
        let r = api
            .consumer_create("S", &cfg, ConsumerAction::Create)
            .expect("req");
        assert_eq!(r.subject, "$JS.API.CONSUMER.CREATE.S.C.orders.new");
        let body: serde_json::Value = serde_json::from_slice(&r.payload).expect("json");
        assert_eq!(body["action"], "create");
        assert_eq!(body["stream_name"], "S");
        assert_eq!(body["config"]["durable_name"], "C");
        assert_eq!(body["config"]["ack_policy"], "explicit");

        cfg.filter_subject = Some("orders.*".into());
        let r = api
            .consumer_create("S", &cfg, ConsumerAction::CreateOrUpdate)
            .expect("req");
        assert_eq!(r.subject, "$JS.API.CONSUMER.CREATE.S.C");
        let body: serde_json::Value = serde_json::from_slice(&r.payload).expect("json");
        assert!(body.get("action").is_none());

        let eph = ConsumerConfig::default();
        let r = api
            .consumer_create("S", &eph, ConsumerAction::Create)
            .expect("req");
        assert_eq!(r.subject, "$JS.API.CONSUMER.CREATE.S");
        let bad = ConsumerConfig::durable_pull("a.b");
        assert!(
            api.consumer_create("S", &bad, ConsumerAction::Create)
                .is_err()
        );
    }

    #[test]
    fn consumer_info_round_trips_unknown_fields() {
        let text = r#"{"type":"io.nats.jetstream.api.v1.consumer_create_response","stream_name":"S","name":"C","created":"2026-01-01T00:00:00Z","config":{"durable_name":"C","name":"C","deliver_policy":"all","ack_policy":"explicit","ack_wait":30000000000,"max_deliver":-1,"replay_policy":"instant","max_waiting":512,"max_ack_pending":1000,"num_replicas":0,"priority_policy":"none"},"delivered":{"consumer_seq":0,"stream_seq":0},"ack_floor":{"consumer_seq":0,"stream_seq":0},"num_ack_pending":0,"num_redelivered":0,"num_waiting":0,"num_pending":5,"ts":"2026-01-01T00:00:00Z"}"#;
        let info: ConsumerInfo = serde_json::from_str(text).expect("parse");
        assert_eq!(info.num_pending, 5);
        assert_eq!(info.config.ack_wait, Some(Duration::from_secs(30)));
        assert_eq!(
            info.config.extra.get("priority_policy"),
            Some(&serde_json::json!("none"))
        );
        let back = serde_json::to_value(&info).expect("encode");
        let orig: serde_json::Value = serde_json::from_str(text).expect("value");
        assert_eq!(back, orig);
    }
}
