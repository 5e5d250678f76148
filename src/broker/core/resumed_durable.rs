//! The order of a resumed durable subscription whose consumer still had events out that
//! no session of this broker handed back.
//!
//! A session that ends here hands its unacknowledged events back (naked in stream order)
//! before the resume looks the consumer up, so they come again first. Events out to a
//! session of a broker that died (or of another broker, whose naks race the lookup)
//! come back only when their ack wait runs out; meanwhile the consumer delivers newer
//! ones. Sending those first and dropping the older ones when they come (they are behind
//! the session's last event) loses them for the session, at every ack wait again; sending
//! the older ones late breaks stream order. So the session waits: until every event the
//! lookup counted as out has come, or one ack wait (and a margin) has passed, newer
//! events are held (only their ack subjects) and the older ones sent as they come; then
//! the held ones are naked in stream order, and JetStream redelivers them first, in that
//! order, before anything newer.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Past the ack wait, for the server's redelivery timer and the trip here.
const MARGIN: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub(super) struct Resumed {
    /// The last stream sequence the consumer had delivered at the lookup: every event
    /// still out is at or below it, every newer one above.
    through: u64,
    /// Events out at the lookup that have not come again yet.
    left: u64,
    /// By then every event out at the lookup is due again.
    until: Instant,
    /// Newer events, by stream sequence, with their newest ack subjects: held while
    /// waiting, then handed back and expected again in this order.
    held: BTreeMap<u64, String>,
    waiting: bool,
}

/// What the subscription does with a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// On to the session, as any delivery (the usual duplicate check still applies).
    Send,
    /// Not now: held, or handed back to come again in order.
    Hold,
}

impl Resumed {
    /// The order keeper for a durable resumed on the consumer `info` describes; none
    /// when it had nothing out.
    pub(super) fn after_lookup(info: &Value, ack_wait: Duration, now: Instant) -> Option<Resumed> {
        let left = info["num_ack_pending"].as_u64().filter(|&n| n > 0)?;
        Some(Resumed {
            through: info["delivered"]["stream_seq"].as_u64().unwrap_or(0),
            left,
            until: now + ack_wait + MARGIN,
            held: BTreeMap::new(),
            waiting: true,
        })
    }

    /// Decides on the delivery of event `seq` (`redelivery`: JetStream delivered it
    /// before) with ack subject `reply`, the session's last event being `last_sent`.
    /// Ack subjects to nak at once, in order, are pushed to `naks`.
    pub(super) fn admit(
        &mut self,
        seq: u64,
        redelivery: bool,
        reply: &str,
        last_sent: u64,
        now: Instant,
        naks: &mut Vec<String>,
    ) -> Admit {
        if seq <= self.through {
            // One of the events out at the lookup, or a stray redelivery of an older one:
            // either is before everything held.
            if self.waiting && seq > last_sent {
                self.left = self.left.saturating_sub(1);
                if self.left == 0 {
                    self.hand_back(naks);
                }
            }
            return Admit::Send;
        }
        if self.waiting {
            if now >= self.until && self.held.is_empty() {
                self.waiting = false;
                return Admit::Send;
            }
            self.held.insert(seq, reply.to_string());
            if now >= self.until {
                self.hand_back(naks);
            }
            return Admit::Hold;
        }
        let Some(&first) = self.held.keys().next() else {
            return Admit::Send;
        };
        if seq < first {
            return Admit::Send;
        }
        if seq == first {
            self.held.remove(&first);
            return Admit::Send;
        }
        if !redelivery {
            // New, and on its way before the naks reached the server: behind them.
            naks.push(reply.to_string());
            self.held.insert(seq, reply.to_string());
            return Admit::Hold;
        }
        // A handed-back event came before the lower ones: they went to another reader
        // of the consumer (a session of the participant on another broker).
        self.held = self.held.split_off(&(seq + 1));
        Admit::Send
    }

    fn hand_back(&mut self, naks: &mut Vec<String>) {
        self.waiting = false;
        naks.extend(self.held.values().cloned());
    }

    /// Nothing held or expected any more: the subscription goes on as any other.
    pub(super) fn is_over(&self) -> bool {
        !self.waiting && self.held.is_empty()
    }

    /// The events held or expected, when the subscription ends.
    pub(super) fn into_held(self) -> BTreeMap<u64, String> {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn resumed(now: Instant) -> Resumed {
        let info = json!({"num_ack_pending": 2, "delivered": {"stream_seq": 5}});
        Resumed::after_lookup(&info, Duration::from_secs(30), now).expect("events were out")
    }

    #[test]
    fn nothing_out_needs_no_keeper() {
        let info = json!({"num_ack_pending": 0, "delivered": {"stream_seq": 5}});
        assert!(Resumed::after_lookup(&info, Duration::from_secs(30), Instant::now()).is_none());
    }

    #[test]
    fn newer_events_wait_for_the_ones_out_and_are_then_handed_back_in_order() {
        let now = Instant::now();
        let mut r = resumed(now);
        let mut naks = Vec::new();
        assert_eq!(r.admit(7, false, "a7", 0, now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(6, false, "a6", 0, now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(3, true, "a3", 0, now, &mut naks), Admit::Send);
        assert!(naks.is_empty());
        assert_eq!(r.admit(4, true, "a4", 3, now, &mut naks), Admit::Send);
        assert_eq!(naks, ["a6", "a7"]);
        // One more new event was under way before the naks: it goes behind them.
        assert_eq!(r.admit(8, false, "a8", 4, now, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a6", "a7", "a8"]);
        for (seq, last) in [(6, 4), (7, 6), (8, 7)] {
            assert_eq!(r.admit(seq, true, "", last, now, &mut naks), Admit::Send);
        }
        assert!(r.is_over());
    }

    #[test]
    fn after_one_ack_wait_the_rest_is_not_waited_for() {
        let now = Instant::now();
        let mut r = resumed(now);
        let mut naks = Vec::new();
        assert_eq!(r.admit(3, true, "a3", 0, now, &mut naks), Admit::Send);
        assert_eq!(r.admit(6, false, "a6", 3, now, &mut naks), Admit::Hold);
        let later = now + Duration::from_secs(33);
        assert_eq!(r.admit(7, false, "a7", 3, later, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a6", "a7"]);
        // The handed-back 6 went to another reader: 7 is sent when it comes.
        assert_eq!(r.admit(7, true, "a7", 3, later, &mut naks), Admit::Send);
        assert!(r.is_over());

        let mut r = resumed(now);
        assert_eq!(r.admit(6, false, "a6", 0, later, &mut naks), Admit::Send);
        assert!(r.is_over());
    }
}
