//! Key/value buckets (ADR-8) over a stream `KV_<bucket>` with subjects `$KV.<bucket>.>`:
//! bucket config, the requests of get/put/create/update/delete/purge, entry decoding
//! (delete and purge operations, TTL expiry markers) and [`KvWatcher`], an ordered
//! push consumer as a sans-IO state machine.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::ack::AckMetadata;
use super::api::{ApiPrefix, Request, parse_response};
use super::consumer::{AckPolicy, ConsumerAction, ConsumerConfig, ConsumerInfo, DeliverPolicy};
use super::error::JsError;
use super::message::Delivery;
use super::publish::{MARKER_REASON, MsgTtl, PublishOptions, ROLLUP, publish_request};
use super::pull::{Inbound, classify};
use super::stream::{
    DiscardPolicy, MsgSelector, StorageType, StoredMessage, StreamConfig, StreamInfo,
    parse_direct_get, parse_msg_get,
};
use super::wire::Extra;
use crate::proto::headers::HeaderMap;

pub const KV_OPERATION: &str = "KV-Operation";
pub const MAX_HISTORY: u8 = 64;

/// A bucket's configuration, mapped onto its stream's.
#[derive(Debug, Clone, PartialEq)]
pub struct KvConfig {
    pub bucket: String,
    pub description: Option<String>,
    /// Values kept per key, 1 to 64.
    pub history: u8,
    /// How long a value lives (the stream's `max_age`); `None` for ever.
    pub ttl: Option<Duration>,
    pub max_bytes: Option<i64>,
    pub max_value_size: Option<i64>,
    pub storage: StorageType,
    pub replicas: i64,
    /// Allow per-key TTLs (`Nats-TTL`) without subject delete markers.
    pub allow_msg_ttl: bool,
    /// Leave a delete marker, living this long, when a key's last value ages out or
    /// its TTL expires (the stream's `subject_delete_marker_ttl`; implies
    /// `allow_msg_ttl`). Watchers see these markers.
    pub limit_marker_ttl: Option<Duration>,
    /// Further stream settings (compression, placement, republish, metadata...) sent
    /// as they are; a config read back from the stream keeps what it does not name here.
    pub extra: Extra,
}

impl KvConfig {
    pub fn new(bucket: &str) -> KvConfig {
        KvConfig {
            bucket: bucket.to_string(),
            description: None,
            history: 1,
            ttl: None,
            max_bytes: None,
            max_value_size: None,
            storage: StorageType::File,
            replicas: 1,
            allow_msg_ttl: false,
            limit_marker_ttl: None,
            extra: Extra::new(),
        }
    }

    /// The stream that implements the bucket.
    pub fn stream_config(&self) -> Result<StreamConfig, JsError> {
        validate_bucket(&self.bucket)?;
        if self.history == 0 || self.history > MAX_HISTORY {
            return Err(JsError::Invalid(format!(
                "KV history must be 1..={MAX_HISTORY}"
            )));
        }
        let two_minutes = Duration::from_secs(120);
        let duplicate_window = match self.ttl {
            Some(ttl) if !ttl.is_zero() && ttl < two_minutes => ttl,
            _ => two_minutes,
        };
        let markers = self.limit_marker_ttl.filter(|d| !d.is_zero());
        Ok(StreamConfig {
            name: stream_name(&self.bucket),
            description: self.description.clone(),
            subjects: vec![format!("$KV.{}.>", self.bucket)],
            max_msgs_per_subject: Some(i64::from(self.history)),
            max_bytes: Some(self.max_bytes.unwrap_or(-1)),
            max_age: Some(self.ttl.unwrap_or_default()),
            max_msg_size: Some(self.max_value_size.unwrap_or(-1)),
            storage: Some(self.storage.clone()),
            num_replicas: Some(self.replicas.max(1)),
            allow_rollup_hdrs: Some(true),
            deny_delete: Some(true),
            duplicate_window: Some(duplicate_window),
            max_msgs: Some(-1),
            max_consumers: Some(-1),
            allow_direct: Some(true),
            discard: Some(DiscardPolicy::New),
            allow_msg_ttl: (self.allow_msg_ttl || markers.is_some()).then_some(true),
            subject_delete_marker_ttl: markers,
            extra: self.extra.clone(),
            ..StreamConfig::default()
        })
    }

    /// The bucket config a KV stream's config describes (e.g. from `STREAM.INFO`);
    /// stream fields with no bucket meaning stay in `extra`, so
    /// `from_stream_config(c)?.stream_config()` recreates the bucket's stream.
    pub fn from_stream_config(stream: &StreamConfig) -> Result<KvConfig, JsError> {
        let bucket = stream
            .name
            .strip_prefix("KV_")
            .ok_or_else(|| JsError::Invalid(format!("{} is not a KV stream", stream.name)))?;
        let history = stream
            .max_msgs_per_subject
            .and_then(|h| u8::try_from(h).ok())
            .filter(|h| (1..=MAX_HISTORY).contains(h))
            .unwrap_or(1);
        let markers = stream.subject_delete_marker_ttl.filter(|d| !d.is_zero());
        Ok(KvConfig {
            bucket: bucket.to_string(),
            description: stream.description.clone(),
            history,
            ttl: stream.max_age.filter(|d| !d.is_zero()),
            max_bytes: stream.max_bytes.filter(|b| *b >= 0),
            max_value_size: stream.max_msg_size.filter(|b| *b >= 0),
            storage: stream.storage.clone().unwrap_or(StorageType::File),
            replicas: stream.num_replicas.unwrap_or(1).max(1),
            allow_msg_ttl: stream.allow_msg_ttl.unwrap_or(false) && markers.is_none(),
            limit_marker_ttl: markers,
            extra: stream.extra.clone(),
        })
    }
}

pub fn stream_name(bucket: &str) -> String {
    format!("KV_{bucket}")
}

/// Bucket names: letters, digits, `_` and `-`.
pub fn validate_bucket(bucket: &str) -> Result<(), JsError> {
    let ok = !bucket.is_empty()
        && bucket
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(JsError::Invalid(format!("invalid bucket name {bucket:?}")))
    }
}

/// Keys: letters, digits and `-/_=.`, not starting or ending with a dot.
pub fn validate_key(key: &str) -> Result<(), JsError> {
    let ok = !key.is_empty()
        && !key.starts_with('.')
        && !key.ends_with('.')
        && !key.contains("..")
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-/_=.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(JsError::Invalid(format!("invalid key {key:?}")))
    }
}

/// A watch filter: a key, or a pattern with `*` tokens and a final `>`.
fn validate_key_pattern(pattern: &str) -> Result<(), JsError> {
    let ok = !pattern.is_empty()
        && pattern.split('.').enumerate().all(|(i, t)| {
            let last = i == pattern.split('.').count() - 1;
            (t == "*")
                || (t == ">" && last)
                || (!t.is_empty()
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-/_=".contains(&b)))
        });
    if ok {
        Ok(())
    } else {
        Err(JsError::Invalid(format!("invalid key pattern {pattern:?}")))
    }
}

/// What an entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOperation {
    Put,
    Delete,
    Purge,
}

/// Why the server left a subject delete marker (ADR-43).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkerReason {
    /// The key's last value aged out or its per-key TTL expired.
    MaxAge,
    /// Removed by a message delete.
    Remove,
    /// Removed by a stream purge.
    Purge,
    Other(String),
}

/// One revision of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEntry {
    pub bucket: String,
    pub key: String,
    pub value: Vec<u8>,
    /// The stream sequence of this revision.
    pub revision: u64,
    /// Nanoseconds since the Unix epoch when it was stored (0 if unknown).
    pub created_nanos: u64,
    /// For a watch: how many later revisions were pending when this one was sent.
    pub delta: u64,
    pub operation: KvOperation,
    /// Set when this entry is a server-placed marker rather than a client's write.
    pub marker: Option<MarkerReason>,
}

impl KvEntry {
    pub fn is_deleted(&self) -> bool {
        self.operation != KvOperation::Put
    }
}

/// The operation a KV message's headers record: `KV-Operation: DEL|PURGE`, or a server
/// delete marker (`Nats-Marker-Reason`: `MaxAge` and `Purge` read as purge, `Remove`
/// as delete), else a put.
pub fn operation_of(headers: Option<&HeaderMap>) -> (KvOperation, Option<MarkerReason>) {
    let Some(h) = headers else {
        return (KvOperation::Put, None);
    };
    match h.get(KV_OPERATION).map(str::trim) {
        Some("DEL") => return (KvOperation::Delete, None),
        Some("PURGE") => return (KvOperation::Purge, None),
        _ => {}
    }
    match h.get(MARKER_REASON).map(str::trim) {
        Some("MaxAge") => (KvOperation::Purge, Some(MarkerReason::MaxAge)),
        Some("Purge") => (KvOperation::Purge, Some(MarkerReason::Purge)),
        Some("Remove") => (KvOperation::Delete, Some(MarkerReason::Remove)),
        Some(other) if !other.is_empty() => (
            KvOperation::Purge,
            Some(MarkerReason::Other(other.to_string())),
        ),
        _ => (KvOperation::Put, None),
    }
}

/// A bound bucket: names and subjects, request builders and reply parsers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    api: ApiPrefix,
    bucket: String,
    stream: String,
    prefix: String,
    direct: bool,
}

impl Kv {
    /// A handle on `bucket`, assuming the bucket allows direct gets (as all buckets
    /// created by current clients do).
    pub fn new(api: ApiPrefix, bucket: &str) -> Result<Kv, JsError> {
        validate_bucket(bucket)?;
        Ok(Kv {
            api,
            bucket: bucket.to_string(),
            stream: stream_name(bucket),
            prefix: format!("$KV.{bucket}."),
            direct: true,
        })
    }

    /// A handle from the bucket's stream info (`STREAM.INFO.KV_<bucket>`).
    pub fn from_stream_info(api: ApiPrefix, info: &StreamInfo) -> Result<Kv, JsError> {
        let bucket =
            info.config.name.strip_prefix("KV_").ok_or_else(|| {
                JsError::Invalid(format!("{} is not a KV stream", info.config.name))
            })?;
        let mut kv = Kv::new(api, bucket)?;
        kv.direct = info.config.allow_direct.unwrap_or(false);
        Ok(kv)
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    pub fn api(&self) -> &ApiPrefix {
        &self.api
    }

    /// The subject of a key: `$KV.<bucket>.<key>`.
    pub fn key_subject(&self, key: &str) -> Result<String, JsError> {
        validate_key(key)?;
        Ok(format!("{}{key}", self.prefix))
    }

    /// Where a write of `key` is published (see [`ApiPrefix::kv_write_subject`]).
    pub fn write_subject(&self, key: &str) -> Result<String, JsError> {
        validate_key(key)?;
        Ok(self.api.kv_write_subject(&self.bucket, key))
    }

    /// `STREAM.INFO.KV_<bucket>`, to bind (reply: [`StreamInfo`]).
    pub fn info_request(&self) -> Result<Request, JsError> {
        self.api.stream_info(&self.stream)
    }

    /// The latest revision of `key` (direct get when allowed) → [`Kv::parse_get`].
    pub fn get_request(&self, key: &str) -> Result<Request, JsError> {
        let which = MsgSelector::LastBySubject(self.key_subject(key)?);
        if self.direct {
            self.api.direct_get(&self.stream, &which)
        } else {
            self.api.msg_get(&self.stream, &which)
        }
    }

    /// A given revision of `key` → [`Kv::parse_get`].
    pub fn get_revision_request(&self, key: &str, revision: u64) -> Result<Request, JsError> {
        validate_key(key)?;
        let which = MsgSelector::Sequence(revision);
        if self.direct {
            self.api.direct_get(&self.stream, &which)
        } else {
            self.api.msg_get(&self.stream, &which)
        }
    }

    /// Decodes a get reply. A deleted or purged key (or an expiry marker) is an entry
    /// with that operation; a key never written is [`JsError::KeyNotFound`].
    pub fn parse_get(
        &self,
        key: &str,
        headers: Option<&HeaderMap>,
        payload: &[u8],
    ) -> Result<KvEntry, JsError> {
        let stored = if self.direct {
            parse_direct_get(headers, payload)
        } else {
            parse_msg_get(payload)
        };
        let stored = stored.map_err(|e| match e {
            JsError::MessageNotFound(_) => JsError::KeyNotFound,
            JsError::StreamNotFound(_) => JsError::BucketNotFound,
            other => other,
        })?;
        if stored.subject != format!("{}{key}", self.prefix) {
            // A revision of another key.
            return Err(JsError::KeyNotFound);
        }
        Ok(self.entry_from_stored(key, stored))
    }

    fn entry_from_stored(&self, key: &str, stored: StoredMessage) -> KvEntry {
        let (operation, marker) = operation_of(stored.headers.as_ref());
        KvEntry {
            bucket: self.bucket.clone(),
            key: key.to_string(),
            revision: stored.sequence,
            created_nanos: crate::rfc3339::parse_nanos(&stored.time)
                .and_then(|n| u64::try_from(n).ok())
                .unwrap_or(0),
            delta: 0,
            operation,
            marker,
            value: stored.payload,
        }
    }

    /// Writes a value (a publish answered by a PubAck whose `seq` is the revision).
    pub fn put_request(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<MsgTtl>,
    ) -> Result<Request, JsError> {
        let opts = PublishOptions {
            ttl,
            ..PublishOptions::default()
        };
        publish_request(&self.write_subject(key)?, None, value, &opts)
    }

    /// Writes only if the key has no message at all (`Nats-Expected-Last-Subject-Sequence: 0`).
    /// A key that exists as a delete marker fails this with
    /// [`JsError::WrongLastSequence`]; clients then read the key and, when it is deleted,
    /// retry with [`Kv::update_request`] on the marker's revision (see
    /// [`Kv::create_retry`]).
    pub fn create_request(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<MsgTtl>,
    ) -> Result<Request, JsError> {
        self.cas_request(key, value, 0, ttl)
    }

    /// After a failed create and a get of the key: the revision to retry the create
    /// on, when the key is deleted; `None` when it really exists.
    pub fn create_retry(current: &Result<KvEntry, JsError>) -> Option<u64> {
        match current {
            Ok(e) if e.is_deleted() => Some(e.revision),
            _ => None,
        }
    }

    /// Writes only if the key's latest revision is `revision` (compare-and-set).
    pub fn update_request(
        &self,
        key: &str,
        value: &[u8],
        revision: u64,
    ) -> Result<Request, JsError> {
        self.cas_request(key, value, revision, None)
    }

    /// [`Kv::update_request`] with a per-message TTL (revision 0: only if absent).
    pub fn update_ttl_request(
        &self,
        key: &str,
        value: &[u8],
        revision: u64,
        ttl: MsgTtl,
    ) -> Result<Request, JsError> {
        self.cas_request(key, value, revision, Some(ttl))
    }

    /// [`Kv::update_request`] that also drops the key's earlier revisions
    /// (`Nats-Rollup: sub`), so the key holds this one only, optionally expiring after
    /// `ttl`.
    pub fn replace_request(
        &self,
        key: &str,
        value: &[u8],
        revision: u64,
        ttl: Option<MsgTtl>,
    ) -> Result<Request, JsError> {
        let mut h = HeaderMap::new();
        h.insert(ROLLUP, "sub")
            .map_err(|e| JsError::Invalid(e.to_string()))?;
        self.cas_with(Some(&h), key, value, revision, ttl)
    }

    fn cas_request(
        &self,
        key: &str,
        value: &[u8],
        revision: u64,
        ttl: Option<MsgTtl>,
    ) -> Result<Request, JsError> {
        self.cas_with(None, key, value, revision, ttl)
    }

    fn cas_with(
        &self,
        headers: Option<&HeaderMap>,
        key: &str,
        value: &[u8],
        revision: u64,
        ttl: Option<MsgTtl>,
    ) -> Result<Request, JsError> {
        let opts = PublishOptions {
            expected_last_subject_sequence: Some(revision),
            ttl,
            ..PublishOptions::default()
        };
        publish_request(&self.write_subject(key)?, headers, value, &opts)
    }

    /// A delete marker (`KV-Operation: DEL`), history kept; optionally only if the
    /// latest revision is `revision`.
    pub fn delete_request(&self, key: &str, revision: Option<u64>) -> Result<Request, JsError> {
        self.delete_ttl_request(key, revision, None)
    }

    /// [`Kv::delete_request`] whose marker expires after `ttl`, as the value it replaces
    /// would have (a bucket whose keys each carry `Nats-TTL`).
    pub fn delete_ttl_request(
        &self,
        key: &str,
        revision: Option<u64>,
        ttl: Option<MsgTtl>,
    ) -> Result<Request, JsError> {
        let mut h = HeaderMap::new();
        h.insert(KV_OPERATION, "DEL")
            .map_err(|e| JsError::Invalid(e.to_string()))?;
        let opts = PublishOptions {
            expected_last_subject_sequence: revision,
            ttl,
            ..PublishOptions::default()
        };
        publish_request(&self.write_subject(key)?, Some(&h), b"", &opts)
    }

    /// A purge marker (`KV-Operation: PURGE`, `Nats-Rollup: sub`) that drops the
    /// key's history; `marker_ttl` lets the marker itself expire.
    pub fn purge_request(&self, key: &str, marker_ttl: Option<MsgTtl>) -> Result<Request, JsError> {
        let mut h = HeaderMap::new();
        let bad = |e: crate::proto::headers::HeaderError| JsError::Invalid(e.to_string());
        h.insert(KV_OPERATION, "PURGE").map_err(bad)?;
        h.insert(ROLLUP, "sub").map_err(bad)?;
        let opts = PublishOptions {
            ttl: marker_ttl,
            ..PublishOptions::default()
        };
        publish_request(&self.write_subject(key)?, Some(&h), b"", &opts)
    }

    /// The entry a watch delivery carries.
    pub fn entry_from_delivery(
        &self,
        msg: &Delivery<'_>,
        meta: &AckMetadata<'_>,
    ) -> Option<KvEntry> {
        let key = msg.subject.strip_prefix(self.prefix.as_str())?;
        let (operation, marker) = operation_of(msg.headers);
        Some(KvEntry {
            bucket: self.bucket.clone(),
            key: key.to_string(),
            value: msg.payload.to_vec(),
            revision: meta.stream_sequence,
            created_nanos: meta.timestamp_nanos,
            delta: meta.pending,
            operation,
            marker,
        })
    }
}

/// What a watch reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A put, delete, purge or expiry marker.
    Entry(KvEntry),
    /// Every value that existed when the watch started has been reported.
    InitialValuesDone,
    /// The consumer was recreated from the last seen revision (informational).
    Reset { reason: String },
    /// A `resync` watch's new consumer reads every key's latest revision again; the
    /// entries up to the next [`WatchEvent::InitialValuesDone`] are what the bucket holds.
    Resync,
    /// The watch cannot go on (the bucket is gone).
    Failed(JsError),
}

/// Why a request asked of the driver is sent; its reply goes back with
/// [`KvWatcher::on_reply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchRequestKind {
    /// Create the consumer of this generation.
    CreateConsumer { generation: u64 },
    /// Delete a replaced consumer; the reply does not matter.
    DeleteConsumer,
}

/// What the driver of a watcher must do.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchAction {
    /// Send as a request (with a reply inbox) and feed the reply back.
    Request {
        kind: WatchRequestKind,
        request: Request,
    },
    /// Publish (no reply expected): flow-control answers.
    Publish(Request),
    /// Subscribe to this deliver subject and feed its messages to the watcher. The
    /// server only delivers to a push consumer whose subject has a literal
    /// subscription; a wildcard one does not count.
    Subscribe { subject: String },
    /// Drop the subscription of a replaced consumer.
    Unsubscribe { subject: String },
}

/// Options of a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchOptions {
    /// Key filters (patterns allowed); all keys when empty.
    pub keys: Vec<String>,
    /// Report every kept revision, not only the latest per key.
    pub include_history: bool,
    /// Report only changes made after the watch starts.
    pub updates_only: bool,
    /// Report entries without their values.
    pub headers_only: bool,
    /// The consumer's idle heartbeat; three missed ones reset it.
    pub idle_heartbeat: Duration,
    /// After a failed consumer create, wait this long before the next.
    pub retry_delay: Duration,
    /// Events held before the watcher stops taking deliveries (and later resumes by
    /// resetting from the last revision it reported).
    pub max_pending_events: usize,
    /// Each new consumer (after a reset, or [`KvWatcher::restart`]) reads every key's
    /// latest revision again and reports [`WatchEvent::InitialValuesDone`] again, instead
    /// of resuming after the last revision reported: a resume never hears of a delete
    /// whose revisions aged out while the watch was away (keys with a TTL), so a mirror
    /// is rebuilt from what the bucket holds. Not with `updates_only`.
    pub resync: bool,
    /// With `resync`: every message of the bucket lives at least this long (keys, their
    /// deletes and the server's markers all carry a TTL this long or longer). A consumer
    /// that starts over within half of it of the watch last being caught up resumes after
    /// the last revision instead: nothing written since has aged out yet. Unless the
    /// server does not start it there (the stream no longer holds the next revision, or
    /// was made anew), which reads every key again after all.
    pub resume_within_lifetime: Option<Duration>,
    /// A bucket not found is asked for again after this long instead of stopping the
    /// watch (a bucket someone else is yet to create).
    pub missing_bucket_retry: Option<Duration>,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            keys: Vec::new(),
            include_history: false,
            updates_only: false,
            headers_only: false,
            idle_heartbeat: Duration::from_secs(5),
            retry_delay: Duration::from_millis(500),
            max_pending_events: 4096,
            resync: false,
            resume_within_lifetime: None,
            missing_bucket_retry: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WatchState {
    /// The create request of the current generation is out.
    Creating,
    Active,
    /// A create failed; the next one goes out at this time.
    RetryAt(Instant),
    Stopped,
}

/// A KV watch: an ordered, ephemeral push consumer on the bucket's stream that
/// reports entries in order, detects gaps by consumer sequence and recreates itself
/// from the last reported revision. Sans-IO: the driver carries out [`WatchAction`]s
/// (subscriptions, requests, publishes), feeds every message of the subscriptions it
/// was asked for to [`KvWatcher::on_message`], feeds request replies to
/// [`KvWatcher::on_reply`] and calls [`KvWatcher::handle_timeout`] at
/// [`KvWatcher::poll_timeout`].
#[derive(Debug)]
pub struct KvWatcher {
    kv: Kv,
    options: WatchOptions,
    deliver_prefix: String,
    name_base: String,
    generation: u64,
    consumer: String,
    state: WatchState,
    last_revision: u64,
    /// An updates-only watch resumes after this stream sequence (the stream's last when
    /// its first consumer was made) until it has reported an entry.
    start_floor: u64,
    last_consumer_seq: u64,
    last_activity: Instant,
    /// When the watch last knew it had every message the stream held: a delivery with
    /// nothing pending after it, or an idle heartbeat at the last delivery.
    caught_up: Option<Instant>,
    /// The current consumer resumes after `last_revision` where a resync would read all.
    resuming: bool,
    /// The stream sequence it was made to resume after: its create's answer says where
    /// the server started it (deliveries may have moved `last_revision` on before it
    /// comes).
    resumed_after: u64,
    resyncs_done: u64,
    initial_done: bool,
    overflowed: bool,
    resets: u64,
    actions: VecDeque<WatchAction>,
    events: VecDeque<WatchEvent>,
}

impl KvWatcher {
    /// `deliver_prefix`: a subject prefix nobody else uses (an inbox); deliveries go to
    /// `<deliver_prefix>.<generation>`. `name_base`: a unique consumer-name prefix.
    pub fn new(
        kv: Kv,
        options: WatchOptions,
        deliver_prefix: &str,
        name_base: &str,
        now: Instant,
    ) -> Result<KvWatcher, JsError> {
        for k in &options.keys {
            validate_key_pattern(k)?;
        }
        super::api::validate_name("consumer", name_base)?;
        if deliver_prefix.is_empty() || deliver_prefix.split('.').any(|t| !super::api::is_token(t))
        {
            return Err(JsError::Invalid(format!(
                "invalid deliver prefix {deliver_prefix:?}"
            )));
        }
        if options.idle_heartbeat.is_zero() {
            return Err(JsError::Invalid("watch idle heartbeat must be > 0".into()));
        }
        let initial_done = options.updates_only;
        let mut w = KvWatcher {
            kv,
            options,
            deliver_prefix: deliver_prefix.to_string(),
            name_base: name_base.to_string(),
            generation: 0,
            consumer: String::new(),
            state: WatchState::Creating,
            last_revision: 0,
            resumed_after: 0,
            start_floor: 0,
            last_consumer_seq: 0,
            last_activity: now,
            caught_up: None,
            resuming: false,
            resyncs_done: 0,
            initial_done,
            overflowed: false,
            resets: 0,
            actions: VecDeque::new(),
            events: VecDeque::new(),
        };
        w.start_generation(now);
        if w.initial_done {
            w.events.push_back(WatchEvent::InitialValuesDone);
        }
        Ok(w)
    }

    /// The deliver subject of the current consumer.
    pub fn deliver_subject(&self) -> String {
        format!("{}.{}", self.deliver_prefix, self.generation)
    }

    /// The revision of the last entry reported.
    pub fn last_revision(&self) -> u64 {
        self.last_revision
    }

    /// How many times the consumer was recreated.
    pub fn resets(&self) -> u64 {
        self.resets
    }

    /// How many consumers read every key again (the first included), with `resync`.
    pub fn resyncs(&self) -> u64 {
        self.resyncs_done
    }

    /// The current consumer's name.
    pub fn consumer_name(&self) -> &str {
        &self.consumer
    }

    pub fn is_stopped(&self) -> bool {
        self.state == WatchState::Stopped
    }

    fn consumer_config(&self) -> ConsumerConfig {
        let filters: Vec<String> = if self.options.keys.is_empty() {
            vec![format!("$KV.{}.>", self.kv.bucket)]
        } else {
            self.options
                .keys
                .iter()
                .map(|k| format!("$KV.{}.{k}", self.kv.bucket))
                .collect()
        };
        let resume_after = if self.rereads() && !self.resuming {
            0
        } else {
            self.last_revision.max(self.start_floor)
        };
        let (deliver_policy, opt_start_seq) = if resume_after > 0 {
            (
                DeliverPolicy::ByStartSequence,
                Some(resume_after.saturating_add(1)),
            )
        } else if self.options.updates_only {
            (DeliverPolicy::New, None)
        } else if self.options.include_history {
            (DeliverPolicy::All, None)
        } else {
            (DeliverPolicy::LastPerSubject, None)
        };
        let (filter_subject, filter_subjects) = if filters.len() == 1 {
            (filters.into_iter().next(), None)
        } else {
            (None, Some(filters))
        };
        ConsumerConfig {
            name: Some(self.consumer.clone()),
            deliver_subject: Some(self.deliver_subject()),
            deliver_policy: Some(deliver_policy),
            opt_start_seq,
            ack_policy: Some(AckPolicy::None),
            max_deliver: Some(1),
            flow_control: Some(true),
            idle_heartbeat: Some(self.options.idle_heartbeat),
            headers_only: self.options.headers_only.then_some(true),
            filter_subject,
            filter_subjects,
            mem_storage: Some(true),
            num_replicas: Some(1),
            inactive_threshold: Some(
                Duration::from_secs(5).max(self.options.idle_heartbeat.saturating_mul(3)),
            ),
            ..ConsumerConfig::default()
        }
    }

    fn rereads(&self) -> bool {
        self.options.resync && !self.options.updates_only
    }

    /// Whether a consumer starting now may resume after the last revision instead of
    /// reading every key: a resync under way has to start over, and a message written
    /// since the watch was last caught up is still in the stream only within its lifetime
    /// (half of it here: the rest leaves room for the create's round trip and delivery).
    fn may_resume(&self, now: Instant) -> bool {
        self.initial_done
            && self.last_revision > 0
            && self
                .caught_up
                .zip(self.options.resume_within_lifetime)
                .is_some_and(|(at, lifetime)| now.saturating_duration_since(at) < lifetime / 2)
    }

    fn start_generation(&mut self, now: Instant) {
        if self.rereads() {
            self.resuming = self.may_resume(now);
            self.resumed_after = self.last_revision.max(self.start_floor);
            if !self.resuming {
                self.initial_done = false;
                self.resyncs_done += 1;
                self.events.push_back(WatchEvent::Resync);
            }
        }
        self.generation += 1;
        self.consumer = format!("{}_{}", self.name_base, self.generation);
        self.last_consumer_seq = 0;
        self.last_activity = now;
        self.state = WatchState::Creating;
        self.actions.push_back(WatchAction::Subscribe {
            subject: self.deliver_subject(),
        });
        match self.kv.api.consumer_create(
            &self.kv.stream,
            &self.consumer_config(),
            ConsumerAction::Create,
        ) {
            Ok(request) => self.actions.push_back(WatchAction::Request {
                kind: WatchRequestKind::CreateConsumer {
                    generation: self.generation,
                },
                request,
            }),
            Err(e) => self.fail(e),
        }
    }

    fn fail(&mut self, e: JsError) {
        self.state = WatchState::Stopped;
        self.events.push_back(WatchEvent::Failed(e));
    }

    fn reset(&mut self, reason: String, now: Instant) {
        if self.state == WatchState::Stopped {
            return;
        }
        let old = self.consumer.clone();
        if let Ok(request) = self.kv.api.consumer_delete(&self.kv.stream, &old) {
            self.actions.push_back(WatchAction::Request {
                kind: WatchRequestKind::DeleteConsumer,
                request,
            });
        }
        self.actions.push_back(WatchAction::Unsubscribe {
            subject: self.deliver_subject(),
        });
        self.resets += 1;
        self.events.push_back(WatchEvent::Reset { reason });
        self.start_generation(now);
    }

    /// Starts over with a new consumer, as a reset does: e.g. once a lost connection is
    /// back, since a consumer that outlived it delivered nothing meanwhile, and what came
    /// and went meanwhile may be gone from the stream.
    pub fn restart(&mut self, reason: &str, now: Instant) {
        self.reset(reason.to_string(), now);
    }

    /// A message of the watch subscription.
    pub fn on_message(&mut self, msg: &Delivery<'_>, now: Instant) {
        if self.state == WatchState::Stopped {
            return;
        }
        match classify(msg) {
            Inbound::Message => self.on_data(msg, now),
            Inbound::FlowControl { reply } if msg.subject == self.deliver_subject() => {
                self.last_activity = now;
                self.answer(reply);
            }
            Inbound::IdleHeartbeat {
                last_consumer_seq,
                stalled_reply,
                ..
            } => {
                if msg.subject != self.deliver_subject() {
                    return;
                }
                self.last_activity = now;
                if let Some(reply) = stalled_reply {
                    self.answer(reply);
                } else if last_consumer_seq == Some(self.last_consumer_seq)
                    && self.state == WatchState::Active
                    && self.initial_done
                {
                    self.caught_up = Some(now);
                }
                if let Some(seq) = last_consumer_seq
                    && seq != self.last_consumer_seq
                    && self.state == WatchState::Active
                {
                    self.reset(
                        format!(
                            "heartbeat says consumer sequence {seq}, last seen {}",
                            self.last_consumer_seq
                        ),
                        now,
                    );
                }
            }
            Inbound::Conflict { description } if msg.subject == self.deliver_subject() => {
                self.reset(format!("consumer conflict: {description}"), now);
            }
            _ => {}
        }
    }

    fn answer(&mut self, reply: &str) {
        self.actions.push_back(WatchAction::Publish(Request::new(
            reply.to_string(),
            Vec::new(),
        )));
    }

    fn on_data(&mut self, msg: &Delivery<'_>, now: Instant) {
        let Some(meta) = msg.reply.and_then(|r| AckMetadata::parse(r).ok()) else {
            return;
        };
        if meta.consumer != self.consumer || meta.stream != self.kv.stream {
            // A delivery of a replaced consumer.
            return;
        }
        self.last_activity = now;
        if self.overflowed || self.events.len() >= self.options.max_pending_events {
            // Not taken: the gap this leaves is filled by a reset once the events drain.
            self.overflowed = true;
            return;
        }
        if Some(meta.consumer_sequence) != self.last_consumer_seq.checked_add(1) {
            let reason = format!(
                "gap: consumer sequence {} after {}",
                meta.consumer_sequence, self.last_consumer_seq
            );
            self.reset(reason, now);
            return;
        }
        self.last_consumer_seq = meta.consumer_sequence;
        let Some(entry) = self.kv.entry_from_delivery(msg, &meta) else {
            return;
        };
        self.last_revision = meta.stream_sequence;
        let pending = meta.pending;
        self.events.push_back(WatchEvent::Entry(entry));
        if pending == 0 {
            if !self.initial_done {
                self.initial_done = true;
                self.events.push_back(WatchEvent::InitialValuesDone);
            }
            self.caught_up = Some(now);
        }
    }

    /// The reply (or failure) of a request the watcher asked for.
    pub fn on_reply(
        &mut self,
        kind: WatchRequestKind,
        reply: Result<&[u8], JsError>,
        now: Instant,
    ) {
        let WatchRequestKind::CreateConsumer { generation } = kind else {
            return;
        };
        if generation != self.generation || self.state != WatchState::Creating {
            return;
        }
        match reply.and_then(parse_response::<ConsumerInfo>) {
            Ok(info)
                if self.resuming
                    && info.delivered.consumer_seq == 0
                    && info.delivered.stream_seq != self.resumed_after =>
            {
                // The server moves a start sequence into the stream: what came after the
                // last revision is gone (or the stream is another one). Told only while
                // nothing was delivered (the reply may follow the first deliveries, and
                // then says where they got to); the lifetime holds either way.
                self.caught_up = None;
                self.reset(
                    format!(
                        "the stream starts the consumer after {}, not after revision {}",
                        info.delivered.stream_seq, self.resumed_after
                    ),
                    now,
                );
            }
            Ok(info) => {
                self.state = WatchState::Active;
                self.last_activity = now;
                if self.options.updates_only && self.start_floor == 0 {
                    // A reset must not skip writes made between this consumer and the next.
                    self.start_floor = info.delivered.stream_seq;
                }
                if info.num_pending == 0 && self.last_consumer_seq == 0 {
                    if !self.initial_done {
                        self.initial_done = true;
                        self.events.push_back(WatchEvent::InitialValuesDone);
                    }
                    self.caught_up = Some(now);
                }
            }
            Err(JsError::StreamNotFound(_)) => match self.options.missing_bucket_retry {
                Some(delay) => self.retry_after("bucket not found".to_string(), delay, now),
                None => self.fail(JsError::BucketNotFound),
            },
            Err(
                e @ (JsError::Invalid(_) | JsError::NotEnabled | JsError::NotEnabledForAccount(_)),
            ) => self.fail(e),
            Err(JsError::Api(e)) if e.code == 400 => self.fail(JsError::Api(e)),
            Err(e) => self.retry_after(
                format!("consumer create failed: {e}"),
                self.options.retry_delay,
                now,
            ),
        }
    }

    fn retry_after(&mut self, reason: String, delay: Duration, now: Instant) {
        self.events.push_back(WatchEvent::Reset { reason });
        self.state = WatchState::RetryAt(now.checked_add(delay).unwrap_or(now));
    }

    /// When [`KvWatcher::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            WatchState::Stopped => None,
            WatchState::RetryAt(at) => Some(at),
            WatchState::Creating | WatchState::Active => self.silence_deadline(),
        }
    }

    /// Timer tick: retries a failed create; resets a consumer that went silent for
    /// three heartbeats.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.state {
            WatchState::RetryAt(at) if now >= at => {
                self.generation_retry(now);
            }
            WatchState::Creating | WatchState::Active
                if self.silence_deadline().is_some_and(|d| now >= d) =>
            {
                self.reset("no heartbeat for three intervals".to_string(), now);
            }
            _ => {}
        }
    }

    /// Three heartbeat intervals after the last sign of life.
    fn silence_deadline(&self) -> Option<Instant> {
        self.last_activity
            .checked_add(self.options.idle_heartbeat.saturating_mul(3))
    }

    fn generation_retry(&mut self, now: Instant) {
        self.actions.push_back(WatchAction::Unsubscribe {
            subject: self.deliver_subject(),
        });
        self.start_generation(now);
    }

    pub fn poll_action(&mut self) -> Option<WatchAction> {
        self.actions.pop_front()
    }

    pub fn poll_event(&mut self, now: Instant) -> Option<WatchEvent> {
        let e = self.events.pop_front();
        if self.overflowed && self.events.is_empty() {
            self.overflowed = false;
            self.reset("event queue was full".to_string(), now);
        }
        e
    }

    /// Stops the watch; returns the request that deletes its consumer.
    pub fn stop(&mut self) -> Option<Request> {
        self.state = WatchState::Stopped;
        self.actions.clear();
        self.kv
            .api
            .consumer_delete(&self.kv.stream, &self.consumer)
            .ok()
    }
}

#[cfg(test)]
mod tests;
