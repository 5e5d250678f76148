//! Topics: `publish` stores an event in `AMP_TOPICS_<ns>`; each `subscribe` is one pull
//! consumer read by its own pull loop. A plain subscription's consumer is ephemeral and
//! acknowledges nothing; a durable one (`binding::durable_sub_consumer`) survives the
//! session and its events must be acked. Events of a subscription reach the session in stream order:
//! a consumer sequence that skips means a lost delivery; a plain consumer is recreated
//! from the last event the session saw, a durable holds its events until the lost ones
//! come again (`resumed_durable.rs`).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::resumed_durable::{Admit, Resumed};
use super::{
    Broker, DELETING_RETRY_MS, Lane, Pending, PullOwner, Route, SessionId, Timer, participant_key,
    unavailable,
};
use crate::amp::frame::{self as amp_frame, FromName, Publish, Subscribe};
use crate::amp::reply::FrameWriter;
use crate::amp::{AmpError, ErrorCode};
use crate::broker::binding;
use crate::broker::config::Topics;
use crate::broker::envelope::{self, Envelope, EnvelopeView, Kind};
use crate::broker::permissions::{self, Action};
use crate::broker::pull_loop::{PullLoop, Pulled};
use crate::jetstream::AckKind;
use crate::jetstream::ack::AckMetadata;
use crate::jetstream::api::check_error;
use crate::jetstream::{ConsumerAction, ConsumerConfig, DeliverFrom};
use crate::nats::{Connection, Message};
use crate::rfc3339;

/// Events a durable subscription may have unacknowledged at once.
const DURABLE_WINDOW: u32 = 256;
/// Events a plain subscription asks for per pull.
const PLAIN_BATCH: u32 = 256;
/// The fewest bytes a subscription's pull may bring: below this, events of moderate
/// size would come one pull each (a larger one comes alone).
const MIN_PULL_WINDOW: u64 = 16 << 10;
const DURABLE_ACK_WAIT: Duration = Duration::from_secs(30);
/// How long an ephemeral consumer outlives a broker that stopped reading it.
const EPHEMERAL_INACTIVE: Duration = Duration::from_secs(30);
/// How soon a subscription whose consumer could not be made again tries again.
const SUB_RETRY: Duration = Duration::from_secs(2);
// A paced subscription waiting for its session pulls before its consumer counts as idle.
const _: () =
    assert!(crate::broker::pull_loop::CREDIT_WAIT.as_secs() < EPHEMERAL_INACTIVE.as_secs());
/// JetStream's "maximum consumers limit reached".
const MAX_CONSUMERS_REACHED: u32 = 10026;
/// Consumer infos a hand-back asks for before it naks anyway.
const HAND_BACK_LOOKS: u8 = 3;
/// Where brokers tell each other of durable take-overs, under the brokers' own prefix
/// that no participant's NATS credential reaches.
pub(super) const DURABLE_TAKEOVER_PREFIX: &str = "_AMP_BROKER.DURABLE";

/// The take-over of participant `ns/name`'s durable `sub`: each part is one token of the
/// names' alphabet, so the subject names exactly one durable.
fn durable_takeover_subject(ns: &str, name: &str, sub: &str) -> String {
    format!("{DURABLE_TAKEOVER_PREFIX}.{ns}.{name}.{sub}")
}

/// A subscribe under way, as its requests name it: the name alone may meanwhile belong
/// to a new subscription (`unsubscribe`, then `subscribe` with the same `sub`), whose
/// set-up must not be taken for this one's.
pub(super) struct SubRef {
    session: SessionId,
    /// The subscribe frame's id, answered once the subscription is ready or failed.
    re: String,
    sub: String,
    serial: u64,
}

/// A durable subscription waiting for its owner's durables to be counted.
pub(super) struct DurableCount {
    to: SubRef,
    /// The create configuration, used once the count allows it.
    config: Box<ConsumerConfig>,
    /// Consumer names read so far.
    offset: usize,
    /// Of those, the owner's durables.
    found: usize,
}

/// A durable subscribe waiting to look its consumer up, with its create configuration.
type DurableResume = (SubRef, Box<ConsumerConfig>);

/// A durable subscription's unacknowledged events going back to JetStream.
#[derive(Default)]
pub(super) struct HandBack {
    /// Events that reached the broker after their session left the consumer (they were
    /// in flight), by stream sequence: naked with the rest, in stream order.
    late: BTreeMap<u64, String>,
    /// Sessions resuming the durable meanwhile: they look it up once all are back.
    resumes: Vec<DurableResume>,
}

pub(super) struct Subscription {
    pub(super) pull: PullLoop,
    /// Tells this subscription from an earlier one of the same name.
    serial: u64,
    ns: String,
    /// The participant whose subscription it is.
    owner: String,
    filter: String,
    durable: bool,
    /// The stream sequence of the last event sent to the session.
    last_seq: u64,
    /// The consumer sequence of the last delivery, to notice a gap.
    last_consumer_seq: u64,
    /// Durable only: events sent and not yet acknowledged (stream sequence -> ack subject),
    /// in stream order so they can be handed back in that order. JetStream bounds it:
    /// it delivers no more than `max_ack_pending` unacknowledged events.
    inflight: BTreeMap<u64, String>,
    /// Durable only: resumed while its consumer had events out; keeps them before newer
    /// ones (`resumed_durable.rs`).
    resumed: Option<Resumed>,
    /// Durable only: events that came (again) behind the last one sent and were never
    /// sent in this session (a delivery lost where the wait for lost ones did not cover
    /// it, an event another session left): not sent, since the session's events go in
    /// stream order, and handed back with the rest when the session ends, so they come
    /// first in the next one. At most `DURABLE_WINDOW`, lowest dropped first (it comes
    /// again after its ack wait all the same).
    passed: BTreeMap<u64, String>,
    /// Durable only: the last events the session acknowledged, so that one coming again
    /// because its ack was lost on the way (a reconnect) is acknowledged again rather
    /// than kept back as never sent. At most `DURABLE_WINDOW`, lowest forgotten first
    /// (such a one is `passed`).
    acked: BTreeSet<u64>,
    /// Durable only: the NATS connection was made again since the last delivery, and
    /// deliveries out to the old one may have been lost on the way.
    reconnected: bool,
    /// Durable only: counted in `durables_creating` until its consumer's create is
    /// answered.
    creating: bool,
    /// Where the consumer is made again from if it is lost before any event arrived:
    /// the deliver policy asked for until the consumer is made or found, then its first
    /// unacknowledged event as JetStream reported it (a policy asked for again would
    /// skip what was published since).
    start: DeliverFrom,
}

impl Subscription {
    /// Its stream was made again from nothing: what it held refers to the old one, and
    /// every event of the new one came after the subscription began.
    fn went_back(&mut self) {
        self.last_seq = 0;
        self.last_consumer_seq = 0;
        self.inflight.clear();
        self.passed.clear();
        self.acked.clear();
        self.resumed = None;
        self.start = DeliverFrom::All;
    }

    /// The topic pattern it was made with.
    pub(super) fn topic(&self) -> Option<&str> {
        self.filter
            .strip_prefix("amp.")?
            .strip_prefix(self.ns.as_str())?
            .strip_prefix(".topic.")
    }
}

impl Broker {
    /// A new name for a plain subscription's consumer. It names this broker process
    /// (`incarnation`), not only the broker id: a broker restarted with the same id must
    /// not adopt a consumer its previous process left behind (it lives on for
    /// `EPHEMERAL_INACTIVE` and has delivered events to a session that is gone).
    fn plain_consumer_name(&mut self) -> String {
        self.next_sub += 1;
        format!(
            "eph_{}_{}_{}",
            self.broker_id, self.incarnation, self.next_sub
        )
    }

    pub(super) fn publish(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        ns: &str,
        name: &str,
        p: Publish,
        now: Instant,
    ) {
        let topic = p.topic.as_str();
        let allowed = self
            .config
            .participant(ns, name)
            .is_some_and(|pp| permissions::allows(&pp.permissions, Action::Publish, topic));
        if !allowed {
            let e = AmpError::new(
                ErrorCode::Forbidden,
                format!("publishing to `{topic}` is not permitted"),
            )
            .with_path("/topic");
            return self.fail(session, &p.id, e);
        }
        let body = p.body.into_text();
        let charged = match self.take_rate(ns, name, body.len(), now) {
            Ok(charged) => charged,
            Err(e) => return self.fail(session, &p.id, e),
        };
        let from = participant_key(ns, name);
        let id = match &p.idem {
            Some(key) => envelope::idempotent_id(Kind::Event, &from, topic, key),
            None => self.ids.next_id(),
        };
        let env = Envelope {
            id,
            kind: Kind::Event,
            from,
            to: None,
            topic: Some(topic.to_string()),
            job: None,
            ts: self.clock.timestamp(now),
            headers: p.headers,
            body,
        };
        let subject = binding::topic_subject(ns, topic);
        self.store(conn, session, p.id, &subject, &env, charged, now);
    }

    pub(super) fn subscribe(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        ns: &str,
        name: &str,
        f: Subscribe,
        now: Instant,
    ) {
        let allowed = self
            .config
            .participant(ns, name)
            .is_some_and(|p| permissions::allows(&p.permissions, Action::Subscribe, &f.topic));
        if !allowed {
            let e = AmpError::new(
                ErrorCode::Forbidden,
                format!("subscribing to `{}` is not permitted", f.topic),
            )
            .with_path("/topic");
            return self.fail(session, &f.id, e);
        }
        let sub = match f.sub {
            Some(sub) => sub,
            // A durable's name outlives the session and the broker: a counter would give
            // the next broker started, or another one, the same name, and with it this
            // durable's events and place.
            None if f.durable => format!("d{}", self.ids.next_id()),
            None => {
                self.next_sub += 1;
                format!("s{}", self.next_sub)
            }
        };
        if self.subscription_mut(session, &sub).is_some() {
            let e = AmpError::new(
                ErrorCode::Conflict,
                format!("subscription `{sub}` already exists in this session"),
            )
            .with_path("/sub");
            return self.fail(session, &f.id, e);
        }
        let caps = self.topic_caps(ns);
        if let Err(e) = self.check_subscription_caps(session, &participant_key(ns, name), &caps) {
            return self.fail(session, &f.id, e);
        }
        let filter = binding::topic_subject(ns, &f.topic);
        if f.durable && self.durable_read_here_for_another_topic(ns, name, &sub, &filter) {
            // Refused before the take-over below, which would end the session reading it:
            // a request that fails changes nothing.
            let e = AmpError::new(
                ErrorCode::Conflict,
                format!("durable subscription `{sub}` exists for another topic"),
            )
            .with_path("/sub");
            return self.fail(session, &f.id, e);
        }
        let stream = binding::topics_stream(ns);
        // A durable's `from` counts when its consumer is made; a resume ignores it.
        let start = match deliver_from(&f.from) {
            Ok(start) => start,
            Err(e) => return self.fail(session, &f.id, e),
        };
        let (consumer, config, start) = if f.durable {
            let consumer = binding::durable_sub_consumer(name, &sub);
            let config = binding::durable_sub_config(
                name,
                &sub,
                &filter,
                DURABLE_ACK_WAIT.as_secs(),
                DURABLE_WINDOW,
                caps.durable_inactive_s,
            )
            .deliver_from(start.clone());
            (consumer, config, start)
        } else {
            let consumer = self.plain_consumer_name();
            let config =
                binding::plain_sub_config(&consumer, &filter, start.clone(), EPHEMERAL_INACTIVE);
            (consumer, config, start)
        };
        self.next_sub += 1;
        let to = SubRef {
            session,
            re: f.id,
            sub: sub.clone(),
            serial: self.next_sub,
        };
        let subscription = Subscription {
            serial: to.serial,
            // A batch, then the next once the session has written what it was sent, so
            // a replay (`from: "all"`) comes as fast as the client reads, not as fast
            // as the server sends; its bytes are the subscription's share of the
            // session's (`share_windows`). A durable's window of unacknowledged events
            // bounds their number, not their size.
            pull: PullLoop::new(
                stream.clone(),
                consumer.clone(),
                if f.durable {
                    DURABLE_WINDOW
                } else {
                    PLAIN_BATCH
                },
            )
            .paced(MIN_PULL_WINDOW)
            .in_domain(self.config.js_api(ns)),
            ns: ns.to_string(),
            owner: name.to_string(),
            filter: filter.clone(),
            durable: f.durable,
            last_seq: 0,
            last_consumer_seq: 0,
            inflight: BTreeMap::new(),
            resumed: None,
            passed: BTreeMap::new(),
            acked: BTreeSet::new(),
            reconnected: false,
            creating: false,
            start,
        };
        if f.durable {
            self.take_over_durable(conn, Some(session), ns, name, &sub, Some(&filter), now);
            // And from sessions on other brokers (brokers share nothing but NATS): they
            // hand its events back as a session here would. The topic goes with it: one
            // read there for another topic is no take-over, the subscribe is refused.
            let payload = format!("{filter} {}", self.takeover_origin());
            let _ = conn.publish(
                &durable_takeover_subject(ns, name, &sub),
                None,
                None,
                payload.as_bytes(),
            );
        }
        if let Some(s) = self.sessions.get_mut(&session) {
            s.subs.insert(sub.clone(), subscription);
            self.topic_subs += 1;
            *self
                .participant_subs
                .entry(participant_key(ns, name))
                .or_default() += 1;
        }
        self.share_windows(session);
        if f.durable {
            let resume = (to, Box::new(config));
            // Its unacknowledged events must be back in JetStream before this session
            // pulls, or it gets later ones first.
            match self.hand_backs.get_mut(&(stream.clone(), consumer.clone())) {
                Some(h) => h.resumes.push(resume),
                None => self.look_up_durable(conn, &stream, &consumer, resume, now),
            }
        } else {
            self.create_sub_consumer(conn, to, &config, now);
        }
    }

    /// A durable subscription is read by one session of its participant: a session that
    /// subscribes it takes it from another that has it (a client that reconnected before
    /// its old connection was seen to end), whose unacknowledged events are handed back
    /// as when a session ends. `except` is the taking session when it is on this broker;
    /// `filter` the topic it subscribes (none from brokers of earlier releases): a
    /// session reading the durable for another topic keeps it.
    #[allow(clippy::too_many_arguments)]
    fn take_over_durable(
        &mut self,
        conn: &mut Connection,
        except: Option<SessionId>,
        ns: &str,
        name: &str,
        sub: &str,
        filter: Option<&str>,
        now: Instant,
    ) {
        let holders: Vec<SessionId> = self
            .presence
            .get(&participant_key(ns, name))
            .map(|p| p.sessions.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|&other| {
                Some(other) != except
                    && self
                        .sessions
                        .get(&other)
                        .and_then(|s| s.subs.get(sub))
                        .is_some_and(|t| t.durable && filter.is_none_or(|f| f == t.filter))
            })
            .collect();
        for other in holders {
            match except {
                Some(by) => {
                    log::info!(session = other, sub; "durable subscription taken over by session {by}")
                }
                None => {
                    log::info!(session = other, sub; "durable subscription taken over by a session on another broker")
                }
            }
            let _ = self.drop_subscription(conn, other, sub, false, now);
        }
    }

    /// Whether a session of the participant here reads durable `sub` with another filter.
    fn durable_read_here_for_another_topic(
        &self,
        ns: &str,
        name: &str,
        sub: &str,
        filter: &str,
    ) -> bool {
        let Some(p) = self.presence.get(&participant_key(ns, name)) else {
            return false;
        };
        p.sessions.iter().any(|id| {
            self.sessions
                .get(id)
                .and_then(|s| s.subs.get(sub))
                .is_some_and(|t| t.durable && t.filter != filter)
        })
    }

    /// What a take-over this broker sends says about its sender, so it can tell its own.
    fn takeover_origin(&self) -> String {
        format!("{} {}", self.broker_id, self.incarnation)
    }

    /// Another broker's session took a durable subscription over (see
    /// [`durable_takeover_subject`]): sessions here that read it stop.
    pub(super) fn durable_taken(&mut self, conn: &mut Connection, msg: &Message, now: Instant) {
        let Some((filter, origin)) = parse_takeover(msg) else {
            return;
        };
        if origin == self.takeover_origin() {
            return;
        }
        let filter = filter.map(str::to_string);
        let rest = msg.subject.strip_prefix(DURABLE_TAKEOVER_PREFIX);
        let mut tokens = rest
            .and_then(|r| r.strip_prefix('.'))
            .unwrap_or("")
            .split('.');
        if let (Some(ns), Some(name), Some(sub), None) =
            (tokens.next(), tokens.next(), tokens.next(), tokens.next())
        {
            let (ns, name, sub) = (ns.to_string(), name.to_string(), sub.to_string());
            self.take_over_durable(conn, None, &ns, &name, &sub, filter.as_deref(), now);
        }
    }

    /// Looks a durable subscription's consumer up: one that exists is resumed as it is
    /// (`from` is then ignored), unless its topic differs.
    fn look_up_durable(
        &mut self,
        conn: &mut Connection,
        stream: &str,
        consumer: &str,
        (to, config): DurableResume,
        now: Instant,
    ) {
        let ns = stream
            .strip_prefix(&binding::topics_stream(""))
            .unwrap_or_default();
        let req = self.config.js_api(ns).consumer_info(stream, consumer);
        let lane = self.lane(to.session);
        self.api_request(conn, lane, req, Pending::SubLookup { to, config }, now);
    }

    /// The subscription a subscribe under way sets up, unless it ended meanwhile.
    fn sub_of(&mut self, to: &SubRef) -> Option<&mut Subscription> {
        self.subscription_mut(to.session, &to.sub)
            .filter(|t| t.serial == to.serial)
    }

    /// A subscribe whose subscription ended before it was ready (`unsubscribe`, or the
    /// session's end) is still answered: it was taken, and is over.
    fn sub_ended_early(&mut self, to: SubRef) {
        let answer = FrameWriter::ok(Some(&to.re)).str("sub", &to.sub);
        self.ok(to.session, &to.re, answer);
    }

    fn create_sub_consumer(
        &mut self,
        conn: &mut Connection,
        to: SubRef,
        config: &ConsumerConfig,
        now: Instant,
    ) {
        let Some((ns, consumer)) = self
            .sub_of(&to)
            .map(|t| (t.ns.clone(), t.pull.consumer().to_string()))
        else {
            return self.sub_ended_early(to);
        };
        // The consumer this subscription pulls is the one created.
        debug_assert_eq!(config.effective_name(), Some(consumer.as_str()));
        let req = self.config.js_api(&ns).consumer_create(
            &binding::topics_stream(&ns),
            config,
            ConsumerAction::CreateOrUpdate,
        );
        let lane = self.lane(to.session);
        self.api_request(conn, lane, req, Pending::SubConsumer(to), now);
    }

    /// The answer to a durable subscription's consumer lookup.
    pub(super) fn sub_lookup_done(
        &mut self,
        conn: &mut Connection,
        to: SubRef,
        config: Box<ConsumerConfig>,
        reply: Result<Message, crate::nats::RequestError>,
        now: Instant,
    ) {
        match reply.map(|m| (check_error(&m.payload), m)) {
            Ok((Ok(()), m)) => {
                let info: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
                let existing = info["config"]["filter_subject"]
                    .as_str()
                    .unwrap_or_default();
                let wanted = config.filter_subject.as_deref().unwrap_or_default();
                if existing != wanted {
                    let e = AmpError::new(
                        ErrorCode::Conflict,
                        format!("durable subscription `{}` exists for another topic", to.sub),
                    )
                    .with_path("/sub");
                    return self.sub_failed(conn, to, e, now);
                }
                // A consumer of the name made by someone else: one that acks nothing
                // loses what a dropped session had, a push one is never pulled.
                let c = &info["config"];
                let unusable = if c["ack_policy"].as_str() != Some("explicit") {
                    Some("ack_policy")
                } else if c["deliver_subject"].as_str().is_some_and(|s| !s.is_empty()) {
                    Some("deliver_subject")
                } else {
                    None
                };
                if let Some(field) = unusable {
                    let e = AmpError::new(
                        ErrorCode::Conflict,
                        format!(
                            "durable subscription `{}` has a consumer whose `{field}` the broker cannot use",
                            to.sub
                        ),
                    )
                    .with_path("/sub");
                    return self.sub_failed(conn, to, e, now);
                }
                if let Some(t) = self.sub_of(&to) {
                    // A resume ignores `from`: made again, it starts here too.
                    t.start = first_unacked(&info).unwrap_or(t.start.clone());
                    t.resumed = Resumed::after_lookup(&info, DURABLE_ACK_WAIT, now);
                    if let Some(until) = t.resumed.as_ref().map(Resumed::until) {
                        let serial = t.serial;
                        let wait = Timer::ResumeWait(to.session, to.sub.clone(), serial);
                        self.set_timer(until, wait);
                    }
                }
                self.sub_ready(conn, to, now);
            }
            Ok((Err(e), _)) if e.err_code() == Some(10014) => {
                let count = DurableCount {
                    to,
                    config,
                    offset: 0,
                    found: 0,
                };
                self.count_durables(conn, count, now)
            }
            Ok((Err(e), _)) => {
                let e = AmpError::new(
                    ErrorCode::Internal,
                    format!("JetStream refused the subscription: {e}"),
                );
                self.sub_failed(conn, to, e, now);
            }
            Err(e) => self.sub_failed(conn, to, unavailable(e), now),
        }
    }

    /// Counts the participant's durables in JetStream, one page of consumer names at a
    /// time, before a new one is created: they outlive sessions and brokers, so only
    /// JetStream knows how many there are.
    fn count_durables(&mut self, conn: &mut Connection, count: DurableCount, now: Instant) {
        let Some(ns) = self.sub_of(&count.to).map(|t| t.ns.clone()) else {
            return self.sub_ended_early(count.to);
        };
        let req = self
            .config
            .js_api(&ns)
            .consumer_names(&binding::topics_stream(&ns), count.offset as u64);
        let lane = self.lane(count.to.session);
        self.api_request(conn, lane, req, Pending::DurableCount(count), now);
    }

    /// One page of consumer names for [`Self::count_durables`].
    pub(super) fn durable_count_done(
        &mut self,
        conn: &mut Connection,
        mut count: DurableCount,
        reply: Result<Message, crate::nats::RequestError>,
        now: Instant,
    ) {
        let Some((ns, owner)) = self
            .sub_of(&count.to)
            .map(|t| (t.ns.clone(), t.owner.clone()))
        else {
            return self.sub_ended_early(count.to);
        };
        let page = match reply.map(|m| (check_error(&m.payload), m)) {
            Ok((Ok(()), m)) => serde_json::from_slice::<Value>(&m.payload).unwrap_or(Value::Null),
            Ok((Err(e), _)) => {
                let e = AmpError::new(
                    ErrorCode::Internal,
                    format!("JetStream refused the subscription: {e}"),
                );
                return self.sub_failed(conn, count.to, e, now);
            }
            Err(e) => return self.sub_failed(conn, count.to, unavailable(e), now),
        };
        let prefix = binding::durable_sub_prefix(&owner);
        let names = page["consumers"].as_array().map_or(&[][..], Vec::as_slice);
        // JetStream lists only the consumers already made: those this broker is making
        // count too (once, listed or not), or one session pipelining subscribes passes
        // every count at once.
        let key = participant_key(&ns, &owner);
        let creating = self.durables_creating.get(&key);
        count.found += names
            .iter()
            .filter_map(Value::as_str)
            .filter(|n| n.starts_with(&prefix) && !creating.is_some_and(|c| c.contains(*n)))
            .count();
        let creating = creating.map_or(0, HashSet::len);
        count.offset += names.len();
        let total = page["total"].as_u64().unwrap_or(0);
        let cap = self.topic_caps(&ns).max_durables_per_participant;
        if count.found + creating >= cap {
            let e = AmpError::new(
                ErrorCode::Forbidden,
                format!("a participant holds at most {cap} durable subscriptions in a namespace"),
            )
            .with_path("/durable");
            return self.sub_failed(conn, count.to, e, now);
        }
        // The stream's max_consumers bounds the pages; an empty page ends a list that
        // shrank meanwhile.
        if names.is_empty() || count.offset as u64 >= total {
            let consumer = self.sub_of(&count.to).map(|t| {
                t.creating = true;
                t.pull.consumer().to_string()
            });
            if let Some(consumer) = consumer {
                self.durables_creating
                    .entry(key)
                    .or_default()
                    .insert(consumer);
            }
            return self.create_sub_consumer(conn, count.to, &count.config, now);
        }
        self.count_durables(conn, count, now);
    }

    /// A durable consumer's create is answered (or its subscription gone).
    fn created_durable(&mut self, participant: &str, consumer: &str) {
        if let Some(names) = self.durables_creating.get_mut(participant) {
            names.remove(consumer);
            if names.is_empty() {
                self.durables_creating.remove(participant);
            }
        }
    }

    /// The caps of a namespace's topics (the defaults for a namespace not configured).
    fn topic_caps(&self, ns: &str) -> Topics {
        self.config
            .namespaces
            .get(ns)
            .map(|n| n.topics.clone())
            .unwrap_or_default()
    }

    /// Refuses a subscription past the session's or the broker's cap; each holds one NATS
    /// subscription on the broker's connection and one consumer. Consumers the session
    /// unsubscribed count until their deletes are answered.
    fn check_subscription_caps(
        &self,
        session: SessionId,
        participant: &str,
        caps: &Topics,
    ) -> Result<(), AmpError> {
        let (mine, deleting) = self
            .sessions
            .get(&session)
            .map_or((0, 0), |s| (s.subs.len(), s.deleting));
        let (all, all_deleting) = (self.topic_subs, self.topic_deleting);
        let theirs = self.participant_subs.get(participant).copied().unwrap_or(0);
        let their_deleting = self
            .participant_deleting
            .get(participant)
            .copied()
            .unwrap_or(0);
        let session_cap = caps.max_subscriptions_per_session;
        let participant_cap = caps.max_subscriptions_per_participant;
        let broker_cap = self.config.limits.max_topic_subscriptions;
        // Deletes its ended sessions left count in the participant's share, so ending
        // sessions faster than JetStream deletes their consumers holds up only its own.
        let caps = [
            (mine, deleting, session_cap, "a session", "subscriptions"),
            (
                theirs,
                their_deleting,
                participant_cap,
                "a participant",
                "subscriptions on this broker",
            ),
            (
                all,
                all_deleting,
                broker_cap,
                "this broker",
                "topic subscriptions",
            ),
        ];
        for (held, deleting, max, who, what) in caps {
            let limit = format!("{who} holds at most {max} {what}");
            if held >= max {
                return Err(AmpError::new(ErrorCode::Forbidden, limit));
            }
            // Only deletes not yet answered stand in the way: soon room again.
            if held + deleting >= max {
                let mut e = AmpError::rate_limited(DELETING_RETRY_MS);
                e.message = format!("{limit}, {deleting} of them still being deleted").into();
                return Err(e);
            }
        }
        Ok(())
    }

    /// The answer to a subscription's consumer create.
    pub(super) fn sub_consumer_done(
        &mut self,
        conn: &mut Connection,
        to: SubRef,
        reply: Result<Message, crate::nats::RequestError>,
        now: Instant,
    ) {
        let counted = self.sub_of(&to).filter(|t| t.creating).map(|t| {
            t.creating = false;
            (
                participant_key(&t.ns, &t.owner),
                t.pull.consumer().to_string(),
            )
        });
        if let Some((key, consumer)) = counted {
            self.created_durable(&key, &consumer);
        }
        match reply.map(|m| (check_error(&m.payload), m)) {
            Ok((Ok(()), m)) => {
                // Where the consumer starts: a later restart resumes from here even if no
                // event arrived before it (`from: "new"` must not turn into "all").
                let info: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
                let start = info["delivered"]["stream_seq"].as_u64();
                if let Some(t) = self.sub_of(&to) {
                    if t.durable {
                        t.start = first_unacked(&info).unwrap_or(t.start.clone());
                    } else if let Some(seq) = start
                        && t.last_seq == 0
                    {
                        t.last_seq = seq;
                    }
                }
                self.sub_ready(conn, to, now)
            }
            Ok((Err(e), _)) if e.err_code() == Some(MAX_CONSUMERS_REACHED) => {
                let stream = self
                    .sub_of(&to)
                    .map(|t| binding::topics_stream(&t.ns))
                    .unwrap_or_default();
                let e = AmpError::new(
                    ErrorCode::Forbidden,
                    format!(
                        "the topics stream `{stream}` is at its maximum of consumers; \
                         subscriptions that end or expire make room"
                    ),
                );
                self.sub_failed(conn, to, e, now);
            }
            Ok((Err(e), _)) => {
                let e = AmpError::new(
                    ErrorCode::Internal,
                    format!("JetStream refused the subscription: {e}"),
                );
                self.sub_failed(conn, to, e, now);
            }
            Err(e) => self.sub_failed(conn, to, unavailable(e), now),
        }
    }

    fn sub_ready(&mut self, conn: &mut Connection, to: SubRef, now: Instant) {
        let Some(t) = self.sub_of(&to) else {
            return self.sub_ended_early(to);
        };
        match t.pull.attach_status_only(conn) {
            Ok(sid) => {
                let check = t.pull.pull(conn, now);
                let SubRef {
                    session, re, sub, ..
                } = to;
                self.routes.insert(
                    sid,
                    Route::Sub {
                        session,
                        sub: sub.clone(),
                    },
                );
                self.check_pull_at(check, PullOwner::Sub(session, sub.clone()));
                self.ok(session, &re, FrameWriter::ok(Some(&re)).str("sub", &sub));
            }
            Err(crate::nats::Error::TooManySubscriptions { max }) => {
                // Not JetStream's doing: the connection's own bound, which the broker's
                // caps normally keep it below.
                let e = AmpError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the broker's NATS connection holds its maximum of {max} subscriptions"
                    ),
                );
                self.sub_failed(conn, to, e, now);
            }
            Err(e) => self.sub_failed(conn, to, unavailable(e), now),
        }
    }

    /// A subscribe that could not be carried out: forget it (unless it already ended)
    /// and answer the error.
    fn sub_failed(&mut self, conn: &mut Connection, to: SubRef, e: AmpError, now: Instant) {
        if self.sub_of(&to).is_some() {
            let _ = self.drop_subscription(conn, to.session, &to.sub, false, now);
        }
        self.fail(to.session, &to.re, e);
    }

    pub(super) fn unsubscribe(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        id: String,
        sub: String,
        now: Instant,
    ) {
        if self.subscription_mut(session, &sub).is_none() {
            let e = AmpError::new(
                ErrorCode::NotFound,
                format!("no subscription `{sub}` in this session"),
            )
            .with_path("/sub");
            return self.fail(session, &id, e);
        }
        let Some(delete) = self.drop_subscription(conn, session, &sub, true, now) else {
            return self.ok(session, &id, FrameWriter::ok(Some(&id)));
        };
        // The answer waits until the consumer is gone: a durable's name is reused by the
        // next subscribe of that `sub`, which could otherwise find it and resume it just
        // before the delete lands; and the session's room for subscriptions is back
        // once it is answered.
        let pending = Pending::SubDeleted { session, re: id };
        self.api_request(conn, self.lane(session), delete, pending, now);
    }

    /// A consumer's delete after `unsubscribe` was answered. The subscription is over in
    /// the session either way; a consumer JetStream did not delete expires unread.
    pub(super) fn sub_deleted(
        &mut self,
        session: SessionId,
        re: String,
        reply: Result<Message, crate::nats::RequestError>,
    ) {
        match reply.map(|m| check_error(&m.payload)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.err_code() == Some(10014) => {}
            Ok(Err(e)) => {
                log::warn!(session:% = format_args!("{}-{session}", self.broker_id); "durable delete refused: {e}")
            }
            Err(e) => {
                log::warn!(session:% = format_args!("{}-{session}", self.broker_id); "durable delete unanswered: {e}")
            }
        }
        self.ok(session, &re, FrameWriter::ok(Some(&re)));
    }

    /// Stops reading a subscription. Its consumer is deleted when the subscription ends
    /// for good (`unsubscribe`, or any end of a plain one); a durable one whose session
    /// merely ended keeps its consumer, and its unacknowledged events are handed back so
    /// they come first when it is resumed. A subscription ended for good (`unsubscribe`)
    /// is left for the caller to delete: the delete request is returned.
    fn drop_subscription(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        for_good: bool,
        now: Instant,
    ) -> Option<Result<crate::jetstream::Request, crate::jetstream::JsError>> {
        let mut t = self
            .sessions
            .get_mut(&session)
            .and_then(|s| s.subs.remove(sub))?;
        self.topic_subs = self.topic_subs.saturating_sub(1);
        self.share_windows(session);
        let owner = participant_key(&t.ns, &t.owner);
        if t.creating {
            self.created_durable(&owner, t.pull.consumer());
        }
        if let Some(n) = self.participant_subs.get_mut(&owner) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.participant_subs.remove(&owner);
            }
        }
        if let Some(sid) = t.pull.detach(conn) {
            self.routes.remove(&sid);
        }
        let delete = self
            .config
            .js_api(&t.ns)
            .consumer_delete(&binding::topics_stream(&t.ns), t.pull.consumer());
        if for_good {
            return Some(delete);
        }
        if !t.durable {
            let gone = Pending::ConsumerGone { owner: Some(owner) };
            self.api_request(conn, Lane::Cleanup, delete, gone, now);
        } else {
            let stream = binding::topics_stream(&t.ns);
            let consumer = t.pull.consumer().to_string();
            let mut back = std::mem::take(&mut t.passed);
            back.append(&mut t.inflight);
            if let Some(r) = t.resumed.take() {
                back.extend(r.into_held());
            }
            let mut acks = back.into_values();
            if let Some(lowest) = acks.next() {
                nak(conn, &lowest);
                self.hand_back(conn, stream, consumer, acks.collect(), 0, now);
            }
        }
        None
    }

    /// Hands the rest of a durable subscription's unacknowledged events back to JetStream.
    ///
    /// JetStream redelivers naked events first, in the order of the naks, so naking lowest
    /// sequence first gives a resumed subscription its events in stream order (spec 2.7).
    /// One catch: the ended session's pull is still waiting on the server, and the first
    /// redelivery goes to it, fails, and is queued again behind the others. So the lowest
    /// event goes alone first; the rest follow once the consumer reports no waiting pull
    /// (or after a few looks, if another session pulls it too).
    fn hand_back(
        &mut self,
        conn: &mut Connection,
        stream: String,
        consumer: String,
        acks: Vec<String>,
        looks: u8,
        now: Instant,
    ) {
        if acks.is_empty() {
            return;
        }
        if looks == 0 {
            self.hand_backs
                .entry((stream.clone(), consumer.clone()))
                .or_default();
        }
        let ns = stream
            .strip_prefix(&binding::topics_stream(""))
            .unwrap_or_default();
        let req = self.config.js_api(ns).consumer_info(&stream, &consumer);
        let pending = Pending::HandBack {
            stream,
            consumer,
            acks,
            looks,
        };
        self.api_request(conn, Lane::Cleanup, req, pending, now);
    }

    /// Naks a hand-back's events together with those that arrived late meanwhile, in
    /// stream order; then the resumes that waited for it go on.
    fn nak_handed_back(
        &mut self,
        conn: &mut Connection,
        stream: &str,
        consumer: &str,
        acks: Vec<String>,
        now: Instant,
    ) {
        let HandBack {
            late: mut all,
            resumes,
        } = self
            .hand_backs
            .remove(&(stream.to_string(), consumer.to_string()))
            .unwrap_or_default();
        for ack in acks {
            if let Ok(seq) = AckMetadata::parse(&ack).map(|m| m.stream_sequence) {
                all.entry(seq).or_insert(ack);
            } else {
                nak(conn, &ack);
            }
        }
        for ack in all.values() {
            nak(conn, ack);
        }
        for resume in resumes {
            self.look_up_durable(conn, stream, consumer, resume, now);
        }
    }

    /// An event that reached the broker on a pull inbox it had already left: it was in
    /// flight when a durable subscription's session ended. Left alone it would come back
    /// only after its ack wait (30 s), after events delivered meanwhile, and a session
    /// resuming the durable sooner would start past it; so it is handed back now, behind
    /// a hand-back of the same consumer still under way.
    pub(super) fn unread_delivery(&mut self, conn: &mut Connection, msg: &Message, now: Instant) {
        if self.jobs.unread_delivery(conn, msg, now) {
            return;
        }
        let Some(reply) = msg.reply.as_deref() else {
            return;
        };
        let Ok(meta) = AckMetadata::parse(reply) else {
            return;
        };
        // An inbox message that reached an inbox pull the broker had left (its
        // participant's last session ended, or the pull was renewed) goes back at once,
        // not after its ack wait: the participant's next session here or elsewhere gets
        // it first (job queues' are the jobs engine's, which does the same). A plain
        // subscription's consumer ignores the nak (it acknowledges nothing).
        if meta.stream.starts_with(&binding::inbox_stream("")) {
            return nak(conn, reply);
        }
        if !meta.stream.starts_with(&binding::topics_stream("")) {
            return;
        }
        let key = (meta.stream.to_string(), meta.consumer.to_string());
        match self.hand_backs.get_mut(&key).map(|h| &mut h.late) {
            Some(late) if late.len() < DURABLE_WINDOW as usize => {
                // A later delivery of the same event carries the ack subject that counts.
                late.insert(meta.stream_sequence, reply.to_string());
            }
            _ => nak(conn, reply),
        }
    }

    /// The consumer info a hand-back waited for.
    pub(super) fn hand_back_done(
        &mut self,
        conn: &mut Connection,
        (stream, consumer, acks, looks): (String, String, Vec<String>, u8),
        reply: Result<Message, crate::nats::RequestError>,
        now: Instant,
    ) {
        let waiting = reply
            .ok()
            .and_then(|m| serde_json::from_slice::<Value>(&m.payload).ok())
            .and_then(|info| info["num_waiting"].as_u64())
            .unwrap_or(0);
        if waiting > 0 && looks < HAND_BACK_LOOKS {
            return self.hand_back(conn, stream, consumer, acks, looks + 1, now);
        }
        self.nak_handed_back(conn, &stream, &consumer, acks, now);
    }

    /// A session ended: every subscription stops.
    pub(super) fn drop_subscriptions(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        now: Instant,
    ) {
        let subs: Vec<String> = self
            .sessions
            .get(&session)
            .map(|s| s.subs.keys().cloned().collect())
            .unwrap_or_default();
        for sub in subs {
            let _ = self.drop_subscription(conn, session, &sub, false, now);
        }
    }

    /// Namespace `ns`'s topics stream was made again here, holding events up to `last`:
    /// every subscription that had gone past that follows the new stream from its start.
    /// Its lost consumer's own look at the stream would find the same, unless events
    /// published meanwhile brought the new stream up to where the old one was.
    pub(super) fn topics_made_again(&mut self, ns: &str, last: u64) {
        for s in self.sessions.values_mut() {
            for t in s.subs.values_mut() {
                if t.ns == ns && t.last_seq > last {
                    t.went_back();
                }
            }
        }
    }

    pub(super) fn subscription_mut(
        &mut self,
        session: SessionId,
        sub: &str,
    ) -> Option<&mut Subscription> {
        self.sessions.get_mut(&session)?.subs.get_mut(sub)
    }

    /// After a reconnect: durable subscriptions pull again, on a fresh pull subscription
    /// ([`PullLoop::retire`]; what the old one still brings goes to the session first,
    /// [`retired_pull_delivery`](Self::retired_pull_delivery)); plain ones get a new
    /// consumer starting after their last event, since an in-memory consumer does not
    /// survive a server restart (a server that lost its data lost the stream's sequences
    /// too: `subscription_lost` looks).
    pub(super) fn restart_subscriptions(&mut self, conn: &mut Connection, now: Instant) {
        self.retired_pulls.clear();
        let mut durable = Vec::new();
        let mut plain = Vec::new();
        for (&session, s) in &mut self.sessions {
            for (sub, t) in &mut s.subs {
                if !t.durable {
                    plain.push((session, sub.clone()));
                    continue;
                }
                t.reconnected = true;
                if let Some(sid) = t.pull.retire(conn) {
                    durable.push((session, sub.clone(), sid));
                }
            }
        }
        for (session, sub, retired) in durable {
            self.routes.remove(&retired);
            self.retired_pulls.insert(retired, (session, sub.clone()));
            self.attach_sub(conn, session, sub, now);
        }
        for (session, sub) in plain {
            self.subscription_lost(conn, session, &sub, now);
        }
    }

    /// An event a durable subscription's pull from before the reconnect brought: the
    /// server sent it before it had the UNSUB, so ahead of anything the new pull brings,
    /// and it goes to the session as any other (uncounted: the new pull did not bring
    /// it). Handed back when the subscription is gone.
    pub(super) fn retired_pull_delivery(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        msg: Message,
        now: Instant,
    ) {
        let ours = self
            .subscription_mut(session, sub)
            .is_some_and(|t| t.durable && t.pull.delivers(&msg));
        if ours {
            self.topic_event(conn, session, sub, &msg, now);
        } else {
            self.unread_delivery(conn, &msg, now);
        }
    }

    /// One message on a subscription's pull inbox.
    pub(super) fn topic_delivery(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        msg: Message,
        now: Instant,
    ) {
        let Some(t) = self.subscription_mut(session, sub) else {
            return;
        };
        let (pulled, check) = t.pull.on_message(conn, &msg, now);
        if pulled == Pulled::Lost {
            log::warn!(session:% = format_args!("{}-{session}", self.broker_id), sub:% = sub; "subscription consumer gone; making it again");
            return self.subscription_lost(conn, session, sub, now);
        }
        if check.is_some() || t.pull.wants_credit() {
            self.check_pull_at(check, PullOwner::Sub(session, sub.to_string()));
        }
        if pulled == Pulled::Message {
            self.topic_event(conn, session, sub, &msg, now);
        }
    }

    /// A delivery of a subscription's consumer, to its session in stream order.
    fn topic_event(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        msg: &Message,
        now: Instant,
    ) {
        let Some(reply) = msg.reply.as_deref() else {
            return;
        };
        let Ok(meta) = AckMetadata::parse(reply) else {
            return log::warn!(session:% = format_args!("{}-{session}", self.broker_id), sub:% = sub; "event without ack metadata"
            );
        };
        let (seq, consumer_seq) = (meta.stream_sequence, meta.consumer_sequence);
        let Some(t) = self.subscription_mut(session, sub) else {
            return;
        };
        if !t.durable {
            // A consumer's first delivery is number 1 (a reset makes a new consumer and
            // pull inbox), so a lost first delivery is a gap too.
            if consumer_seq != t.last_consumer_seq.saturating_add(1) {
                // A delivery went missing: start over right after the last event sent.
                return self.reset_subscription(conn, session, sub, now);
            }
            t.last_consumer_seq = consumer_seq;
            if seq <= t.last_seq {
                return;
            }
        } else {
            // Consumer sequences that skip: deliveries went missing on the way (out to a
            // connection that dropped), and come again only after their ack wait. Sent
            // meanwhile, newer events would put them behind the session's last one; so
            // everything waits for them, as a resume does.
            let reconnected = std::mem::take(&mut t.reconnected);
            let lost = match t.last_consumer_seq {
                0 => 0,
                last => consumer_seq.saturating_sub(last.saturating_add(1)),
            };
            t.last_consumer_seq = consumer_seq;
            let last_sent = t.last_seq;
            let wait = match &mut t.resumed {
                _ if lost == 0 => None,
                None => {
                    let r = Resumed::after_loss(lost, last_sent, DURABLE_ACK_WAIT, now);
                    Some(t.resumed.insert(r).until())
                }
                // While a resume is put in order, deliveries that go to another reader
                // (a pull of the session it took over) are expected; only a reconnect
                // loses some.
                Some(r) if reconnected => r.lost_again(lost, DURABLE_ACK_WAIT, now),
                Some(_) => None,
            };
            if let Some(until) = wait {
                let serial = t.serial;
                log::info!(session:% = format_args!("{}-{session}", self.broker_id), sub:% = sub; "{lost} durable deliveries lost on the way; holding events until they come again");
                self.set_timer(until, Timer::ResumeWait(session, sub.to_string(), serial));
            }
        }
        let Some(t) = self.subscription_mut(session, sub) else {
            return;
        };
        if let Some(r) = &mut t.resumed {
            let mut naks = Vec::new();
            let admit = r.admit(seq, meta.delivered > 1, reply, now, &mut naks);
            settle_resumed(conn, t, &naks);
            if admit == Admit::Hold {
                return;
            }
        }
        if t.durable && seq <= t.last_seq {
            // An event behind the session's last one is never sent (spec 2.3: in stream
            // order, no duplicates within the session). A redelivery of one it has out
            // (its ack wait ran out) keeps its newest ack subject; one it acknowledged
            // (the ack lost on the way) is acknowledged again.
            if let Some(ack) = t.inflight.get_mut(&seq) {
                *ack = reply.to_string();
            } else if t.acked.contains(&seq) {
                let _ = conn.publish(reply, None, None, &AckKind::Ack.payload());
            } else {
                // One it never got (lost on the way where the wait for lost deliveries
                // did not cover it, an event another session left after this one went
                // past it): it comes first in the participant's next session.
                if t.passed.insert(seq, reply.to_string()).is_none() {
                    log::info!(session = session, sub:% = sub, seq:% = seq; "durable event came behind the session's last one; kept for its next session");
                }
                if t.passed.len() > DURABLE_WINDOW as usize {
                    t.passed.pop_first();
                }
            }
            return;
        }
        t.last_seq = seq;
        if t.durable {
            t.inflight.insert(seq, reply.to_string());
        }
        let Ok(env) = EnvelopeView::parse(&msg.payload) else {
            return log::warn!(seq:% = seq, sub:% = sub; "skipping malformed event");
        };
        let size = msg.payload.len() + 64;
        let text = FrameWriter::with_capacity(amp_frame::server_op::EVENT, size)
            .str("sub", sub)
            .str("topic", env.topic.as_ref().map_or("", |t| t.as_str()))
            .uint("seq", seq)
            .str("ts", env.ts.as_str())
            .str("from", env.from.as_str())
            .raw("body", env.body.get())
            .str_map("headers", &env.headers)
            .finish();
        self.frame(session, text);
    }

    /// A resumed durable's wait for the events out at its lookup is over: what it holds
    /// is handed back, to come again in order.
    pub(super) fn resume_wait_over(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        serial: u64,
        now: Instant,
    ) {
        let Some(t) = self
            .subscription_mut(session, sub)
            .filter(|t| t.serial == serial)
        else {
            return;
        };
        let Some(r) = &mut t.resumed else {
            return;
        };
        let mut naks = Vec::new();
        r.wait_over(now, &mut naks);
        settle_resumed(conn, t, &naks);
    }

    /// The subscription's consumer is gone (deleted, or lost with its server: a plain
    /// one is kept in memory on one server). Pulling alone would be refused once a second
    /// for good. The stream is asked where it stands first, once per namespace for every
    /// subscription lost meanwhile: one deleted and made again starts its sequences at 1,
    /// below the last event a subscription saw, and a consumer made again after that event
    /// would hear nothing until the new stream passed it.
    fn subscription_lost(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        now: Instant,
    ) {
        let Some(t) = self.subscription_mut(session, sub) else {
            return;
        };
        let detached = t.pull.detach(conn);
        let (ns, serial) = (t.ns.clone(), t.serial);
        if let Some(sid) = detached {
            self.routes.remove(&sid);
        }
        let waiting = self.stream_checks.entry(ns.clone()).or_default();
        let asked = !waiting.is_empty();
        waiting.insert((session, sub.to_string(), serial));
        if !asked {
            let req = self
                .config
                .js_api(&ns)
                .stream_info(&binding::topics_stream(&ns));
            self.api_request(conn, Lane::Cleanup, req, Pending::StreamState { ns }, now);
        }
    }

    /// Where the topics stream stands, for the subscriptions lost meanwhile: each is made
    /// again, from the stream's start if it went back behind the subscription's last
    /// event (everything in the new stream came after), or tries again in a while if the
    /// stream is not there (yet).
    pub(super) fn stream_state_done(
        &mut self,
        conn: &mut Connection,
        ns: String,
        reply: Result<Message, crate::nats::RequestError>,
        now: Instant,
    ) {
        let waiting = self.stream_checks.remove(&ns).unwrap_or_default();
        let last = match reply.map(|m| (check_error(&m.payload), m)) {
            Ok((Ok(()), m)) => serde_json::from_slice::<Value>(&m.payload)
                .ok()
                .and_then(|v| v["state"]["last_seq"].as_u64()),
            Ok((Err(e), _)) => {
                log::warn!(namespace:% = ns; "topics stream unavailable ({e}); its subscriptions try again in {}s", SUB_RETRY.as_secs());
                if e.err_code() == Some(crate::jetstream::error::ERR_STREAM_NOT_FOUND) {
                    self.stream_gone(conn, &ns, &binding::topics_stream(&ns), now);
                }
                None
            }
            Err(e) => {
                log::warn!(namespace:% = ns; "topics stream unanswered ({e}); its subscriptions try again in {}s", SUB_RETRY.as_secs());
                None
            }
        };
        for (session, sub, serial) in waiting {
            let Some(t) = self
                .subscription_mut(session, &sub)
                .filter(|t| t.serial == serial && t.pull.sid().is_none())
            else {
                continue;
            };
            let Some(last) = last else {
                let at = crate::deadline::after(now, SUB_RETRY);
                self.set_timer(at, Timer::SubRetry(session, sub, serial));
                continue;
            };
            let (durable, was) = (t.durable, t.last_seq);
            if was > last {
                t.went_back();
                log::warn!(session:% = format_args!("{}-{session}", self.broker_id), sub:% = sub; "topics stream went back from seq {was} to {last}; following it from its start");
            }
            if durable {
                self.remake_durable(conn, session, &sub, now);
            } else {
                self.reset_subscription(conn, session, &sub, now);
            }
        }
    }

    /// A durable's consumer again under its name, from its oldest event unacknowledged
    /// here, else the one after the last sent (its events before that were acknowledged),
    /// else where its consumer started (`start`).
    fn remake_durable(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        now: Instant,
    ) {
        let Some(t) = self.subscription_mut(session, sub) else {
            return;
        };
        let from = match t.inflight.keys().next() {
            Some(&oldest) => DeliverFrom::Sequence(oldest),
            None if t.last_seq > 0 => DeliverFrom::Sequence(t.last_seq.saturating_add(1)),
            None => t.start.clone(),
        };
        let (ns, owner, filter) = (t.ns.clone(), t.owner.clone(), t.filter.clone());
        let consumer = t.pull.consumer().to_string();
        t.last_consumer_seq = 0;
        let name = owner.split_once('/').map_or(owner.as_str(), |(_, n)| n);
        let caps = self.topic_caps(&ns);
        let config = binding::durable_sub_config(
            name,
            sub,
            &filter,
            DURABLE_ACK_WAIT.as_secs(),
            DURABLE_WINDOW,
            caps.durable_inactive_s,
        )
        .deliver_from(from);
        // Only made if it is not there: another broker's session of the durable may have
        // made it first, or it only went unserved a while.
        let made = (ns.as_str(), config, ConsumerAction::Create, consumer);
        self.make_sub_consumer(conn, session, sub, made, now);
    }

    /// Asks for a subscription's consumer made anew; the answer attaches its pull
    /// (`sub_reset_done`).
    fn make_sub_consumer(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        (ns, config, action, consumer): (&str, ConsumerConfig, ConsumerAction, String),
        now: Instant,
    ) {
        let req =
            self.config
                .js_api(ns)
                .consumer_create(&binding::topics_stream(ns), &config, action);
        let Some(serial) = self.subscription_mut(session, sub).map(|t| t.serial) else {
            return;
        };
        let pending = Pending::SubReset {
            session,
            sub: sub.to_string(),
            serial,
            consumer,
        };
        self.api_request(conn, self.lane(session), req, pending, now);
    }

    /// A subscription whose consumer could not be made again tries again, unless it
    /// ended meanwhile or has one.
    pub(super) fn retry_subscription(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        serial: u64,
        now: Instant,
    ) {
        let waiting = self
            .subscription_mut(session, sub)
            .is_some_and(|t| t.serial == serial && t.pull.sid().is_none());
        if waiting {
            self.subscription_lost(conn, session, sub, now);
        }
    }

    /// Replaces a plain subscription's consumer with one starting after the last event
    /// the session saw.
    fn reset_subscription(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        sub: &str,
        now: Instant,
    ) {
        let Some(t) = self.subscription_mut(session, sub) else {
            return;
        };
        let (ns, filter, last, start) =
            (t.ns.clone(), t.filter.clone(), t.last_seq, t.start.clone());
        let old = t.pull.consumer().to_string();
        if let Some(sid) = t.pull.detach(conn) {
            self.routes.remove(&sid);
        }
        let api = self.config.js_api(&ns);
        let delete = api.consumer_delete(&binding::topics_stream(&ns), &old);
        // The subscription lives on: its participant holds no more than before.
        let gone = Pending::ConsumerGone { owner: None };
        self.api_request(conn, Lane::Cleanup, delete, gone, now);
        let consumer = self.plain_consumer_name();
        let from = if last == 0 {
            start
        } else {
            DeliverFrom::Sequence(last.saturating_add(1))
        };
        let config = binding::plain_sub_config(&consumer, &filter, from, EPHEMERAL_INACTIVE);
        if let Some(t) = self.subscription_mut(session, sub) {
            t.pull = PullLoop::new(binding::topics_stream(&ns), consumer.clone(), PLAIN_BATCH)
                .paced(MIN_PULL_WINDOW)
                .in_domain(api.clone());
            t.last_consumer_seq = 0;
        }
        self.share_windows(session);
        log::info!(session:% = format_args!("{}-{session}", self.broker_id), sub:% = sub; "subscription gap; resuming after seq {last}"
        );
        let made = (
            ns.as_str(),
            config,
            ConsumerAction::CreateOrUpdate,
            consumer,
        );
        self.make_sub_consumer(conn, session, sub, made, now);
    }

    pub(super) fn sub_reset_done(
        &mut self,
        conn: &mut Connection,
        (session, sub, serial, consumer): (SessionId, String, u64, String),
        ok: bool,
        now: Instant,
    ) {
        // A later reset has a consumer of its own, and a new subscription of the name
        // (a durable's has the same consumer) a serial of its own.
        let Some(t) = self.subscription_mut(session, &sub).filter(|t| {
            t.serial == serial && t.pull.consumer() == consumer && t.pull.sid().is_none()
        }) else {
            return;
        };
        if !ok {
            // JetStream away (a cluster without quorum answers 503 for a while): the
            // subscription would get nothing more for good.
            let serial = t.serial;
            log::debug!(session:% = format_args!("{}-{session}", self.broker_id), sub:% = sub; "subscription could not be resumed; trying again");
            let at = crate::deadline::after(now, SUB_RETRY);
            return self.set_timer(at, Timer::SubRetry(session, sub, serial));
        }
        self.attach_sub(conn, session, sub, now);
    }

    /// A subscription whose consumer is there subscribes and pulls.
    fn attach_sub(&mut self, conn: &mut Connection, session: SessionId, sub: String, now: Instant) {
        let Some(t) = self.subscription_mut(session, &sub) else {
            return;
        };
        match t.pull.attach_status_only(conn) {
            Ok(sid) => {
                let check = t.pull.pull(conn, now);
                self.routes.insert(
                    sid,
                    Route::Sub {
                        session,
                        sub: sub.clone(),
                    },
                );
                self.check_pull_at(check, PullOwner::Sub(session, sub));
            }
            // No room for the SUB (the server not reading) or no subscription left: as
            // silent as a refused consumer unless tried again.
            Err(e) => {
                let serial = t.serial;
                log::debug!(session:% = format_args!("{}-{session}", self.broker_id), sub:% = sub; "subscription could not be resumed ({e}); trying again");
                let at = crate::deadline::after(now, SUB_RETRY);
                self.set_timer(at, Timer::SubRetry(session, sub, serial));
            }
        }
    }

    /// Each subscription of a session pulls at most its share of a quarter of the
    /// session's outbound bound at a time (at least [`MIN_PULL_WINDOW`]): together they
    /// bring no more than that before the session has written it, whatever the size of
    /// their events.
    fn share_windows(&mut self, session: SessionId) {
        let quarter = self.config.limits.max_outbound_bytes / 4;
        if let Some(s) = self.sessions.get_mut(&session) {
            let share = (quarter / s.subs.len().max(1)) as u64;
            for t in s.subs.values_mut() {
                t.pull.set_window(share.max(MIN_PULL_WINDOW));
            }
        }
    }

    /// The session's output is written: its paced subscriptions waiting to pull do.
    pub(super) fn grant_pulls(&mut self, conn: &mut Connection, session: SessionId, now: Instant) {
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        let mut checks = Vec::new();
        for (sub, t) in &mut s.subs {
            if t.pull.wants_credit() {
                checks.push((t.pull.grant(conn, now), sub.clone()));
            }
        }
        for (check, sub) in checks {
            self.check_pull_at(check, PullOwner::Sub(session, sub));
        }
    }

    /// `{"op":"ack","sub":..,"seq":..}`.
    pub(super) fn event_ack(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        id: Option<String>,
        sub: &str,
        seq: u64,
        now: Instant,
    ) {
        let Some(t) = self.subscription_mut(session, sub) else {
            if let Some(re) = id {
                let e = AmpError::new(
                    ErrorCode::NotFound,
                    format!("no subscription `{sub}` in this session"),
                )
                .with_path("/sub");
                self.fail(session, &re, e);
            }
            return;
        };
        if !t.durable {
            if let Some(re) = id {
                self.ok(session, &re, FrameWriter::ok(Some(&re)));
            }
            return;
        }
        let Some(ack_subject) = t.inflight.remove(&seq).inspect(|_| {
            t.acked.insert(seq);
            if t.acked.len() > DURABLE_WINDOW as usize {
                t.acked.pop_first();
            }
        }) else {
            if let Some(re) = id {
                let e = AmpError::new(
                    ErrorCode::NotFound,
                    format!("no unacknowledged event {seq} on `{sub}`"),
                )
                .with_path("/seq");
                self.fail(session, &re, e);
            }
            return;
        };
        self.ack(conn, session, id, &ack_subject, AckKind::Ack, now);
    }
}

/// Where a plain subscription's consumer starts.
fn deliver_from(from: &amp_frame::From) -> Result<DeliverFrom, AmpError> {
    Ok(match from.clone().normalized() {
        amp_frame::From::New => DeliverFrom::New,
        amp_frame::From::Named(FromName::All) => DeliverFrom::All,
        amp_frame::From::Named(FromName::Last) => DeliverFrom::LastPerSubject,
        amp_frame::From::Named(FromName::New) => DeliverFrom::New,
        amp_frame::From::Seq { seq } => DeliverFrom::Sequence(seq.max(1)),
        amp_frame::From::Time { time } => {
            let nanos = rfc3339::parse_nanos(&time).ok_or_else(|| {
                AmpError::new(ErrorCode::Schema, "not an RFC 3339 time").with_path("/from/time")
            })?;
            let millis = i64::try_from(nanos / 1_000_000).unwrap_or(0);
            DeliverFrom::Time(rfc3339::format_millis(millis))
        }
    })
}

/// The first unacknowledged event of the durable consumer `info` describes: right above
/// its ack floor (a new consumer's floor is just below where its deliver policy starts).
fn first_unacked(info: &Value) -> Option<DeliverFrom> {
    let floor = info["ack_floor"]["stream_seq"].as_u64()?;
    Some(DeliverFrom::Sequence(floor.saturating_add(1)))
}

/// Naks what a resumed durable's order keeper handed back, and drops the keeper once it
/// has nothing left to order.
fn settle_resumed(conn: &mut Connection, t: &mut Subscription, naks: &[String]) {
    if t.resumed.as_ref().is_some_and(Resumed::is_over) {
        t.resumed = None;
    }
    for ack in naks {
        nak(conn, ack);
    }
}

fn nak(conn: &mut Connection, ack: &str) {
    let _ = conn.publish(ack, None, None, &AckKind::Nak { delay: None }.payload());
}

/// A message on a take-over subject, if a broker sent it: no reply, no headers,
/// `<topic filter> <broker id> <incarnation>`, or without the filter from brokers of
/// earlier releases (which read the filter as part of the broker id, so still take the
/// durable over). Its filter, if any, and its sender (`<broker id> <incarnation>`).
/// Participants cannot publish there, but whatever can send JetStream a request can have
/// its answer sent there (a reply subject is not checked against permissions), and those
/// answers are JSON, empty, or carry headers or a reply.
fn parse_takeover(msg: &Message) -> Option<(Option<&str>, &str)> {
    let text = std::str::from_utf8(&msg.payload).ok()?;
    if msg.reply.is_some() || msg.headers.is_some() || text.starts_with('{') {
        return None;
    }
    let (rest, incarnation) = text.rsplit_once(' ')?;
    let (filter, id) = match rest.rsplit_once(' ') {
        Some((filter, id)) => (Some(filter).filter(|f| !f.is_empty()), id),
        None => (None, rest),
    };
    let broker = !id.is_empty()
        && !incarnation.is_empty()
        && incarnation.bytes().all(|b| b.is_ascii_alphanumeric());
    broker.then(|| {
        (
            filter,
            &text[text.len() - id.len() - 1 - incarnation.len()..],
        )
    })
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    //! Topics driven in process: the core on the NATS/JetStream model, one virtual clock.

    use std::time::Duration;

    use serde_json::{Value, json};

    use crate::testing::harness::{Harness, Session};

    fn publish(h: &mut Harness, s: Session, topic: &str, n: u64) -> u64 {
        let ok = h.request(s, json!({"op":"publish","topic":topic,"body":{"n":n}}));
        assert_eq!(ok["op"], "ok", "{ok}");
        ok["seq"].as_u64().expect("seq")
    }

    fn events(h: &mut Harness, s: Session, sub: &str, count: usize) -> Vec<Value> {
        (0..count)
            .map(|_| h.wait_for(s, |f| f["op"] == "event" && f["sub"] == sub))
            .collect()
    }

    fn seqs(events: &[Value]) -> Vec<u64> {
        events.iter().filter_map(|e| e["seq"].as_u64()).collect()
    }

    #[test]
    fn a_resumed_durable_starts_at_its_first_unacknowledged_event() {
        let mut h = Harness::development(1);
        let alice = h.join(0, "alice", json!({}));
        let published: Vec<u64> = (1..=5).map(|n| publish(&mut h, alice, "t.a", n)).collect();

        let bob = h.join(0, "bob", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"d","durable":true,"from":"all"});
        assert_eq!(h.request(bob, sub.clone())["op"], "ok");
        let first = events(&mut h, bob, "d", 5);
        assert_eq!(seqs(&first), published);
        assert_eq!(first[0]["from"], "dev/alice");
        assert_eq!(first[0]["body"]["n"], 1);
        for seq in &published[..2] {
            h.send(bob, json!({"op":"ack","sub":"d","seq":seq}));
        }
        h.close(bob);

        let bob = h.join(0, "bob", json!({}));
        assert_eq!(h.request(bob, sub)["op"], "ok");
        assert_eq!(seqs(&events(&mut h, bob, "d", 3)), published[2..]);
    }

    /// After a reconnect a durable pulls on a fresh subscription (its old one, restored
    /// with the connection, kept the pull from before the drop live next to the new
    /// one). What the server sent on the old one before it had the UNSUB comes ahead of
    /// the new pull's events: it goes to the session as any other, in that order, not
    /// back to JetStream (whose redelivery would come behind later events, and be held
    /// out of the session to keep the order).
    #[test]
    fn a_durables_event_from_its_pull_before_a_reconnect_goes_out_in_order() {
        let mut h = Harness::development(1);
        let alice = h.join(0, "alice", json!({}));
        let bob = h.join(0, "bob", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"d","durable":true,"from":"all"});
        assert_eq!(h.request(bob, sub)["op"], "ok");
        let first = publish(&mut h, alice, "t.a", 1);
        assert_eq!(seqs(&events(&mut h, bob, "d", 1)), [first]);
        let pull = |h: &Harness| {
            let t = &h.broker(0).sessions[&bob.id].subs["d"];
            (t.pull.sid(), t.pull.consumer().to_string())
        };
        let (old, consumer) = pull(&h);
        let old = old.expect("subscribed");
        h.drop_nats(0);
        let (new, _) = pull(&h);
        assert!(new.is_some_and(|s| s != old), "{new:?} after {old:?}");
        assert!(h.broker(0).retired_pulls.contains_key(&old));
        let next = first + 1;
        let envelope = json!({"id":"e2","kind":"event","from":"dev/alice","topic":"t.a",
                              "ts":"2027-01-15T08:00:01.000Z","body":{"n":2}});
        let late = crate::nats::Message {
            subject: "amp.dev.topic.t.a".into(),
            reply: Some(format!(
                "$JS.ACK.AMP_TOPICS_dev.{consumer}.1.{next}.2.1800000001000000000.0"
            )),
            headers: None,
            payload: envelope.to_string().into_bytes(),
        };
        h.nats_event(
            0,
            crate::nats::Event::Unread {
                sid: old,
                msg: late,
            },
        );
        let got = h.take(bob);
        let events: Vec<&Value> = got.iter().filter(|f| f["op"] == "event").collect();
        assert_eq!(events.len(), 1, "{got:?}");
        assert_eq!(
            (&events[0]["seq"], &events[0]["body"]["n"]),
            (&json!(next), &json!(2))
        );
        // Anything else on it is no event of the subscription's: not sent.
        let foreign = crate::nats::Message {
            subject: "amp.dev.topic.t.a".into(),
            reply: Some(format!(
                "$JS.ACK.AMP_TOPICS_dev.other.1.{}.3.1800000001000000000.0",
                next + 1
            )),
            headers: None,
            payload: envelope.to_string().into_bytes(),
        };
        h.nats_event(
            0,
            crate::nats::Event::Unread {
                sid: old,
                msg: foreign,
            },
        );
        assert!(h.take(bob).iter().all(|f| f["op"] != "event"));
    }

    #[test]
    fn only_a_broker_shaped_message_takes_a_durable_over() {
        let msg = |payload: &str, reply: Option<&str>| crate::nats::Message {
            subject: "_AMP_BROKER.DURABLE.acme.bob.n".into(),
            reply: reply.map(str::to_string),
            headers: None,
            payload: payload.as_bytes().to_vec(),
        };
        let parse = |payload, reply| {
            let m = msg(payload, reply);
            super::parse_takeover(&m).map(|(f, o)| (f.map(str::to_string), o.to_string()))
        };
        // From a broker of an earlier release, and from this one with its topic.
        assert_eq!(
            parse("b7f3a9 K2QX7JHA", None),
            Some((None, "b7f3a9 K2QX7JHA".into()))
        );
        assert_eq!(
            parse("amp.acme.topic.t.* b7f3a9 K2QX7JHA", None),
            Some((Some("amp.acme.topic.t.*".into()), "b7f3a9 K2QX7JHA".into()))
        );
        // What JetStream sends to a reply subject a request named.
        let info = r#"{"type":"io.nats.jetstream.api.v1.consumer_info_response"}"#;
        assert_eq!(parse(info, None), None);
        assert_eq!(parse("", None), None);
        assert_eq!(
            parse(
                "b7f3a9 K2QX7JHA",
                Some("$JS.ACK.AMP_INBOX_acme.inbox_eve.1.1.1.1.0")
            ),
            None
        );
        assert_eq!(parse("{ 1", None), None);
        assert_eq!(parse("{\"a\": 1} b7f3a9 K2QX7JHA", None), None);
    }

    #[test]
    fn a_durable_resumed_while_its_old_session_is_still_open_starts_at_the_first_unacked() {
        // Found by the simulator (generation 2, seed 0x2a2): a client reconnected while the
        // broker still held its old session open; both sessions pulled the durable, the
        // old one kept events 2-5 unacknowledged, and the new one got 6 first.
        let mut h = Harness::development(1);
        let alice = h.join(0, "alice", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"d","durable":true,"from":"all"});
        let old = h.join(0, "bob", json!({}));
        assert_eq!(h.request(old, sub.clone())["op"], "ok");
        let published: Vec<u64> = (1..=4).map(|n| publish(&mut h, alice, "t.a", n)).collect();
        let first = events(&mut h, old, "d", 4);
        h.send(old, json!({"op":"ack","sub":"d","seq":first[0]["seq"]}));

        let new = h.join(0, "bob", json!({}));
        assert_eq!(h.request(new, sub)["op"], "ok");
        let later = publish(&mut h, alice, "t.a", 5);
        let resumed = events(&mut h, new, "d", 4);
        assert_eq!(seqs(&resumed), [&published[1..], &[later]].concat());
        // The old session reads the subscription no more.
        h.advance(Duration::from_secs(1));
        let stale = h.take(old);
        assert!(stale.iter().all(|f| f["op"] != "event"), "{stale:?}");
    }

    #[test]
    fn a_durable_resumed_after_its_broker_crashed_gets_what_the_crash_left_unacked_first() {
        // Found by the simulator (seed 0x169e, 600 steps): the crashed broker could not
        // hand event 2 back, the resumed session got 3 while 2 waited out its ack wait,
        // and 2's redelivery was then taken for one this session had already got.
        let mut h = Harness::development(2);
        let alice = h.join(0, "alice", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"d","durable":true,"from":"all"});
        let old = h.join(1, "bob", json!({}));
        assert_eq!(h.request(old, sub.clone())["op"], "ok");
        let published: Vec<u64> = (1..=2).map(|n| publish(&mut h, alice, "t.a", n)).collect();
        let first = events(&mut h, old, "d", 2);
        h.send(old, json!({"op":"ack","sub":"d","seq":first[0]["seq"]}));
        h.advance(Duration::from_millis(100));
        h.crash(1);

        let new = h.join(0, "bob", json!({}));
        assert_eq!(h.request(new, sub)["op"], "ok");
        let later: Vec<u64> = (3..=4).map(|n| publish(&mut h, alice, "t.a", n)).collect();
        let resumed = events(&mut h, new, "d", 3);
        assert_eq!(seqs(&resumed), [&published[1..], &later].concat());
        for e in &resumed {
            h.send(new, json!({"op":"ack","sub":"d","seq":e["seq"]}));
        }
        // Nothing comes twice, and the subscription goes on as usual.
        let last = publish(&mut h, alice, "t.a", 5);
        assert_eq!(seqs(&events(&mut h, new, "d", 1)), [last]);
        h.advance(Duration::from_secs(40));
        let stray: Vec<Value> = h
            .take(new)
            .into_iter()
            .filter(|f| f["op"] == "event")
            .collect();
        assert!(stray.is_empty(), "events again: {stray:?}");
    }

    /// Events `s` was sent on `sub`, all that came by now.
    fn sent(h: &mut Harness, s: Session, sub: &str) -> Vec<u64> {
        let frames = h.take(s);
        let got: Vec<Value> = frames
            .into_iter()
            .filter(|f| f["op"] == "event" && f["sub"] == sub)
            .collect();
        seqs(&got)
    }

    /// The durable `d` of `dev/bob`: its events unacknowledged.
    fn ack_pending(h: &mut Harness) -> u64 {
        let consumer = crate::broker::binding::durable_sub_consumer("bob", "d");
        let subject = format!("$JS.API.CONSUMER.INFO.AMP_TOPICS_dev.{consumer}");
        let info = h.nats_request(&subject, &[], b"");
        info["num_ack_pending"].as_u64().expect("consumer info")
    }

    #[test]
    fn durable_deliveries_lost_in_a_reconnect_come_again_in_order() {
        // Deliveries out to a NATS connection that drops never reach the broker and come
        // again after their ack wait, behind newer ones: the newer ones wait for them.
        let mut h = Harness::development(2);
        let alice = h.join(1, "alice", json!({}));
        let bob = h.join(0, "bob", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"d","durable":true});
        assert_eq!(h.request(bob, sub)["op"], "ok");
        let first = publish(&mut h, alice, "t.a", 1);
        assert_eq!(seqs(&events(&mut h, bob, "d", 1)), [first]);
        h.send(bob, json!({"op":"ack","sub":"d","seq":first}));
        h.deafen(0, true);
        let mut published: Vec<u64> = (2..=4).map(|n| publish(&mut h, alice, "t.a", n)).collect();
        h.cut(0);
        published.push(publish(&mut h, alice, "t.a", 5));
        h.advance(Duration::from_secs(40));
        let got = sent(&mut h, bob, "d");
        assert_eq!(got, published, "each once, in stream order");
        for seq in &got {
            h.send(bob, json!({"op":"ack","sub":"d","seq":seq}));
        }
        h.advance(Duration::from_secs(1));
        assert_eq!(ack_pending(&mut h), 0);
    }

    #[test]
    fn a_durable_event_that_comes_behind_the_last_one_sent_waits_for_the_next_session() {
        // Event 2 is lost in a reconnect, 3 waits for it; its redelivery is lost too, and
        // unseen (standing for any way the wait ends before a lost event is back), so
        // the wait ends and 3 is sent. 2 then comes behind 3: sent, it would break the
        // stream order within the session (the simulator's "event 8 after 20").
        let mut h = Harness::development(2);
        let alice = h.join(1, "alice", json!({}));
        let bob = h.join(0, "bob", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"d","durable":true});
        assert_eq!(h.request(bob, sub.clone())["op"], "ok");
        let first = publish(&mut h, alice, "t.a", 1);
        assert_eq!(seqs(&events(&mut h, bob, "d", 1)), [first]);
        h.send(bob, json!({"op":"ack","sub":"d","seq":first}));
        h.deafen(0, true);
        let lost = publish(&mut h, alice, "t.a", 2);
        h.cut(0);
        let third = publish(&mut h, alice, "t.a", 3);
        h.advance(Duration::from_secs(29));
        assert_eq!(sent(&mut h, bob, "d"), [0u64; 0], "3 waits for 2");
        h.deafen(0, true);
        h.advance(Duration::from_secs(2));
        h.deafen(0, false);
        h.advance(Duration::from_secs(40));
        assert_eq!(sent(&mut h, bob, "d"), [third], "2 came behind 3: not sent");
        h.send(bob, json!({"op":"ack","sub":"d","seq":third}));
        h.advance(Duration::from_secs(1));
        assert_eq!(ack_pending(&mut h), 1, "2, kept for the next session");
        h.close(bob);
        let bob = h.join(0, "bob", json!({}));
        assert_eq!(h.request(bob, sub)["op"], "ok");
        assert_eq!(seqs(&events(&mut h, bob, "d", 1)), [lost]);
        h.send(bob, json!({"op":"ack","sub":"d","seq":lost}));
        let later = publish(&mut h, alice, "t.a", 4);
        assert_eq!(seqs(&events(&mut h, bob, "d", 1)), [later]);
    }

    #[test]
    fn a_durable_event_whose_ack_was_lost_in_a_reconnect_is_acknowledged_again() {
        // The ack of 1 is lost with the connection; 1 comes again after its ack wait,
        // behind the session's last event. Kept back as never sent, it held one of the
        // durable's unacknowledged slots for the rest of the session and came again in
        // the next one.
        let mut h = Harness::development(2);
        let alice = h.join(1, "alice", json!({}));
        let bob = h.join(0, "bob", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"d","durable":true});
        assert_eq!(h.request(bob, sub)["op"], "ok");
        let published: Vec<u64> = (1..=2).map(|n| publish(&mut h, alice, "t.a", n)).collect();
        assert_eq!(seqs(&events(&mut h, bob, "d", 2)), published);
        h.mute(0, true);
        h.send(bob, json!({"op":"ack","sub":"d","seq":published[0]}));
        h.cut(0);
        h.send(bob, json!({"op":"ack","sub":"d","seq":published[1]}));
        h.advance(Duration::from_secs(40));
        assert_eq!(sent(&mut h, bob, "d"), [0u64; 0], "nothing twice");
        assert_eq!(ack_pending(&mut h), 0);
    }

    #[test]
    fn a_resumed_durable_whose_consumer_is_lost_before_an_event_came_loses_none() {
        // Resumed (its `from` ignored), then its consumer deleted while broker 0 hears
        // nothing, and events published meanwhile: made again from the subscribe's
        // `from` ("new"), it started after them.
        let mut h = Harness::development(2);
        let alice = h.join(1, "alice", json!({}));
        let bob = h.join(0, "bob", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"d","durable":true});
        assert_eq!(h.request(bob, sub.clone())["op"], "ok");
        let first = publish(&mut h, alice, "t.a", 1);
        assert_eq!(seqs(&events(&mut h, bob, "d", 1)), [first]);
        h.send(bob, json!({"op":"ack","sub":"d","seq":first}));
        h.close(bob);
        let bob = h.join(0, "bob", json!({}));
        assert_eq!(h.request(bob, sub)["op"], "ok");
        h.deafen(0, true);
        let consumer = crate::broker::binding::durable_sub_consumer("bob", "d");
        let deleted = h.nats_request(
            &format!("$JS.API.CONSUMER.DELETE.AMP_TOPICS_dev.{consumer}"),
            &[],
            b"",
        );
        assert_eq!(deleted["success"], true, "{deleted}");
        let missed: Vec<u64> = (2..=3).map(|n| publish(&mut h, alice, "t.a", n)).collect();
        h.cut(0);
        h.advance(Duration::from_secs(10));
        assert_eq!(sent(&mut h, bob, "d"), missed);
    }

    #[test]
    fn a_plain_subscription_gets_what_its_from_asks_for_and_nothing_after_unsubscribe() {
        let mut h = Harness::development(1);
        let alice = h.join(0, "alice", json!({}));
        let early: Vec<u64> = (1..=3).map(|n| publish(&mut h, alice, "t.b", n)).collect();

        let bob = h.join(0, "bob", json!({}));
        let ok = h.request(bob, json!({"op":"subscribe","topic":"t.*","sub":"new"}));
        assert_eq!(ok["op"], "ok", "{ok}");
        let ok = h.request(
            bob,
            json!({"op":"subscribe","topic":"t.b","sub":"from2","from":{"seq":early[1]}}),
        );
        assert_eq!(ok["op"], "ok", "{ok}");
        assert_eq!(seqs(&events(&mut h, bob, "from2", 2)), early[1..]);

        let late = publish(&mut h, alice, "t.b", 4);
        assert_eq!(seqs(&events(&mut h, bob, "new", 1)), [late]);
        assert_eq!(seqs(&events(&mut h, bob, "from2", 1)), [late]);

        assert_eq!(
            h.request(bob, json!({"op":"unsubscribe","sub":"new"}))["op"],
            "ok"
        );
        let last = publish(&mut h, alice, "t.b", 5);
        assert_eq!(seqs(&events(&mut h, bob, "from2", 1)), [last]);
        h.advance(std::time::Duration::from_secs(5));
        let stray: Vec<Value> = h
            .take(bob)
            .into_iter()
            .filter(|f| f["sub"] == "new")
            .collect();
        assert!(stray.is_empty(), "events after unsubscribe: {stray:?}");
    }

    #[test]
    fn a_subscription_name_taken_in_the_session_is_refused() {
        let mut h = Harness::development(1);
        let bob = h.join(0, "bob", json!({}));
        let sub = json!({"op":"subscribe","topic":"t.a","sub":"s"});
        assert_eq!(h.request(bob, sub.clone())["op"], "ok");
        let again = h.request(bob, sub);
        assert_eq!(again["op"], "error", "{again}");
    }

    #[test]
    fn a_participant_gets_no_more_turns_of_the_api_queue_for_holding_more_sessions() {
        // Turns went session by session: a participant with 16 sessions had 16 turns to
        // another's one, whatever share of JetStream's API that left the other.
        const SESSIONS: usize = 16;
        const EACH: usize = 8;
        let mut h = Harness::development(1);
        let mallory: Vec<Session> = (0..SESSIONS)
            .map(|_| h.join(0, "mallory", json!({})))
            .collect();
        let victim = h.join(0, "victim", json!({}));
        let subscribe = |id: String| json!({"op":"subscribe","id":id,"topic":"t.>","sub":id});
        let mut frames: Vec<(Session, Value)> = Vec::new();
        for (k, &m) in mallory.iter().enumerate() {
            frames.extend((0..EACH).map(|i| (m, subscribe(format!("m{k}-{i}")))));
        }
        frames.extend((0..EACH).map(|i| (victim, subscribe(format!("v{i}")))));
        h.sent_log = Some(Vec::new());
        h.send_together(&frames);
        let answered: Vec<(Session, Value)> = h
            .sent_log
            .take()
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, f)| f["re"].is_string())
            .collect();
        assert!(
            answered.iter().all(|(_, f)| f["op"] == "ok"),
            "{answered:?}"
        );
        assert_eq!(answered.len(), frames.len());
        let order: Vec<bool> = answered.iter().map(|(s, _)| *s == victim).collect();
        let last = order.iter().rposition(|&v| v).unwrap_or(usize::MAX);
        // 16 of mallory's were out before the victim asked; then the two take turns.
        let limit = crate::broker::core::SESSION_API_IN_FLIGHT + 2 * EACH;
        let picture: String = order.iter().map(|&v| if v { 'V' } else { '.' }).collect();
        eprintln!("answers in order (V: the victim's): {picture}");
        assert!(
            last < limit,
            "the victim's last subscription was answered {}th of {}: {picture}",
            last + 1,
            order.len()
        );
    }
}
