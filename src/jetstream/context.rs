//! A blocking JetStream context over [`nats::Client`](crate::nats::Client), for tests,
//! benchmarks and tools. It only sends the sans-IO layer's requests and waits for their
//! replies; the broker's event loop uses the same requests and parsers without it.

use std::time::{Duration, Instant};

use super::ack::AckKind;
use super::api::{ApiPrefix, Request, SuccessResponse, parse_response};
use super::consumer::{ConsumerAction, ConsumerConfig, ConsumerInfo};
use super::error::JsError;
use super::kv::{
    Kv, KvConfig, KvEntry, KvWatcher, WatchAction, WatchEvent, WatchOptions, WatchRequestKind,
};
use super::message::Delivery;
use super::publish::{MsgTtl, PubAck, PublishOptions, parse_pub_ack, publish_request};
use super::pull::{Inbound, PullRequest, classify};
use super::stream::{
    MsgSelector, NamesPage, PurgeRequest, PurgeResponse, StoredMessage, StreamConfig, StreamInfo,
    StreamListPage, parse_direct_get, parse_msg_get,
};
use super::{AccountInfo, account};
use crate::deadline::after;
use crate::nats::{Client, Event, Message, RequestError, RequestId, Sid};
use crate::proto::headers::HeaderMap;

/// Pages followed at most by the names/list helpers.
const MAX_PAGES: usize = 1000;

impl<'a> From<&'a Message> for Delivery<'a> {
    fn from(m: &'a Message) -> Delivery<'a> {
        Delivery {
            subject: &m.subject,
            reply: m.reply.as_deref(),
            headers: m.headers.as_ref(),
            payload: &m.payload,
        }
    }
}

fn request_error(e: RequestError, no_responders: JsError) -> JsError {
    match e {
        RequestError::NoResponders => no_responders,
        RequestError::Timeout => JsError::Timeout,
        other => JsError::Transport(other.to_string()),
    }
}

/// What a [`Context::fetch`] got: the messages, and the status that ended the pull
/// (404, 408, 409...) if one did before the batch was full.
#[derive(Debug, Default)]
pub struct Fetched {
    pub messages: Vec<Message>,
    pub end: Option<(u16, String)>,
    /// Idle heartbeats seen while waiting.
    pub heartbeats: u64,
}

/// A blocking JetStream client: the API prefix, a timeout and the connection.
#[derive(Debug)]
pub struct Context {
    client: Client,
    api: ApiPrefix,
    timeout: Duration,
}

impl Context {
    pub fn new(client: Client) -> Context {
        Context {
            client,
            api: ApiPrefix::new(),
            timeout: Duration::from_secs(5),
        }
    }

    pub fn with_api(mut self, api: ApiPrefix) -> Context {
        self.api = api;
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Context {
        self.timeout = timeout;
        self
    }

    pub fn api(&self) -> &ApiPrefix {
        &self.api
    }

    pub fn client(&mut self) -> &mut Client {
        &mut self.client
    }

    pub fn into_client(self) -> Client {
        self.client
    }

    /// Sends `req` as a request and returns the reply message. No responders on an API
    /// subject means the server runs without JetStream.
    pub fn send(&mut self, req: &Request) -> Result<Message, JsError> {
        self.send_mapping(req, JsError::NotEnabled)
    }

    fn send_mapping(&mut self, req: &Request, no_responders: JsError) -> Result<Message, JsError> {
        self.client
            .request(
                &req.subject,
                req.headers.as_ref(),
                &req.payload,
                self.timeout,
            )
            .map_err(|e| request_error(e, no_responders))
    }

    fn call<T: serde::de::DeserializeOwned>(&mut self, req: &Request) -> Result<T, JsError> {
        let reply = self.send(req)?;
        parse_response(&reply.payload)
    }

    pub fn account_info(&mut self) -> Result<AccountInfo, JsError> {
        let req = self.api.account_info();
        self.call::<account::AccountInfo>(&req)
    }

    pub fn create_stream(&mut self, config: &StreamConfig) -> Result<StreamInfo, JsError> {
        let req = self.api.stream_create(config)?;
        self.call(&req)
    }

    pub fn update_stream(&mut self, config: &StreamConfig) -> Result<StreamInfo, JsError> {
        let req = self.api.stream_update(config)?;
        self.call(&req)
    }

    pub fn stream_info(&mut self, stream: &str) -> Result<StreamInfo, JsError> {
        let req = self.api.stream_info(stream)?;
        self.call(&req)
    }

    pub fn delete_stream(&mut self, stream: &str) -> Result<bool, JsError> {
        let req = self.api.stream_delete(stream)?;
        Ok(self.call::<SuccessResponse>(&req)?.success)
    }

    pub fn purge_stream(
        &mut self,
        stream: &str,
        purge: &PurgeRequest,
    ) -> Result<PurgeResponse, JsError> {
        let req = self.api.stream_purge(stream, purge)?;
        self.call(&req)
    }

    /// Every stream name (all pages), optionally only streams listening on `subject`.
    pub fn stream_names(&mut self, subject: Option<&str>) -> Result<Vec<String>, JsError> {
        let mut names = Vec::new();
        let mut offset = 0;
        for _ in 0..MAX_PAGES {
            let req = self.api.stream_names(subject, offset);
            let page: NamesPage = self.call(&req)?;
            names.extend_from_slice(page.names());
            match page.next_offset() {
                Some(next) => offset = next,
                None => break,
            }
        }
        Ok(names)
    }

    /// Every stream's info (all pages).
    pub fn stream_list(&mut self) -> Result<Vec<StreamInfo>, JsError> {
        let mut all = Vec::new();
        let mut offset = 0;
        for _ in 0..MAX_PAGES {
            let req = self.api.stream_list(offset);
            let page: StreamListPage = self.call(&req)?;
            let next = page.next_offset();
            all.extend(page.streams.unwrap_or_default());
            match next {
                Some(n) => offset = n,
                None => break,
            }
        }
        Ok(all)
    }

    pub fn get_msg(&mut self, stream: &str, which: &MsgSelector) -> Result<StoredMessage, JsError> {
        let req = self.api.msg_get(stream, which)?;
        let reply = self.send(&req)?;
        parse_msg_get(&reply.payload)
    }

    /// `DIRECT.GET`; nobody answering means the stream does not exist (or does not
    /// allow direct gets).
    pub fn direct_get(
        &mut self,
        stream: &str,
        which: &MsgSelector,
    ) -> Result<StoredMessage, JsError> {
        let req = self.api.direct_get(stream, which)?;
        let reply = self.send_mapping(&req, JsError::NoResponders)?;
        parse_direct_get(reply.headers.as_ref(), &reply.payload)
    }

    pub fn delete_msg(&mut self, stream: &str, seq: u64, erase: bool) -> Result<bool, JsError> {
        let req = self.api.msg_delete(stream, seq, erase)?;
        Ok(self.call::<SuccessResponse>(&req)?.success)
    }

    pub fn create_consumer(
        &mut self,
        stream: &str,
        config: &ConsumerConfig,
        action: ConsumerAction,
    ) -> Result<ConsumerInfo, JsError> {
        let req = self.api.consumer_create(stream, config, action)?;
        self.call(&req)
    }

    pub fn consumer_info(&mut self, stream: &str, consumer: &str) -> Result<ConsumerInfo, JsError> {
        let req = self.api.consumer_info(stream, consumer)?;
        self.call(&req)
    }

    pub fn delete_consumer(&mut self, stream: &str, consumer: &str) -> Result<bool, JsError> {
        let req = self.api.consumer_delete(stream, consumer)?;
        Ok(self.call::<SuccessResponse>(&req)?.success)
    }

    pub fn consumer_names(&mut self, stream: &str) -> Result<Vec<String>, JsError> {
        let mut names = Vec::new();
        let mut offset = 0;
        for _ in 0..MAX_PAGES {
            let req = self.api.consumer_names(stream, offset)?;
            let page: NamesPage = self.call(&req)?;
            names.extend_from_slice(page.names());
            match page.next_offset() {
                Some(next) => offset = next,
                None => break,
            }
        }
        Ok(names)
    }

    /// Publishes to a stream and waits for its PubAck.
    pub fn publish(
        &mut self,
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        options: &PublishOptions,
    ) -> Result<PubAck, JsError> {
        let id = self.publish_async(subject, headers, payload, options)?;
        self.wait_pub_ack(id)
    }

    /// Publishes to a stream without waiting; [`Context::wait_pub_ack`] with the
    /// returned id waits for its PubAck. Many can be in flight at once.
    pub fn publish_async(
        &mut self,
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        options: &PublishOptions,
    ) -> Result<RequestId, JsError> {
        if !options.is_empty() {
            let req = publish_request(subject, headers, payload, options)?;
            return self.start(&req);
        }
        // No expectation headers to add: send the caller's bytes as they are.
        self.client
            .connection_mut()
            .request(subject, headers, payload, self.timeout, Instant::now())
            .map_err(|e| match e {
                crate::nats::Error::InvalidSubject(s) => {
                    JsError::Invalid(format!("invalid publish subject {s:?}"))
                }
                other => JsError::Transport(other.to_string()),
            })
    }

    fn start(&mut self, req: &Request) -> Result<RequestId, JsError> {
        self.client
            .connection_mut()
            .request(
                &req.subject,
                req.headers.as_ref(),
                &req.payload,
                self.timeout,
                Instant::now(),
            )
            .map_err(|e| JsError::Transport(e.to_string()))
    }

    pub fn wait_pub_ack(&mut self, id: RequestId) -> Result<PubAck, JsError> {
        let deadline = after(
            Instant::now(),
            self.timeout.saturating_add(Duration::from_millis(50)),
        );
        let reply = self
            .client
            .wait_response(id, deadline)
            .map_err(|e| request_error(e, JsError::NoResponders))?;
        parse_pub_ack(reply.status(), &reply.payload)
    }

    /// Sends a pull request for `pull.batch` messages to a fresh inbox and collects
    /// what arrives until the batch is full, a status ends the pull, or `wait` passes.
    /// Idle heartbeats are counted; flow-control requests are answered.
    pub fn fetch(
        &mut self,
        stream: &str,
        consumer: &str,
        pull: &PullRequest,
        wait: Duration,
    ) -> Result<Fetched, JsError> {
        let req = self.api.pull_next(stream, consumer, pull)?;
        let inbox = self.client.connection_mut().new_inbox();
        let sid = self.subscribe(&inbox)?;
        let result = self.fetch_on(sid, &inbox, &req, pull.batch, wait);
        let _ = self.client.unsubscribe(sid, None);
        result
    }

    fn subscribe(&mut self, subject: &str) -> Result<Sid, JsError> {
        self.client
            .subscribe(subject, None)
            .map_err(|e| JsError::Transport(e.to_string()))
    }

    fn fetch_on(
        &mut self,
        sid: Sid,
        inbox: &str,
        req: &Request,
        batch: u64,
        wait: Duration,
    ) -> Result<Fetched, JsError> {
        self.client
            .publish(
                &req.subject,
                Some(inbox),
                req.headers.as_ref(),
                &req.payload,
            )
            .map_err(|e| JsError::Transport(e.to_string()))?;
        let deadline = after(Instant::now(), wait);
        let mut out = Fetched::default();
        while (out.messages.len() as u64) < batch {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let Some(msg) = self
                .client
                .next_message(sid, left)
                .map_err(|e| JsError::Transport(e.to_string()))?
            else {
                break;
            };
            let reply = match classify(&Delivery::from(&msg)) {
                Inbound::Message => None,
                Inbound::IdleHeartbeat { .. } => {
                    out.heartbeats += 1;
                    continue;
                }
                Inbound::FlowControl { reply } => Some(reply.to_string()),
                _ => {
                    let code = msg.status().unwrap_or_default();
                    out.end = Some((code, msg.description().unwrap_or_default().to_string()));
                    break;
                }
            };
            match reply {
                Some(fc) => self
                    .client
                    .publish(&fc, None, None, b"")
                    .map_err(|e| JsError::Transport(e.to_string()))?,
                None => out.messages.push(msg),
            }
        }
        Ok(out)
    }

    /// Acknowledges a delivery without waiting.
    pub fn ack(&mut self, msg: &Message, kind: &AckKind) -> Result<(), JsError> {
        let reply = ack_reply(msg)?;
        self.client
            .publish(reply, None, None, &kind.payload())
            .map_err(|e| JsError::Transport(e.to_string()))
    }

    /// Acknowledges a delivery and waits for the server to confirm it.
    pub fn ack_sync(&mut self, msg: &Message, kind: &AckKind) -> Result<(), JsError> {
        let reply = ack_reply(msg)?.to_string();
        let req = Request::new(reply, kind.payload().into_owned());
        // No responders: the consumer or its ack subscription is gone.
        self.send_mapping(&req, JsError::NoResponders).map(|_| ())
    }

    // KV

    /// Creates (or updates to the same config) a bucket and returns its handle.
    pub fn kv_create(&mut self, config: &KvConfig) -> Result<Kv, JsError> {
        let stream = config.stream_config()?;
        let info = self.create_stream(&stream)?;
        Kv::from_stream_info(self.api.clone(), &info)
    }

    /// Binds to an existing bucket.
    pub fn kv_bind(&mut self, bucket: &str) -> Result<Kv, JsError> {
        let kv = Kv::new(self.api.clone(), bucket)?;
        let req = kv.info_request()?;
        match self.call::<StreamInfo>(&req) {
            Ok(info) => Kv::from_stream_info(self.api.clone(), &info),
            Err(JsError::StreamNotFound(_)) => Err(JsError::BucketNotFound),
            Err(e) => Err(e),
        }
    }

    pub fn kv_delete_bucket(&mut self, bucket: &str) -> Result<bool, JsError> {
        match self.delete_stream(&super::kv::stream_name(bucket)) {
            Err(JsError::StreamNotFound(_)) => Err(JsError::BucketNotFound),
            other => other,
        }
    }

    /// The latest entry of `key`, deleted or not.
    pub fn kv_entry(&mut self, kv: &Kv, key: &str) -> Result<KvEntry, JsError> {
        let req = kv.get_request(key)?;
        let reply = self.send_mapping(&req, JsError::BucketNotFound)?;
        kv.parse_get(key, reply.headers.as_ref(), &reply.payload)
    }

    /// The value of `key`; deleted and purged keys are [`JsError::KeyNotFound`].
    pub fn kv_get(&mut self, kv: &Kv, key: &str) -> Result<KvEntry, JsError> {
        match self.kv_entry(kv, key)? {
            e if e.is_deleted() => Err(JsError::KeyNotFound),
            e => Ok(e),
        }
    }

    /// A given revision of `key`.
    pub fn kv_get_revision(
        &mut self,
        kv: &Kv,
        key: &str,
        revision: u64,
    ) -> Result<KvEntry, JsError> {
        let req = kv.get_revision_request(key, revision)?;
        let reply = self.send_mapping(&req, JsError::BucketNotFound)?;
        kv.parse_get(key, reply.headers.as_ref(), &reply.payload)
    }

    fn kv_write(&mut self, req: &Request) -> Result<u64, JsError> {
        let reply = self.send_mapping(req, JsError::BucketNotFound)?;
        Ok(parse_pub_ack(reply.status(), &reply.payload)?.seq)
    }

    /// Writes `value`; returns the new revision.
    pub fn kv_put(&mut self, kv: &Kv, key: &str, value: &[u8]) -> Result<u64, JsError> {
        self.kv_write(&kv.put_request(key, value, None)?)
    }

    /// Writes `value` that expires after `ttl` (the bucket needs `allow_msg_ttl`).
    pub fn kv_put_ttl(
        &mut self,
        kv: &Kv,
        key: &str,
        value: &[u8],
        ttl: MsgTtl,
    ) -> Result<u64, JsError> {
        self.kv_write(&kv.put_request(key, value, Some(ttl))?)
    }

    /// Writes only if the key has no value; a deleted or purged key counts as absent.
    /// An existing key is [`JsError::WrongLastSequence`].
    pub fn kv_create_key(
        &mut self,
        kv: &Kv,
        key: &str,
        value: &[u8],
        ttl: Option<MsgTtl>,
    ) -> Result<u64, JsError> {
        let first = self.kv_write(&kv.create_request(key, value, ttl)?);
        let Err(err @ JsError::WrongLastSequence(_)) = first else {
            return first;
        };
        let current = self.kv_entry(kv, key);
        match Kv::create_retry(&current) {
            Some(revision) => {
                let mut req = kv.update_request(key, value, revision)?;
                if let Some(ttl) = ttl {
                    let h = req.headers.get_or_insert_with(HeaderMap::new);
                    h.insert(super::publish::MSG_TTL, &ttl.header_value()?)
                        .map_err(|e| JsError::Invalid(e.to_string()))?;
                }
                self.kv_write(&req)
            }
            None => Err(err),
        }
    }

    /// Writes only if the key's latest revision is `revision`.
    pub fn kv_update(
        &mut self,
        kv: &Kv,
        key: &str,
        value: &[u8],
        revision: u64,
    ) -> Result<u64, JsError> {
        self.kv_write(&kv.update_request(key, value, revision)?)
    }

    pub fn kv_delete(&mut self, kv: &Kv, key: &str) -> Result<u64, JsError> {
        self.kv_write(&kv.delete_request(key, None)?)
    }

    pub fn kv_purge(&mut self, kv: &Kv, key: &str) -> Result<u64, JsError> {
        self.kv_write(&kv.purge_request(key, None)?)
    }

    /// Starts a watch; [`BlockingWatch::next`] drives it.
    pub fn kv_watch(&mut self, kv: &Kv, options: WatchOptions) -> Result<BlockingWatch, JsError> {
        let inbox = self.client.connection_mut().new_inbox();
        let name = format!("watch_{}", inbox.rsplit('.').next().unwrap_or("w"));
        let watcher = KvWatcher::new(kv.clone(), options, &inbox, &name, Instant::now())?;
        Ok(BlockingWatch {
            watcher,
            subs: Vec::new(),
            requests: Vec::new(),
        })
    }
}

fn ack_reply(msg: &Message) -> Result<&str, JsError> {
    msg.reply
        .as_deref()
        .filter(|r| r.starts_with("$JS.ACK."))
        .ok_or_else(|| JsError::Invalid("not a JetStream delivery (no $JS.ACK reply)".into()))
}

/// A [`KvWatcher`] driven by the blocking client. While it waits it consumes the
/// client's events; events of other subscriptions that arrive meanwhile are dropped.
#[derive(Debug)]
pub struct BlockingWatch {
    watcher: KvWatcher,
    subs: Vec<(String, Sid)>,
    requests: Vec<(RequestId, WatchRequestKind)>,
}

impl BlockingWatch {
    pub fn watcher(&self) -> &KvWatcher {
        &self.watcher
    }

    /// Starts over with a new consumer, as after a lost connection.
    pub fn restart(&mut self, reason: &str) {
        self.watcher.restart(reason, Instant::now());
    }

    fn run_actions(&mut self, js: &mut Context) -> Result<(), JsError> {
        while let Some(action) = self.watcher.poll_action() {
            match action {
                WatchAction::Subscribe { subject } => {
                    let sid = js.subscribe(&subject)?;
                    self.subs.push((subject, sid));
                }
                WatchAction::Unsubscribe { subject } => {
                    if let Some(pos) = self.subs.iter().position(|(s, _)| *s == subject) {
                        let (_, sid) = self.subs.remove(pos);
                        let _ = js.client.unsubscribe(sid, None);
                    }
                }
                WatchAction::Request { kind, request } => {
                    let id = js.start(&request)?;
                    if matches!(kind, WatchRequestKind::CreateConsumer { .. }) {
                        self.requests.push((id, kind));
                    }
                }
                WatchAction::Publish(req) => js
                    .client
                    .publish(&req.subject, None, req.headers.as_ref(), &req.payload)
                    .map_err(|e| JsError::Transport(e.to_string()))?,
            }
        }
        Ok(())
    }

    /// The next watch event, or `None` when `timeout` passes first.
    pub fn next(
        &mut self,
        js: &mut Context,
        timeout: Duration,
    ) -> Result<Option<WatchEvent>, JsError> {
        let deadline = after(Instant::now(), timeout);
        loop {
            self.run_actions(js)?;
            let now = Instant::now();
            if let Some(e) = self.watcher.poll_event(now) {
                return Ok(Some(e));
            }
            if now >= deadline {
                return Ok(None);
            }
            let wake = self
                .watcher
                .poll_timeout()
                .map_or(deadline, |t| t.min(deadline));
            let mut got: Vec<Event> = Vec::new();
            let subs = &self.subs;
            let requests = &self.requests;
            js.client
                .run_until(wake.saturating_duration_since(now), |event| {
                    let mine = match event {
                        Event::Message { sid, .. } => subs.iter().any(|(_, s)| s == sid),
                        Event::Response { id, .. } | Event::RequestFailed { id, .. } => {
                            requests.iter().any(|(r, _)| r == id)
                        }
                        _ => false,
                    };
                    if mine {
                        got.push(event.clone());
                    }
                    mine
                })
                .map_err(|e| JsError::Transport(e.to_string()))?;
            let now = Instant::now();
            for event in got {
                match event {
                    Event::Message { msg, .. } => {
                        self.watcher.on_message(&Delivery::from(&msg), now)
                    }
                    Event::Response { id, msg } => {
                        if let Some(kind) = self.take_request(id) {
                            self.watcher.on_reply(kind, Ok(&msg.payload), now);
                        }
                    }
                    Event::RequestFailed { id, error } => {
                        if let Some(kind) = self.take_request(id) {
                            let e = request_error(error, JsError::NotEnabled);
                            self.watcher.on_reply(kind, Err(e), now);
                        }
                    }
                    _ => {}
                }
            }
            self.watcher.handle_timeout(Instant::now());
        }
    }

    fn take_request(&mut self, id: RequestId) -> Option<WatchRequestKind> {
        let pos = self.requests.iter().position(|(r, _)| *r == id)?;
        Some(self.requests.remove(pos).1)
    }

    /// Stops the watch: unsubscribes and deletes the consumer.
    pub fn stop(mut self, js: &mut Context) -> Result<(), JsError> {
        if let Some(req) = self.watcher.stop() {
            let _ = js.send(&req);
        }
        self.run_actions(js)
    }
}
