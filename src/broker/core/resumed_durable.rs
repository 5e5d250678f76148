//! The order of a resumed durable subscription whose consumer still had events out.
//!
//! A resumed durable starts at its first unacknowledged event (spec 2.3). Events a
//! session of this broker left are handed back (naked lowest first) before the resume
//! looks the consumer up, and come again at once. Others come only when their ack wait
//! runs out: events out to a session of a broker that died, or whose delivery was lost on
//! the way to a session (a gap the session could not fill without breaking its order),
//! or still held by a session on another broker. Meanwhile the consumer delivers the
//! handed-back and newer ones; sent as they came, they would put the late ones behind the
//! session's last event, where the duplicate check drops them: lost to the session, at
//! every ack wait again.
//!
//! So a resume whose lookup counts events out waits: every delivery is held (its ack
//! subject only) until as many events at or below the lookup's last delivered sequence
//! as were out have come, or one ack wait and a margin has passed (when every event out
//! at the lookup was due again). Then all it holds are naked in stream order, and
//! JetStream delivers them again first, in that order, before anything newer.
//!
//! A live session's durable whose deliveries went missing on the way (its consumer
//! sequences skip, see `topics.rs`) waits the same way for the missing ones.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Past the ack wait, for the server's redelivery timer and the trip here.
const MARGIN: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub(super) struct Resumed {
    /// The events waited for are above this stream sequence...
    above: u64,
    /// ...and at or below this one: after a lookup, the last the consumer had delivered
    /// then (every event out then is at or below it).
    through: u64,
    /// Events out at the lookup that have not come yet.
    left: u64,
    /// By then every event out at the lookup was due again: the wait ends.
    until: Instant,
    /// By stream sequence: the events held while waiting, then those handed back and
    /// expected again, lowest first.
    held: BTreeMap<u64, Held>,
    /// Numbers the naks: JetStream redelivers naked events in the order of their naks.
    naked: u64,
    waiting: bool,
}

#[derive(Debug)]
struct Held {
    /// The newest ack subject.
    ack: String,
    /// When it was naked, by [`Resumed::naked`]; 0 while held.
    nak: u64,
    /// It came before lower ones naked before it and was put behind them once more.
    again: bool,
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
    /// The order keeper for a durable resumed on the consumer `info` describes, and when
    /// its wait ends; none when the consumer had nothing out.
    pub(super) fn after_lookup(info: &Value, ack_wait: Duration, now: Instant) -> Option<Resumed> {
        let left = info["num_ack_pending"].as_u64().filter(|&n| n > 0)?;
        Some(Resumed {
            above: 0,
            through: info["delivered"]["stream_seq"].as_u64().unwrap_or(0),
            left,
            until: now + ack_wait + MARGIN,
            held: BTreeMap::new(),
            naked: 0,
            waiting: true,
        })
    }

    /// The order keeper for a durable whose `lost` deliveries went missing on the way
    /// (out to a connection that dropped): which events they were is not known, only
    /// that those that matter were never sent, so are above `last_sent`; it holds
    /// everything until as many such events came again, or one ack wait and the margin
    /// has passed, by when each of them was due again.
    pub(super) fn after_loss(
        lost: u64,
        last_sent: u64,
        ack_wait: Duration,
        now: Instant,
    ) -> Resumed {
        Resumed {
            above: last_sent,
            through: u64::MAX,
            left: lost,
            until: now + ack_wait + MARGIN,
            held: BTreeMap::new(),
            naked: 0,
            waiting: true,
        }
    }

    pub(super) fn until(&self) -> Instant {
        self.until
    }

    /// Decides on the delivery of event `seq` (`redelivery`: JetStream delivered it
    /// before) with ack subject `reply`. Ack subjects to nak at once, in this order, are
    /// pushed to `naks`.
    pub(super) fn admit(
        &mut self,
        seq: u64,
        redelivery: bool,
        reply: &str,
        now: Instant,
        naks: &mut Vec<String>,
    ) -> Admit {
        if self.waiting {
            let held = Held {
                ack: reply.to_string(),
                nak: 0,
                again: false,
            };
            // An event waited for comes again: it was delivered before.
            if self.held.insert(seq, held).is_none()
                && redelivery
                && (self.above + 1..=self.through).contains(&seq)
            {
                self.left = self.left.saturating_sub(1);
            }
            if self.left == 0 || now >= self.until {
                self.hand_back(naks);
            }
            return Admit::Hold;
        }
        let Some(&first) = self.held.keys().next() else {
            return Admit::Send;
        };
        if seq <= first {
            // The one expected next, or an event out at the lookup that came only now
            // and is still before everything handed back.
            self.held.remove(&seq);
            return Admit::Send;
        }
        let mut again = false;
        if let Some(h) = self.held.get(&seq).filter(|_| redelivery) {
            // Expected, but a lower one is still to come. If that one was naked after
            // this one, it is behind it: this one goes behind it again. If before, either
            // this is its own redelivery racing the naks (held about as long as the ack
            // wait, its ack wait ran out as the wait ended), or the lower one went to
            // another reader of the consumer (a session of the participant on another
            // broker). One more turn behind them tells: the second time it is sent, the
            // lower ones not waited for.
            if !self.held.range(..seq).any(|(_, lower)| lower.nak > h.nak) {
                if h.again {
                    self.held = self.held.split_off(&seq.saturating_add(1));
                    return Admit::Send;
                }
                again = true;
            }
        }
        // New and on its way before the naks reached the server, or handed back by
        // another session meanwhile, or expected after one still to come: behind them.
        self.nak(seq, reply, naks);
        if let Some(h) = self.held.get_mut(&seq) {
            h.again = again;
        }
        Admit::Hold
    }

    /// More deliveries were lost on the way while it waits: it waits for those too.
    /// The new end of the wait, if it still waits.
    pub(super) fn lost_again(
        &mut self,
        lost: u64,
        ack_wait: Duration,
        now: Instant,
    ) -> Option<Instant> {
        if !self.waiting {
            return None;
        }
        self.left = self.left.saturating_add(lost);
        self.through = u64::MAX;
        self.until = self.until.max(now + ack_wait + MARGIN);
        Some(self.until)
    }

    /// A timer for the end of the wait: unless the wait was made longer since, it hands
    /// back what it holds.
    pub(super) fn wait_over(&mut self, now: Instant, naks: &mut Vec<String>) {
        if self.waiting && now >= self.until {
            self.hand_back(naks);
        }
    }

    fn hand_back(&mut self, naks: &mut Vec<String>) {
        self.waiting = false;
        for h in self.held.values_mut() {
            self.naked += 1;
            h.nak = self.naked;
            naks.push(h.ack.clone());
        }
    }

    fn nak(&mut self, seq: u64, reply: &str, naks: &mut Vec<String>) {
        self.naked += 1;
        let h = Held {
            ack: reply.to_string(),
            nak: self.naked,
            again: false,
        };
        self.held.insert(seq, h);
        naks.push(reply.to_string());
    }

    /// Nothing held or expected any more: the subscription goes on as any other.
    pub(super) fn is_over(&self) -> bool {
        !self.waiting && self.held.is_empty()
    }

    /// The events held or expected (their ack subjects), when the subscription ends.
    pub(super) fn into_held(self) -> impl Iterator<Item = (u64, String)> {
        self.held.into_iter().map(|(seq, h)| (seq, h.ack))
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
    fn everything_waits_for_the_events_out_and_comes_again_in_order() {
        let now = Instant::now();
        let mut r = resumed(now);
        let mut naks = Vec::new();
        // A handed-back 4 and a new 7 come first; 3 (lost on the way) after its ack wait.
        assert_eq!(r.admit(4, true, "a4", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(7, false, "a7", now, &mut naks), Admit::Hold);
        assert!(naks.is_empty());
        assert_eq!(r.admit(3, true, "a3", now, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a3", "a4", "a7"]);
        // One more new event was under way before the naks: it goes behind them.
        assert_eq!(r.admit(8, false, "a8", now, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a3", "a4", "a7", "a8"]);
        for seq in [3, 4, 7, 8] {
            assert_eq!(r.admit(seq, true, "", now, &mut naks), Admit::Send);
        }
        assert!(r.is_over());
    }

    #[test]
    fn events_handed_back_by_another_session_meanwhile_go_behind_in_order() {
        let now = Instant::now();
        let mut r = resumed(now);
        let mut naks = Vec::new();
        r.admit(2, true, "a2", now, &mut naks);
        r.admit(5, true, "a5", now, &mut naks);
        assert_eq!(naks, ["a2", "a5"]);
        naks.clear();
        // Another session hands back 9, then 4; both go behind 2 and 5.
        assert_eq!(r.admit(9, true, "b9", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(2, true, "c2", now, &mut naks), Admit::Send);
        assert_eq!(r.admit(4, true, "b4", now, &mut naks), Admit::Send);
        // 5 comes, but 9 was naked after it and is lower than nothing: 5 is next.
        assert_eq!(r.admit(5, true, "c5", now, &mut naks), Admit::Send);
        assert_eq!(naks, ["b9"]);
        assert_eq!(r.admit(9, true, "c9", now, &mut naks), Admit::Send);
        assert!(r.is_over());

        // 6 and 8 handed back, then 7 from another session behind them: 8 waits for 7.
        let mut r2 = resumed(now);
        naks.clear();
        r2.admit(6, false, "a6", now, &mut naks);
        r2.admit(8, false, "a8", now, &mut naks);
        r2.wait_over(r2.until(), &mut naks);
        assert_eq!(naks, ["a6", "a8"]);
        assert_eq!(r2.admit(7, true, "b7", now, &mut naks), Admit::Hold);
        assert_eq!(r2.admit(6, true, "c6", now, &mut naks), Admit::Send);
        assert_eq!(r2.admit(8, true, "c8", now, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a6", "a8", "b7", "c8"]);
        assert_eq!(r2.admit(7, true, "d7", now, &mut naks), Admit::Send);
        assert_eq!(r2.admit(8, true, "d8", now, &mut naks), Admit::Send);
        assert!(r2.is_over());
    }

    #[test]
    fn the_wait_ends_after_one_ack_wait() {
        let now = Instant::now();
        let mut r = resumed(now);
        let mut naks = Vec::new();
        assert_eq!(r.admit(4, true, "a4", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(6, false, "a6", now, &mut naks), Admit::Hold);
        r.wait_over(r.until(), &mut naks);
        assert_eq!(naks, ["a4", "a6"]);
        // 3, still out elsewhere, comes before the handed-back ones: still in order.
        assert_eq!(r.admit(3, true, "a3", now, &mut naks), Admit::Send);
        // The handed-back 4 went to another reader: 6 goes behind it once, and is sent
        // when it comes again.
        assert_eq!(r.admit(6, true, "b6", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(6, true, "c6", now, &mut naks), Admit::Send);
        assert!(r.is_over());

        let mut r = resumed(now);
        let later = now + Duration::from_secs(33);
        assert_eq!(r.admit(6, false, "a6", later, &mut naks), Admit::Hold);
        assert!(!r.is_over());
        assert_eq!(r.admit(6, true, "a6", later, &mut naks), Admit::Send);
        assert!(r.is_over());
    }

    #[test]
    fn a_loss_waits_for_as_many_events_above_the_last_sent_then_all_come_in_order() {
        // 5 sent; two deliveries lost on the way (6 and 7); 9 is new, 4 (out, its ack
        // wait run out) comes again behind 5 and does not count.
        let now = Instant::now();
        let mut r = Resumed::after_loss(2, 5, Duration::from_secs(30), now);
        let mut naks = Vec::new();
        assert_eq!(r.admit(9, false, "a9", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(4, true, "a4", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(6, true, "a6", now, &mut naks), Admit::Hold);
        assert!(naks.is_empty(), "{naks:?}");
        assert_eq!(r.admit(7, true, "a7", now, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a4", "a6", "a7", "a9"]);
        for seq in [4, 6, 7, 9] {
            assert_eq!(r.admit(seq, true, "", now, &mut naks), Admit::Send);
        }
        assert!(r.is_over());
    }

    #[test]
    fn a_loss_while_waiting_makes_the_wait_longer() {
        let now = Instant::now();
        let ack_wait = Duration::from_secs(30);
        let mut r = Resumed::after_loss(1, 5, ack_wait, now);
        let mut naks = Vec::new();
        assert_eq!(r.admit(8, false, "a8", now, &mut naks), Admit::Hold);
        let later = now + Duration::from_secs(10);
        assert_eq!(
            r.lost_again(1, ack_wait, later),
            Some(later + ack_wait + MARGIN)
        );
        // The first wait's timer finds the wait made longer: nothing handed back yet.
        r.wait_over(now + ack_wait + MARGIN, &mut naks);
        assert!(naks.is_empty(), "{naks:?}");
        assert_eq!(r.admit(6, true, "a6", later, &mut naks), Admit::Hold);
        assert!(naks.is_empty(), "one lost delivery still to come: {naks:?}");
        assert_eq!(r.admit(7, true, "a7", later, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a6", "a7", "a8"]);
        // Over, it waits no more.
        assert_eq!(r.lost_again(1, ack_wait, later), None);
    }

    #[test]
    fn a_held_events_own_redelivery_racing_the_naks_goes_behind_the_lower_ones_once() {
        // Seen in broker_topics' killed-broker test: 3 was held for as long as 2's ack
        // wait, so its own ack wait ran out just as the wait ended with 2. That
        // redelivery of 3 came before the naked 2 and was taken for "2 went to another
        // reader": 3 was sent, and 2 came behind it and never reached the session.
        let now = Instant::now();
        let mut r = resumed(now);
        let mut naks = Vec::new();
        assert_eq!(r.admit(3, false, "a3", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(2, true, "a2", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(1, true, "a1", now, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a1", "a2", "a3"]);
        assert_eq!(r.admit(1, true, "b1", now, &mut naks), Admit::Send);
        // 3's own ack wait ran out.
        assert_eq!(r.admit(3, true, "b3", now, &mut naks), Admit::Hold);
        assert_eq!(naks, ["a1", "a2", "a3", "b3"]);
        assert_eq!(r.admit(2, true, "b2", now, &mut naks), Admit::Send);
        assert_eq!(r.admit(3, true, "c3", now, &mut naks), Admit::Send);
        assert!(r.is_over());
        // 2 went to another reader indeed: 3 is sent when it comes again.
        let mut r = resumed(now);
        naks.clear();
        r.admit(3, false, "a3", now, &mut naks);
        r.admit(2, true, "a2", now, &mut naks);
        r.admit(1, true, "a1", now, &mut naks);
        assert_eq!(r.admit(1, true, "b1", now, &mut naks), Admit::Send);
        assert_eq!(r.admit(3, true, "b3", now, &mut naks), Admit::Hold);
        assert_eq!(r.admit(3, true, "c3", now, &mut naks), Admit::Send);
        assert!(r.is_over());
    }
}
