//! The broker's one pull engine: a pull consumer read continuously, in one of two paces.
//!
//! - *Steady* (each participant's inbox, each topic subscription, MIG's live events): at
//!   most one `MSG.NEXT` of a fixed batch outstanding, renewed when it is used up or ended
//!   by 404/408, replaced when it has been silent (no message, no idle heartbeat) for too
//!   long, retried shortly after a 503 or another refusal. A *paced* steady loop (inboxes,
//!   topic subscriptions) also caps each pull's bytes (`max_bytes`, whose ends are the
//!   409s "Message Size Exceeds MaxBytes" and "Batch Completed") and renews it only when
//!   its owner grants it, once its reader has written what the last one brought, so a
//!   reader gets its backlog as fast as it reads it. Each pull is answered on its
//!   own numbered subject and only the latest one's statuses count: a pull replaced while
//!   still alive at the server (a silent one) would otherwise renew itself with every
//!   status and the loop would hold two pulls, then more, for good. Nothing is sent while
//!   disconnected: the reconnect sends the one pull, on a fresh subscription
//!   ([`PullLoop::retire`]).
//! - *On demand* (each job's queue): pulls sized by the owner's free slots, several
//!   outstanding, each answered on its own numbered subject so that its 404/408/409 says
//!   how much of it is not coming; a pull is over at its expiry whether or not a status
//!   said so. What follows an ended pull (pull again, create the consumer again) is the
//!   owner's decision.

use std::time::{Duration, Instant};

use crate::id_map::IdMap;
use crate::jetstream::ack::AckMetadata;
use crate::jetstream::pull::{Inbound, PullRequest, classify};
use crate::jetstream::{AckKind, ApiPrefix, Delivery};
use crate::nats::{Connection, Message, Sid};

/// A pull request's lifetime; the next one follows when it ends.
pub const PULL_EXPIRES: Duration = Duration::from_secs(20);
/// The server's idle heartbeat while a pull waits; two missed ones mean it is gone.
pub const PULL_HEARTBEAT: Duration = Duration::from_secs(5);
const RETRY_AFTER_NO_RESPONDERS: Duration = Duration::from_secs(1);
/// A paced loop waits this long for its grant, then pulls anyway: the consumers it
/// reads are deleted by the server after 30 s without a pull (`inactive_threshold`).
/// A session that reads nothing for good is then closed as a slow consumer rather than
/// losing its subscription without a word.
pub const CREDIT_WAIT: Duration = Duration::from_secs(15);

#[derive(Debug)]
pub struct PullLoop {
    /// The JetStream API the consumer lives under (`$JS.API` or a domain's).
    api: ApiPrefix,
    stream: String,
    consumer: String,
    batch: u32,
    /// The subscription receiving the pulled messages.
    sid: Option<Sid>,
    /// The deliver subjects' prefix: pulls answer on `<prefix>.<n>`.
    deliver: String,
    /// Steady: the number of the latest pull.
    current: u64,
    /// Messages the outstanding pulls may still deliver; 0 when none is outstanding.
    remaining: u32,
    /// On demand only: the outstanding pulls.
    shares: Option<Shares>,
    /// When the outstanding pull counts as lost without word from the server.
    until: Option<Instant>,
    /// The generation of the one check that counts; checks the owner filed earlier in
    /// the timer table are stale when they fire.
    generation: u64,
    /// Paced loops only: whether the next pull may go. Each pull spends it and the
    /// owner grants it again ([`PullLoop::grant`]), e.g. once what the last one brought
    /// has been written to its reader.
    credit: Option<bool>,
    /// Paced loops only: the bytes one pull may bring (its `max_bytes`).
    window: Option<u64>,
    /// The messages the latest pull asked for.
    asked: u32,
    /// What is left of the latest pull's `max_bytes`, as the server counts it.
    bytes_left: u64,
    /// The next pull asks for one message whatever its size: the last one ended on a
    /// message larger than its whole window.
    whole: bool,
    /// Pulls answered 503 in a row (see [`UNSERVED_LOST`]).
    unserved: u8,
}

/// The status that ends a pull whose next message is larger than what is left of its
/// `max_bytes`.
const OVER_MAX_BYTES: &str = "Message Size Exceeds MaxBytes";
/// The status that follows the last message of a pull carrying `max_bytes` whose count
/// ran out first.
const BATCH_COMPLETED: &str = "Batch Completed";

/// The outstanding pulls of an on-demand loop.
#[derive(Debug)]
struct Shares {
    expires: Duration,
    /// By number, with their batch.
    pulls: IdMap<u64, u32>,
    next: u64,
}

/// A pull an on-demand loop sent: its number, and when it is over whether or not a
/// status says so (a fully answered pull gets none), for the owner's timer table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub pull: u64,
    pub over_at: Instant,
}

/// After this much silence past its expiry an on-demand pull is taken as gone.
const SHARE_GRACE: Duration = Duration::from_secs(5);

/// Messages asked for at most through acks (`+NXT`): each such pull that finds nothing
/// waits at the server, which keeps a bounded number of waiting pulls per consumer
/// (`max_waiting`, 512 by default) for every broker together.
pub const ACK_PULL_LIMIT: u32 = 16;

/// What a message on an on-demand loop's subscription was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer<'a> {
    /// A stream message: hand it on.
    Message,
    /// A heartbeat or the like: nothing to do.
    Nothing,
    /// A status ended a pull; with the server's reason for a 409 or another status.
    Ended { why: Option<&'a str> },
    /// 503: nobody serves the consumer (JetStream not ready, or the consumer is gone).
    NoResponders,
}

/// A check for the owner to file in the timer table and hand back to
/// [`PullLoop::check`] when it is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    pub at: Instant,
    pub generation: u64,
}

/// What a message on the pull's subscription was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pulled {
    /// A stream message: hand it on.
    Message,
    /// An idle heartbeat, or a status of a pull replaced since: nothing to do.
    Heartbeat,
    /// A status that ended the pull; a new one has been asked for.
    Ended,
    /// As `Ended`, and the consumer is gone: deleted (`409 Consumer Deleted`), or nobody
    /// has served its pulls for [`UNSERVED_LOST`] tries in a row (503). An owner that can
    /// make it again does; pulling alone would be refused once a second for good.
    Lost,
}

/// Pulls answered 503 (no responders) in a row after which the consumer counts as lost:
/// a few, since JetStream still starting or a consumer's leader being elected answer so
/// for a moment too.
pub const UNSERVED_LOST: u8 = 3;
const CONSUMER_DELETED: &str = "Consumer Deleted";

impl PullLoop {
    pub fn new(stream: String, consumer: String, batch: u32) -> PullLoop {
        PullLoop {
            api: ApiPrefix::default(),
            stream,
            consumer,
            batch: batch.max(1),
            sid: None,
            deliver: String::new(),
            current: 0,
            remaining: 0,
            shares: None,
            until: None,
            generation: 0,
            credit: None,
            window: None,
            asked: 0,
            bytes_left: 0,
            whole: false,
            unserved: 0,
        }
    }

    /// A steady loop that pulls again only when granted ([`PullLoop::grant`]), each pull
    /// bringing at most `window` bytes (a message larger than that alone): its batches
    /// come no faster, and no larger, than its owner takes them.
    pub fn paced(mut self, window: u64) -> PullLoop {
        self.credit = Some(true);
        self.window = Some(window.max(1));
        self
    }

    /// Paced: the bytes each pull from the next on may bring.
    pub fn set_window(&mut self, window: u64) {
        if self.window.is_some() {
            self.window = Some(window.max(1));
        }
    }

    /// Paced: a pull is due and waits for [`PullLoop::grant`].
    pub fn wants_credit(&self) -> bool {
        self.credit == Some(false) && self.remaining == 0 && self.sid.is_some()
    }

    /// Paced: the next pull may go, now if one is due.
    pub fn grant(&mut self, conn: &mut Connection, now: Instant) -> Option<Check> {
        if self.credit.is_some() {
            self.credit = Some(true);
        }
        self.pull(conn, now)
    }

    /// An on-demand loop answered under `deliver_prefix`, its pulls expiring after
    /// `expires`.
    pub fn on_demand(
        stream: String,
        consumer: String,
        deliver_prefix: String,
        expires: Duration,
    ) -> PullLoop {
        PullLoop {
            deliver: deliver_prefix,
            shares: Some(Shares {
                expires,
                pulls: IdMap::default(),
                next: 0,
            }),
            ..PullLoop::new(stream, consumer, 1)
        }
    }

    /// The same loop on a consumer in another JetStream domain.
    pub fn in_domain(mut self, api: ApiPrefix) -> PullLoop {
        self.api = api;
        self
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    pub fn sid(&self) -> Option<Sid> {
        self.sid
    }

    /// Subscribes to every numbered subject of the deliver prefix (steady: a fresh
    /// inbox); returns the subscription.
    pub fn attach(&mut self, conn: &mut Connection) -> Result<Sid, crate::nats::Error> {
        if self.shares.is_none() {
            self.deliver = conn.new_inbox();
        }
        let sid = conn.subscribe(&format!("{}.*", self.deliver), None)?;
        self.sid = Some(sid);
        // Its consumer made again: a lost one counts its 503s afresh, or the first one
        // after would make it again at once, a create and a pull per round trip.
        self.unserved = 0;
        Ok(sid)
    }

    /// [`attach`](Self::attach) for a reader that builds its frames from the stored
    /// envelope and needs of each header block only its status (inboxes, topic
    /// subscriptions): no delivery's header fields are checked or copied.
    pub fn attach_status_only(&mut self, conn: &mut Connection) -> Result<Sid, crate::nats::Error> {
        let sid = self.attach(conn)?;
        conn.status_only_headers(sid);
        Ok(sid)
    }

    /// Drops the subscription; returns it so the caller can forget its route.
    pub fn detach(&mut self, conn: &mut Connection) -> Option<Sid> {
        let sid = self.sid.take()?;
        let _ = conn.unsubscribe(sid, None);
        Some(sid)
    }

    /// Steady, after a reconnect: the subscription came back with the connection, and
    /// with it each pull from before the drop that the server still held, live again next
    /// to the one sent after it: two pulls for one loop, more in flight than its batch,
    /// window or grant allow, until the old one expired (20 s). Dropped here, the server
    /// drops those pulls (nobody listens on their subject any more); the owner attaches
    /// again (a fresh inbox) and pulls. Returns the old subscription: what it still
    /// brings comes as [`crate::nats::Event::Unread`].
    pub fn retire(&mut self, conn: &mut Connection) -> Option<Sid> {
        self.remaining = 0;
        self.detach(conn)
    }

    /// Sends a pull unless one is outstanding; returns when to check on it.
    pub fn pull(&mut self, conn: &mut Connection, now: Instant) -> Option<Check> {
        if self.sid.is_none() || self.remaining > 0 || !conn.sends_now() {
            return None;
        }
        if self.credit == Some(false) {
            // Not granted in time, it pulls anyway (`check`): without a pull for
            // `inactive_threshold` the server deletes the consumer.
            self.until = Some(now + CREDIT_WAIT);
            return self.arm();
        }
        let (asked, max_bytes) = match self.window {
            Some(_) if self.whole => (1, None),
            window => (self.batch, window),
        };
        let pull = PullRequest {
            expires: Some(PULL_EXPIRES),
            idle_heartbeat: Some(PULL_HEARTBEAT),
            max_bytes,
            ..PullRequest::batch(u64::from(asked))
        };
        let req = self
            .api
            .pull_next(&self.stream, &self.consumer, &pull)
            .ok()?;
        let number = self.current.wrapping_add(1);
        let reply = format!("{}.{number}", self.deliver);
        if conn
            .publish(&req.subject, Some(&reply), None, &req.payload)
            .is_err()
        {
            // The write buffer is full: try again shortly rather than never.
            self.until = Some(now + RETRY_AFTER_NO_RESPONDERS);
            return self.arm();
        }
        self.current = number;
        self.remaining = asked;
        self.asked = asked;
        self.bytes_left = max_bytes.unwrap_or(u64::MAX);
        self.whole = false;
        if self.credit.is_some() {
            self.credit = Some(false);
        }
        // The server answers a live pull with a heartbeat within PULL_HEARTBEAT; a pull
        // that was lost (e.g. sent while JetStream was still recovering) is noticed soon.
        self.until = Some(now + PULL_HEARTBEAT * 2);
        self.arm()
    }

    /// A new check at `until`; every check filed before it is stale from now on. Only
    /// a deadline that moved earlier, or a new pull, needs one: while it moves later
    /// (every message, every heartbeat) the check filed fires early and files the next.
    fn arm(&mut self) -> Option<Check> {
        let at = self.until?;
        self.generation = self.generation.wrapping_add(1);
        Some(Check {
            at,
            generation: self.generation,
        })
    }

    /// Accounts for one message of the subscription, renewing the pull when it ends.
    /// Statuses of pulls replaced since say nothing.
    pub fn on_message(
        &mut self,
        conn: &mut Connection,
        msg: &Message,
        now: Instant,
    ) -> (Pulled, Option<Check>) {
        let meta = msg
            .reply
            .as_deref()
            .and_then(|r| AckMetadata::parse(r).ok());
        self.on_delivery(conn, msg, meta.as_ref(), now)
    }

    /// [`PullLoop::on_message`] for a caller that has parsed the message's ack subject
    /// (`meta`) for its own use: each delivery's is parsed once.
    pub fn on_delivery(
        &mut self,
        conn: &mut Connection,
        msg: &Message,
        meta: Option<&AckMetadata>,
        now: Instant,
    ) -> (Pulled, Option<Check>) {
        let status = msg.status();
        // A status comes on its pull's subject; a message on its own stream subject.
        let stale = status.is_some()
            && msg
                .subject
                .rsplit_once('.')
                .and_then(|(_, n)| n.parse::<u64>().ok())
                != Some(self.current);
        if stale || (status.is_none() && !meta.is_some_and(|m| self.names(m))) {
            return (Pulled::Heartbeat, None);
        }
        if status != Some(503) {
            self.unserved = 0;
        }
        match status {
            Some(100) => {
                self.until = Some(now + PULL_HEARTBEAT * 2);
                (Pulled::Heartbeat, None)
            }
            Some(404 | 408) => {
                // Expired or empty: the usual end of a pull, the next one at once.
                self.remaining = 0;
                (Pulled::Ended, self.pull(conn, now))
            }
            Some(409) if matches!(msg.description(), Some(OVER_MAX_BYTES | BATCH_COMPLETED)) => {
                // The pull's bytes or count are used up: the usual end of a paced one,
                // once what it brought is here. The server says how many it did not
                // send; a replicated consumer's status can overtake the rest.
                let unsent = msg
                    .header("Nats-Pending-Messages")
                    .and_then(|n| n.trim().parse::<u32>().ok());
                // Had it brought nothing, its next message is larger than a whole window
                // and comes alone, now: nothing waits to be written for it.
                if msg.description() == Some(OVER_MAX_BYTES)
                    && unsent.map_or(self.remaining == self.asked, |n| n >= self.asked)
                {
                    self.whole = true;
                    if self.credit.is_some() {
                        self.credit = Some(true);
                    }
                }
                self.remaining = unsent.map_or(0, |n| self.remaining.saturating_sub(n));
                if self.remaining > 0 {
                    self.until = Some(now + PULL_HEARTBEAT * 2);
                    return (Pulled::Heartbeat, None);
                }
                (Pulled::Ended, self.pull(conn, now))
            }
            Some(code) => {
                // Nobody serves the consumer yet (503: JetStream still starting), or the
                // server refused the pull (409 "Exceeded MaxWaiting", a leadership
                // change, 400...): pulling again at once would be refused again at once,
                // a loop at round-trip speed. Shortly instead.
                let brought = self.remaining < self.asked;
                self.remaining = 0;
                if self.credit.is_some() && !brought {
                    // The refused pull brought nothing; the retry needs no grant.
                    self.credit = Some(true);
                }
                // One that brought some (a leadership change ends a pull midway) waits for
                // its owner to write them, as at any end, or for `CREDIT_WAIT`.
                let wait = if self.credit == Some(false) {
                    CREDIT_WAIT
                } else {
                    RETRY_AFTER_NO_RESPONDERS
                };
                self.until = Some(now + wait);
                if code == 503 {
                    self.unserved = self.unserved.saturating_add(1);
                }
                let lost = self.unserved >= UNSERVED_LOST
                    || (code == 409 && msg.description() == Some(CONSUMER_DELETED));
                (if lost { Pulled::Lost } else { Pulled::Ended }, self.arm())
            }
            None => {
                self.remaining = self.remaining.saturating_sub(1);
                self.bytes_left = self.bytes_left.saturating_sub(msg.pulled_size() as u64);
                if self.bytes_left == 0 {
                    // Its bytes used up exactly, the server ends the pull with no status.
                    self.remaining = 0;
                }
                self.until = Some(now + PULL_HEARTBEAT * 2);
                (Pulled::Message, self.pull(conn, now))
            }
        }
    }

    /// Whether `msg` is a delivery of this loop's consumer: its ack subject names the
    /// stream and the consumer. Anything else on the pull's subject was put there by
    /// someone who learnt it (a leaf site's hub sees the pulls a site sends into its
    /// domain): acted on, it would be taken for JetStream's, and acked, the broker would
    /// ack whatever its reply named. A client cannot give a message a `$JS.ACK` reply
    /// (nats-server refuses it); a leaf node's server can, so a peer holding leaf
    /// credentials that names the right stream and consumer still passes: there the leaf
    /// user's permissions are what protects.
    pub fn delivers(&self, msg: &Message) -> bool {
        msg.reply
            .as_deref()
            .and_then(|r| AckMetadata::parse(r).ok())
            .is_some_and(|m| self.names(&m))
    }

    fn names(&self, meta: &AckMetadata) -> bool {
        meta.stream == self.stream && meta.consumer == self.consumer
    }

    /// Whether a check filed with `generation` still counts (see [`PullLoop::check`]).
    pub fn checks(&self, generation: u64) -> bool {
        generation == self.generation
    }

    /// At a check's time: a pull that has been silent too long is replaced. A stale
    /// check (another was filed since) does nothing.
    pub fn check(&mut self, conn: &mut Connection, generation: u64, now: Instant) -> Option<Check> {
        if generation != self.generation {
            return None;
        }
        if self.until.is_some_and(|until| until <= now) {
            if self.remaining == 0 && self.credit == Some(false) {
                self.credit = Some(true);
            }
            self.remaining = 0;
            return self.pull(conn, now);
        }
        self.arm()
    }

    /// The outstanding pull is gone (died with the old connection, or left with its
    /// subscription): the next one now.
    pub fn restart(&mut self, conn: &mut Connection, now: Instant) -> Option<Check> {
        self.remaining = 0;
        self.pull(conn, now)
    }

    // ---- on demand ----------------------------------------------------------------------

    /// Messages asked for and not yet delivered, over every outstanding pull.
    pub fn requested(&self) -> u32 {
        self.remaining
    }

    /// On demand: asks for one message per free slot not already asked for or in hand
    /// (`in_hand`: delivered, not yet given a slot). While asked-for messages are still
    /// coming, freed slots wait until a quarter of the `slots` are free: one pull then
    /// serves several tasks instead of one each. Nothing is sent while disconnected: the
    /// pull would wait in the reconnect buffer and arrive next to the one sent after the
    /// reconnect, asking for messages twice.
    pub fn fill(
        &mut self,
        conn: &mut Connection,
        slots: u32,
        free: u32,
        in_hand: u32,
        now: Instant,
    ) -> Result<Option<Share>, String> {
        let Some(want) = self.wanted(conn, free, in_hand) else {
            return Ok(None);
        };
        if self.remaining.saturating_add(in_hand) > 0 && want < (slots / 4).max(1) {
            return Ok(None);
        }
        self.send_share(conn, None, want, now)
    }

    /// On demand: acknowledges a finished message with `+NXT`, which is also the pull for
    /// what is wanted now (the slot the message held among it): one message to the server
    /// instead of an ack and a pull. `None`, with nothing sent, when nothing is wanted or
    /// [`ACK_PULL_LIMIT`] messages are already asked for; the caller acks plainly then.
    pub fn ack_and_fill(
        &mut self,
        conn: &mut Connection,
        ack: &str,
        free: u32,
        in_hand: u32,
        now: Instant,
    ) -> Result<Option<Share>, String> {
        match self.wanted(conn, free, in_hand) {
            Some(want) if self.remaining < ACK_PULL_LIMIT => {
                self.send_share(conn, Some(ack), want.min(ACK_PULL_LIMIT), now)
            }
            _ => Ok(None),
        }
    }

    /// Free slots not already asked for or in hand, when a pull may be sent at all.
    fn wanted(&self, conn: &Connection, free: u32, in_hand: u32) -> Option<u32> {
        if self.shares.is_none() || self.sid.is_none() || !conn.sends_now() {
            return None;
        }
        let want = free.saturating_sub(self.remaining.saturating_add(in_hand));
        (want > 0).then_some(want)
    }

    /// Sends a numbered pull of `want` messages: a `MSG.NEXT` request, or the `+NXT` ack
    /// of delivery `ack`.
    fn send_share(
        &mut self,
        conn: &mut Connection,
        ack: Option<&str>,
        want: u32,
        now: Instant,
    ) -> Result<Option<Share>, String> {
        let Some(shares) = self.shares.as_mut() else {
            return Ok(None);
        };
        let pull = PullRequest {
            batch: u64::from(want),
            expires: Some(shares.expires),
            ..PullRequest::default()
        };
        let n = shares.next;
        let reply = format!("{}.{n}", self.deliver);
        let sent = match ack {
            Some(ack) => conn.publish(ack, Some(&reply), None, &AckKind::Next { pull }.payload()),
            None => {
                let req = self
                    .api
                    .pull_next(&self.stream, &self.consumer, &pull)
                    .map_err(|e| format!("pull request invalid: {e}"))?;
                conn.publish(&req.subject, Some(&reply), None, &req.payload)
            }
        };
        sent.map_err(|e| format!("pull failed: {e}"))?;
        shares.next += 1;
        shares.pulls.insert(n, want);
        self.remaining = self.remaining.saturating_add(want);
        Ok(Some(Share {
            pull: n,
            over_at: now + shares.expires + SHARE_GRACE,
        }))
    }

    /// On demand: accounts for one message of the subscription.
    pub fn answer<'a>(&mut self, msg: &'a Message) -> Answer<'a> {
        let delivery = Delivery {
            subject: &msg.subject,
            reply: msg.reply.as_deref(),
            headers: msg.headers.as_ref(),
            payload: &msg.payload,
        };
        let inbound = classify(&delivery);
        if inbound == Inbound::Message && !self.delivers(msg) {
            return Answer::Nothing;
        }
        if inbound == Inbound::Message {
            self.remaining = self.remaining.saturating_sub(1);
            return Answer::Message;
        }
        if !inbound.ends_pull() {
            return Answer::Nothing;
        }
        let undelivered = match &inbound {
            Inbound::RequestTimeout {
                pending_messages, ..
            } => *pending_messages,
            _ => msg
                .header("Nats-Pending-Messages")
                .and_then(|v| v.trim().parse::<u64>().ok()),
        };
        let pull_no = msg
            .subject
            .rsplit('.')
            .next()
            .and_then(|n| n.parse::<u64>().ok());
        if let (Some(shares), Some(n)) = (self.shares.as_mut(), pull_no)
            && let Some(batch) = shares.pulls.remove(&n)
        {
            let undelivered =
                undelivered.map_or(batch, |p| u32::try_from(p).unwrap_or(u32::MAX).min(batch));
            self.remaining = self.remaining.saturating_sub(undelivered);
        }
        match inbound {
            Inbound::Status { code: 503, .. } => Answer::NoResponders,
            Inbound::Conflict { description } | Inbound::Status { description, .. } => {
                Answer::Ended {
                    why: Some(description),
                }
            }
            _ => Answer::Ended { why: None },
        }
    }

    /// On demand: pull `pull` is past [`Share::over_at`], so over. True when it was the
    /// newest: every pull has expired by now, and if their 408s were lost (a reconnect)
    /// nothing is outstanding any more.
    pub fn over(&mut self, pull: u64) -> bool {
        let Some(shares) = self.shares.as_mut() else {
            return false;
        };
        shares.pulls.remove(&pull);
        let newest = shares.next.checked_sub(1) == Some(pull);
        if newest && self.remaining > 0 {
            self.remaining = 0;
            shares.pulls.clear();
        }
        newest
    }

    /// On demand, after a reconnect: the pulls from before it are forgotten, and so is
    /// the subscription, which came back with the connection and made each of those
    /// pulls that the server still held live again next to the ones sent from now on:
    /// two pulls for one free slot until they expired. Later pulls are answered under
    /// `deliver_prefix`, the old ones find nobody listening and the server drops them.
    /// Returns the old subscription (detached) for the owner to forget; what it still
    /// brings comes as [`crate::nats::Event::Unread`].
    pub fn forget_pulls(&mut self, conn: &mut Connection, deliver_prefix: String) -> Option<Sid> {
        if let Some(shares) = self.shares.as_mut() {
            shares.pulls.clear();
        }
        self.remaining = 0;
        self.deliver = deliver_prefix;
        self.detach(conn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nats::Options;

    fn connected(now: Instant) -> Connection {
        let mut conn = Connection::new(Options::new("nats://127.0.0.1:4222"), now);
        handshake(&mut conn, now);
        conn
    }

    /// Dials and completes the handshake.
    fn handshake(conn: &mut Connection, now: Instant) {
        conn.poll_connect(now).expect("a server to dial");
        conn.on_transport_open(now);
        conn.receive(
            b"INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\n",
            now,
        );
        conn.receive(b"PONG\r\n", now);
        assert!(conn.is_connected());
    }

    /// The subject the latest pull's statuses come on.
    fn latest(p: &PullLoop) -> String {
        format!("{}.{}", p.deliver, p.current)
    }

    fn pulls_sent(conn: &mut Connection) -> usize {
        let out = String::from_utf8_lossy(conn.output()).into_owned();
        let n = conn.output().len();
        conn.consume_output(n);
        out.matches("CONSUMER.MSG.NEXT").count()
    }

    #[test]
    fn one_check_counts_and_messages_file_none() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 2);
        p.attach(&mut conn).expect("subscribe");
        let first = p.pull(&mut conn, t0).expect("a check for the new pull");
        assert_eq!(first.at, t0 + PULL_HEARTBEAT * 2);
        assert_eq!(pulls_sent(&mut conn), 1);
        // Heartbeats and a message that leaves the batch open push the deadline back
        // without filing anything: the check filed fires early and files the next.
        let t1 = t0 + Duration::from_secs(3);
        assert_eq!(
            p.on_message(&mut conn, &status(&latest(&p), 100, None), t1),
            (Pulled::Heartbeat, None)
        );
        assert_eq!(
            p.on_message(&mut conn, &message(&latest(&p)), t1),
            (Pulled::Message, None)
        );
        let next = p
            .check(&mut conn, first.generation, first.at)
            .expect("the deadline moved");
        assert_eq!(next.at, t1 + PULL_HEARTBEAT * 2);
        assert_eq!(pulls_sent(&mut conn), 0, "the pull is still alive");
        // The first check is stale now, whenever it fires again.
        assert_eq!(p.check(&mut conn, first.generation, next.at), None);
        assert_eq!(pulls_sent(&mut conn), 0);
        // The live one finds the pull silent and replaces it.
        let again = p
            .check(&mut conn, next.generation, next.at)
            .expect("a new pull");
        assert_eq!(pulls_sent(&mut conn), 1);
        assert_ne!(again.generation, next.generation);
    }

    #[test]
    fn a_paced_loop_pulls_again_only_when_granted() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 2).paced(1 << 20);
        p.attach(&mut conn).expect("subscribe");
        assert!(p.pull(&mut conn, t0).is_some());
        assert_eq!(pulls_sent(&mut conn), 1);
        // The batch used up: the next pull waits for credit, and says so.
        for _ in 0..2 {
            p.on_message(&mut conn, &message("stream.subject"), t0);
        }
        assert_eq!(pulls_sent(&mut conn), 0);
        assert!(p.wants_credit());
        // An expiry does not go around it either.
        p.on_message(&mut conn, &status(&latest(&p), 408, None), t0);
        assert_eq!(pulls_sent(&mut conn), 0);
        assert!(p.grant(&mut conn, t0).is_some());
        assert_eq!(pulls_sent(&mut conn), 1);
        assert!(!p.wants_credit(), "one pull per grant");
        // A refused pull brought nothing: its retry needs no grant (else a drained
        // session would regrant it at round-trip speed, past the 1 s retry).
        let (_, retry) = p.on_message(&mut conn, &status(&latest(&p), 503, None), t0);
        let retry = retry.expect("a retry check");
        assert!(!p.wants_credit());
        assert!(p.check(&mut conn, retry.generation, retry.at).is_some());
        assert_eq!(pulls_sent(&mut conn), 1);
        // Not granted in time, it pulls anyway before the server would delete the
        // consumer for want of pulls.
        p.on_message(&mut conn, &message("stream.subject"), t0);
        let waiting = p.on_message(&mut conn, &message("stream.subject"), t0).1;
        let waiting = waiting.expect("a check for the wait");
        assert!(p.wants_credit());
        assert_eq!(waiting.at, t0 + CREDIT_WAIT);
        assert!(p.check(&mut conn, waiting.generation, waiting.at).is_some());
        assert_eq!(pulls_sent(&mut conn), 1);
        // An unpaced loop never waits for one.
        let mut steady = PullLoop::new("S".into(), "C".into(), 1);
        steady.attach(&mut conn).expect("subscribe");
        steady.pull(&mut conn, t0);
        steady.on_message(&mut conn, &message("stream.subject"), t0);
        assert_eq!(pulls_sent(&mut conn), 2);
        assert!(!steady.wants_credit());
    }

    #[test]
    fn a_paced_pull_brings_its_window_in_bytes_and_a_larger_message_alone() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 8).paced(1000);
        p.attach(&mut conn).expect("subscribe");
        let sent = |conn: &mut Connection| {
            let out = String::from_utf8_lossy(conn.output()).into_owned();
            conn.consume_output(out.len());
            out
        };
        let sized = |n: usize| Message {
            payload: vec![b'x'; n],
            ..message("stream.subject")
        };
        let ended = |p: &PullLoop, why: &str, unsent: u32| {
            let mut h = crate::proto::headers::HeaderMap::with_status(409, why).expect("status");
            h.insert("Nats-Pending-Messages", &unsent.to_string())
                .expect("field");
            Message {
                headers: Some(h),
                ..message(&latest(p))
            }
        };
        p.pull(&mut conn, t0);
        assert!(sent(&mut conn).contains(r#""batch":8,"#) && !p.wants_credit());
        // The server ends a pull whose next message does not fit what is left.
        p.on_message(&mut conn, &sized(600), t0);
        let over = ended(&p, OVER_MAX_BYTES, 7);
        assert_eq!(p.on_message(&mut conn, &over, t0).0, Pulled::Ended);
        assert!(
            p.wants_credit(),
            "the usual end: the next waits for its grant"
        );
        p.grant(&mut conn, t0);
        assert!(sent(&mut conn).contains(r#""max_bytes":1000"#));
        // Its count used up first, the server says so after the last message: the
        // end it already was, not a refusal (which would pull again without a grant).
        for _ in 0..8 {
            p.on_message(&mut conn, &sized(10), t0);
        }
        assert!(p.wants_credit());
        p.on_message(&mut conn, &ended(&p, BATCH_COMPLETED, 0), t0);
        assert!(p.wants_credit(), "still waiting for its grant");
        p.check(&mut conn, p.generation, t0 + RETRY_AFTER_NO_RESPONDERS);
        assert_eq!(sent(&mut conn), "", "no pull without a grant");
        p.grant(&mut conn, t0);
        sent(&mut conn);
        // A replicated consumer's status may overtake the last messages: the pull is
        // over once they are here.
        for _ in 0..6 {
            p.on_message(&mut conn, &sized(10), t0);
        }
        p.on_message(&mut conn, &ended(&p, BATCH_COMPLETED, 0), t0);
        p.on_message(&mut conn, &sized(10), t0);
        assert!(!p.wants_credit(), "one more to come");
        p.on_message(&mut conn, &sized(10), t0);
        assert!(p.wants_credit());
        p.grant(&mut conn, t0);
        sent(&mut conn);
        // A pull that brought nothing: its next message is larger than the window and
        // comes alone, at once.
        p.on_message(&mut conn, &ended(&p, OVER_MAX_BYTES, 8), t0);
        let whole = sent(&mut conn);
        assert!(
            whole.contains(r#""batch":1,"#) && !whole.contains("max_bytes"),
            "{whole}"
        );
        p.on_message(&mut conn, &sized(5000), t0);
        assert!(p.wants_credit());
        // Bytes used up exactly end a pull with no status.
        p.grant(&mut conn, t0);
        sent(&mut conn);
        let exact = sized(1000 - "stream.subject".len());
        p.on_message(&mut conn, &exact, t0);
        assert!(p.wants_credit(), "over without a status");
    }

    #[test]
    fn no_responders_files_an_earlier_check_and_the_later_one_goes_stale() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 1);
        p.attach(&mut conn).expect("subscribe");
        let silent = p.pull(&mut conn, t0).expect("check");
        pulls_sent(&mut conn);
        let (pulled, retry) = p.on_message(&mut conn, &status(&latest(&p), 503, None), t0);
        assert_eq!(pulled, Pulled::Ended);
        let retry = retry.expect("an earlier check");
        assert_eq!(retry.at, t0 + RETRY_AFTER_NO_RESPONDERS);
        assert!(p.check(&mut conn, retry.generation, retry.at).is_some());
        assert_eq!(pulls_sent(&mut conn), 1);
        assert_eq!(p.check(&mut conn, silent.generation, silent.at), None);
    }

    #[test]
    fn a_refused_pull_is_asked_again_shortly_an_expired_one_at_once() {
        // A server answering every pull with 409 ("Exceeded MaxWaiting") had the loop
        // pull again at once, forever, at round-trip speed.
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 1);
        p.attach(&mut conn).expect("subscribe");
        p.pull(&mut conn, t0).expect("check");
        pulls_sent(&mut conn);
        for code in [409, 400] {
            let (pulled, retry) = p.on_message(&mut conn, &status(&latest(&p), code, None), t0);
            assert_eq!(pulled, Pulled::Ended);
            assert_eq!(pulls_sent(&mut conn), 0, "{code}: not at once");
            let retry = retry.expect("a check");
            assert_eq!(retry.at, t0 + RETRY_AFTER_NO_RESPONDERS);
            assert!(p.check(&mut conn, retry.generation, retry.at).is_some());
            assert_eq!(pulls_sent(&mut conn), 1, "{code}: then again");
        }
        let (_, next) = p.on_message(&mut conn, &status(&latest(&p), 408, None), t0);
        assert!(next.is_some());
        assert_eq!(pulls_sent(&mut conn), 1, "408: the next pull at once");
    }

    fn status(subject: &str, code: u16, pending: Option<u32>) -> Message {
        let mut headers =
            crate::proto::headers::HeaderMap::with_status(code, "").expect("a status line");
        if let Some(p) = pending {
            let _ = headers.insert("Nats-Pending-Messages", &p.to_string());
        }
        Message {
            headers: Some(headers),
            ..message(subject)
        }
    }

    #[test]
    fn a_deleted_consumer_or_one_nobody_serves_for_a_while_is_lost() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 4).paced(1024);
        p.attach(&mut conn).expect("subscribe");
        p.pull(&mut conn, t0);
        let deleted = Message {
            headers: crate::proto::headers::HeaderMap::with_status(409, CONSUMER_DELETED).ok(),
            ..message(&latest(&p))
        };
        assert_eq!(p.on_message(&mut conn, &deleted, t0).0, Pulled::Lost);
        // 503s: a moment of them is JetStream starting or electing; more, a loss. A pull
        // the server served in between starts the count again.
        let refused = |p: &mut PullLoop, conn: &mut Connection| {
            let (pulled, retry) = p.on_message(conn, &status(&latest(p), 503, None), t0);
            // Pulls again at the retry's time.
            let retry = retry.expect("a retry");
            assert!(p.check(conn, retry.generation, retry.at).is_some());
            pulled
        };
        let retry = p.arm().expect("a check");
        assert!(
            p.check(&mut conn, retry.generation, t0 + CREDIT_WAIT)
                .is_some()
        );
        assert_eq!(refused(&mut p, &mut conn), Pulled::Ended);
        assert_eq!(refused(&mut p, &mut conn), Pulled::Ended);
        let served = p.on_message(&mut conn, &status(&latest(&p), 100, None), t0);
        assert_eq!(served.0, Pulled::Heartbeat);
        for _ in 1..UNSERVED_LOST {
            assert_eq!(refused(&mut p, &mut conn), Pulled::Ended);
        }
        assert_eq!(refused(&mut p, &mut conn), Pulled::Lost);
        // Made again and attached, it counts afresh: one more 503 is no loss yet (else a
        // consumer without a leader is made again at every round trip).
        p.detach(&mut conn);
        p.attach(&mut conn).expect("subscribe");
        let retry = p.arm().expect("a check");
        assert!(
            p.check(&mut conn, retry.generation, t0 + CREDIT_WAIT)
                .is_some()
        );
        assert_eq!(refused(&mut p, &mut conn), Pulled::Ended);
    }

    #[test]
    fn a_paced_pull_refused_midway_waits_for_what_it_brought_to_be_written() {
        // nats-server ends waiting pulls `409 Leadership Change` when the consumer's
        // leader moves, after some of the batch went out: taken for a refusal that
        // brought nothing, the retry a second later pulled another window on a session
        // that had not written the first.
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 8).paced(1 << 20);
        p.attach(&mut conn).expect("subscribe");
        p.pull(&mut conn, t0);
        assert_eq!(pulls_sent(&mut conn), 1);
        for _ in 0..3 {
            p.on_message(&mut conn, &message("stream.subject"), t0);
        }
        let moved = Message {
            headers: crate::proto::headers::HeaderMap::with_status(409, "Leadership Change").ok(),
            ..message(&latest(&p))
        };
        let (pulled, check) = p.on_message(&mut conn, &moved, t0);
        assert_eq!(pulled, Pulled::Ended);
        let check = check.expect("a check");
        assert_eq!(check.at, t0 + CREDIT_WAIT);
        assert!(p.wants_credit());
        assert!(
            p.check(&mut conn, check.generation, t0 + RETRY_AFTER_NO_RESPONDERS)
                .is_some()
        );
        assert_eq!(pulls_sent(&mut conn), 0, "no pull before a grant");
        assert!(p.grant(&mut conn, t0).is_some());
        assert_eq!(pulls_sent(&mut conn), 1);
    }

    /// A delivery of consumer `C` of stream `S`, as the loops of these tests pull.
    fn message(subject: &str) -> Message {
        Message {
            subject: subject.to_string(),
            reply: Some("$JS.ACK.S.C.1.7.7.1700000000000000000.0".to_string()),
            headers: None,
            payload: Vec::new(),
        }
    }

    #[test]
    fn what_no_consumer_of_the_loop_delivered_is_not_a_message() {
        // Someone who learnt the pull's subject puts a message on it: no ack subject, or
        // one of another stream or consumer (acking it would ack what it names).
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 2);
        p.attach(&mut conn).expect("subscribe");
        p.pull(&mut conn, t0).expect("a pull");
        let mut q = PullLoop::on_demand(
            "S".into(),
            "C".into(),
            "_I.q".into(),
            Duration::from_secs(30),
        );
        q.attach(&mut conn).expect("subscribe");
        for reply in [
            None,
            Some("_INBOX.x"),
            Some("$JS.ACK.T.C.1.7.7.1700000000000000000.0"),
            Some("$JS.ACK.S.D.1.7.7.1700000000000000000.0"),
            Some("$JS.ACK.hub.ABC.S.D.1.7.7.1700000000000000000.0.x"),
        ] {
            let mut forged = message(&latest(&p));
            forged.reply = reply.map(str::to_string);
            assert_eq!(
                p.on_message(&mut conn, &forged, t0),
                (Pulled::Heartbeat, None),
                "{reply:?}"
            );
            assert_eq!(q.answer(&forged), Answer::Nothing, "{reply:?}");
        }
        let mut domain = message(&latest(&p));
        domain.reply = Some("$JS.ACK.hub.ABC.S.C.1.7.7.1700000000000000000.0.x".to_string());
        assert_eq!(p.on_message(&mut conn, &domain, t0).0, Pulled::Message);
        assert_eq!(q.answer(&domain), Answer::Message);
    }

    #[test]
    fn on_demand_asks_per_free_slot_and_a_quarter_at_a_time_while_messages_come() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let expires = Duration::from_secs(30);
        let mut p = PullLoop::on_demand("S".into(), "C".into(), "_I.q".into(), expires);
        p.attach(&mut conn).expect("subscribe");
        let first = p
            .fill(&mut conn, 8, 8, 0, t0)
            .expect("sent")
            .expect("a pull");
        assert_eq!(first.pull, 0);
        assert_eq!(first.over_at, t0 + expires + SHARE_GRACE);
        assert_eq!(p.requested(), 8);
        let out = String::from_utf8_lossy(conn.output()).into_owned();
        assert!(out.contains("CONSUMER.MSG.NEXT.S.C _I.q.0"), "{out}");
        assert!(out.contains("\"batch\":8"), "{out}");
        // Two delivered and placed, one more in hand: one freed slot waits for a quarter.
        assert_eq!(p.answer(&message("amp.x.job.j")), Answer::Message);
        assert_eq!(p.answer(&message("amp.x.job.j")), Answer::Message);
        assert_eq!(p.fill(&mut conn, 8, 7, 0, t0), Ok(None));
        let second = p.fill(&mut conn, 8, 8, 0, t0).expect("sent").expect("two");
        assert_eq!((second.pull, p.requested()), (1, 8));
        // The first pull's 408 says 5 of its 6 outstanding are not coming.
        let timeout = status("_I.q.0", 408, Some(5));
        assert_eq!(p.answer(&timeout), Answer::Ended { why: None });
        assert_eq!(p.requested(), 3);
        assert!(!p.over(0), "not the newest");
        assert!(p.over(1), "the newest: nothing is outstanding");
        assert_eq!(p.requested(), 0);
        assert_eq!(p.answer(&status("_I.q.2", 503, None)), Answer::NoResponders);
    }

    /// A pull replaced while still alive at the server (one from before a reconnect, or
    /// one silent for a while) answered with its own 408s, and each renewed "the" pull:
    /// the loop held two pulls for good, then more after every outage.
    #[test]
    fn only_the_latest_pulls_statuses_renew_it() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 4);
        p.attach(&mut conn).expect("subscribe");
        p.pull(&mut conn, t0).expect("check");
        let old = latest(&p);
        p.restart(&mut conn, t0).expect("check");
        assert_eq!(pulls_sent(&mut conn), 2);
        assert_eq!(
            p.on_message(&mut conn, &status(&old, 408, None), t0),
            (Pulled::Heartbeat, None)
        );
        assert_eq!(
            pulls_sent(&mut conn),
            0,
            "the old pull's end renews nothing"
        );
        // Messages count whichever pull brought them (they come on their own subject).
        assert_eq!(
            p.on_message(&mut conn, &message("amp.acme.topic.t.1"), t0)
                .0,
            Pulled::Message
        );
        let (pulled, _) = p.on_message(&mut conn, &status(&latest(&p), 408, None), t0);
        assert_eq!(pulled, Pulled::Ended);
        assert_eq!(pulls_sent(&mut conn), 1, "the latest pull's end renews it");
    }

    /// While disconnected every check sent a pull into the reconnect buffer: an outage
    /// of a minute left six pulls per loop to go out at once on reconnect.
    #[test]
    fn nothing_is_pulled_while_disconnected_and_the_reconnect_pulls_once() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 4);
        p.attach(&mut conn).expect("subscribe");
        let mut check = p.pull(&mut conn, t0).expect("check");
        pulls_sent(&mut conn);
        conn.receive(b"-ERR 'Stale Connection'\r\n", t0);
        assert!(!conn.is_connected());
        assert!(conn.poll_close());
        for i in 1..=6 {
            let t = t0 + Duration::from_secs(10 * i);
            if let Some(c) = p.check(&mut conn, check.generation, t.max(check.at)) {
                check = c;
            }
        }
        let at = t0 + Duration::from_secs(70);
        conn.handle_timeout(at);
        // What went out at the handshake (buffered pulls included) and the restart's pull.
        handshake(&mut conn, at);
        p.restart(&mut conn, at).expect("check");
        assert_eq!(pulls_sent(&mut conn), 1);
    }

    /// A pull the write buffer had no room for ended the loop's checks: that inbox or
    /// subscription went silent until the next reconnect.
    #[test]
    fn a_pull_that_could_not_be_written_is_tried_again() {
        let t0 = Instant::now();
        let mut o = Options::new("nats://127.0.0.1:4222");
        o.max_write_buffer = 300;
        let mut conn = Connection::new(o, t0);
        handshake(&mut conn, t0);
        pulls_sent(&mut conn);
        let mut p = PullLoop::new("S".into(), "C".into(), 4);
        p.attach(&mut conn).expect("subscribe");
        conn.publish("fill", None, None, &[0; 200]).expect("fits");
        let retry = p
            .pull(&mut conn, t0)
            .expect("a check although nothing was sent");
        assert_eq!(pulls_sent(&mut conn), 0);
        assert!(p.check(&mut conn, retry.generation, retry.at).is_some());
        assert_eq!(pulls_sent(&mut conn), 1);
    }
}
