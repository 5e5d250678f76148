//! `$JS.API` requests: account info, stream and consumer administration, stored-message
//! reads (`STREAM.MSG.GET`, `DIRECT.GET`), message delete and `CONSUMER.MSG.NEXT`.
//! Answers are shaped like nats-server's, error codes included.

use std::time::Instant;

use base64::Engine;
use serde_json::{Value, json};

use super::clock::format_nanos;
use super::consumer::{self, Consumer, NextRequest, Outbound};
use super::errors::{self, ApiErr};
use super::jetstream::{Handled, JetStream, StreamEntry};
use super::stream::{self, StoredMsg, Stream};
use crate::jetstream::StorageType;
use crate::proto::subject::matches;

/// The level of the JetStream API the model speaks (nats-server 2.11's).
const API_LEVEL: u64 = 1;

type Reply = Result<Value, ApiErr>;

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && s.bytes()
            .all(|b| b > 0x20 && b != 0x7f && !b".*>/\\".contains(&b))
}

/// Whether two subject patterns can both match one subject.
fn overlap(a: &str, b: &str) -> bool {
    let (mut x, mut y) = (a.split('.'), b.split('.'));
    loop {
        match (x.next(), y.next()) {
            (Some(">"), Some(_)) | (Some(_), Some(">")) => return true,
            (Some(p), Some(q)) => {
                if p != q && p != "*" && q != "*" {
                    return false;
                }
            }
            (None, None) => return true,
            _ => return false,
        }
    }
}

fn json_reply(reply: Option<&str>, body: &Value) -> Vec<Outbound> {
    reply
        .map(|r| Outbound {
            to: r.to_string(),
            subject: r.to_string(),
            reply: None,
            headers: None,
            payload: body.to_string().into_bytes(),
        })
        .into_iter()
        .collect()
}

fn num(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

fn text<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v.get(k).and_then(Value::as_str)
}

/// A message read: by sequence, last on a subject, or next on a subject from a sequence.
fn select<'a>(s: &'a Stream, body: &Value) -> Result<(u64, &'a StoredMsg), ApiErr> {
    let found = if let Some(subject) = text(body, "last_by_subj") {
        s.last_on_subject(subject)
            .and_then(|seq| s.msgs.get_key_value(&seq))
    } else if let Some(subject) = text(body, "next_by_subj") {
        let from = num(body, "seq").unwrap_or(0);
        s.msgs
            .range(from..)
            .find(|(_, m)| matches(subject.as_bytes(), m.subject.as_bytes()))
    } else if let Some(seq) = num(body, "seq") {
        s.msgs.get_key_value(&seq)
    } else {
        return Err(errors::bad_request("empty request"));
    };
    found
        .map(|(k, m)| (*k, m))
        .ok_or_else(errors::no_message_found)
}

impl JetStream {
    /// `op` is the subject after the API prefix (`STREAM.INFO.S`, ...).
    #[allow(clippy::too_many_arguments)]
    pub fn api(
        &mut self,
        op: &str,
        reply: Option<&str>,
        payload: &[u8],
        now: Instant,
        wall: u64,
        server_name: &str,
    ) -> Handled {
        let t: Vec<&str> = op.split('.').collect();
        let body: Value = if payload.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            match serde_json::from_slice(payload) {
                Ok(v) => v,
                // MSG.NEXT also takes a bare number.
                Err(_) if t.first() == Some(&"CONSUMER") => Value::Null,
                Err(_) => {
                    return Handled::Out(json_reply(
                        reply,
                        &json!({"error": errors::bad_request("invalid JSON").to_json()}),
                    ));
                }
            }
        };
        match t.as_slice() {
            ["DIRECT", "GET", stream, rest @ ..] => {
                return self.direct_get(stream, rest, reply, &body);
            }
            ["CONSUMER", "MSG", "NEXT", stream, name] => {
                return self.next(stream, name, reply, payload, now);
            }
            _ => {}
        }
        self.api_total += 1;
        let (kind, result) = match t.as_slice() {
            ["INFO"] => ("account_info_response", Ok(self.account_info())),
            ["STREAM", "CREATE", name] => (
                "stream_create_response",
                self.stream_create(name, &body, now, wall, server_name),
            ),
            ["STREAM", "UPDATE", name] => (
                "stream_update_response",
                self.stream_update(name, &body, wall, server_name),
            ),
            ["STREAM", "INFO", name] => (
                "stream_info_response",
                self.stream_info(name, &body, wall, server_name),
            ),
            ["STREAM", "DELETE", name] => ("stream_delete_response", self.stream_delete(name)),
            ["STREAM", "PURGE", name] => ("stream_purge_response", self.stream_purge(name, &body)),
            ["STREAM", "NAMES"] => ("stream_names_response", Ok(self.stream_names(&body))),
            ["STREAM", "LIST"] => (
                "stream_list_response",
                Ok(self.stream_list(&body, wall, server_name)),
            ),
            ["STREAM", "MSG", "GET", name] => {
                ("stream_msg_get_response", self.msg_get(name, &body))
            }
            ["STREAM", "MSG", "DELETE", name] => {
                ("stream_msg_delete_response", self.msg_delete(name, &body))
            }
            ["CONSUMER", "CREATE", stream] => (
                "consumer_create_response",
                self.consumer_create(stream, None, None, false, &body, now, wall),
            ),
            ["CONSUMER", "CREATE", stream, name, filter @ ..] => {
                let filter = (!filter.is_empty()).then(|| filter.join("."));
                (
                    "consumer_create_response",
                    self.consumer_create(
                        stream,
                        Some(name),
                        filter.as_deref(),
                        false,
                        &body,
                        now,
                        wall,
                    ),
                )
            }
            ["CONSUMER", "DURABLE", "CREATE", stream, name] => (
                "consumer_create_response",
                self.consumer_create(stream, Some(name), None, true, &body, now, wall),
            ),
            ["CONSUMER", "INFO", stream, name] => (
                "consumer_info_response",
                self.consumer_info(stream, name, wall),
            ),
            ["CONSUMER", "DELETE", stream, name] => (
                "consumer_delete_response",
                self.consumer_delete(stream, name, now),
            ),
            ["CONSUMER", "NAMES", stream] => (
                "consumer_names_response",
                self.consumer_names(stream, &body),
            ),
            ["CONSUMER", "LIST", stream] => (
                "consumer_list_response",
                self.consumer_list(stream, &body, wall),
            ),
            _ => {
                self.api_total -= 1;
                return Handled::NotMine;
            }
        };
        let mut v = match result {
            Ok(v) => v,
            Err(e) => {
                self.api_errors += 1;
                json!({"error": e.to_json()})
            }
        };
        v["type"] = json!(format!("io.nats.jetstream.api.v1.{kind}"));
        Handled::Out(json_reply(reply, &v))
    }

    fn entry(&self, name: &str) -> Result<&StreamEntry, ApiErr> {
        self.streams.get(name).ok_or_else(errors::stream_not_found)
    }

    fn entry_mut(&mut self, name: &str) -> Result<&mut StreamEntry, ApiErr> {
        self.streams
            .get_mut(name)
            .ok_or_else(errors::stream_not_found)
    }

    fn account_info(&self) -> Value {
        let (mut memory, mut storage, mut consumers) = (0u64, 0u64, 0usize);
        for e in self.streams.values() {
            if e.stream.cfg.storage == Some(StorageType::Memory) {
                memory += e.stream.bytes;
            } else {
                storage += e.stream.bytes;
            }
            consumers += e.consumers.len();
        }
        let mut v = json!({
            "memory": memory,
            "storage": storage,
            "reserved_memory": 0,
            "reserved_storage": 0,
            "streams": self.streams.len(),
            "consumers": consumers,
            "limits": {"max_memory": -1, "max_storage": -1, "max_streams": -1, "max_consumers": -1,
                       "max_ack_pending": -1, "memory_max_stream_bytes": -1,
                       "storage_max_stream_bytes": -1, "max_bytes_required": false},
            "api": {"level": API_LEVEL, "total": self.api_total, "errors": self.api_errors},
        });
        if let Some(d) = &self.domain {
            v["domain"] = json!(d);
        }
        v
    }

    fn stream_json(&self, e: &StreamEntry, wall: u64, server_name: &str) -> Value {
        json!({
            "config": e.stream.config,
            "created": e.stream.created,
            "state": e.stream.state(e.consumers.len()),
            "cluster": {"leader": server_name},
            "ts": format_nanos(wall),
        })
    }

    fn check_overlap(&self, name: &str, subjects: &[String]) -> Result<(), ApiErr> {
        for (other, e) in &self.streams {
            if other != name
                && e.stream
                    .cfg
                    .subjects
                    .iter()
                    .any(|a| subjects.iter().any(|b| overlap(a, b)))
            {
                return Err(errors::subjects_overlap());
            }
        }
        Ok(())
    }

    fn stream_create(
        &mut self,
        name: &str,
        body: &Value,
        _now: Instant,
        wall: u64,
        server_name: &str,
    ) -> Reply {
        if !is_name(name) {
            return Err(errors::invalid_stream_config("invalid stream name"));
        }
        let (config, cfg) = stream::normalize_config(name, body)?;
        if let Some(e) = self.streams.get(name) {
            if e.stream.config != config {
                return Err(errors::stream_exists());
            }
            return Ok(self.stream_json(e, wall, server_name));
        }
        self.check_overlap(name, &cfg.subjects)?;
        let s = Stream::new(name, config, cfg, format_nanos(wall));
        let entry = StreamEntry {
            stream: s,
            consumers: Default::default(),
        };
        let mut v = self.stream_json(&entry, wall, server_name);
        v["did_create"] = json!(true);
        self.streams.insert(name.to_string(), entry);
        Ok(v)
    }

    fn stream_update(&mut self, name: &str, body: &Value, wall: u64, server_name: &str) -> Reply {
        let (config, cfg) = stream::normalize_config(name, body)?;
        self.entry(name)?;
        self.check_overlap(name, &cfg.subjects)?;
        let e = self.entry_mut(name)?;
        e.stream.config = config;
        e.stream.cfg = cfg;
        let e = self.entry(name)?;
        Ok(self.stream_json(e, wall, server_name))
    }

    /// With `subjects_filter`, `state.subjects` counts the messages of each matching
    /// subject, as nats-server's does.
    fn stream_info(&self, name: &str, body: &Value, wall: u64, server_name: &str) -> Reply {
        let e = self.entry(name)?;
        let mut info = self.stream_json(e, wall, server_name);
        if let Some(filter) = text(body, "subjects_filter") {
            let mut subjects = serde_json::Map::new();
            for m in e
                .stream
                .msgs
                .values()
                .filter(|m| matches(filter.as_bytes(), m.subject.as_bytes()))
            {
                let n = subjects
                    .get(&m.subject)
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                subjects.insert(m.subject.clone(), json!(n + 1));
            }
            info["state"]["subjects"] = Value::Object(subjects);
        }
        Ok(info)
    }

    fn stream_delete(&mut self, name: &str) -> Reply {
        let e = self
            .streams
            .remove(name)
            .ok_or_else(errors::stream_not_found)?;
        for mut c in e.consumers.into_values() {
            c.close(&mut self.closing);
        }
        Ok(json!({"success": true}))
    }

    /// Statuses of pulls that a deleted consumer or stream left waiting.
    pub fn take_closing(&mut self) -> Vec<Outbound> {
        std::mem::take(&mut self.closing)
    }

    fn stream_purge(&mut self, name: &str, body: &Value) -> Reply {
        let e = self.entry_mut(name)?;
        if e.stream.cfg.deny_purge == Some(true) {
            return Err(errors::purge_denied());
        }
        let purged = e
            .stream
            .purge(text(body, "filter"), num(body, "seq"), num(body, "keep"));
        Ok(json!({"success": true, "purged": purged}))
    }

    fn stream_names(&self, body: &Value) -> Value {
        let offset = num(body, "offset").unwrap_or(0) as usize;
        let subject = text(body, "subject");
        let names: Vec<&String> = self
            .streams
            .iter()
            .filter(|(_, e)| {
                subject.is_none_or(|s| e.stream.cfg.subjects.iter().any(|p| overlap(p, s)))
            })
            .map(|(n, _)| n)
            .collect();
        let total = names.len();
        let page: Vec<&String> = names.into_iter().skip(offset).take(1024).collect();
        json!({"total": total, "offset": offset, "limit": 1024, "streams": page})
    }

    fn stream_list(&self, body: &Value, wall: u64, server_name: &str) -> Value {
        let offset = num(body, "offset").unwrap_or(0) as usize;
        let page: Vec<Value> = self
            .streams
            .values()
            .skip(offset)
            .take(256)
            .map(|e| self.stream_json(e, wall, server_name))
            .collect();
        json!({"total": self.streams.len(), "offset": offset, "limit": 256, "streams": page})
    }

    fn msg_get(&self, name: &str, body: &Value) -> Reply {
        let e = self.entry(name)?;
        let (seq, m) = select(&e.stream, body)?;
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut msg = json!({"subject": m.subject, "seq": seq, "time": format_nanos(m.ts)});
        if let Some(h) = &m.headers {
            msg["hdrs"] = json!(b64.encode(h));
        }
        if !m.payload.is_empty() {
            msg["data"] = json!(b64.encode(&m.payload));
        }
        Ok(json!({"message": msg}))
    }

    fn direct_get(&self, name: &str, rest: &[&str], reply: Option<&str>, body: &Value) -> Handled {
        let Some(e) = self
            .streams
            .get(name)
            .filter(|e| e.stream.cfg.allow_direct == Some(true))
        else {
            return Handled::NotMine;
        };
        let Some(reply) = reply else {
            return Handled::Out(Vec::new());
        };
        let body = if rest.is_empty() {
            body.clone()
        } else {
            json!({"last_by_subj": rest.join(".")})
        };
        let out = match select(&e.stream, &body) {
            Ok((seq, m)) => {
                let mut h = format!(
                    "NATS/1.0\r\nNats-Stream: {}\r\nNats-Subject: {}\r\nNats-Sequence: {}\r\nNats-Time-Stamp: {}\r\n",
                    name,
                    m.subject,
                    seq,
                    format_nanos(m.ts)
                )
                .into_bytes();
                if let Some(orig) = &m.headers {
                    // The stored block's fields, without its version line and final CRLF.
                    let start = orig
                        .windows(2)
                        .position(|w| w == b"\r\n")
                        .map_or(orig.len(), |p| p + 2);
                    let end = orig.len().saturating_sub(2).max(start);
                    h.extend_from_slice(&orig[start..end]);
                }
                h.extend_from_slice(b"\r\n");
                Outbound {
                    to: reply.to_string(),
                    subject: reply.to_string(),
                    reply: None,
                    headers: Some(h),
                    payload: m.payload.clone(),
                }
            }
            Err(e) if e.code == 404 => Outbound::status(reply, 404, "Message Not Found", &[]),
            Err(_) => Outbound::status(reply, 408, "Bad Request", &[]),
        };
        Handled::Out(vec![out])
    }

    fn msg_delete(&mut self, name: &str, body: &Value) -> Reply {
        let e = self.entry_mut(name)?;
        if e.stream.cfg.deny_delete == Some(true) {
            return Err(errors::msg_delete_failed("message delete not permitted"));
        }
        let seq = num(body, "seq").ok_or_else(|| errors::bad_request("no sequence"))?;
        e.stream
            .remove(seq)
            .ok_or_else(|| errors::msg_delete_failed("no message found"))?;
        for c in e.consumers.values_mut() {
            c.sync(&e.stream);
        }
        Ok(json!({"success": true}))
    }

    #[allow(clippy::too_many_arguments)]
    fn consumer_create(
        &mut self,
        stream_name: &str,
        subject_name: Option<&str>,
        subject_filter: Option<&str>,
        durable_api: bool,
        body: &Value,
        now: Instant,
        wall: u64,
    ) -> Reply {
        let mut config = body.get("config").cloned().unwrap_or(Value::Null);
        if !config.is_object() {
            return Err(errors::bad_request("no consumer config"));
        }
        if let Some(s) = text(body, "stream_name")
            && s != stream_name
        {
            return Err(errors::stream_name_mismatch());
        }
        let action = text(body, "action").unwrap_or("");
        if durable_api && text(&config, "durable_name").is_none() {
            config["durable_name"] = json!(subject_name);
        }
        let named = text(&config, "name")
            .or(text(&config, "durable_name"))
            .map(str::to_string);
        if let (Some(a), Some(b)) = (subject_name, named.as_deref())
            && a != b
        {
            return Err(errors::consumer_name_mismatch());
        }
        if let Some(f) = subject_filter
            && text(&config, "filter_subject") != Some(f)
        {
            return Err(errors::invalid_consumer_config(
                "filter subject in subject does not match",
            ));
        }
        let durable = text(&config, "durable_name").is_some_and(|d| !d.is_empty());
        let name = match subject_name.map(str::to_string).or(named) {
            Some(n) => n,
            None => self.next_name(),
        };
        if !is_name(&name) {
            return Err(errors::invalid_consumer_config("invalid consumer name"));
        }
        let (config, cfg) = consumer::normalize_config(&name, &config, durable)?;
        self.entry(stream_name)?;
        let e = self.entry_mut(stream_name)?;
        if let Some(c) = e.consumers.get_mut(&name) {
            if c.config != config {
                if action == "create" {
                    return Err(errors::consumer_exists());
                }
                if let Some(why) = consumer::fixed_field_change(&c.config, &config) {
                    return Err(errors::consumer_create(why));
                }
                c.update_config(config, cfg);
            }
        } else {
            if action == "update" {
                return Err(errors::consumer_missing());
            }
            if let Some(max) = e.stream.cfg.max_consumers.filter(|m| *m > 0)
                && e.consumers.len() as i64 >= max
            {
                return Err(errors::max_consumers());
            }
            let c = Consumer::new(&name, &e.stream, config, cfg, format_nanos(wall), now);
            e.consumers.insert(name.clone(), c);
        }
        self.consumer_info(stream_name, &name, wall)
    }

    fn consumer_info(&self, stream: &str, name: &str, wall: u64) -> Reply {
        let e = self.entry(stream)?;
        let c = e
            .consumers
            .get(name)
            .ok_or_else(errors::consumer_not_found)?;
        let mut v = c.info(&e.stream, wall);
        if let Value::Object(m) = &mut v {
            m.remove("type");
        }
        Ok(v)
    }

    fn consumer_delete(&mut self, stream: &str, name: &str, _now: Instant) -> Reply {
        let e = self.entry_mut(stream)?;
        let mut c = e
            .consumers
            .remove(name)
            .ok_or_else(errors::consumer_not_found)?;
        let mut out = Vec::new();
        c.close(&mut out);
        self.closing.extend(out);
        Ok(json!({"success": true}))
    }

    fn consumer_names(&self, stream: &str, body: &Value) -> Reply {
        let e = self.entry(stream)?;
        let offset = num(body, "offset").unwrap_or(0) as usize;
        let names: Vec<&String> = e.consumers.keys().skip(offset).take(1024).collect();
        Ok(json!({"total": e.consumers.len(), "offset": offset, "limit": 1024, "consumers": names}))
    }

    fn consumer_list(&self, stream: &str, body: &Value, wall: u64) -> Reply {
        let e = self.entry(stream)?;
        let offset = num(body, "offset").unwrap_or(0) as usize;
        let list: Vec<Value> = e
            .consumers
            .values()
            .skip(offset)
            .take(256)
            .map(|c| {
                let mut v = c.info(&e.stream, wall);
                if let Value::Object(m) = &mut v {
                    m.remove("type");
                }
                v
            })
            .collect();
        Ok(json!({"total": e.consumers.len(), "offset": offset, "limit": 256, "consumers": list}))
    }

    fn next(
        &mut self,
        stream: &str,
        name: &str,
        reply: Option<&str>,
        payload: &[u8],
        now: Instant,
    ) -> Handled {
        let Some(c) = self
            .streams
            .get_mut(stream)
            .and_then(|e| e.consumers.get_mut(name))
        else {
            return Handled::NotMine;
        };
        let Some(reply) = reply else {
            return Handled::Out(Vec::new());
        };
        let mut out = Vec::new();
        match NextRequest::parse(payload) {
            Ok(req) => c.add_pull(reply, req, now, &mut out),
            Err(_) => out.push(Outbound::status(reply, 400, "Bad Request", &[])),
        }
        Handled::Out(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_overlap_when_one_subject_can_match_both() {
        assert!(overlap("a.>", "a.b"));
        assert!(overlap("a.*", "a.b"));
        assert!(overlap("*.b", "a.*"));
        assert!(!overlap("a.b", "a.c"));
        assert!(!overlap("a.*", "a.b.c"));
        assert!(overlap("a.*.>", "a.b.c"));
    }
}
