//! Start-up: every stream and bucket of the JetStream binding is created when missing and
//! adopted when compatible; an incompatible one stops the broker with the field named.
//! Runs once before the event loop starts, so it may block on its own connection.

use std::time::Duration;

use serde_json::Value;

use super::binding::{self, StreamSettings};
use super::config::Config;
use crate::jetstream::api::check_error;
use crate::nats::Client;

const TIMEOUT: Duration = Duration::from_secs(10);

/// The streams the configuration needs, in creation order.
pub fn desired_streams(config: &Config, settings: StreamSettings) -> Vec<Value> {
    let mut streams = vec![
        binding::task_state_stream_config(settings),
        super::budget::budget_stream_config(settings.replicas),
    ];
    for (ns, n) in &config.namespaces {
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

/// Creates or adopts every stream; returns a line per stream saying which.
pub fn ensure_streams(
    client: &mut Client,
    config: &Config,
    settings: StreamSettings,
) -> Result<Vec<String>, String> {
    let mut report = Vec::new();
    for desired in desired_streams(config, settings) {
        let name = desired["name"].as_str().unwrap_or_default().to_string();
        let info = request(client, &format!("$JS.API.STREAM.INFO.{name}"), b"")?;
        let line = match check_error(&info) {
            Ok(()) => {
                let parsed: Value = serde_json::from_slice(&info)
                    .map_err(|e| format!("stream {name}: bad info reply: {e}"))?;
                binding::check_compatible(&desired, &parsed["config"])
                    .map_err(|e| format!("existing stream {name} cannot be used: {e}"))?;
                format!("adopted stream {name}")
            }
            Err(e) if e.err_code() == Some(10059) => {
                let created = request(
                    client,
                    &format!("$JS.API.STREAM.CREATE.{name}"),
                    desired.to_string().as_bytes(),
                )?;
                check_error(&created).map_err(|e| format!("creating stream {name}: {e}"))?;
                format!("created stream {name}")
            }
            Err(e) => return Err(format!("stream {name}: {e}")),
        };
        report.push(line);
    }
    Ok(report)
}

fn request(client: &mut Client, subject: &str, payload: &[u8]) -> Result<Vec<u8>, String> {
    match client.request(subject, None, payload, TIMEOUT) {
        Ok(msg) if msg.status() == Some(503) => {
            Err("JetStream is not enabled on the NATS server".to_string())
        }
        Ok(msg) => Ok(msg.payload),
        Err(e) => Err(format!("JetStream did not answer {subject}: {e}")),
    }
}
