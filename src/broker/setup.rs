//! Start-up: every stream and bucket of the JetStream binding is created when missing and
//! adopted when compatible; an incompatible one stops the broker with the field named.
//! Runs once before the event loop starts, so it may block on its own connection.

use std::time::Duration;

use serde_json::Value;

use super::binding::{self, StreamSettings};
use super::config::Config;
use crate::jetstream::ApiPrefix;
use crate::jetstream::api::check_error;
use crate::nats::Client;

const TIMEOUT: Duration = Duration::from_secs(10);

/// The streams the configuration needs in one JetStream domain (`None`: the local one),
/// in creation order. Every domain in use gets its own task store and budget bucket.
pub fn desired_streams(
    config: &Config,
    domain: Option<&str>,
    settings: StreamSettings,
) -> Vec<Value> {
    let mut streams = vec![
        binding::task_state_stream_config(settings),
        super::budget::budget_stream_config(settings.replicas),
    ];
    for (ns, n) in &config.namespaces {
        if n.jetstream_domain.as_deref() != domain {
            continue;
        }
        streams.push(binding::inbox_stream_config(
            ns,
            n.inbox.max_age_s,
            settings,
        ));
        streams.push(binding::topics_stream_config(
            ns,
            n.topics.max_age_s,
            n.topics.max_bytes,
            n.topics.max_consumers,
            settings,
        ));
        streams.push(binding::tasks_stream_config(ns, settings));
        streams.push(binding::registry_stream_config(
            ns,
            config.limits.registry_ttl_s,
            settings,
        ));
    }
    streams
}

/// Creates or adopts every stream, in the local JetStream and in each domain the
/// namespaces name; returns a line per stream saying which. A domain that does not answer
/// (a leaf node whose hub is away) is skipped with a line saying so, so a site starts
/// and serves its local namespaces without its hub; that domain's streams are then
/// the hub's own broker's to create.
pub fn ensure_streams(
    client: &mut Client,
    config: &Config,
    settings: StreamSettings,
) -> Result<Vec<String>, String> {
    let mut report = Vec::new();
    let mut domains: Vec<Option<&str>> = vec![None];
    for n in config.namespaces.values() {
        let d = n.jetstream_domain.as_deref();
        if !domains.contains(&d) {
            domains.push(d);
        }
    }
    for domain in domains {
        let api = match domain {
            Some(d) => ApiPrefix::domain(d).map_err(|e| e.to_string())?,
            None => ApiPrefix::default(),
        };
        for desired in desired_streams(config, domain, settings) {
            match ensure_stream(client, &api, &desired) {
                Ok(line) => report.push(line),
                Err(Failure::Away(e)) if domain.is_some() => {
                    report.push(format!(
                        "JetStream domain {} did not answer ({e}); its streams are left to \
                         the brokers that reach it",
                        api.as_str()
                    ));
                    break;
                }
                Err(Failure::Away(e) | Failure::Fatal(e)) => return Err(e),
            }
        }
    }
    Ok(report)
}

enum Failure {
    /// Nobody answered: fatal locally, a domain that is away elsewhere.
    Away(String),
    Fatal(String),
}

fn ensure_stream(client: &mut Client, api: &ApiPrefix, desired: &Value) -> Result<String, Failure> {
    let name = desired["name"].as_str().unwrap_or_default().to_string();
    let fatal = Failure::Fatal;
    let info = request(client, &api.subject(&format!("STREAM.INFO.{name}")), b"")?;
    match check_error(&info) {
        Ok(()) => {
            let parsed: Value = serde_json::from_slice(&info)
                .map_err(|e| fatal(format!("stream {name}: bad info reply: {e}")))?;
            binding::check_compatible(desired, &parsed["config"])
                .map_err(|e| fatal(format!("existing stream {name} cannot be used: {e}")))?;
            Ok(format!("adopted stream {name} ({})", api.as_str()))
        }
        Err(e) if e.err_code() == Some(10059) => {
            let created = request(
                client,
                &api.subject(&format!("STREAM.CREATE.{name}")),
                desired.to_string().as_bytes(),
            )?;
            check_error(&created).map_err(|e| fatal(format!("creating stream {name}: {e}")))?;
            Ok(format!("created stream {name} ({})", api.as_str()))
        }
        Err(e) => Err(fatal(format!("stream {name}: {e}"))),
    }
}

fn request(client: &mut Client, subject: &str, payload: &[u8]) -> Result<Vec<u8>, Failure> {
    match client.request(subject, None, payload, TIMEOUT) {
        Ok(msg) if msg.status() == Some(503) => Err(Failure::Away(format!(
            "no JetStream answers {subject} (not enabled, or its domain is not connected)"
        ))),
        Ok(msg) => Ok(msg.payload),
        Err(e) => Err(Failure::Away(format!(
            "JetStream did not answer {subject}: {e}"
        ))),
    }
}
