//! MIG configuration: the broker-wide `mig` settings and the per-job `mig` descriptor
//! that makes a job a capability. Checked at load like every member.

use serde::Deserialize;

use crate::broker::config::{ConfigError, Namespace, is_name, within};

/// `mig` at the top of the configuration file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MigSettings {
    /// Serve MIG on `mig.v0_1.<ns>.>` for every namespace.
    pub enabled: bool,
    /// `deadline_ms` of a request that sets none.
    pub default_deadline_ms: u64,
    /// Larger requested deadlines are cut to this.
    pub max_deadline_ms: u64,
    /// Invocations one broker waits on at once; past it `MIG_BACKPRESSURE`.
    pub max_pending: usize,
    /// Message ids one caller may hold claimed in `AMP_MIG_SEEN` through one broker at
    /// once (keys still inside their TTL); past it `MIG_RATE_LIMITED`.
    pub max_claims_per_caller: usize,
    /// Signed message ids one broker remembers within the replay window (every tenant's
    /// NKey callers share them fairly).
    pub max_signed_ids: usize,
    /// Ed25519 checks of MIG credentials (NKey signatures, issued JWTs) one broker makes a
    /// second, in all; past it a request is refused `MIG_RATE_LIMITED` unchecked.
    pub verifications_per_s: u32,
    /// The same for one presented key (an issued JWT: one reply prefix).
    pub verifications_per_key_per_s: u32,
    /// Refusals of requests that proved nobody (their reply subject is anyone's choice)
    /// answered a second, in all; past it they are answered with nothing.
    pub refusals_per_s: u32,
    /// The same for one reply prefix.
    pub refusals_per_prefix_per_s: u32,
}

impl Default for MigSettings {
    fn default() -> Self {
        MigSettings {
            enabled: false,
            default_deadline_ms: 30_000,
            max_deadline_ms: 300_000,
            max_pending: 4096,
            max_claims_per_caller: 8192,
            max_signed_ids: 65_536,
            verifications_per_s: 2000,
            verifications_per_key_per_s: 200,
            refusals_per_s: 1000,
            refusals_per_prefix_per_s: 5,
        }
    }
}

/// `namespaces.<ns>.jobs.<job>.mig`: the job as a MIG capability.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Capability {
    /// Dotted capability id, e.g. `observatory.models.infer`.
    pub id: String,
    #[serde(default = "default_version")]
    pub version: String,
    #[serde(default = "default_modes")]
    pub modes: Vec<String>,
    #[serde(default)]
    pub input_schema_uri: String,
    #[serde(default)]
    pub output_schema_uri: String,
    #[serde(default)]
    pub auth_scopes: Vec<String>,
    #[serde(default)]
    pub event_topics: Vec<String>,
}

/// The capabilities of `ns` whose dead letters participant `p` may read over MIG: those
/// of the jobs it may serve. `None` when MIG is off.
pub fn readable_dead_letters(
    config: &crate::broker::config::Config,
    ns: &str,
    p: &crate::broker::config::Participant,
) -> Option<Vec<String>> {
    use crate::broker::permissions::{Action, allows};
    if !config.mig.enabled {
        return None;
    }
    let jobs = config.namespaces.get(ns).map(|n| &n.jobs);
    Some(
        jobs.into_iter()
            .flatten()
            .filter(|(job, _)| allows(&p.permissions, Action::Serve, job))
            .filter_map(|(_, j)| j.mig.as_ref().map(|m| m.id.clone()))
            .collect(),
    )
}

fn default_version() -> String {
    "1.0.0".to_string()
}

fn default_modes() -> Vec<String> {
    vec!["unary".to_string()]
}

/// The modes a capability may declare.
pub const MODES: &[&str] = &["unary", "server_stream"];

const DAY_MS: u64 = 24 * 3600 * 1000;

fn err(path: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.into(),
        problem: problem.into(),
    }
}

/// A capability id: 1 to 16 dot-separated tokens of the name alphabet, so it is a valid
/// NATS subject tail and cannot hold wildcards.
pub fn is_capability_id(id: &str) -> bool {
    id.len() <= 255 && id.split('.').count() <= 16 && id.split('.').all(is_name)
}

pub fn validate_settings(s: &MigSettings) -> Result<(), ConfigError> {
    within("mig.max_deadline_ms", s.max_deadline_ms, 1, DAY_MS)?;
    within(
        "mig.default_deadline_ms",
        s.default_deadline_ms,
        1,
        s.max_deadline_ms,
    )?;
    within("mig.max_pending", s.max_pending, 1, 1_000_000)?;
    within(
        "mig.max_claims_per_caller",
        s.max_claims_per_caller,
        1,
        1_000_000,
    )?;
    within("mig.max_signed_ids", s.max_signed_ids, 1, 1_048_576)?;
    for (path, value) in [
        ("mig.verifications_per_s", s.verifications_per_s),
        (
            "mig.verifications_per_key_per_s",
            s.verifications_per_key_per_s,
        ),
        ("mig.refusals_per_s", s.refusals_per_s),
        ("mig.refusals_per_prefix_per_s", s.refusals_per_prefix_per_s),
    ] {
        within(path, value, 1, 1_000_000)?;
    }
    Ok(())
}

/// The `mig` members of a namespace's jobs: valid descriptors, ids unique in it.
pub fn validate_namespace(at: &str, ns: &Namespace) -> Result<(), ConfigError> {
    let mut seen: Vec<&str> = Vec::new();
    for (job_name, job) in &ns.jobs {
        let at = format!("{at}.jobs.{job_name}");
        if let Some(max) = job.max_queued {
            within(&format!("{at}.max_queued"), max, 1, 10_000_000)?;
        }
        let Some(cap) = &job.mig else { continue };
        let at = format!("{at}.mig");
        if !is_capability_id(&cap.id) {
            return Err(err(
                format!("{at}.id"),
                format!(
                    "`{}` is not a capability id (1-16 dot-separated tokens of A-Z a-z 0-9 _ -)",
                    cap.id
                ),
            ));
        }
        if seen.contains(&cap.id.as_str()) {
            return Err(err(
                format!("{at}.id"),
                format!("`{}` is the id of another job's capability", cap.id),
            ));
        }
        seen.push(&cap.id);
        within(&format!("{at}.version"), cap.version.len(), 1, 64)?;
        within(
            &format!("{at}.modes"),
            cap.modes.len(),
            1,
            MODES.len() as u64,
        )?;
        for (i, m) in cap.modes.iter().enumerate() {
            if !MODES.contains(&m.as_str()) {
                return Err(err(
                    format!("{at}.modes[{i}]"),
                    format!("`{m}` is not one of {}", MODES.join(", ")),
                ));
            }
        }
        within(
            &format!("{at}.input_schema_uri"),
            cap.input_schema_uri.len(),
            0,
            2048,
        )?;
        within(
            &format!("{at}.output_schema_uri"),
            cap.output_schema_uri.len(),
            0,
            2048,
        )?;
        within(&format!("{at}.auth_scopes"), cap.auth_scopes.len(), 0, 64)?;
        within(&format!("{at}.event_topics"), cap.event_topics.len(), 0, 64)?;
        for (i, t) in cap.event_topics.iter().enumerate() {
            if !crate::broker::config::is_topic_pattern(t) || t.contains('*') || t.contains('>') {
                return Err(err(
                    format!("{at}.event_topics[{i}]"),
                    format!("`{t}` is not a topic"),
                ));
            }
        }
        for (i, s) in cap.auth_scopes.iter().enumerate() {
            within(&format!("{at}.auth_scopes[{i}]"), s.len(), 1, 256)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::broker::config::Config;

    fn parse(v: serde_json::Value) -> Result<Config, String> {
        Config::parse(v.to_string().as_bytes()).map_err(|e| e.to_string())
    }

    #[test]
    fn a_job_with_a_descriptor_is_a_capability() {
        let c = parse(serde_json::json!({"mig": {"enabled": true}, "namespaces": {"acme": {"jobs": {
            "infer": {"max_queued": 10, "mig": {"id": "observatory.models.infer", "modes": ["unary", "server_stream"]}}
        }}}}))
        .expect("valid");
        let job = &c.namespaces["acme"].jobs["infer"];
        assert_eq!(job.max_queued, Some(10));
        let cap = job.mig.as_ref().expect("descriptor");
        assert_eq!(cap.version, "1.0.0");
        assert!(c.mig.enabled);
        assert_eq!(c.mig.default_deadline_ms, 30_000);
    }

    #[test]
    fn turning_mig_on_or_off_takes_a_restart_and_descriptors_reload() {
        let off =
            parse(serde_json::json!({"namespaces": {"a": {"jobs": {"j": {}}}}})).expect("off");
        let on = parse(
            serde_json::json!({"mig": {"enabled": true}, "namespaces": {"a": {"jobs": {"j": {}}}}}),
        )
        .expect("on");
        let described = parse(
            serde_json::json!({"mig": {"enabled": true}, "namespaces": {"a": {"jobs": {
            "j": {"max_queued": 5, "mig": {"id": "a.j"}}}}}}),
        )
        .expect("described");
        use crate::broker::reload::restart_only_changes;
        assert_eq!(restart_only_changes(&off, &on), ["mig.enabled"]);
        assert!(restart_only_changes(&on, &described).is_empty());
    }

    #[test]
    fn unknown_members_and_bad_values_name_the_member() {
        for (v, needle) in [
            (
                serde_json::json!({"mig": {"enabeld": true}}),
                "unknown field `enabeld`",
            ),
            (
                serde_json::json!({"namespaces": {"a": {"jobs": {"j": {"mig": {"id": "x", "colour": 1}}}}}}),
                "unknown field `colour`",
            ),
            (
                serde_json::json!({"namespaces": {"a": {"jobs": {"j": {"mig": {"id": "x.*"}}}}}}),
                "namespaces.a.jobs.j.mig.id",
            ),
            (
                serde_json::json!({"namespaces": {"a": {"jobs": {"j": {"mig": {"id": "x", "modes": ["bidi_stream"]}}}}}}),
                "namespaces.a.jobs.j.mig.modes[0]",
            ),
            (
                serde_json::json!({"namespaces": {"a": {"jobs": {"j": {"mig": {"id": "x"}}, "k": {"mig": {"id": "x"}}}}}}),
                "namespaces.a.jobs.k.mig.id",
            ),
            (
                serde_json::json!({"namespaces": {"a": {"jobs": {"j": {"max_queued": 0}}}}}),
                "namespaces.a.jobs.j.max_queued: must be at least 1",
            ),
            (
                serde_json::json!({"mig": {"default_deadline_ms": 400000}}),
                "mig.default_deadline_ms: must be at most 300000",
            ),
            (
                serde_json::json!({"mig": {"max_deadline_ms": 0}}),
                "mig.max_deadline_ms: must be at least 1",
            ),
        ] {
            let e = parse(v.clone()).expect_err("refused");
            assert!(e.contains(needle), "{v}: {e}");
        }
    }
}
