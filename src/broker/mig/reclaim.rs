//! `AMP_MIG_SEEN` made again (deleted while the brokers run, `remake.rs`) is empty, but the
//! ids it held are still in use: a running invocation's message id names its stream and
//! its forwarded cancels, and a signed PUBLISH's id may be replayed to any broker until its
//! window ends. Each broker that finds a new bucket claims again the ids it holds, and
//! takes no new claim until it has and the other brokers, who hear of it about when it
//! does, have had [`SETTLE`] to do the same. Before, another caller's invoke through
//! another broker took a running stream's id in the new bucket, and a subscriber's copy of
//! a signed PUBLISH was stored there as the signer's event.
//!
//! A bucket is told from the one before by its `created` time, which JetStream keeps
//! across restarts and gives in every stream info. The broker asks for it at start, at
//! every reconnect (an advisory sent while its connection was down never reaches it) and
//! at JetStream's advisory of the bucket's creation; its own create's answer carries it.
//! So a bucket is claimed again once per broker, however many ways it hears of it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::json;

use super::envelope::{Code, MigError};
use super::{Alarm, Awaiting, Mig, Pending, js_request, seen};
use crate::broker::config::Config;
use crate::broker::jobs::SessionId;
use crate::jetstream::{ApiPrefix, JsError};
use crate::nats::{Connection, Message, RequestError};

/// Re-claims out at once: a round holds up to `mig.max_pending` invocations and
/// `mig.max_signed_ids` signed ids, more than the connection's 65,536 request slots that
/// everything shares, so the rest wait for answers.
const OUT_AT_ONCE: usize = 1024;
/// Re-claims sent by the step that starts a round; each answer then sends up to
/// [`PER_ANSWER`], so the ids out double each round trip up to [`OUT_AT_ONCE`] while no
/// step hashes and sends more than a few. The step that started a round of 65,536 signed
/// ids used to hash every key and send 1,024 creates (32 to 37 ms in a release build),
/// holding up every session meanwhile; it now only lists them (3 to 5 ms).
const FIRST_STEP: usize = 64;
const PER_ANSWER: usize = 2;
/// New claims wait this long after the bucket is heard made again, for the other
/// brokers' re-claims: each hears of it within a round trip and sends its first
/// [`FIRST_STEP`] at once. The retry a refusal asks for.
pub const SETTLE: Duration = Duration::from_millis(crate::broker::remake::RETRY_AFTER_MS);

/// The JetStream advisory of the bucket's creation, in the local JetStream (MIG serves
/// only the tenants it holds).
pub fn made_advisory() -> String {
    format!("$JS.EVENT.ADVISORY.STREAM.CREATED.{}", stream())
}

fn stream() -> String {
    ["KV_", seen::BUCKET].concat()
}

/// An id this broker holds.
enum Held {
    /// A running invocation's message id, looked up when sent (one ended holds none).
    Invocation(SessionId),
    /// Signed PUBLISH id `id` of `caller` (`ns/name`), held until `until`; its
    /// [`seen::key`] is hashed when it is sent. Both shared with the replay cache: the
    /// step that starts a round copies no id.
    Signed {
        caller: Arc<str>,
        id: Arc<str>,
        until: Instant,
    },
}

/// Where the question "which bucket is there?" stands: one out at a time, and a trigger
/// while it is out asks once more after its answer (the bucket may have changed since it
/// was sent).
#[derive(Default, PartialEq)]
enum Check {
    #[default]
    Idle,
    Out,
    Again,
}

/// The ids being claimed again, and since when new claims wait.
#[derive(Default)]
pub struct Reclaims {
    /// Bounded by the invocations and the replay cache it was taken from.
    queue: VecDeque<Held>,
    out: usize,
    heard: Option<Instant>,
    /// The `created` time of the bucket this broker's ids are in, once known.
    known: Option<String>,
    check: Check,
    /// A check that failed is asked again by a timer: one at a time.
    retry_armed: bool,
    /// Checks that failed in a row (only the first is logged as a warning).
    misses: u32,
    /// MIG is on: the bucket is checked at each reconnect.
    watching: bool,
}

impl Reclaims {
    /// Whether a new claim waits: this broker's ids are not all claimed again, or the
    /// other brokers' may not be.
    pub fn settling(&self, now: Instant) -> bool {
        !self.queue.is_empty()
            || self.out > 0
            || self
                .heard
                .is_some_and(|t| now.saturating_duration_since(t) < SETTLE)
    }
}

/// The answer to a new claim while [`Reclaims::settling`].
pub fn settling() -> MigError {
    MigError::new(
        Code::Unavailable,
        format!(
            "JetStream stream {} was made again; the ids in use are being claimed again",
            stream()
        ),
    )
    .detail("retry_after_ms", json!(SETTLE.as_millis() as u64))
}

/// What the broker reads of a stream info (or create) answer.
#[derive(Deserialize)]
struct Created {
    created: String,
}

/// The `created` time of the bucket a STREAM.INFO or STREAM.CREATE answer describes.
pub fn created(payload: &[u8]) -> Result<String, JsError> {
    crate::jetstream::api::parse_response::<Created>(payload).map(|c| c.created)
}

impl Mig {
    /// Starts watching for the bucket made again: JetStream's advisory, and the bucket
    /// there now as the one known.
    pub(super) fn watch_seen(&mut self, conn: &mut Connection, now: Instant) -> Result<(), String> {
        let sid = conn
            .subscribe(&made_advisory(), None)
            .map_err(|e| format!("MIG advisory of {} made: {e}", stream()))?;
        self.subs.insert(sid, super::Sub::SeenMade);
        self.reclaims.watching = true;
        self.check_seen(conn, now);
        Ok(())
    }

    /// The main connection is back: the bucket may have been made again while it was
    /// down, its advisory lost.
    pub(super) fn seen_after_reconnect(&mut self, conn: &mut Connection, now: Instant) {
        if self.reclaims.watching {
            self.check_seen(conn, now);
        }
    }

    /// JetStream says the bucket was made. New claims wait from now: the ids this broker
    /// holds may be missing from it until its answer to the check says which it is.
    pub(super) fn seen_advisory(&mut self, conn: &mut Connection, now: Instant) {
        self.reclaims.heard = Some(now);
        self.check_seen(conn, now);
    }

    /// The timer of a check that failed.
    pub(super) fn seen_retry(&mut self, conn: &mut Connection, now: Instant) {
        self.reclaims.retry_armed = false;
        self.check_seen(conn, now);
    }

    /// Asks which bucket is there.
    pub fn check_seen(&mut self, conn: &mut Connection, now: Instant) {
        match self.reclaims.check {
            Check::Idle => {}
            Check::Out | Check::Again => {
                self.reclaims.check = Check::Again;
                return;
            }
        }
        match js_request(conn, ApiPrefix::default().stream_info(&stream()), now) {
            Ok(id) => {
                self.reclaims.check = Check::Out;
                self.staged.push(id, Awaiting(Pending::SeenCheck), now);
            }
            Err(e) => self.seen_unchecked(&e, now),
        }
    }

    /// The answer to [`Mig::check_seen`].
    pub(super) fn seen_checked(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let again = self.reclaims.check == Check::Again;
        self.reclaims.check = Check::Idle;
        let why = match reply.map(|m| created(&m.payload)) {
            Ok(Ok(created)) => {
                self.reclaims.misses = 0;
                self.seen_is(conn, config, &created, now);
                None
            }
            // Gone: the first claim that finds it so has it made, and this broker's create
            // or the advisory then tells which it is.
            Ok(Err(JsError::StreamNotFound(_))) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) => Some(e.to_string()),
        };
        match why {
            // The timer's check tells what the one asked for meanwhile would.
            Some(why) => self.seen_unchecked(&why, now),
            None if again => self.check_seen(conn, now),
            None => {}
        }
    }

    /// A check not sent or not answered is asked again a second later (JetStream still
    /// starting after a reconnect): until one is, a bucket made again meanwhile goes
    /// unnoticed.
    fn seen_unchecked(&mut self, why: &str, now: Instant) {
        let r = &mut self.reclaims;
        let level = if r.misses == 0 {
            log::Level::Warn
        } else {
            log::Level::Debug
        };
        r.misses = r.misses.saturating_add(1);
        log::log!(
            level,
            "which {} is there is not known ({why}); asking again every {} ms",
            stream(),
            SETTLE.as_millis()
        );
        if !std::mem::replace(&mut r.retry_armed, true) {
            self.later
                .push(crate::deadline::after(now, SETTLE), Alarm::SeenCheck);
        }
    }

    /// The bucket there was created at `created` (a check's answer, or this broker's own
    /// create's): one other than the bucket known was made again, and gets this broker's
    /// ids (the first known, at start, only those it already holds).
    pub fn seen_is(&mut self, conn: &mut Connection, config: &Config, created: &str, now: Instant) {
        let first = match self.reclaims.known.as_deref() {
            Some(known) if known == created => return,
            known => known.is_none(),
        };
        self.reclaims.known = Some(created.to_string());
        self.claim_again(conn, config, first, now);
    }

    /// Every id this broker holds is claimed again. The `first` bucket it knows, found
    /// while it holds none, has nothing to claim or wait for. A round under way starts
    /// over, as the bucket may have gone again since its ids were sent.
    fn claim_again(&mut self, conn: &mut Connection, config: &Config, first: bool, now: Instant) {
        let wall = self.wall_ms(now);
        let invocations = self
            .invocations
            .iter()
            .filter(|(_, inv)| inv.claimed)
            .map(|(session, _)| Held::Invocation(*session));
        let signed = self.auth.exposed_ids(wall).map(|(caller, id, until)| {
            let left = Duration::from_millis(u64::try_from(until - wall).unwrap_or(0));
            Held::Signed {
                caller: caller.clone(),
                id: id.clone(),
                until: crate::deadline::after(now, left),
            }
        });
        let queue: VecDeque<Held> = invocations.chain(signed).collect();
        if first && queue.is_empty() {
            return;
        }
        log::warn!(
            "{} was made again: claiming again the {} ids this broker holds",
            stream(),
            queue.len()
        );
        self.reclaims.queue = queue;
        self.reclaims.heard = Some(now);
        self.reclaim_more(conn, config, FIRST_STEP, now);
    }

    /// A re-claim was answered: created, or found taken (by a broker that claimed it
    /// again first, or by anyone in the gap), either way nothing more to do. One that
    /// found nobody has the bucket made again (`Awaiting::seen_tenant`).
    /// One not answered (timed out, or the connection lost) leaves the round incomplete.
    pub(super) fn reclaimed(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        answered: Result<(), &RequestError>,
        now: Instant,
    ) {
        self.reclaims.out = self.reclaims.out.saturating_sub(1);
        if let Err(e) = answered {
            return self.round_cut(&format!("a re-claim not answered: {e}"), now);
        }
        self.reclaim_more(conn, config, PER_ANSWER, now);
    }

    /// A round that did not claim every id again: the bucket is no longer taken for
    /// known, so the next check (the reconnect's, or this one's timer a second on)
    /// starts the round again. Before, the check found the bucket known and the ids left
    /// stayed free in it for another caller to take.
    fn round_cut(&mut self, why: &str, now: Instant) {
        self.reclaims.queue.clear();
        self.reclaims.known = None;
        self.seen_unchecked(why, now);
    }

    /// Sends up to `budget` more re-claims, within [`OUT_AT_ONCE`].
    fn reclaim_more(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        budget: usize,
        now: Instant,
    ) {
        let mut sent = 0;
        while sent < budget && self.reclaims.out < OUT_AT_ONCE {
            let Some(held) = self.reclaims.queue.pop_front() else {
                return;
            };
            let (ns, request) = match held {
                Held::Invocation(session) => {
                    let Some(inv) = self.invocations.get(&session) else {
                        continue;
                    };
                    let id = inv.echo.message_id.as_deref().unwrap_or_default();
                    let left = inv.deadline.saturating_duration_since(now);
                    let api = config.js_api(&inv.ns);
                    let request = seen::claim_invocation(api, &inv.ns, id, &inv.caller, left);
                    (inv.ns.clone(), request)
                }
                Held::Signed { caller, id, until } => {
                    let left = until.saturating_duration_since(now);
                    let Some((ns, name)) = caller.split_once('/').filter(|_| !left.is_zero())
                    else {
                        continue;
                    };
                    let key = seen::key(ns, name, &id);
                    (
                        ns.to_string(),
                        seen::claim_key(config.js_api(ns), &key, left),
                    )
                }
            };
            match js_request(conn, request, now) {
                Ok(id) => {
                    sent += 1;
                    self.reclaims.out += 1;
                    self.staged.push(id, Awaiting(Pending::Reclaim(ns)), now);
                }
                Err(e) => {
                    // The rest would not go either; new claims must not wait on them.
                    let left = self.reclaims.queue.len() + 1;
                    log::warn!("{left} ids in use not claimed again in {}: {e}", stream());
                    return self.round_cut(&e, now);
                }
            }
        }
    }
}
