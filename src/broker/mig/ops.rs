//! The operations answered from configuration and the registry alone: HELLO, DISCOVER and
//! HEARTBEAT.

use serde_json::{Map, Value, json};

use super::Ctx;
use super::envelope::{Code, MigError};
use crate::broker::config::{Config, Participant};
use crate::broker::permissions::{self, Action};
use crate::broker::registry::{Registry, Serving};

/// Features `hello` can enable: the ones this broker implements.
pub const FEATURES: &[&str] = &[
    "streaming",
    "replay",
    "cancel",
    "heartbeat",
    "idempotency",
    "dead_letter",
];
/// Versions this broker speaks, highest first.
const VERSIONS: &[&str] = &[super::envelope::MIG_VERSION];
/// `suggested_interval_ms` of a heartbeat that asks for none, and its bounds.
const HEARTBEAT_DEFAULT_MS: u64 = 5000;
const HEARTBEAT_MIN_MS: u64 = 1000;
const HEARTBEAT_MAX_MS: u64 = 300_000;

fn strings(body: &Map<String, Value>, name: &str) -> Result<Option<Vec<String>>, MigError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) if items.len() <= 64 => items
            .iter()
            .map(|v| v.as_str().map(|s| s.trim().to_string()))
            .collect::<Option<Vec<String>>>()
            .map(Some)
            .ok_or_else(|| MigError::new(Code::InvalidRequest, format!("{name} must be strings"))),
        Some(_) => Err(MigError::new(
            Code::InvalidRequest,
            format!("{name} must be an array of at most 64 strings"),
        )),
    }
}

pub fn hello(body: &Map<String, Value>, server_id: &str) -> Result<Value, MigError> {
    let versions = strings(body, "supported_versions")?.unwrap_or_default();
    let bindings = strings(body, "requested_bindings")?.unwrap_or_default();
    let requested = strings(body, "requested_features")?;
    // The highest version both sides speak; an empty list means this one.
    let selected = if versions.is_empty() {
        VERSIONS.first().copied()
    } else {
        VERSIONS
            .iter()
            .copied()
            .find(|v| versions.iter().any(|c| c == v))
    };
    let Some(selected) = selected else {
        return Err(MigError::new(
            Code::VersionMismatch,
            format!(
                "no common version: this broker speaks {}",
                VERSIONS.join(", ")
            ),
        ));
    };
    if !bindings.is_empty() && !bindings.iter().any(|b| b == "nats") {
        return Err(MigError::new(
            Code::InvalidRequest,
            "this is the NATS binding; requested_bindings does not include nats",
        ));
    }
    let enabled: Vec<&str> = FEATURES
        .iter()
        .copied()
        .filter(|f| {
            requested
                .as_ref()
                .is_none_or(|r| r.is_empty() || r.iter().any(|x| x == f))
        })
        .collect();
    Ok(json!({
        "selected_version": selected,
        "selected_binding": "nats",
        "enabled_features": enabled,
        "server_id": server_id,
    }))
}

pub fn discover(
    config: &Config,
    ns: &str,
    participant: &Participant,
    body: &Map<String, Value>,
    max_payload: usize,
) -> Value {
    let query = body.get("query").and_then(Value::as_str).unwrap_or("");
    let schemas = body
        .get("include_schema_refs")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let qos = body
        .get("include_qos")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let mut caps: Vec<Value> = config
        .namespaces
        .get(ns)
        .into_iter()
        .flat_map(|n| n.jobs.iter())
        .filter(|(job, _)| permissions::allows(&participant.permissions, Action::Submit, job))
        .filter_map(|(_, j)| j.mig.as_ref())
        .filter(|c| c.id.contains(query))
        .map(|c| {
            let mut d = json!({
                "id": c.id,
                "version": c.version,
                "modes": c.modes,
                "auth_scopes": c.auth_scopes,
                "event_topics": c.event_topics,
            });
            if schemas {
                d["input_schema_uri"] = json!(c.input_schema_uri);
                d["output_schema_uri"] = json!(c.output_schema_uri);
            }
            if qos {
                d["qos"] = json!({
                    "max_payload_bytes": max_payload,
                    "supports_replay": true,
                    "delivery_semantics": "at_least_once",
                    "supports_ordering": true,
                });
            }
            d
        })
        .collect();
    caps.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    json!({"capabilities": caps})
}

pub fn heartbeat(ctx: &Ctx<'_>, ns: &str, body: &Map<String, Value>) -> Result<Value, MigError> {
    let interval = match body.get("interval_ms") {
        None | Some(Value::Null) => HEARTBEAT_DEFAULT_MS,
        Some(v) => v.as_u64().filter(|&ms| ms >= 1).ok_or_else(|| {
            MigError::new(
                Code::InvalidRequest,
                "interval_ms must be a positive integer",
            )
        })?,
    };
    let capabilities: Vec<&str> = ctx
        .config
        .namespaces
        .get(ns)
        .into_iter()
        .flat_map(|n| n.jobs.iter())
        .filter(|(_, j)| j.mig.is_some())
        .map(|(job, _)| job.as_str())
        .collect();
    let (mut leases, mut slots) = (0u64, 0u64);
    for (_, entry) in ctx.registry.into_iter().flat_map(Registry::entries) {
        let serving = Serving::of(entry);
        let count = |of: &std::collections::BTreeMap<String, Value>, job: &str| {
            of.get(job).and_then(Value::as_u64)
        };
        for job in &capabilities {
            slots += count(&serving.serve, job).unwrap_or(0);
            leases += count(&serving.load, job).unwrap_or(0);
        }
    }
    let load = if slots == 0 {
        0.0
    } else {
        leases as f64 / slots as f64
    };
    Ok(json!({
        "suggested_interval_ms": interval.clamp(HEARTBEAT_MIN_MS, HEARTBEAT_MAX_MS),
        "load_factor": load,
    }))
}
