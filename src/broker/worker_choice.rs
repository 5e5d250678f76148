//! Which local session gets an offer: an eligible one with a free slot, the least loaded
//! (tasks in flight per slot), then the one idle longest, then the oldest session number
//! so the choice is deterministic.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::time::Instant;

use super::task_store::Eligible;

/// A session serving the job, as the choice sees it. `in_flight` counts offers out and
/// leases held for this job.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub session: u64,
    pub name: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub slots: u32,
    pub in_flight: u32,
    /// When its last lease of this job ended, or when it began serving the job.
    pub idle_since: Instant,
}

impl Candidate<'_> {
    pub fn has_free_slot(&self) -> bool {
        self.in_flight < self.slots
    }

    /// `in_flight / slots` compared exactly, without floating point.
    fn load_cmp(&self, other: &Candidate<'_>) -> Ordering {
        (u64::from(self.in_flight) * u64::from(other.slots))
            .cmp(&(u64::from(other.in_flight) * u64::from(self.slots)))
    }
}

/// The session to offer a task to, if any may take it.
pub fn choose<'a>(
    candidates: impl IntoIterator<Item = Candidate<'a>>,
    eligible: Option<&Eligible>,
) -> Option<u64> {
    candidates
        .into_iter()
        .filter(|c| c.has_free_slot())
        .filter(|c| eligible.is_none_or(|e| e.admits(c.name, c.labels)))
        .min_by(|a, b| {
            a.load_cmp(b)
                .then(a.idle_since.cmp(&b.idle_since))
                .then(a.session.cmp(&b.session))
        })
        .map(|c| c.session)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(base: Instant, s: u64) -> Instant {
        base + Duration::from_secs(s)
    }

    #[test]
    fn picks_the_least_loaded_then_the_longest_idle() {
        let t = Instant::now();
        let none = BTreeMap::new();
        let c = |session, slots, in_flight, idle| Candidate {
            session,
            name: "w",
            labels: &none,
            slots,
            in_flight,
            idle_since: at(t, idle),
        };
        // 1/2 loaded beats 1/1 (full) and 2/3; ties on load go to the longest idle.
        assert_eq!(
            choose(
                [c(1, 1, 1, 0), c(2, 3, 2, 0), c(3, 2, 1, 5), c(4, 4, 2, 3)],
                None
            ),
            Some(4)
        );
        assert_eq!(choose([c(1, 2, 0, 9), c(2, 1, 0, 4)], None), Some(2));
        assert_eq!(choose([c(7, 1, 0, 4), c(5, 1, 0, 4)], None), Some(5));
        assert_eq!(
            choose([c(1, 1, 1, 0), c(2, 0, 0, 0)], None),
            None,
            "no free slot"
        );
    }

    #[test]
    fn only_eligible_sessions_are_chosen() {
        let t = Instant::now();
        let gpu = BTreeMap::from([("gpu".to_string(), "a100".to_string())]);
        let none = BTreeMap::new();
        let cands = [
            Candidate {
                session: 1,
                name: "w1",
                labels: &none,
                slots: 4,
                in_flight: 0,
                idle_since: t,
            },
            Candidate {
                session: 2,
                name: "w2",
                labels: &gpu,
                slots: 1,
                in_flight: 0,
                idle_since: at(t, 1),
            },
        ];
        let want_gpu = Eligible {
            names: None,
            labels: Some(gpu.clone()),
        };
        assert_eq!(choose(cands, Some(&want_gpu)), Some(2));
        let want_w3 = Eligible {
            names: Some(vec!["w3".into()]),
            labels: None,
        };
        assert_eq!(choose(cands, Some(&want_w3)), None);
        assert_eq!(choose(cands, None), Some(1));
    }
}
