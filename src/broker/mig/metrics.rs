//! MIG metrics (`amp_mig_requests_total{op,capability,code}`, the latency histogram,
//! `amp_mig_rejected_total{reason}`) and the audit line of each invocation.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Every `reason` of `amp_mig_rejected_total`, each shown from the start so that an alert
/// on one works before its first event.
const REJECTED_REASONS: &[&str] = &[
    "bearer_on_publish",
    "no_reply_subject",
    "rate_limited",
    "refusal_unanswered",
    "replay",
    "replay_cache_share",
    "reply_subject",
    "requests_in_flight",
    "verification_budget",
];

/// Distinct `(op, capability, code)` label sets kept; more are counted under `capability="other"`.
const MAX_SERIES: usize = 4096;

#[derive(Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Default)]
pub struct Metrics {
    requests: BTreeMap<(&'static str, String, &'static str), u64>,
    latency: BTreeMap<&'static str, Histogram>,
    rejected: BTreeMap<&'static str, u64>,
    forwarded_cancels: u64,
}

impl Metrics {
    /// One answered request: `code` is `OK` or a MIG error code.
    pub fn request(
        &mut self,
        op: &'static str,
        capability: &str,
        code: &'static str,
        took: Duration,
    ) {
        // The capability comes from the subject, before any check: one that could be no
        // capability's id (quotes, backslashes, anything else a NATS token may hold) is
        // not a label, and neither is one nobody proved a credential for, so junk
        // neither breaks the exposition nor fills the series.
        let label = if code == "MIG_UNAUTHORIZED" || !super::config::is_capability_id(capability) {
            "other"
        } else {
            capability
        };
        let mut key = (op, label.to_string(), code);
        if !self.requests.contains_key(&key) && self.requests.len() >= MAX_SERIES {
            key.1 = "other".to_string();
        }
        *self.requests.entry(key).or_insert(0) += 1;
        let h = self.latency.entry(op).or_default();
        if h.counts.is_empty() {
            h.counts = vec![0; BUCKETS.len()];
        }
        let secs = took.as_secs_f64();
        for (i, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound
                && let Some(c) = h.counts.get_mut(i)
            {
                *c += 1;
            }
        }
        h.sum += secs;
        h.count += 1;
    }

    /// A cancel answered by the broker holding its keyed invocation.
    pub fn forwarded_cancel(&mut self) {
        self.forwarded_cancels += 1;
    }

    pub fn rejected(&mut self, reason: &'static str) {
        debug_assert!(REJECTED_REASONS.contains(&reason), "{reason}");
        *self.rejected.entry(reason).or_insert(0) += 1;
    }

    /// `verifications`: the Ed25519 checks authentication made.
    pub fn render(&self, out: &mut String, verifications: u64) {
        out.push_str("# HELP amp_mig_requests_total MIG requests answered, by operation, capability and code.\n");
        out.push_str("# TYPE amp_mig_requests_total counter\n");
        for ((op, cap, code), n) in &self.requests {
            let _ = writeln!(
                out,
                "amp_mig_requests_total{{op=\"{op}\",capability=\"{cap}\",code=\"{code}\"}} {n}"
            );
        }
        out.push_str("# HELP amp_mig_request_seconds Time from a MIG request to its answer.\n");
        out.push_str("# TYPE amp_mig_request_seconds histogram\n");
        for (op, h) in &self.latency {
            for (bound, c) in BUCKETS.iter().zip(&h.counts) {
                let _ = writeln!(
                    out,
                    "amp_mig_request_seconds_bucket{{op=\"{op}\",le=\"{bound}\"}} {c}"
                );
            }
            let _ = writeln!(
                out,
                "amp_mig_request_seconds_bucket{{op=\"{op}\",le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(out, "amp_mig_request_seconds_sum{{op=\"{op}\"}} {}", h.sum);
            let _ = writeln!(
                out,
                "amp_mig_request_seconds_count{{op=\"{op}\"}} {}",
                h.count
            );
        }
        out.push_str("# HELP amp_mig_rejected_total MIG requests refused before their operation, by reason: answered with nothing (reply_subject, no_reply_subject, refusal_unanswered) or with an error.\n");
        out.push_str("# TYPE amp_mig_rejected_total counter\n");
        let others = self
            .rejected
            .keys()
            .filter(|r| !REJECTED_REASONS.contains(r));
        for reason in REJECTED_REASONS.iter().chain(others) {
            let n = self.rejected.get(reason).copied().unwrap_or(0);
            let _ = writeln!(out, "amp_mig_rejected_total{{reason=\"{reason}\"}} {n}");
        }
        out.push_str("# HELP amp_mig_cancels_forwarded_total CANCELs answered by the broker holding their keyed invocation.\n");
        out.push_str("# TYPE amp_mig_cancels_forwarded_total counter\n");
        let _ = writeln!(
            out,
            "amp_mig_cancels_forwarded_total {}",
            self.forwarded_cancels
        );
        out.push_str("# HELP amp_mig_verifications_total Ed25519 checks of MIG credentials (NKey signatures, issued JWTs).\n");
        out.push_str("# TYPE amp_mig_verifications_total counter\n");
        let _ = writeln!(out, "amp_mig_verifications_total {verifications}");
    }
}

/// The audit line of one finished invocation (MIG "full" profile: actor, tenant,
/// capability, outcome, timestamp).
pub fn audit(
    actor: &str,
    tenant: &str,
    capability: &str,
    outcome: &str,
    timestamp: &str,
    message_id: &str,
    task: &str,
) {
    log::info!(
        target: "amp_broker::audit",
        actor:% = actor, tenant:% = tenant, capability:% = capability, outcome:% = outcome,
        timestamp:% = timestamp, message_id:% = message_id, task:% = task;
        "mig invocation"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Most reasons are refusals answered with an error, and an alert on one needs its
    /// series before its first event (README "probes and metrics": a family whose label
    /// values are a known few shows each at 0 from the start).
    #[test]
    fn every_rejection_reason_shows_from_the_start_and_the_help_says_what_counts() {
        let mut out = String::new();
        Metrics::default().render(&mut out, 0);
        for reason in [
            "bearer_on_publish",
            "no_reply_subject",
            "rate_limited",
            "refusal_unanswered",
            "replay",
            "replay_cache_share",
            "reply_subject",
            "requests_in_flight",
            "verification_budget",
        ] {
            let line = format!("amp_mig_rejected_total{{reason=\"{reason}\"}} 0\n");
            assert!(out.contains(&line), "no {line} in {out}");
        }
        assert!(
            !out.contains("MIG requests answered with nothing, by"),
            "{out}"
        );
    }

    #[test]
    fn capabilities_from_odd_subjects_are_not_labels() {
        let mut m = Metrics::default();
        m.request("invoke", "a\"b", "MIG_NOT_FOUND", Duration::ZERO);
        m.request("invoke", "made-up", "MIG_UNAUTHORIZED", Duration::ZERO);
        m.request("invoke", "render.v2", "OK", Duration::ZERO);
        let mut out = String::new();
        m.render(&mut out, 0);
        assert!(!out.contains("a\"b"), "{out}");
        assert!(!out.contains("made-up"), "{out}");
        assert!(
            out.contains(
                "amp_mig_requests_total{op=\"invoke\",capability=\"render.v2\",code=\"OK\"} 1"
            ),
            "{out}"
        );
    }
}
