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
    /// The generation of the one check that counts; checks the owner filed earlier in
    /// the timer table are stale when they fire.
    generation: u64,
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
            generation: 0,
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
    pub fn pull(&mut self, conn: &mut Connection, now: Instant) -> Option<Check> {
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
    pub fn on_message(
        &mut self,
        conn: &mut Connection,
        status: Option<u16>,
        now: Instant,
    ) -> (Pulled, Option<Check>) {
        match status {
            Some(100) => {
                self.until = Some(now + PULL_HEARTBEAT * 2);
                (Pulled::Heartbeat, None)
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
                (Pulled::Message, self.pull(conn, now))
            }
        }
    }

    /// At a check's time: a pull that has been silent too long is replaced. A stale
    /// check (another was filed since) does nothing.
    pub fn check(&mut self, conn: &mut Connection, generation: u64, now: Instant) -> Option<Check> {
        if generation != self.generation {
            return None;
        }
        if self.until.is_some_and(|until| until <= now) {
            self.remaining = 0;
            return self.pull(conn, now);
        }
        self.arm()
    }

    /// After a reconnect the outstanding pull died with the old connection.
    pub fn restart(&mut self, conn: &mut Connection, now: Instant) -> Option<Check> {
        self.remaining = 0;
        self.pull(conn, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nats::Options;

    fn connected(now: Instant) -> Connection {
        let mut conn = Connection::new(Options::new("nats://127.0.0.1:4222"), now);
        conn.poll_connect(now).expect("a server to dial");
        conn.on_transport_open(now);
        conn.receive(
            b"INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\n",
            now,
        );
        conn.receive(b"PONG\r\n", now);
        assert!(conn.is_connected());
        conn
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
            p.on_message(&mut conn, Some(100), t1),
            (Pulled::Heartbeat, None)
        );
        assert_eq!(p.on_message(&mut conn, None, t1), (Pulled::Message, None));
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
    fn no_responders_files_an_earlier_check_and_the_later_one_goes_stale() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut p = PullLoop::new("S".into(), "C".into(), 1);
        p.attach(&mut conn).expect("subscribe");
        let silent = p.pull(&mut conn, t0).expect("check");
        pulls_sent(&mut conn);
        let (pulled, retry) = p.on_message(&mut conn, Some(503), t0);
        assert_eq!(pulled, Pulled::Ended);
        let retry = retry.expect("an earlier check");
        assert_eq!(retry.at, t0 + RETRY_AFTER_NO_RESPONDERS);
        assert!(p.check(&mut conn, retry.generation, retry.at).is_some());
        assert_eq!(pulls_sent(&mut conn), 1);
        assert_eq!(p.check(&mut conn, silent.generation, silent.at), None);
    }
}
