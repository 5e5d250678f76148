//! `AMP_MIG_SEEN` made again (deleted while the brokers run, `remake.rs`) is empty, but the
//! ids it held are still in use: a running invocation's message id names its stream and
//! its forwarded cancels, and a signed PUBLISH's id may be replayed to any broker until its
//! window ends. Each broker that hears of the new bucket (JetStream's advisory of its
//! creation, or its own create answered) claims again the ids it holds, and takes no new
//! claim until it has and the other brokers, who hear of it about when it does, have had
//! [`SETTLE`] to do the same. Before, another caller's invoke through another broker
//! took a running stream's id in the new bucket, and a subscriber's copy of a signed
//! PUBLISH was stored there as the signer's event.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde_json::json;

use super::envelope::{Code, MigError};
use super::{Awaiting, Mig, Pending, js_request, seen};
use crate::broker::config::Config;
use crate::broker::jobs::SessionId;
use crate::nats::Connection;

/// Re-claims out at once: a round holds up to `mig.max_pending` invocations and
/// `mig.max_signed_ids` signed ids, more than the connection's 65,536 request slots that
/// everything shares, so the rest wait for answers.
const OUT_AT_ONCE: usize = 1024;
/// New claims wait this long after the bucket is heard made again, for the other
/// brokers' re-claims: each hears of it within a round trip and sends its first
/// [`OUT_AT_ONCE`] at once. The retry a refusal asks for.
pub const SETTLE: Duration = Duration::from_millis(crate::broker::remake::RETRY_AFTER_MS);

/// The JetStream advisory of the bucket's creation, in the local JetStream (MIG serves
/// only the tenants it holds).
pub fn made_advisory() -> String {
    format!("$JS.EVENT.ADVISORY.STREAM.CREATED.KV_{}", seen::BUCKET)
}

/// An id this broker holds.
enum Held {
    /// A running invocation's message id, looked up when sent (one ended holds none).
    Invocation(SessionId),
    /// A signed PUBLISH's [`seen::key`] in tenant `ns`, held until `until`.
    Signed {
        ns: String,
        key: String,
        until: Instant,
    },
}

/// The ids being claimed again, and since when new claims wait.
#[derive(Default)]
pub struct Reclaims {
    /// Bounded by the invocations and the replay cache it was taken from.
    queue: VecDeque<Held>,
    out: usize,
    heard: Option<Instant>,
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
            "JetStream stream KV_{} was made again; the ids in use are being claimed again",
            seen::BUCKET
        ),
    )
    .detail("retry_after_ms", json!(SETTLE.as_millis() as u64))
}

impl Mig {
    /// The bucket was made again: every id this broker holds is claimed again. A round
    /// under way starts over, as the bucket may have gone again since its ids were sent.
    pub fn seen_made_again(&mut self, conn: &mut Connection, config: &Config, now: Instant) {
        let wall = self.wall_ms(now);
        let invocations = self
            .invocations
            .iter()
            .filter(|(_, inv)| inv.claimed)
            .map(|(session, _)| Held::Invocation(*session));
        let signed = self.auth.exposed_ids(wall).filter_map(|(caller, id, at)| {
            let (ns, name) = caller.split_once('/')?;
            let age = Duration::from_millis(u64::try_from(wall - at).unwrap_or(0));
            Some(Held::Signed {
                ns: ns.to_string(),
                key: seen::key(ns, name, id),
                until: crate::deadline::after(now, seen::KEEP.saturating_sub(age)),
            })
        });
        let queue: VecDeque<Held> = invocations.chain(signed).collect();
        log::warn!(
            "KV_{} was made again: claiming again the {} ids this broker holds",
            seen::BUCKET,
            queue.len()
        );
        self.reclaims.queue = queue;
        self.reclaims.heard = Some(now);
        self.reclaim_more(conn, config, now);
    }

    /// A re-claim was answered: created, or found taken (by a broker that claimed it
    /// again first, or by anyone in the gap), either way nothing more to do. One that
    /// found nobody has the bucket made again (`Awaiting::seen_tenant`).
    pub(super) fn reclaimed(&mut self, conn: &mut Connection, config: &Config, now: Instant) {
        self.reclaims.out = self.reclaims.out.saturating_sub(1);
        self.reclaim_more(conn, config, now);
    }

    fn reclaim_more(&mut self, conn: &mut Connection, config: &Config, now: Instant) {
        while self.reclaims.out < OUT_AT_ONCE {
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
                Held::Signed { ns, key, until } => {
                    let left = until.saturating_duration_since(now);
                    if left.is_zero() {
                        continue;
                    }
                    let request = seen::claim_key(config.js_api(&ns), &key, left);
                    (ns, request)
                }
            };
            match js_request(conn, request, now) {
                Ok(id) => {
                    self.reclaims.out += 1;
                    self.staged.push(id, Awaiting(Pending::Reclaim(ns)), now);
                }
                Err(e) => {
                    // The rest would not go either; new claims must not wait on them.
                    let left = self.reclaims.queue.len() + 1;
                    self.reclaims.queue.clear();
                    log::warn!(
                        "{left} ids in use not claimed again in KV_{}: {e}",
                        seen::BUCKET
                    );
                    return;
                }
            }
        }
    }
}
