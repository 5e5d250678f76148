//! A stream's stored messages and the rules of a publish into it: expectations, dedupe,
//! per-message TTL, rollups, limits and their discard policy, expiry with subject delete
//! markers. Timestamps are the model's wall clock; deadlines its monotonic `now`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::errors::{self, ApiErr};
use crate::jetstream::{DiscardPolicy, RetentionPolicy, StreamConfig};
use crate::proto::headers::HeaderMap;
use crate::proto::subject::matches;

#[derive(Debug, Clone)]
pub struct StoredMsg {
    pub subject: String,
    /// The header block as published (`NATS/1.0 ...\r\n\r\n`), if any.
    pub headers: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    /// Unix time in nanoseconds.
    pub ts: u64,
    pub stored_at: Instant,
    pub expires: Option<Instant>,
    /// A subject delete marker never leaves another marker behind.
    pub is_marker: bool,
}

impl StoredMsg {
    /// nats-server's memory-store accounting.
    pub fn size(&self) -> u64 {
        (self.subject.len() + self.headers.as_ref().map_or(0, Vec::len) + self.payload.len() + 16)
            as u64
    }
}

/// What a stored publish answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub seq: u64,
    pub duplicate: bool,
}

#[derive(Debug)]
pub struct Stream {
    pub name: String,
    /// The normalized configuration as INFO reports it.
    pub config: Value,
    pub cfg: StreamConfig,
    pub created: String,
    pub msgs: BTreeMap<u64, StoredMsg>,
    /// The sequences of each subject, for the per-subject reads and limits.
    by_subject: BTreeMap<String, BTreeSet<u64>>,
    pub last_seq: u64,
    pub last_ts: u64,
    pub bytes: u64,
    /// First sequence once everything is gone (after a purge to a sequence).
    empty_first: u64,
    dedupe: BTreeMap<String, (u64, Instant)>,
    /// Msg ids in the order they were stored, to age them out without a scan.
    dedupe_order: VecDeque<(Instant, String)>,
    last_msg_id: Option<String>,
}

/// Fills in what nats-server fills in, so a config read back compares equal to the
/// one it came from and can be sent again.
pub fn normalize_config(name: &str, body: &Value) -> Result<(Value, StreamConfig), ApiErr> {
    let mut v = match body {
        Value::Object(m) => m.clone(),
        Value::Null => serde_json::Map::new(),
        _ => return Err(errors::bad_request("invalid JSON")),
    };
    if let Some(n) = v.get("name").and_then(Value::as_str)
        && n != name
    {
        return Err(errors::stream_name_mismatch());
    }
    v.insert("name".into(), json!(name));
    let subjects_empty = v
        .get("subjects")
        .and_then(Value::as_array)
        .is_none_or(|a| a.is_empty());
    if subjects_empty {
        v.insert("subjects".into(), json!([name]));
    }
    let max_age = v.get("max_age").and_then(Value::as_u64).unwrap_or(0);
    let two_minutes = 120_000_000_000u64;
    let window = if max_age > 0 && max_age < two_minutes {
        max_age
    } else {
        two_minutes
    };
    let defaults = [
        ("retention", json!("limits")),
        ("max_consumers", json!(-1)),
        ("max_msgs", json!(-1)),
        ("max_bytes", json!(-1)),
        ("max_age", json!(0)),
        ("max_msgs_per_subject", json!(-1)),
        ("max_msg_size", json!(-1)),
        ("discard", json!("old")),
        ("storage", json!("file")),
        ("num_replicas", json!(1)),
        ("duplicate_window", json!(window)),
        ("compression", json!("none")),
        ("allow_direct", json!(false)),
        ("mirror_direct", json!(false)),
        ("sealed", json!(false)),
        ("deny_delete", json!(false)),
        ("deny_purge", json!(false)),
        ("allow_rollup_hdrs", json!(false)),
        ("consumer_limits", json!({})),
    ];
    for (k, d) in defaults {
        if v.get(k).is_none_or(Value::is_null) {
            v.insert(k.into(), d);
        }
    }
    if v.get("duplicate_window").and_then(Value::as_u64) == Some(0) {
        v.insert("duplicate_window".into(), json!(window));
    }
    let value = Value::Object(v);
    let cfg: StreamConfig = serde_json::from_value(value.clone())
        .map_err(|e| errors::invalid_stream_config(&e.to_string()))?;
    for s in &cfg.subjects {
        if crate::proto::subject::validate_pattern(s.as_bytes()).is_err() {
            return Err(errors::invalid_stream_config("invalid subject"));
        }
    }
    if cfg.subject_delete_marker_ttl.is_some_and(|d| !d.is_zero())
        && cfg.allow_msg_ttl != Some(true)
    {
        return Err(errors::invalid_stream_config(
            "subject marker delete cannot be set if message TTLs are disabled",
        ));
    }
    Ok((value, cfg))
}

fn limit(v: Option<i64>) -> Option<u64> {
    v.filter(|n| *n > 0).map(|n| n as u64)
}

/// `Nats-TTL`: `never`, a Go duration in whole units (`5s`, `1m`, `2h`) or seconds.
pub fn parse_ttl(value: &str) -> Option<Option<Duration>> {
    let v = value.trim();
    if v.eq_ignore_ascii_case("never") {
        return Some(None);
    }
    let (digits, unit) = v
        .find(|c: char| !c.is_ascii_digit())
        .map_or((v, "s"), |i| (&v[..i], &v[i..]));
    let n: u64 = digits.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "m" => n.checked_mul(60)?,
        "h" => n.checked_mul(3600)?,
        _ => return None,
    };
    if secs == 0 {
        return None;
    }
    Some(Some(Duration::from_secs(secs)))
}

impl Stream {
    pub fn new(name: &str, config: Value, cfg: StreamConfig, created: String) -> Stream {
        Stream {
            name: name.to_string(),
            config,
            cfg,
            created,
            msgs: BTreeMap::new(),
            by_subject: BTreeMap::new(),
            last_seq: 0,
            last_ts: 0,
            bytes: 0,
            empty_first: 1,
            dedupe: BTreeMap::new(),
            dedupe_order: VecDeque::new(),
            last_msg_id: None,
        }
    }

    pub fn captures(&self, subject: &str) -> bool {
        self.cfg
            .subjects
            .iter()
            .any(|p| matches(p.as_bytes(), subject.as_bytes()))
    }

    pub fn is_workqueue(&self) -> bool {
        self.cfg.retention == Some(RetentionPolicy::WorkQueue)
    }

    pub fn first_seq(&self) -> u64 {
        self.msgs
            .keys()
            .next()
            .copied()
            .unwrap_or(self.empty_first.max(self.last_seq + 1))
    }

    pub fn last_on_subject(&self, pattern: &str) -> Option<u64> {
        if crate::proto::subject::is_literal(pattern.as_bytes()) {
            return self
                .by_subject
                .get(pattern)
                .and_then(|seqs| seqs.iter().next_back().copied());
        }
        self.msgs
            .iter()
            .rev()
            .find(|(_, m)| matches(pattern.as_bytes(), m.subject.as_bytes()))
            .map(|(s, _)| *s)
    }

    fn insert(&mut self, seq: u64, msg: StoredMsg) {
        self.last_seq = seq;
        self.last_ts = msg.ts;
        self.bytes += msg.size();
        self.by_subject
            .entry(msg.subject.clone())
            .or_default()
            .insert(seq);
        self.msgs.insert(seq, msg);
    }

    pub fn remove(&mut self, seq: u64) -> Option<StoredMsg> {
        let m = self.msgs.remove(&seq)?;
        self.bytes = self.bytes.saturating_sub(m.size());
        if let Some(seqs) = self.by_subject.get_mut(&m.subject) {
            seqs.remove(&seq);
            if seqs.is_empty() {
                self.by_subject.remove(&m.subject);
            }
        }
        Some(m)
    }

    /// Stores a publish, or says why not (the PubAck error).
    pub fn store(
        &mut self,
        subject: &str,
        headers: Option<&[u8]>,
        payload: &[u8],
        now: Instant,
        wall_nanos: u64,
    ) -> Result<Stored, ApiErr> {
        let h = headers.and_then(|b| HeaderMap::parse(b).ok());
        let get = |name: &str| h.as_ref().and_then(|h| h.get(name)).map(str::trim);
        let size = headers.map_or(0, <[u8]>::len) + payload.len();
        if let Some(max) = limit(self.cfg.max_msg_size)
            && size as u64 > max
        {
            return Err(errors::msg_too_big());
        }
        if let Some(expected) = get("Nats-Expected-Stream")
            && expected != self.name
        {
            return Err(errors::stream_not_match());
        }
        let window = self
            .cfg
            .duplicate_window
            .unwrap_or(Duration::from_secs(120));
        while let Some((at, id)) = self.dedupe_order.front() {
            if now.saturating_duration_since(*at) < window {
                break;
            }
            if self.dedupe.get(id).is_some_and(|(_, t)| t == at) {
                self.dedupe.remove(id);
            }
            self.dedupe_order.pop_front();
        }
        let msg_id = get("Nats-Msg-Id").filter(|s| !s.is_empty());
        if let Some(id) = msg_id
            && let Some((seq, _)) = self.dedupe.get(id)
        {
            return Ok(Stored {
                seq: *seq,
                duplicate: true,
            });
        }
        if let Some(v) = get("Nats-Expected-Last-Sequence") {
            let want: u64 = v.parse().map_err(|_| errors::bad_request("bad header"))?;
            if want != self.last_seq {
                return Err(errors::wrong_last_sequence(self.last_seq));
            }
        }
        if let Some(id) = get("Nats-Expected-Last-Msg-Id") {
            let last = self.last_msg_id.as_deref().unwrap_or("");
            if id != last {
                return Err(errors::wrong_last_msg_id(last));
            }
        }
        if let Some(v) = get("Nats-Expected-Last-Subject-Sequence") {
            let want: u64 = v.parse().map_err(|_| errors::bad_request("bad header"))?;
            let filter = get("Nats-Expected-Last-Subject-Sequence-Subject").unwrap_or(subject);
            let have = self.last_on_subject(filter).unwrap_or(0);
            if want != have {
                return Err(errors::wrong_last_sequence(have));
            }
        }
        let ttl = match get("Nats-TTL") {
            None => None,
            Some(_) if self.cfg.allow_msg_ttl != Some(true) => return Err(errors::ttl_disabled()),
            Some(v) => match parse_ttl(v) {
                Some(ttl) => ttl,
                None => return Err(errors::ttl_invalid()),
            },
        };
        let rollup = match get("Nats-Rollup") {
            None => None,
            Some(_) if self.cfg.allow_rollup_hdrs != Some(true) => {
                return Err(errors::rollup_not_permitted());
            }
            Some(v) if v.eq_ignore_ascii_case("sub") => Some(false),
            Some(v) if v.eq_ignore_ascii_case("all") => Some(true),
            Some(_) => return Err(errors::rollup_invalid()),
        };
        let discard_new = self.cfg.discard == Some(DiscardPolicy::New);
        if discard_new && rollup.is_none() {
            if let Some(max) = limit(self.cfg.max_msgs)
                && self.msgs.len() as u64 >= max
            {
                return Err(errors::store_failed("maximum messages exceeded"));
            }
            if let Some(max) = limit(self.cfg.max_bytes)
                && self.bytes + (subject.len() + size + 16) as u64 > max
            {
                return Err(errors::store_failed("maximum bytes exceeded"));
            }
        }
        let seq = self.last_seq + 1;
        let msg = StoredMsg {
            subject: subject.to_string(),
            headers: headers.map(<[u8]>::to_vec),
            payload: payload.to_vec(),
            ts: wall_nanos.max(self.last_ts + 1),
            stored_at: now,
            expires: ttl.and_then(|d| now.checked_add(d)),
            is_marker: get("Nats-Marker-Reason").is_some(),
        };
        self.insert(seq, msg);
        if let Some(id) = msg_id {
            self.dedupe.insert(id.to_string(), (seq, now));
            self.dedupe_order.push_back((now, id.to_string()));
            self.last_msg_id = Some(id.to_string());
        }
        match rollup {
            Some(true) => {
                let gone: Vec<u64> = self.msgs.keys().copied().filter(|s| *s != seq).collect();
                for s in gone {
                    self.remove(s);
                }
            }
            Some(false) => {
                let gone: Vec<u64> = self
                    .by_subject
                    .get(subject)
                    .map(|seqs| seqs.iter().copied().filter(|s| *s != seq).collect())
                    .unwrap_or_default();
                for s in gone {
                    self.remove(s);
                }
            }
            None => self.enforce_limits(subject),
        }
        Ok(Stored {
            seq,
            duplicate: false,
        })
    }

    fn enforce_limits(&mut self, subject: &str) {
        if let Some(max) = limit(self.cfg.max_msgs_per_subject) {
            let on: Vec<u64> = self
                .by_subject
                .get(subject)
                .map(|seqs| seqs.iter().copied().collect())
                .unwrap_or_default();
            let excess = on.len().saturating_sub(max as usize);
            for s in on.into_iter().take(excess) {
                self.remove(s);
            }
        }
        if let Some(max) = limit(self.cfg.max_msgs) {
            while self.msgs.len() as u64 > max {
                let Some(first) = self.msgs.keys().next().copied() else {
                    break;
                };
                self.remove(first);
            }
        }
        if let Some(max) = limit(self.cfg.max_bytes) {
            while self.bytes > max {
                let Some(first) = self.msgs.keys().next().copied() else {
                    break;
                };
                self.remove(first);
            }
        }
    }

    /// When the next message ages out.
    pub fn next_expiry(&self) -> Option<Instant> {
        let max_age = self.cfg.max_age.filter(|d| !d.is_zero());
        let mut next: Option<Instant> = None;
        let mut keep = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        if let Some(age) = max_age
            && let Some(m) = self.msgs.values().next()
            && let Some(t) = m.stored_at.checked_add(age)
        {
            keep(t);
        }
        for m in self.msgs.values() {
            if let Some(t) = m.expires {
                keep(t);
            }
        }
        next
    }

    /// Drops what has aged out and leaves subject delete markers where the stream asks
    /// for them (the last message of a subject gone by age or TTL).
    pub fn expire(&mut self, now: Instant, wall_nanos: u64) {
        let max_age = self.cfg.max_age.filter(|d| !d.is_zero());
        let gone: Vec<u64> = self
            .msgs
            .iter()
            .filter(|(_, m)| {
                m.expires.is_some_and(|t| t <= now)
                    || max_age.is_some_and(|a| m.stored_at.checked_add(a).is_some_and(|t| t <= now))
            })
            .map(|(s, _)| *s)
            .collect();
        let marker_ttl = self.cfg.subject_delete_marker_ttl.filter(|d| !d.is_zero());
        let mut markers = Vec::new();
        for s in gone {
            if let Some(m) = self.remove(s)
                && marker_ttl.is_some()
                && !m.is_marker
                && !self.by_subject.contains_key(&m.subject)
            {
                markers.push(m.subject);
            }
        }
        if let Some(ttl) = marker_ttl {
            for subject in markers {
                let block = format!(
                    "NATS/1.0\r\nNats-Marker-Reason: MaxAge\r\nNats-TTL: {}s\r\n\r\n",
                    ttl.as_secs().max(1)
                );
                let seq = self.last_seq + 1;
                let msg = StoredMsg {
                    subject,
                    headers: Some(block.into_bytes()),
                    payload: Vec::new(),
                    ts: wall_nanos.max(self.last_ts + 1),
                    stored_at: now,
                    expires: now.checked_add(ttl),
                    is_marker: true,
                };
                self.insert(seq, msg);
            }
        }
    }

    /// `STREAM.PURGE`: everything, a subject, below a sequence, or all but the last few.
    pub fn purge(&mut self, filter: Option<&str>, below: Option<u64>, keep: Option<u64>) -> u64 {
        let hit =
            |m: &StoredMsg| filter.is_none_or(|f| matches(f.as_bytes(), m.subject.as_bytes()));
        let mut chosen: Vec<u64> = self
            .msgs
            .iter()
            .filter(|(s, m)| hit(m) && below.is_none_or(|b| **s < b))
            .map(|(s, _)| *s)
            .collect();
        if let Some(k) = keep {
            let n = chosen.len().saturating_sub(k as usize);
            chosen.truncate(n);
        }
        let purged = chosen.len() as u64;
        for s in chosen {
            self.remove(s);
        }
        if filter.is_none() {
            self.empty_first = below.unwrap_or(self.last_seq + 1);
        }
        purged
    }

    pub fn num_subjects(&self) -> u64 {
        self.by_subject.len() as u64
    }

    pub fn state(&self, consumers: usize) -> Value {
        let first = self.first_seq();
        let span = if self.msgs.is_empty() {
            0
        } else {
            self.last_seq + 1 - first
        };
        let fmt = |ts: u64| super::clock::format_nanos(ts);
        json!({
            "messages": self.msgs.len(),
            "bytes": self.bytes,
            "first_seq": first,
            "first_ts": fmt(self.msgs.values().next().map_or(0, |m| m.ts)),
            "last_seq": self.last_seq,
            "last_ts": fmt(self.last_ts),
            "num_subjects": self.num_subjects(),
            "num_deleted": span.saturating_sub(self.msgs.len() as u64),
            "consumer_count": consumers,
        })
    }
}
