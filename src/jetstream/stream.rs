//! Streams: configuration and info, create/update/info/delete/purge, names and list,
//! stored-message get (`STREAM.MSG.GET` and `DIRECT.GET`) and message delete.

use std::time::Duration;

use base64::Engine;
use serde::{Deserialize, Serialize};

use super::api::{ApiPrefix, Request, check_error, parse_response, validate_name};
use super::error::{ApiError, JsError};
use super::wire::{Extra, opt_nanos, wire_enum};
use crate::proto::headers::HeaderMap;

wire_enum!(
    /// When messages leave a stream.
    RetentionPolicy { Limits = "limits", Interest = "interest", WorkQueue = "workqueue" }
);
wire_enum!(
    /// Where a stream or consumer keeps its state.
    StorageType { File = "file", Memory = "memory" }
);
wire_enum!(
    /// What a full stream drops.
    DiscardPolicy { Old = "old", New = "new" }
);

/// A stream's configuration. Fields left `None` are not sent (the server's default
/// applies); fields this type does not name are kept in `extra`, so a config read from
/// the server can be changed and sent back as an update without losing anything.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamConfig {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subjects: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<RetentionPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_consumers: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_msgs: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<i64>,
    #[serde(default, with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub max_age: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_msgs_per_subject: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_msg_size: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discard: Option<DiscardPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<StorageType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_replicas: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_ack: Option<bool>,
    #[serde(default, with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub duplicate_window: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_delete: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_purge: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_rollup_hdrs: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_direct: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror_direct: Option<bool>,
    /// Per-message TTL (`Nats-TTL`), ADR-43; cannot be turned off once on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_msg_ttl: Option<bool>,
    /// How long subject delete markers live (requires `allow_msg_ttl`).
    #[serde(default, with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub subject_delete_marker_ttl: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl StreamConfig {
    pub fn new(name: &str, subjects: &[&str]) -> StreamConfig {
        StreamConfig {
            name: name.to_string(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            ..StreamConfig::default()
        }
    }
}

/// A stream's counters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamState {
    #[serde(default)]
    pub messages: u64,
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub first_seq: u64,
    #[serde(default)]
    pub last_seq: u64,
    #[serde(default)]
    pub num_subjects: u64,
    #[serde(default)]
    pub num_deleted: u64,
    #[serde(default)]
    pub consumer_count: u64,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `STREAM.CREATE/UPDATE/INFO` reply, and an element of `STREAM.LIST`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamInfo {
    pub config: StreamConfig,
    #[serde(default)]
    pub created: String,
    #[serde(default)]
    pub state: StreamState,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Which messages a purge removes; all when empty.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PurgeRequest {
    /// Only messages on subjects matching this filter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// Everything below this sequence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// Keep this many of the newest messages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PurgeResponse {
    #[serde(default)]
    pub success: bool,
    #[serde(default)]
    pub purged: u64,
}

/// One page of `STREAM.NAMES` / `CONSUMER.NAMES`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct NamesPage {
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub offset: u64,
    #[serde(default)]
    pub limit: u64,
    #[serde(default, alias = "consumers")]
    pub streams: Option<Vec<String>>,
}

impl NamesPage {
    pub fn names(&self) -> &[String] {
        self.streams.as_deref().unwrap_or(&[])
    }

    /// The offset of the next page, or `None` when this was the last.
    pub fn next_offset(&self) -> Option<u64> {
        let next = self.offset.saturating_add(self.names().len() as u64);
        (next < self.total && !self.names().is_empty()).then_some(next)
    }
}

/// One page of `STREAM.LIST`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct StreamListPage {
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub offset: u64,
    #[serde(default)]
    pub streams: Option<Vec<StreamInfo>>,
}

impl StreamListPage {
    pub fn next_offset(&self) -> Option<u64> {
        let n = self.streams.as_ref().map_or(0, |s| s.len() as u64);
        let next = self.offset.saturating_add(n);
        (next < self.total && n > 0).then_some(next)
    }
}

/// Which stored message to fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MsgSelector {
    /// The message with this stream sequence.
    Sequence(u64),
    /// The newest message on this subject.
    LastBySubject(String),
    /// The first message on this subject at or after sequence `from`.
    NextBySubject { subject: String, from: u64 },
}

impl MsgSelector {
    fn body(&self) -> serde_json::Value {
        match self {
            MsgSelector::Sequence(seq) => serde_json::json!({ "seq": seq }),
            MsgSelector::LastBySubject(s) => serde_json::json!({ "last_by_subj": s }),
            MsgSelector::NextBySubject { subject, from } => {
                serde_json::json!({ "next_by_subj": subject, "seq": from })
            }
        }
    }
}

/// A message read back from a stream.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredMessage {
    pub subject: String,
    pub sequence: u64,
    /// RFC 3339 time the stream stored it.
    pub time: String,
    pub headers: Option<HeaderMap>,
    pub payload: Vec<u8>,
}

impl StoredMessage {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.as_ref().and_then(|h| h.get(name))
    }
}

#[derive(Deserialize)]
struct RawStoredMessage {
    subject: String,
    seq: u64,
    #[serde(default)]
    time: String,
    #[serde(default)]
    hdrs: Option<String>,
    #[serde(default)]
    data: Option<String>,
}

#[derive(Deserialize)]
struct MsgGetResponse {
    message: RawStoredMessage,
}

/// Stream administration requests, each paired with the parser of its reply.
impl ApiPrefix {
    /// `$JS.API.INFO` → [`AccountInfo`](super::AccountInfo).
    pub fn account_info(&self) -> Request {
        Request::new(self.subject("INFO"), Vec::new())
    }

    /// `STREAM.CREATE.<name>` → [`StreamInfo`].
    pub fn stream_create(&self, config: &StreamConfig) -> Result<Request, JsError> {
        validate_name("stream", &config.name)?;
        Ok(Request::json(
            self.subject(&format!("STREAM.CREATE.{}", config.name)),
            config,
        ))
    }

    /// `STREAM.UPDATE.<name>` → [`StreamInfo`].
    pub fn stream_update(&self, config: &StreamConfig) -> Result<Request, JsError> {
        validate_name("stream", &config.name)?;
        Ok(Request::json(
            self.subject(&format!("STREAM.UPDATE.{}", config.name)),
            config,
        ))
    }

    /// `STREAM.INFO.<name>` → [`StreamInfo`].
    pub fn stream_info(&self, stream: &str) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        Ok(Request::new(
            self.subject(&format!("STREAM.INFO.{stream}")),
            Vec::new(),
        ))
    }

    /// `STREAM.INFO.<name>` with the message count of every subject matching `filter`
    /// (in `state.subjects`) → [`StreamInfo`].
    pub fn stream_info_subjects(&self, stream: &str, filter: &str) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        Ok(Request::json(
            self.subject(&format!("STREAM.INFO.{stream}")),
            &serde_json::json!({ "subjects_filter": filter }),
        ))
    }

    /// `STREAM.DELETE.<name>` → [`SuccessResponse`](super::api::SuccessResponse).
    pub fn stream_delete(&self, stream: &str) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        Ok(Request::new(
            self.subject(&format!("STREAM.DELETE.{stream}")),
            Vec::new(),
        ))
    }

    /// `STREAM.PURGE.<name>` → [`PurgeResponse`].
    pub fn stream_purge(&self, stream: &str, purge: &PurgeRequest) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        if purge.seq.is_some() && purge.keep.is_some() {
            return Err(JsError::Invalid("purge takes seq or keep, not both".into()));
        }
        Ok(Request::json(
            self.subject(&format!("STREAM.PURGE.{stream}")),
            purge,
        ))
    }

    /// `STREAM.NAMES` from `offset`, optionally only streams listening on `subject` →
    /// [`NamesPage`].
    pub fn stream_names(&self, subject: Option<&str>, offset: u64) -> Request {
        let mut body = serde_json::json!({ "offset": offset });
        if let Some(s) = subject {
            body["subject"] = s.into();
        }
        Request::json(self.subject("STREAM.NAMES"), &body)
    }

    /// `STREAM.LIST` from `offset` → [`StreamListPage`].
    pub fn stream_list(&self, offset: u64) -> Request {
        Request::json(
            self.subject("STREAM.LIST"),
            &serde_json::json!({ "offset": offset }),
        )
    }

    /// `STREAM.MSG.GET.<name>` → [`parse_msg_get`].
    pub fn msg_get(&self, stream: &str, which: &MsgSelector) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        Ok(Request::json(
            self.subject(&format!("STREAM.MSG.GET.{stream}")),
            &which.body(),
        ))
    }

    /// `DIRECT.GET.<name>` (or `DIRECT.GET.<name>.<subject>` for last-by-subject, which
    /// needs no body) → [`parse_direct_get`]. The stream needs `allow_direct`.
    pub fn direct_get(&self, stream: &str, which: &MsgSelector) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        Ok(match which {
            MsgSelector::LastBySubject(subject) => Request::new(
                self.subject(&format!("DIRECT.GET.{stream}.{subject}")),
                Vec::new(),
            ),
            other => Request::json(self.subject(&format!("DIRECT.GET.{stream}")), &other.body()),
        })
    }

    /// `STREAM.MSG.DELETE.<name>`; `erase` overwrites the stored bytes →
    /// [`SuccessResponse`](super::api::SuccessResponse).
    pub fn msg_delete(&self, stream: &str, seq: u64, erase: bool) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        let body = if erase {
            serde_json::json!({ "seq": seq })
        } else {
            serde_json::json!({ "seq": seq, "no_erase": true })
        };
        Ok(Request::json(
            self.subject(&format!("STREAM.MSG.DELETE.{stream}")),
            &body,
        ))
    }
}

/// Decodes a `STREAM.MSG.GET` reply (headers and data come base64-encoded).
pub fn parse_msg_get(payload: &[u8]) -> Result<StoredMessage, JsError> {
    let r: MsgGetResponse = parse_response(payload)?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let decode = |s: Option<String>| -> Result<Vec<u8>, JsError> {
        match s {
            Some(s) => b64
                .decode(s.as_bytes())
                .map_err(|e| JsError::Malformed(format!("message base64: {e}"))),
            None => Ok(Vec::new()),
        }
    };
    let hdrs = decode(r.message.hdrs)?;
    let headers = if hdrs.is_empty() {
        None
    } else {
        Some(
            HeaderMap::parse(&hdrs)
                .map_err(|e| JsError::Malformed(format!("message headers: {e:?}")))?,
        )
    };
    Ok(StoredMessage {
        subject: r.message.subject,
        sequence: r.message.seq,
        time: r.message.time,
        headers,
        payload: decode(r.message.data)?,
    })
}

/// Decodes a `DIRECT.GET` reply: the message itself, its origin in `Nats-Subject`,
/// `Nats-Sequence` and `Nats-Time-Stamp` headers; or a status (404 not found, 408/400
/// bad request) with no body.
pub fn parse_direct_get(
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> Result<StoredMessage, JsError> {
    let Some(h) = headers else {
        // A JSON error body (e.g. the stream does not exist) rather than a message.
        check_error(payload)?;
        return Err(JsError::Malformed(
            "direct get reply without headers".into(),
        ));
    };
    if let Some(status) = h.status() {
        let description = h.description().unwrap_or_default().to_string();
        let e = ApiError {
            code: status,
            err_code: if status == 404 {
                super::error::ERR_MESSAGE_NOT_FOUND
            } else {
                0
            },
            description,
        };
        return Err(JsError::from_api(e));
    }
    let subject = h
        .get("Nats-Subject")
        .ok_or_else(|| JsError::Malformed("direct get reply without Nats-Subject".into()))?
        .to_string();
    let sequence = h
        .get("Nats-Sequence")
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| JsError::Malformed("direct get reply without Nats-Sequence".into()))?;
    let time = h.get("Nats-Time-Stamp").unwrap_or_default().to_string();
    Ok(StoredMessage {
        subject,
        sequence,
        time,
        headers: Some(h.clone()),
        payload: payload.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_config_read_from_the_server_round_trips_unknown_fields() {
        let text = r#"{"name":"S","subjects":["a.>"],"retention":"limits","max_consumers":-1,"max_msgs":-1,"max_bytes":-1,"max_age":0,"max_msgs_per_subject":-1,"max_msg_size":-1,"discard":"old","storage":"file","num_replicas":1,"duplicate_window":120000000000,"compression":"none","allow_direct":false,"mirror_direct":false,"sealed":false,"deny_delete":false,"deny_purge":false,"allow_rollup_hdrs":false,"allow_msg_ttl":true,"subject_delete_marker_ttl":60000000000,"consumer_limits":{},"future_field":{"x":[1,2]}}"#;
        let cfg: StreamConfig = serde_json::from_str(text).expect("parse");
        assert_eq!(cfg.duplicate_window, Some(Duration::from_secs(120)));
        assert_eq!(cfg.subject_delete_marker_ttl, Some(Duration::from_secs(60)));
        assert_eq!(cfg.storage, Some(StorageType::File));
        assert!(cfg.extra.contains_key("future_field"));
        let back: serde_json::Value = serde_json::to_value(&cfg).expect("encode");
        let orig: serde_json::Value = serde_json::from_str(text).expect("value");
        assert_eq!(back, orig);
    }

    #[test]
    fn requests_name_the_stream_in_the_subject() {
        let api = ApiPrefix::domain("hub").expect("domain");
        let r = api
            .stream_create(&StreamConfig::new("S", &["s.>"]))
            .expect("req");
        assert_eq!(r.subject, "$JS.hub.API.STREAM.CREATE.S");
        assert_eq!(r.payload, br#"{"name":"S","subjects":["s.>"]}"#);
        let purge = PurgeRequest {
            filter: Some("s.a".into()),
            keep: Some(2),
            seq: None,
        };
        let r = api.stream_purge("S", &purge).expect("req");
        assert_eq!(r.payload, br#"{"filter":"s.a","keep":2}"#);
        assert!(api.stream_info("a.b").is_err());
        let r = api
            .direct_get("S", &MsgSelector::LastBySubject("s.x".into()))
            .expect("req");
        assert_eq!(r.subject, "$JS.hub.API.DIRECT.GET.S.s.x");
        assert!(r.payload.is_empty());
        let r = api
            .msg_get(
                "S",
                &MsgSelector::NextBySubject {
                    subject: "s.x".into(),
                    from: 3,
                },
            )
            .expect("req");
        let body: serde_json::Value = serde_json::from_slice(&r.payload).expect("json");
        assert_eq!(body, serde_json::json!({"next_by_subj":"s.x","seq":3}));
    }

    #[test]
    fn msg_get_reply_decodes_base64_headers_and_data() {
        let reply = br#"{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","message":{"subject":"s.a","seq":7,"hdrs":"TkFUUy8xLjANCkZvbzogYmFyDQoNCg==","data":"aGVsbG8=","time":"2026-01-01T00:00:00Z"}}"#;
        let m = parse_msg_get(reply).expect("message");
        assert_eq!(m.subject, "s.a");
        assert_eq!(m.sequence, 7);
        assert_eq!(m.payload, b"hello");
        assert_eq!(m.header("Foo"), Some("bar"));
        let bad = br#"{"message":{"subject":"s","seq":1,"data":"***"}}"#;
        assert!(matches!(parse_msg_get(bad), Err(JsError::Malformed(_))));
    }

    #[test]
    fn names_pages_know_when_they_are_done() {
        let p: NamesPage =
            serde_json::from_str(r#"{"total":3,"offset":0,"limit":2,"streams":["a","b"]}"#)
                .expect("page");
        assert_eq!(p.next_offset(), Some(2));
        let p: NamesPage =
            serde_json::from_str(r#"{"total":0,"offset":0,"limit":1024,"streams":null}"#)
                .expect("page");
        assert_eq!(p.next_offset(), None);
        let c: NamesPage =
            serde_json::from_str(r#"{"total":1,"offset":0,"limit":1024,"consumers":["c"]}"#)
                .expect("page");
        assert_eq!(c.names(), ["c".to_string()]);
    }
}
