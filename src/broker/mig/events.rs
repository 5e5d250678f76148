//! MIG events over AMP topics (mig-nats.md section 4): PUBLISH stores an AMP event, one
//! durable consumer per tenant (`mig_events`, shared by every broker) feeds the live
//! subjects, and SUBSCRIBE pages through the stored events from an exclusive cursor.

use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::envelope::{Code, Echo, MigError};
use super::{Answer, JS_TIMEOUT, Mig, Pending, Sub, seen};
use crate::broker::binding;
use crate::broker::config::{Config, Participant, is_topic_pattern};
use crate::broker::core::{consumer_exists, naming_the_field};
use crate::broker::envelope::{self, Envelope, Kind};
use crate::broker::held_bytes::Hold;
use crate::broker::in_flight::Ticket;
use crate::broker::permissions::{self, Action};
use crate::broker::pull_loop::{Check, PullLoop, Pulled};
use crate::jetstream::JsError;
use crate::jetstream::ack::AckKind;
use crate::jetstream::ack::AckMetadata;
use crate::jetstream::api::{ApiPrefix, check_error};
use crate::jetstream::consumer::{ConsumerAction, DeliverFrom};
use crate::jetstream::publish::{PubAck, parse_pub_ack};
use crate::jetstream::stream::{MsgSelector, parse_msg_get};
use crate::nats::{Connection, Message, RequestError, RequestId};
use crate::proto::headers::HeaderMap;

/// The durable consumer on `AMP_TOPICS_<ns>` that feeds the live event subjects.
pub const LIVE_CONSUMER: &str = "mig_events";
/// Its bound on unacknowledged events.
const LIVE_MAX_ACK_PENDING: u32 = 1000;
/// Events pulled at once for the live subjects.
const LIVE_BATCH: u32 = 64;
/// The longest a feed whose consumer could not be made waits before asking again.
const LIVE_RETRY_MAX: Duration = Duration::from_secs(60);
/// SUBSCRIBE page size: default and most.
const PAGE_DEFAULT: u64 = 100;
const PAGE_MAX: u64 = 1000;
/// What a replay page keeps free of `max_payload` for its reply header, NATS headers,
/// `next_cursor` and `caught_up` (the echoed ids and traceparent are bounded well below it).
const PAGE_SLACK: usize = 4096;

/// The bytes of EventMessages one replay page may carry.
fn page_limit(max_payload: usize) -> usize {
    max_payload.saturating_sub(PAGE_SLACK)
}

/// Whether an EventMessage of `len` bytes fits in a replay page alone, with the comma
/// that separates it from the next (a live event, with its few NATS headers, is then well
/// within `max_payload` too).
fn fits_a_page(len: usize, max_payload: usize) -> bool {
    len < page_limit(max_payload)
}

/// The stored events a SUBSCRIBE may read (each one JetStream read), as its caller's
/// pace counts them: the page size it asks for, or the default.
pub(super) fn page_cost(body: Option<&Map<String, Value>>) -> u64 {
    body.and_then(|b| b.get("max_inflight"))
        .and_then(Value::as_u64)
        .map_or(PAGE_DEFAULT, |n| n.clamp(1, PAGE_MAX))
}

/// A PUBLISH waiting for its PubAck.
pub struct PublishRequest {
    reply: String,
    echo: Echo,
    topic: String,
    event_id: String,
    received: Instant,
    /// Its place in its caller's requests in flight, through the claim and the store.
    _ticket: Option<Ticket>,
}

impl PublishRequest {
    fn answer(&self) -> Answer<'_> {
        Answer {
            reply: &self.reply,
            echo: &self.echo,
            op: "publish",
            capability: "",
            received: self.received,
        }
    }
}

/// A PUBLISH held while its signed id is recorded (`seen`): its event is stored after,
/// or its refusal answered.
pub struct ClaimedPublish {
    then: AfterClaim,
    request: PublishRequest,
}

enum AfterClaim {
    Store {
        /// The tenant whose bucket holds the claim.
        ns: String,
        subject: String,
        nats: HeaderMap,
        bytes: Vec<u8>,
        /// Released once the event is handed to the connection's bounded write buffer.
        _hold: Hold,
    },
    /// `caller` (`ns/name`) holds the claim in `claims_held`.
    Refuse { error: MigError, caller: String },
}

impl ClaimedPublish {
    /// The tenant whose bucket the claim went to.
    pub(super) fn ns(&self) -> &str {
        match &self.then {
            AfterClaim::Store { ns, .. } => ns,
            AfterClaim::Refuse { caller, .. } => super::caller_tenant(caller),
        }
    }
}

/// The signer and id of a PUBLISH whose signature verified.
#[derive(Clone, Copy)]
pub struct Signed<'a> {
    pub ns: &'a str,
    pub name: &'a str,
    pub id: &'a str,
}

/// A SUBSCRIBE page being read, one stored event after another.
pub struct ReplayPage {
    reply: String,
    echo: Echo,
    ns: String,
    filter: String,
    /// The next sequence to read from (inclusive).
    from: u64,
    /// The exclusive cursor the page started from.
    cursor: u64,
    left: u64,
    events: Vec<Value>,
    /// The answer must fit in one NATS message.
    bytes: usize,
    limit: usize,
    received: Instant,
    /// Its place in its caller's requests in flight, from the first read to the answer.
    _ticket: Option<Ticket>,
}

/// The live feed of one tenant.
pub struct LiveFeed {
    ns: String,
    pull: PullLoop,
    /// The highest stream sequence the feed knows its consumer delivered (here, or to
    /// any broker when it was made): a consumer made again after its loss starts after it.
    /// `None` until it knows one: such a consumer takes new events only.
    seen: Option<u64>,
    /// Tries in a row to make the consumer again that failed.
    retries: u32,
}

fn is_topic(t: &str) -> bool {
    is_topic_pattern(t) && !t.contains('*') && !t.contains('>')
}

/// An EventMessage of a stored AMP event.
fn event_message(ns: &str, seq: u64, env: &Envelope, replay: bool, timestamp: &str) -> Value {
    let topic = env.topic.clone().unwrap_or_default();
    let payload: Value = serde_json::from_str(&env.body).unwrap_or(Value::Null);
    json!({
        "header": {"mig_version": super::envelope::MIG_VERSION, "tenant_id": ns,
                   "message_id": env.id, "timestamp": timestamp},
        "topic": topic,
        "event_id": env.id,
        "sequence": seq,
        "payload": payload,
        "published_at": env.ts,
        "replay": replay,
    })
}

impl Mig {
    /// Creates each tenant's live-feed consumer (idempotent: every broker asks for the
    /// same one) and pulls it once it is there.
    pub(super) fn start_live(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        now: Instant,
    ) -> Result<(), String> {
        for ns in config.namespaces.keys() {
            let stream = binding::topics_stream(ns);
            let pull = PullLoop::new(stream, LIVE_CONSUMER.to_string(), LIVE_BATCH)
                .in_domain(config.js_api(ns));
            self.live.push(LiveFeed {
                ns: ns.clone(),
                pull,
                seen: None,
                retries: 0,
            });
            self.make_live_consumer(conn, config, self.live.len() - 1, now)
                .map_err(|e| format!("MIG live consumer of {ns}: {e}"))?;
        }
        Ok(())
    }

    /// Asks for feed `feed`'s consumer: new events only while the feed knows no event
    /// (`CreateOrUpdate`, as at start), else from the one after the last it knows of,
    /// made only if it is not there (another broker may have made it first).
    fn make_live_consumer(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        feed: usize,
        now: Instant,
    ) -> Result<(), String> {
        let Some(f) = self.live.get(feed) else {
            return Ok(());
        };
        let live = binding::mig_live_consumer_config(LIVE_CONSUMER, LIVE_MAX_ACK_PENDING);
        let (live, action) = match f.seen {
            None => (live, ConsumerAction::CreateOrUpdate),
            Some(seq) => (
                live.deliver_from(DeliverFrom::Sequence(seq.saturating_add(1))),
                ConsumerAction::Create,
            ),
        };
        let req = config
            .js_api(&f.ns)
            .consumer_create(&binding::topics_stream(&f.ns), &live, action)
            .map_err(|e| e.to_string())?;
        let id = conn
            .request(&req.subject, None, &req.payload, JS_TIMEOUT, now)
            .map_err(|e| e.to_string())?;
        self.staged
            .push(id, super::Awaiting(Pending::LiveConsumer(feed)), now);
        Ok(())
    }

    /// The feed's consumer is there (made, or found made by another broker): the feed
    /// pulls it. Otherwise it asks again later.
    pub(super) fn live_consumer_ready(
        &mut self,
        conn: &mut Connection,
        feed: usize,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let Some(f) = self.live.get_mut(feed) else {
            return;
        };
        let answer = reply
            .map_err(|e| e.to_string())
            .and_then(|m| match check_error(&m.payload) {
                Ok(()) => Ok(Some(m)),
                Err(e) if consumer_exists(&e) => Ok(None),
                Err(e) => Err(naming_the_field(e).to_string()),
            });
        let info = match answer {
            Ok(info) => info,
            Err(e) => {
                log::warn!(ns:% = f.ns; "MIG live event consumer not made ({e}); asking again later");
                return self.retry_live(feed, now);
            }
        };
        // Where the consumer stands: what it delivered, to any broker, is not published
        // again by a consumer made after its loss.
        let delivered = info
            .and_then(|m| serde_json::from_slice::<Value>(&m.payload).ok())
            .and_then(|v| v["delivered"]["stream_seq"].as_u64());
        if let Some(d) = delivered {
            f.seen = Some(f.seen.map_or(d, |s| s.max(d)));
        }
        if f.pull.sid().is_none() {
            match f.pull.attach(conn) {
                Ok(sid) => {
                    self.subs.insert(sid, Sub::Live(feed));
                }
                Err(e) => {
                    log::warn!(ns:% = f.ns; "MIG live event subscription failed ({e}); asking again later");
                    return self.retry_live(feed, now);
                }
            }
        }
        f.retries = 0;
        let at = f.pull.pull(conn, now);
        self.arm_live(feed, at);
    }

    /// The feed's consumer is gone (deleted, or lost with a server that restarted
    /// without its state): pulling alone would be refused once a second for good, and
    /// live events stopped without a word. The stream is asked where it stands first: one
    /// made again from nothing starts its sequences at 1, below the last event the feed
    /// knows of, and a consumer made after that event would hear nothing until the new
    /// stream passed it.
    fn live_lost(&mut self, conn: &mut Connection, config: &Config, feed: usize, now: Instant) {
        let Some(f) = self.live.get_mut(feed) else {
            return;
        };
        if let Some(sid) = f.pull.detach(conn) {
            self.subs.remove(&sid);
        }
        let sent = super::js_request(
            conn,
            config
                .js_api(&f.ns)
                .stream_info(&binding::topics_stream(&f.ns)),
            now,
        );
        match sent {
            Ok(id) => {
                let pending = Pending::LiveStream(feed);
                self.staged.push(id, super::Awaiting(pending), now);
            }
            Err(e) => {
                log::warn!(ns:% = f.ns; "MIG live event stream not asked ({e}); asking again later");
                self.retry_live(feed, now);
            }
        }
    }

    /// Where the topics stream of a feed whose consumer is gone stands: the consumer is
    /// made again after the last event the feed knows of, or from the stream's start if
    /// the stream went back behind it (everything in the new stream came after).
    pub(super) fn live_stream_read(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        feed: usize,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let Some(f) = self.live.get_mut(feed) else {
            return;
        };
        let last = reply.map_err(|e| e.to_string()).and_then(|m| {
            check_error(&m.payload).map_err(|e| e.to_string())?;
            serde_json::from_slice::<Value>(&m.payload)
                .ok()
                .and_then(|v| v["state"]["last_seq"].as_u64())
                .ok_or_else(|| "no state.last_seq".to_string())
        });
        let last = match last {
            Ok(last) => last,
            Err(e) => {
                log::warn!(ns:% = f.ns; "MIG live event stream unavailable ({e}); asking again later");
                return self.retry_live(feed, now);
            }
        };
        if f.seen.is_some_and(|seen| seen > last) {
            log::warn!(ns:% = f.ns; "topics stream went back to seq {last}; MIG live events follow it from its start");
            f.seen = Some(0);
        }
        log::warn!(ns:% = f.ns; "MIG live event consumer gone; making it again");
        if let Err(e) = self.make_live_consumer(conn, config, feed, now) {
            log::warn!(ns:% = self.live[feed].ns; "MIG live event consumer not asked for ({e}); asking again later");
            self.retry_live(feed, now);
        }
    }

    /// Asks again for a feed's consumer after 1, 2, 4 ... at most 60 s.
    fn retry_live(&mut self, feed: usize, now: Instant) {
        let Some(f) = self.live.get_mut(feed) else {
            return;
        };
        let wait = Duration::from_secs(1 << f.retries.min(6)).min(LIVE_RETRY_MAX);
        f.retries = f.retries.saturating_add(1);
        self.later.push(
            crate::deadline::after(now, wait),
            super::Alarm::LiveRetry(feed),
        );
    }

    /// A feed waiting to ask again for its consumer does.
    pub(super) fn live_retry(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        feed: usize,
        now: Instant,
    ) {
        if self.live.get(feed).is_some_and(|f| f.pull.sid().is_none()) {
            self.live_lost(conn, config, feed, now);
        }
    }

    pub(super) fn arm_live(&mut self, feed: usize, check: Option<Check>) {
        if let Some(c) = check {
            self.later
                .push(c.at, super::Alarm::LiveCheck(feed, c.generation));
        }
    }

    pub(super) fn live_check(
        &mut self,
        conn: &mut Connection,
        feed: usize,
        generation: u64,
        now: Instant,
    ) {
        let next = self
            .live
            .get_mut(feed)
            .and_then(|f| f.pull.check(conn, generation, now));
        self.arm_live(feed, next);
    }

    /// A pull still held by the server came back with its subscription: each feed pulls
    /// on a fresh one ([`PullLoop::retire`]). Record changes may have been missed.
    pub fn after_reconnect(&mut self, conn: &mut Connection, now: Instant) {
        self.subs.retain(|_, s| !matches!(s, Sub::RetiredLive(_)));
        for feed in 0..self.live.len() {
            let Some(f) = self.live.get_mut(feed) else {
                continue;
            };
            let Some(retired) = f.pull.retire(conn) else {
                continue;
            };
            self.subs.insert(retired, Sub::RetiredLive(feed));
            match f.pull.attach(conn) {
                Ok(sid) => {
                    self.subs.insert(sid, Sub::Live(feed));
                    let at = f.pull.restart(conn, now);
                    self.arm_live(feed, at);
                }
                Err(e) => {
                    log::warn!(ns:% = f.ns; "MIG live event subscription failed ({e}); asking again later");
                    self.retry_live(feed, now);
                }
            }
        }
        self.reread_records(conn, now);
        self.seen_after_reconnect(conn, now);
    }

    /// A delivery of the feed's pull from before the reconnect: published as any other,
    /// uncounted (the new pull did not bring it).
    pub(super) fn retired_live_delivery(
        &mut self,
        conn: &mut Connection,
        feed: usize,
        msg: &Message,
        now: Instant,
    ) {
        let Some(f) = self.live.get_mut(feed).filter(|f| f.pull.delivers(msg)) else {
            return;
        };
        let seq = msg
            .reply
            .as_deref()
            .and_then(|r| AckMetadata::parse(r).ok())
            .map_or(0, |m| m.stream_sequence);
        f.seen = Some(f.seen.map_or(seq, |s| s.max(seq)));
        let ns = f.ns.clone();
        self.publish_live(conn, &ns, seq, msg, now);
    }

    /// One delivery of a tenant's live feed: published once on its live subject, then acked.
    pub(super) fn live_delivery(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        feed: usize,
        msg: &Message,
        now: Instant,
    ) {
        let Some(f) = self.live.get_mut(feed) else {
            return;
        };
        let (pulled, at) = f.pull.on_message(conn, msg, now);
        let ns = f.ns.clone();
        let reply = msg.reply.as_deref().filter(|_| pulled == Pulled::Message);
        let seq = reply
            .and_then(|r| AckMetadata::parse(r).ok())
            .map(|m| m.stream_sequence);
        if let Some(seq) = seq {
            f.seen = Some(f.seen.map_or(seq, |s| s.max(seq)));
        }
        let seq = seq.unwrap_or(0);
        if pulled == Pulled::Lost {
            return self.live_lost(conn, config, feed, now);
        }
        self.arm_live(feed, at);
        if reply.is_some() {
            self.publish_live(conn, &ns, seq, msg, now);
        }
    }

    /// Publishes a delivery of a feed on its live subject, then acks it.
    fn publish_live(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        seq: u64,
        msg: &Message,
        now: Instant,
    ) {
        let Some(reply) = msg.reply.as_deref() else {
            return;
        };
        if let Ok(env) = Envelope::from_json(&msg.payload)
            && let Some(topic) = env.topic.as_deref().filter(|t| is_topic(t))
        {
            let ts = self.timestamp(now);
            let event = event_message(ns, seq, &env, false, &ts);
            let subject = format!("{}.{ns}.events.{topic}", super::subjects::ROOT);
            let echo = Echo {
                tenant_id: ns.to_string(),
                message_id: Some(env.id.clone()),
                ..Echo::default()
            };
            if let Err(e) = conn.publish(
                &subject,
                None,
                Some(&echo.nats_headers()),
                event.to_string().as_bytes(),
            ) {
                log::warn!(subject:% = subject; "MIG live event not sent: {e}");
            }
        }
        let _ = conn.publish(reply, None, None, &AckKind::Ack.payload());
    }

    // ---- PUBLISH ---------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    pub(super) fn publish(
        &mut self,
        conn: &mut Connection,
        ctx: &mut super::Ctx<'_>,
        ns: &str,
        name: &str,
        participant: &Participant,
        topic: &str,
        answer: &Answer<'_>,
        header: &super::envelope::Header,
        body: &Map<String, Value>,
        ticket: Option<Ticket>,
        now: Instant,
    ) {
        let refused = |code: Code, m: &str| Err(MigError::new(code, m));
        let check = if body.get("topic").is_some_and(|t| t.as_str() != Some(topic)) {
            refused(
                Code::InvalidRequest,
                "topic is not the topic of the subject",
            )
        } else if !is_topic(topic) {
            refused(
                Code::InvalidRequest,
                "the topic is 1-16 dot-separated tokens of A-Z a-z 0-9 _ -",
            )
        } else if !permissions::allows(&participant.permissions, Action::Publish, topic) {
            refused(Code::Forbidden, "publishing to this topic is not permitted")
        } else if !matches!(body.get("payload"), Some(Value::Object(_))) {
            refused(
                Code::InvalidRequest,
                "payload is required and must be a JSON object",
            )
        } else {
            Ok(())
        };
        // Only a signature reaches this far (`Refusal::Exposed`).
        let signed = Signed {
            ns,
            name,
            id: &header.message_id,
        };
        // Another broker's id a copy replays may not be in a bucket just made again yet;
        // refused, the id is claimed all the same.
        let check = match check {
            Ok(()) if self.reclaims.settling(now) => Err(super::reclaim::settling()),
            checked => checked,
        };
        if let Err(e) = check {
            return self.refuse_signed(
                conn,
                ctx.config,
                ticket.map(|t| (signed, t)),
                answer,
                e,
                now,
            );
        }
        let from = format!("{ns}/{name}");
        let id = match &header.idempotency_key {
            Some(key) => envelope::idempotent_id(Kind::Event, &from, topic, key),
            None => self.ids.next_id(),
        };
        let payload = body.get("payload").cloned().unwrap_or(Value::Null);
        let mut headers = std::collections::BTreeMap::new();
        if let Some(tp) = &header.traceparent {
            headers.insert("traceparent".to_string(), tp.clone());
        }
        let env = Envelope {
            id: id.clone(),
            kind: Kind::Event,
            from: from.clone(),
            to: None,
            topic: Some(topic.to_string()),
            job: None,
            ts: self.timestamp(now),
            headers,
            body: crate::amp::Body::from_value(&payload).into_text(),
        };
        let mut nats = HeaderMap::new();
        for (k, v) in [
            ("Nats-Msg-Id", id.as_str()),
            ("AMP-From", from.as_str()),
            ("AMP-Kind", Kind::Event.as_str()),
        ] {
            let _ = nats.insert(k, v);
        }
        // parse_header let through only a traceparent a NATS header carries.
        if let Some(tp) = &header.traceparent {
            let _ = nats.insert("traceparent", tp);
        }
        let bytes = env.to_json();
        // Stored, an event the live feed and replay could not carry would be lost to MIG
        // clients: its EventMessage (the longest sequence stands in for the real one) must
        // fit a replay page.
        let delivered = event_message(ns, u64::MAX, &env, false, &env.ts)
            .to_string()
            .len();
        let max = conn.max_payload();
        if bytes.len() + nats.encoded_len() > max || !fits_a_page(delivered, max) {
            let e = MigError::new(
                Code::InvalidRequest,
                format!(
                    "the event is too large: as an EventMessage it must fit in {} bytes \
                     (the server's max_payload less {PAGE_SLACK})",
                    page_limit(max)
                ),
            )
            .detail("amp_code", json!("too_large"));
            return self.refuse_signed(
                conn,
                ctx.config,
                ticket.map(|t| (signed, t)),
                answer,
                e,
                now,
            );
        }
        // The event waits for its id's claim; pipelined PUBLISHes with JetStream slow to
        // answer held as many as the caller's pace let in. Asked before the rate is
        // charged, so that a refusal for want of room spends none of it.
        let hold = match super::hold_bytes(ctx.jobs, bytes.len() + nats.encoded_len()) {
            Ok(hold) => hold,
            Err(e) => {
                return self.refuse_signed(
                    conn,
                    ctx.config,
                    ticket.map(|t| (signed, t)),
                    answer,
                    e,
                    now,
                );
            }
        };
        let rated = body.get("payload").map_or(0, |p| p.to_string().len());
        if let Err(e) = super::take_rate(ctx.rates, participant, ns, name, rated, now) {
            return self.refuse_signed(
                conn,
                ctx.config,
                ticket.map(|t| (signed, t)),
                answer,
                e,
                now,
            );
        }
        let event = ClaimedPublish {
            then: AfterClaim::Store {
                ns: ns.to_string(),
                subject: binding::topic_subject(ns, topic),
                nats,
                bytes,
                _hold: hold,
            },
            request: PublishRequest {
                reply: answer.reply.to_string(),
                echo: answer.echo.clone(),
                topic: topic.to_string(),
                event_id: id,
                received: now,
                _ticket: ticket,
            },
        };
        // The id is recorded for every broker before the event is stored.
        let claim = seen::claim(ctx.config.js_api(ns), ns, name, &header.message_id)
            .map_err(|e| e.to_string())
            .and_then(|c| {
                conn.request(&c.subject, c.headers.as_ref(), &c.payload, JS_TIMEOUT, now)
                    .map_err(|e| e.to_string())
            });
        match claim {
            Ok(req) => self
                .staged
                .push(req, super::Awaiting(Pending::Claim(Box::new(event))), now),
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}"));
                self.respond(conn, answer, Err(e), now);
            }
        }
    }

    /// Refuses a request after its credential was proved. A signed PUBLISH (`signed`)
    /// has its id recorded for every broker first, and is answered once that is done:
    /// its request reached every subscriber of the topic, and the signature does not
    /// cover the body, so a copy with another body sent to any broker later must find
    /// the id taken. Before, a PUBLISH refused ahead of its claim (for pace, rate, size)
    /// left the id free, and a subscriber's copy was stored as the signer's event. The
    /// claims of refusals count in the caller's `mig.max_claims_per_caller`; past it the
    /// refusal is answered at once, its id used up on this broker only.
    pub(super) fn refuse_signed(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        claim: Option<(Signed<'_>, Ticket)>,
        answer: &Answer<'_>,
        error: MigError,
        now: Instant,
    ) {
        let claimed = claim.and_then(|(s, t)| self.claim_refused(conn, config, s, t, now));
        let Some((req, caller, ticket)) = claimed else {
            return self.respond(conn, answer, Err(error), now);
        };
        let held = ClaimedPublish {
            then: AfterClaim::Refuse { error, caller },
            // Only the answer's fields are used.
            request: PublishRequest {
                reply: answer.reply.to_string(),
                echo: answer.echo.clone(),
                topic: String::new(),
                event_id: String::new(),
                received: answer.received,
                _ticket: Some(ticket),
            },
        };
        let pending = Pending::Claim(Box::new(held));
        self.staged.push(req, super::Awaiting(pending), now);
    }

    /// A signed PUBLISH dropped unanswered for its reply subject (not its signer's)
    /// reached every subscriber of its topic all the same: its id is used up here and
    /// recorded for every broker, as a refused PUBLISH's is. Before, it was dropped before
    /// its id counted, and a subscriber's copy with another body and the signer's reply
    /// subject was stored as the signer's event.
    pub(super) fn use_up_dropped(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        s: Signed<'_>,
        ticket: Option<Ticket>,
        now: Instant,
    ) {
        let wall = self.wall_ms(now);
        let capacity = config.mig.max_signed_ids;
        // A replay's id was used up by the request it copies.
        if let Err(super::Refusal::Unauthorized) = self
            .auth
            .take_signed(s.ns, s.name, s.id, true, capacity, now, wall)
        {
            return;
        }
        let claimed = ticket.and_then(|t| self.claim_refused(conn, config, s, t, now));
        if let Some((req, caller, ticket)) = claimed {
            let pending = Pending::DroppedClaim(caller, ticket);
            self.staged.push(req, super::Awaiting(pending), now);
        }
    }

    /// Sends the create of a refused signed PUBLISH's id, counted in its caller's
    /// `mig.max_claims_per_caller` and held in its requests in flight by `ticket`: the
    /// request, the caller (`ns/name`) and the ticket, or nothing past that bound or
    /// without a connection (the id is then used up on this broker only).
    fn claim_refused(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        s: Signed<'_>,
        ticket: Ticket,
        now: Instant,
    ) -> Option<(RequestId, String, Ticket)> {
        let caller = format!("{}/{}", s.ns, s.name);
        let bound = config.mig.max_claims_per_caller;
        self.claims_held.admit(&caller, bound, now).ok()?;
        let sent = seen::claim(config.js_api(s.ns), s.ns, s.name, s.id)
            .map_err(|e| e.to_string())
            .and_then(|c| {
                conn.request(&c.subject, c.headers.as_ref(), &c.payload, JS_TIMEOUT, now)
                    .map_err(|e| e.to_string())
            });
        match sent {
            Ok(req) => Some((req, caller, ticket)),
            Err(_) => {
                self.claims_held.settle(&caller, None, now);
                None
            }
        }
    }

    /// A refusal's claim was answered: it counts until its key's TTL has passed, also
    /// when the answer was lost, since the server may have stored the key.
    pub(super) fn settle_claim(
        &mut self,
        caller: &str,
        acked: &Result<Result<PubAck, JsError>, RequestError>,
        now: Instant,
    ) {
        let created = matches!(acked, Ok(Ok(_)) | Err(_)).then_some(seen::KEEP);
        self.claims_held.settle(caller, created, now);
    }

    /// The signed id is recorded (or was taken before): the event is stored (or refused
    /// as a replay), or the refusal it was held for is answered.
    pub(super) fn claimed(
        &mut self,
        conn: &mut Connection,
        event: ClaimedPublish,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let acked = reply.map(|m| parse_pub_ack(m.status(), &m.payload));
        let (subject, nats, bytes, _hold) = match event.then {
            AfterClaim::Store {
                subject,
                nats,
                bytes,
                _hold,
                ..
            } => (subject, nats, bytes, _hold),
            AfterClaim::Refuse { error, caller } => {
                self.settle_claim(&caller, &acked, now);
                let error = match acked {
                    Ok(Err(JsError::WrongLastSequence(_))) => self.replayed(),
                    _ => error,
                };
                return self.respond(conn, &event.request.answer(), Err(error), now);
            }
        };
        let refusal = match acked {
            Ok(Ok(_)) => {
                let p = event.request;
                let sent = conn.request(&subject, Some(&nats), &bytes, JS_TIMEOUT, now);
                match sent {
                    Ok(req) => {
                        self.staged
                            .push(req, super::Awaiting(Pending::Publish(Box::new(p))), now);
                        return;
                    }
                    Err(e) => {
                        let e =
                            MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}"));
                        return self.respond(conn, &p.answer(), Err(e), now);
                    }
                }
            }
            Ok(Err(JsError::WrongLastSequence(_))) => self.replayed(),
            Ok(Err(e)) => MigError::new(
                Code::Unavailable,
                format!("JetStream did not record the signed id: {e}"),
            ),
            Err(RequestError::NoResponders) => seen::gone(),
            Err(e) => MigError::new(Code::Unavailable, format!("JetStream did not answer: {e}")),
        };
        self.respond(conn, &event.request.answer(), Err(refusal), now);
    }

    /// A PUBLISH whose signed id another broker (or this one) took before.
    fn replayed(&mut self) -> MigError {
        self.metrics.rejected("replay");
        MigError::new(Code::Unauthorized, "authentication failed")
    }

    pub(super) fn published(
        &mut self,
        conn: &mut Connection,
        p: PublishRequest,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let result = match reply.map(|m| parse_pub_ack(m.status(), &m.payload)) {
            Ok(Ok(ack)) => Ok(
                json!({"topic": p.topic, "event_id": p.event_id, "sequence": ack.seq, "accepted": true}),
            ),
            Ok(Err(e)) => Err(MigError::new(
                Code::Internal,
                format!("JetStream refused the event: {e}"),
            )),
            Err(e) => Err(MigError::new(
                Code::Unavailable,
                format!("JetStream did not answer: {e}"),
            )),
        };
        self.respond(conn, &p.answer(), result, now);
    }

    // ---- SUBSCRIBE (replay pages) ----------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    pub(super) fn replay(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        participant: &Participant,
        answer: &Answer<'_>,
        body: &Map<String, Value>,
        ticket: Option<Ticket>,
        now: Instant,
    ) {
        let topic = body.get("topic").and_then(Value::as_str).unwrap_or("");
        let cursor = match body.get("resume_cursor") {
            None | Some(Value::Null) => Some(0),
            Some(Value::String(s)) => s.parse::<u64>().ok(),
            Some(v) => v.as_u64(),
        };
        let size = match body.get("max_inflight") {
            None | Some(Value::Null) => Some(PAGE_DEFAULT),
            Some(v) => v.as_u64().filter(|n| *n >= 1).map(|n| n.min(PAGE_MAX)),
        };
        let check = if !is_topic_pattern(topic) {
            Err(MigError::new(
                Code::InvalidRequest,
                "topic must be a topic pattern (`*` for one token, a trailing `>`)",
            ))
        } else if !permissions::allows(&participant.permissions, Action::Subscribe, topic) {
            Err(MigError::new(
                Code::Forbidden,
                "subscribing to this topic is not permitted",
            ))
        } else {
            match (cursor, size) {
                (Some(c), Some(s)) => Ok((c, s)),
                (None, _) => Err(MigError::new(
                    Code::InvalidRequest,
                    "resume_cursor must be a stream sequence",
                )),
                (_, None) => Err(MigError::new(
                    Code::InvalidRequest,
                    "max_inflight must be a positive integer",
                )),
            }
        };
        let (cursor, size) = match check {
            Ok(v) => v,
            Err(e) => return self.respond(conn, answer, Err(e), now),
        };
        let page = ReplayPage {
            reply: answer.reply.to_string(),
            echo: answer.echo.clone(),
            ns: ns.to_string(),
            filter: binding::topic_subject(ns, topic),
            from: cursor.saturating_add(1),
            cursor,
            left: size,
            events: Vec::new(),
            bytes: 0,
            limit: page_limit(conn.max_payload()),
            received: now,
            _ticket: ticket,
        };
        self.read_next(conn, page, now);
    }

    fn read_next(&mut self, conn: &mut Connection, page: ReplayPage, now: Instant) {
        let which = MsgSelector::NextBySubject {
            subject: page.filter.clone(),
            from: page.from,
        };
        let stream = binding::topics_stream(&page.ns);
        let sent = super::js_request(conn, ApiPrefix::default().msg_get(&stream, &which), now);
        match sent {
            Ok(id) => {
                self.staged
                    .push(id, super::Awaiting(Pending::Replay(Box::new(page))), now);
            }
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}"));
                self.page_done(conn, page, Err(e), now);
            }
        }
    }

    pub(super) fn replay_read(
        &mut self,
        conn: &mut Connection,
        mut page: ReplayPage,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let stored = match reply {
            Ok(m) => parse_msg_get(&m.payload),
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("JetStream did not answer: {e}"));
                return self.page_done(conn, page, Err(e), now);
            }
        };
        match stored {
            Ok(m) => {
                if let Ok(env) = Envelope::from_json(&m.payload) {
                    let ts = self.timestamp(now);
                    let event = event_message(&page.ns, m.sequence, &env, true, &ts);
                    let size = event.to_string().len() + 1;
                    if size > page.limit {
                        // No page could ever carry it (an AMP event near max_payload):
                        // kept, every page would end before it and the cursor stay put.
                        log::warn!(ns:% = page.ns, seq = m.sequence;
                            "MIG replay skips an event too large for a page ({size} bytes)");
                    } else if page.bytes + size > page.limit {
                        // The rest goes in the next page.
                        return self.page_done(conn, page, Ok(false), now);
                    } else {
                        page.bytes += size;
                        page.events.push(event);
                    }
                }
                page.from = m.sequence.saturating_add(1);
                page.left = page.left.saturating_sub(1);
                if page.left == 0 {
                    return self.page_done(conn, page, Ok(false), now);
                }
                self.read_next(conn, page, now);
            }
            Err(crate::jetstream::JsError::MessageNotFound(_)) => {
                self.page_done(conn, page, Ok(true), now)
            }
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("JetStream refused: {e}"));
                self.page_done(conn, page, Err(e), now)
            }
        }
    }

    /// Answers a page: its events, the cursor after the last one, and whether it reached
    /// the end of what is stored.
    fn page_done(
        &mut self,
        conn: &mut Connection,
        page: ReplayPage,
        caught_up: Result<bool, MigError>,
        now: Instant,
    ) {
        // Past every event read, including any that were not events (skipped).
        let next = page.from.saturating_sub(1).max(page.cursor);
        let result = caught_up.map(|caught_up| {
            json!({"events": page.events, "next_cursor": next.to_string(), "caught_up": caught_up})
        });
        let answer = Answer {
            reply: &page.reply,
            echo: &page.echo,
            op: "subscribe",
            capability: "",
            received: page.received,
        };
        self.respond(conn, &answer, result, now);
    }
}
