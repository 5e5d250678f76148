//! One pull consumer being read continuously: at most one `MSG.NEXT` outstanding, renewed
//! when it is used up, ended by a status (404/408/409) or silent for too long. The
//! broker runs one for each participant's inbox and each topic subscription.

use std::time::{Duration, Instant};

use crate::jetstream::ApiPrefix;
use crate::jetstream::pull::PullRequest;
use crate::nats::{Connection, Sid};

/// A pull request's lifetime; the next one follows when it ends.
pub const PULL_EXPIRES: Duration = Duration::from_secs(20);
/// The server's idle heartbeat while a pull waits; two missed ones mean it is gone.
pub const PULL_HEARTBEAT: Duration = Duration::from_secs(5);
const RETRY_AFTER_NO_RESPONDERS: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct PullLoop {
    /// The JetStream API the consumer lives under (`$JS.API` or a domain's).
    api: ApiPrefix,
    stream: String,
    consumer: String,
    batch: u32,
    /// The subscription receiving the pulled messages.
    sid: Option<Sid>,
    deliver: String,
    /// Messages the outstanding pull may still deliver; 0 when none is outstanding.
    remaining: u32,
    /// When the outstanding pull counts as lost without word from the server.
    until: Option<Instant>,
    /// The check timer the owner has scheduled, so there is one at a time.
    armed_at: Option<Instant>,
}

/// What a message on the pull's subscription was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pulled {
    /// A stream message: hand it on.
    Message,
    /// An idle heartbeat: nothing to do.
    Heartbeat,
    /// A status that ended the pull; a new one has been asked for.
    Ended,
}

impl PullLoop {
    pub fn new(stream: String, consumer: String, batch: u32) -> PullLoop {
        PullLoop {
            api: ApiPrefix::default(),
            stream,
            consumer,
            batch: batch.max(1),
            sid: None,
            deliver: String::new(),
            remaining: 0,
            until: None,
            armed_at: None,
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

    /// Subscribes to a fresh inbox for the deliveries; returns the subscription.
    pub fn attach(&mut self, conn: &mut Connection) -> Result<Sid, crate::nats::Error> {
        let deliver = conn.new_inbox();
        let sid = conn.subscribe(&deliver, None)?;
        self.sid = Some(sid);
        self.deliver = deliver;
        Ok(sid)
    }

    /// Drops the subscription; returns it so the caller can forget its route.
    pub fn detach(&mut self, conn: &mut Connection) -> Option<Sid> {
        let sid = self.sid.take()?;
        let _ = conn.unsubscribe(sid, None);
        Some(sid)
    }

    /// Sends a pull unless one is outstanding; returns when to check on it.
    pub fn pull(&mut self, conn: &mut Connection, now: Instant) -> Option<Instant> {
        if self.sid.is_none() || self.remaining > 0 {
            return None;
        }
        let pull = PullRequest {
            expires: Some(PULL_EXPIRES),
            idle_heartbeat: Some(PULL_HEARTBEAT),
            ..PullRequest::batch(u64::from(self.batch))
        };
        let req = self
            .api
            .pull_next(&self.stream, &self.consumer, &pull)
            .ok()?;
        conn.publish(&req.subject, Some(&self.deliver), None, &req.payload)
            .ok()?;
        self.remaining = self.batch;
        // The server answers a live pull with a heartbeat within PULL_HEARTBEAT; a pull
        // that was lost (e.g. sent while JetStream was still recovering) is noticed soon.
        self.until = Some(now + PULL_HEARTBEAT * 2);
        self.arm()
    }

    /// A check time for the owner to schedule, unless one at or before `until` already is.
    fn arm(&mut self) -> Option<Instant> {
        let until = self.until?;
        if self.armed_at.is_some_and(|at| at <= until) {
            return None;
        }
        self.armed_at = Some(until);
        Some(until)
    }

    /// Accounts for one message of the subscription, renewing the pull when it ends.
    pub fn on_message(
        &mut self,
        conn: &mut Connection,
        status: Option<u16>,
        now: Instant,
    ) -> (Pulled, Option<Instant>) {
        match status {
            Some(100) => {
                self.until = Some(now + PULL_HEARTBEAT * 2);
                (Pulled::Heartbeat, self.arm())
            }
            Some(503) => {
                // Nobody serves the consumer yet (JetStream still starting): try again
                // shortly rather than at once.
                self.remaining = 0;
                self.until = Some(now + RETRY_AFTER_NO_RESPONDERS);
                (Pulled::Ended, self.arm())
            }
            Some(_) => {
                self.remaining = 0;
                (Pulled::Ended, self.pull(conn, now))
            }
            None => {
                self.remaining = self.remaining.saturating_sub(1);
                self.until = Some(now + PULL_HEARTBEAT * 2);
                (Pulled::Message, self.pull(conn, now).or_else(|| self.arm()))
            }
        }
    }

    /// At a check time: a pull that has been silent too long is replaced.
    pub fn check(&mut self, conn: &mut Connection, now: Instant) -> Option<Instant> {
        if self.armed_at.is_some_and(|at| at <= now) {
            self.armed_at = None;
        }
        if self.until.is_some_and(|until| until <= now) {
            self.remaining = 0;
            return self.pull(conn, now);
        }
        self.arm()
    }

    /// After a reconnect the outstanding pull died with the old connection.
    pub fn restart(&mut self, conn: &mut Connection, now: Instant) -> Option<Instant> {
        self.remaining = 0;
        self.pull(conn, now)
    }
}
