//! Start-up: every stream and bucket of the JetStream binding is created when missing and
//! adopted when compatible; an incompatible one stops the broker with the field named.
//! Runs once before the event loop starts, so it may block on its own connection; a
//! domain that does not answer then is set up later on a thread of its own.

use std::time::Duration;

use serde_json::Value;

use super::binding::{self, StreamSettings};
use super::config::{Config, Job, Namespace};
use crate::jetstream::api::check_error;
use crate::jetstream::{
    ApiPrefix, ConsumerAction, DiscardPolicy, JsError, Request, RetentionPolicy, StreamConfig,
};
use crate::nats::{Client, Options};

const TIMEOUT: Duration = Duration::from_secs(10);

/// How much longer than its longest lease a namespace's inbox and dead letters keep
/// message ids: the margin the default 30 s lease had in the 120 s window.
pub const REDELIVERY_MARGIN_S: u64 = 90;

/// The duplicate window of namespace `n`'s inbox and dead-letter streams: the broker's
/// own, or its jobs' longest `lease_s` (a job it does not list has the default) and
/// [`REDELIVERY_MARGIN_S`]. A finished task's message whose ack was lost, or whose broker
/// died before acking it, comes back one AckWait (the lease) after its last delivery,
/// and that redelivery publishes the task's result and letter again: still inside the
/// window, a duplicate. With 120 s whatever the lease, a 300 s lease gave the submitter
/// a second `task_result`.
pub fn outcome_window_s(n: &Namespace, settings: StreamSettings) -> u64 {
    let longest = n
        .jobs
        .values()
        .map(|j| j.lease_s)
        .fold(Job::default().lease_s, u64::max);
    settings
        .duplicate_window_s
        .max(longest.saturating_add(REDELIVERY_MARGIN_S))
}

/// The streams the configuration needs in one JetStream domain (`None`: the local one),
/// in creation order. Every domain in use gets its own task store and budget bucket.
pub fn desired_streams(
    config: &Config,
    domain: Option<&str>,
    settings: StreamSettings,
) -> Vec<StreamConfig> {
    let mut streams = vec![
        binding::task_state_stream_config(settings),
        super::budget::budget_stream_config(settings.replicas),
    ];
    if config.mig.enabled {
        streams.push(binding::mig_seen_stream_config(settings));
    }
    for (ns, n) in &config.namespaces {
        if n.jetstream_domain.as_deref() != domain {
            continue;
        }
        let outcomes = StreamSettings {
            duplicate_window_s: outcome_window_s(n, settings),
            ..settings
        };
        streams.push(binding::inbox_stream_config(
            ns,
            n.inbox.max_age_s,
            n.inbox.max_consumers,
            outcomes,
        ));
        streams.push(binding::topics_stream_config(
            ns,
            n.topics.max_age_s,
            n.topics.max_bytes,
            n.topics.max_consumers,
            settings,
        ));
        streams.push(binding::tasks_stream_config(ns, settings));
        streams.push(binding::dlq_stream_config(
            ns,
            n.dead_letters.max_age_s,
            n.dead_letters.max_bytes,
            outcomes,
        ));
        streams.push(binding::registry_stream_config(
            ns,
            config.limits.registry_ttl_s,
            settings,
        ));
    }
    for s in &mut streams {
        // nats-server refuses a window longer than the stream's max_age (10052): an inbox
        // with max_age_s under 120 s, or under the longest lease and 90 s, never started.
        if let (Some(age), Some(window)) = (s.max_age, s.duplicate_window)
            && !age.is_zero()
            && window > age
        {
            s.duplicate_window = Some(age);
        }
    }
    streams
}

/// What [`desired_streams`]' cap at `max_age` takes off namespace `ns`'s inbox and
/// dead-letter windows, a warning for each, naming the jobs whose lease and
/// [`REDELIVERY_MARGIN_S`] reach past it: a task's result or letter published again more
/// than `max_age` after the first (a lost ack under such a lease) is stored a second time,
/// as under the 120 s window before leases counted.
pub fn window_caps(ns: &str, n: &Namespace, settings: StreamSettings) -> Vec<String> {
    let want = outcome_window_s(n, settings);
    let streams = [
        (
            binding::inbox_stream(ns),
            "inbox.max_age_s",
            n.inbox.max_age_s,
        ),
        (
            binding::dlq_stream(ns),
            "dead_letters.max_age_s",
            n.dead_letters.max_age_s,
        ),
    ];
    let mut caps = Vec::new();
    for (stream, field, age) in streams {
        let jobs: Vec<&str> = n
            .jobs
            .iter()
            .filter(|(_, j)| age > 0 && j.lease_s.saturating_add(REDELIVERY_MARGIN_S) > age)
            .map(|(name, _)| name.as_str())
            .collect();
        if !jobs.is_empty() {
            caps.push(format!(
                "stream {stream}: duplicate_window capped at {field}, {age} s, below the {want} s of the longest lease_s and {REDELIVERY_MARGIN_S} s (jobs: {}): a task result or letter published again more than {age} s after the first, after a lost ack under such a lease, is stored a second time",
                jobs.join(", ")
            ));
        }
    }
    caps
}

/// What start-up makes of stream `name` in the JetStream of namespace `ns` (its domain's
/// API and configuration), for making it again after it was deleted while the broker ran.
pub fn desired_stream(
    config: &Config,
    ns: &str,
    name: &str,
    settings: StreamSettings,
) -> Option<(ApiPrefix, StreamConfig)> {
    let domain = config.namespaces.get(ns)?.jetstream_domain.as_deref();
    let stream = desired_streams(config, domain, settings)
        .into_iter()
        .find(|s| s.name == name)?;
    Some((config.js_api(ns), stream))
}

/// What start-up set up, and the domains it could not reach.
pub struct Setup {
    /// A line per stream saying whether it was created or adopted.
    pub report: Vec<String>,
    /// Domains that did not answer; [`retry_away_domains`] sets them up later.
    pub away: Vec<String>,
}

/// Creates or adopts every stream, in the local JetStream and in each domain the
/// namespaces name. A domain that does not answer (a leaf node whose hub is away) is
/// skipped with a line saying so and listed in [`Setup::away`], so a site starts and
/// serves its local namespaces without its hub.
pub fn ensure_streams(
    client: &mut Client,
    config: &Config,
    settings: StreamSettings,
) -> Result<Setup, String> {
    let mut setup = Setup {
        report: Vec::new(),
        away: Vec::new(),
    };
    for domain in domains(config) {
        match ensure_domain(client, config, domain, settings) {
            Ok(lines) => setup.report.extend(lines),
            Err(Failure::Away(e)) if domain.is_some() => {
                setup.report.push(format!(
                    "JetStream domain {} did not answer ({e}); its streams are set up once it does",
                    domain.unwrap_or_default()
                ));
                setup.away.extend(domain.map(String::from));
            }
            Err(Failure::Away(e) | Failure::Fatal(e)) => return Err(e),
        }
    }
    Ok(setup)
}

/// The local JetStream (`None`) and every domain a namespace names, each once.
fn domains(config: &Config) -> Vec<Option<&str>> {
    let mut domains: Vec<Option<&str>> = vec![None];
    for n in config.namespaces.values() {
        let d = n.jetstream_domain.as_deref();
        if !domains.contains(&d) {
            domains.push(d);
        }
    }
    domains
}

fn ensure_domain(
    client: &mut Client,
    config: &Config,
    domain: Option<&str>,
    settings: StreamSettings,
) -> Result<Vec<String>, Failure> {
    let api = match domain {
        Some(d) => ApiPrefix::domain(d).map_err(|e| Failure::Fatal(e.to_string()))?,
        None => ApiPrefix::default(),
    };
    let mut lines: Vec<String> = desired_streams(config, domain, settings)
        .iter()
        .map(|desired| ensure_stream(client, &api, desired, settings))
        .collect::<Result<_, _>>()?;
    for (ns, n) in &config.namespaces {
        if n.jetstream_domain.as_deref() != domain {
            continue;
        }
        for cap in window_caps(ns, n, settings) {
            log::warn!("{cap}");
        }
        if n.open.is_some() {
            lines.push(keep_listed_inboxes(client, &api, ns, n));
        }
    }
    Ok(lines)
}

/// In a namespace whose `open` entry lets any name in, every listed participant's inbox
/// consumer is made at start, so that names made up by whoever holds the open credential
/// can never take the room `inbox.max_consumers` keeps for them (a consumer is otherwise
/// made at a participant's first `hello`, and made-up names could fill the stream
/// before). Idempotent: an existing consumer keeps its state.
fn keep_listed_inboxes(client: &mut Client, api: &ApiPrefix, ns: &str, n: &Namespace) -> String {
    let stream = binding::inbox_stream(ns);
    let mut failed = Vec::new();
    for name in n.participants.keys() {
        let config =
            binding::inbox_consumer_config(ns, name, n.inbox.ack_wait_s, n.inbox.inbox_window);
        let req = api.consumer_create(&stream, &config, ConsumerAction::CreateOrUpdate);
        if let Err(e) = call(client, req) {
            failed.push(format!("{name} ({e})"));
        }
    }
    if !failed.is_empty() {
        log::warn!(
            "namespace {ns}: {} inbox consumers not made at start, made at first hello instead: {}{}",
            failed.len(),
            failed[..failed.len().min(10)].join(", "),
            if failed.len() > 10 { ", ..." } else { "" }
        );
    }
    format!(
        "namespace {ns} is open: inboxes of its {} listed participants kept ({} not made)",
        n.participants.len(),
        failed.len()
    )
}

/// The first wait before a domain that was away is tried again, doubled after each miss.
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two tries.
pub const RETRY_MAX: Duration = Duration::from_secs(5);

/// Sets up the domains start-up could not reach, on a thread of its own with its own
/// connection, so the event loop never waits for a hub. Each domain is tried with a
/// backoff until it answers: a site whose hub was down at start, and for which no hub
/// broker ever created the fleet streams, gets them once the leaf link is up. An
/// incompatible stream found then is logged and that domain is given up.
pub fn retry_away_domains(
    options: Options,
    config: Config,
    settings: StreamSettings,
    away: Vec<String>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("domain-setup".to_string())
        .spawn(move || {
            let mut away = away;
            let mut wait = RETRY_FIRST;
            while !away.is_empty() {
                std::thread::sleep(wait);
                wait = (wait * 2).min(RETRY_MAX);
                let mut client = match Client::connect(options.clone()) {
                    Ok(c) => c,
                    Err(e) => {
                        log::debug!("domain setup: cannot reach NATS: {e}");
                        continue;
                    }
                };
                away.retain(
                    |d| match ensure_domain(&mut client, &config, Some(d), settings) {
                        Ok(lines) => {
                            for line in lines {
                                log::info!("{line}");
                            }
                            log::info!("JetStream domain {d} answers: its streams are set up");
                            false
                        }
                        Err(Failure::Away(e)) => {
                            log::debug!("JetStream domain {d} still away: {e}");
                            true
                        }
                        Err(Failure::Fatal(e)) => {
                            log::error!("JetStream domain {d}: {e}; its streams are not set up");
                            false
                        }
                    },
                );
            }
        })
}

enum Failure {
    /// Nobody answered: fatal locally, a domain that is away elsewhere.
    Away(String),
    Fatal(String),
}

/// JetStream's answer to a create of a stream that exists with another configuration.
pub const ERR_STREAM_NAME_IN_USE: u32 = 10058;

/// JetStream's answer to a stream configuration it refuses, among them a
/// `duplicate_window` over the server's `jetstream.limits.duplicate_window`.
const ERR_STREAM_INVALID_CONFIG: u32 = 10052;

fn ensure_stream(
    client: &mut Client,
    api: &ApiPrefix,
    desired: &StreamConfig,
    settings: StreamSettings,
) -> Result<String, Failure> {
    let name = desired.name.as_str();
    let fatal = Failure::Fatal;
    let invalid = |e| fatal(format!("stream {name}: {e}"));
    let info_request = api.stream_info(name).map_err(invalid)?;
    let info = request(client, &info_request)?;
    match check_error(&info) {
        Ok(()) => adopt(client, api, desired, &info, settings),
        Err(e) if e.err_code() == Some(10059) => {
            let created = request(client, &api.stream_create(desired).map_err(invalid)?)?;
            match check_error(&created) {
                Ok(()) => {
                    warn_if_unbounded(desired, &serde_json::to_value(desired).unwrap_or_default());
                    Ok(format!("created stream {name} ({})", api.as_str()))
                }
                // Another broker, with other settings, made it between our look and our
                // create: judged as one found there.
                Err(e) if e.err_code() == Some(ERR_STREAM_NAME_IN_USE) => {
                    let info = request(client, &info_request)?;
                    check_error(&info).map_err(|e| fatal(format!("stream {name}: {e}")))?;
                    adopt(client, api, desired, &info, settings)
                }
                Err(e) if e.err_code() == Some(ERR_STREAM_INVALID_CONFIG) => {
                    match fallback_window(desired, settings) {
                        Some(fallback) => {
                            window_refused(desired, &fallback, &e.to_string());
                            ensure_stream(client, api, &fallback, settings)
                        }
                        None => Err(fatal(format!("creating stream {name}: {e}"))),
                    }
                }
                Err(e) => Err(fatal(format!("creating stream {name}: {e}"))),
            }
        }
        Err(e) => Err(fatal(format!("stream {name}: {e}"))),
    }
}

/// Adopts an existing stream (its `STREAM.INFO` reply) after the updates it may get, or
/// says which field prevents it. Every value kept that differs from ours is logged.
fn adopt(
    client: &mut Client,
    api: &ApiPrefix,
    desired: &StreamConfig,
    info: &[u8],
    settings: StreamSettings,
) -> Result<String, Failure> {
    let name = desired.name.as_str();
    let fatal = Failure::Fatal;
    let parsed: Value = serde_json::from_slice(info)
        .map_err(|e| fatal(format!("stream {name}: bad info reply: {e}")))?;
    let mut existing = parsed["config"].clone();
    let updates: [(&str, Update); 3] = [
        ("per-message TTLs enabled", message_ttl_update),
        ("discard set to new", discard_update),
        (
            "subject_delete_marker_ttl raised to registry_ttl_s",
            marker_ttl_update,
        ),
    ];
    for (what, update) in updates {
        if let Some(updated) = update(desired, &existing) {
            apply(client, api, &updated, what, log::Level::Info, &mut existing)?;
        }
    }
    let mut kept = None;
    let mut updates = 0;
    while let Some((updated, what, level)) = duplicate_window_update(desired, &existing) {
        if updates == WINDOW_UPDATES {
            window_changed_back(name, &what);
            kept = fallback_window(desired, settings);
            break;
        }
        if let Err(Failure::Fatal(e) | Failure::Away(e)) =
            apply(client, api, &updated, &what, level, &mut existing)
        {
            let fallback = fallback_window(desired, settings).ok_or_else(|| fatal(e.clone()))?;
            window_refused(desired, &fallback, &e);
            kept = Some(fallback);
            break;
        }
        updates += 1;
        let read = api.stream_info(name).map_err(|e| fatal(e.to_string()))?;
        let info = request(client, &read)?;
        check_error(&info).map_err(|e| fatal(format!("stream {name}: {e}")))?;
        existing = serde_json::from_slice::<Value>(&info)
            .map_err(|e| fatal(format!("stream {name}: bad info reply: {e}")))?["config"]
            .take();
    }
    let desired = kept.as_ref().unwrap_or(desired);
    let differences = binding::check_compatible(desired, &existing)
        .map_err(|e| fatal(format!("existing stream {name} cannot be used: {e}")))?;
    let raised = consumer_limit_update(desired, &existing)
        .is_some_and(|updated| raise_consumer_limit(client, api, &updated));
    for d in differences {
        if !(raised && d.field == "max_consumers") {
            log::warn!("stream {name} adopted as it is: {d}");
        }
    }
    warn_if_unbounded(desired, &existing);
    Ok(if raised {
        format!(
            "adopted stream {name} ({}), its max_consumers set to {}",
            api.as_str(),
            desired.max_consumers.unwrap_or_default()
        )
    } else {
        format!("adopted stream {name} ({})", api.as_str())
    })
}

/// Sends `updated`, the configuration stream `existing` gets, and says so at `level`.
fn apply(
    client: &mut Client,
    api: &ApiPrefix,
    updated: &StreamConfig,
    what: &str,
    level: log::Level,
    existing: &mut Value,
) -> Result<(), Failure> {
    let name = updated.name.as_str();
    call(client, api.stream_update(updated))
        .map_err(|e| Failure::Fatal(format!("stream {name}: {what} failed: {e}")))?;
    log::log!(level, "stream {name}: {what}");
    if let Ok(applied) = serde_json::to_value(updated) {
        *existing = applied;
    }
    Ok(())
}

/// How many times a broker updates a stream's duplicate window before it leaves it as it
/// is. A stream's configuration has no compare-and-set: another broker's update, made
/// from a read taken before ours landed, may land after ours and take the window back
/// (one raising it to its own shorter lease's, an operator's `nats stream edit`). So the
/// window is read again after each update and updated again while it falls short: two
/// brokers raising it together for leases of 600 s and 300 s left it at 390 s when the
/// 300 s one's update came last (review finding 5).
pub const WINDOW_UPDATES: u8 = 3;

/// The warning when [`WINDOW_UPDATES`] updates did not keep the window as `what` says.
pub fn window_changed_back(stream: &str, what: &str) {
    log::warn!(
        "stream {stream}: {what}, {WINDOW_UPDATES} times, each taken back by another update of the stream; left as it is (a restart tries again)"
    );
}

/// Every namespace stream client input fills (inbox, topics, tasks) that nothing bounds:
/// one participant could fill the JetStream storage every namespace shares.
fn warn_if_unbounded(desired: &StreamConfig, config: &Value) {
    if binding::fed_by_clients(desired) && binding::unbounded(config) {
        log::warn!(
            "stream {} has no age, byte or message limit: client input fills it until JetStream's storage is full",
            desired.name
        );
    }
}

type Update = fn(&StreamConfig, &Value) -> Option<StreamConfig>;

/// Earlier releases created the inbox and tasks streams with discard `old`: a limit an
/// operator sets then removes accepted messages and tasks silently. Discard `new` refuses
/// new writes instead (`unavailable`, "JetStream cannot store the message now"), and the
/// server allows the update; nothing changes before a limit is reached.
fn discard_update(desired: &StreamConfig, existing: &Value) -> Option<StreamConfig> {
    let migrated = [binding::inbox_stream(""), binding::tasks_stream("")];
    if desired.discard != Some(DiscardPolicy::New)
        || !migrated
            .iter()
            .any(|p| desired.name.starts_with(p.as_str()))
        || existing.get("discard").and_then(Value::as_str) != Some("old")
    {
        return None;
    }
    let mut updated: StreamConfig = serde_json::from_value(existing.clone()).ok()?;
    updated.discard = Some(DiscardPolicy::New);
    Some(updated)
}

/// A duplicate window that does not keep the broker's guarantees, brought to one that
/// does; says what it changed, and how loud. The tasks stream's is kept from ours (a
/// submit retried within it is a duplicate; an operator's shorter one stored it twice,
/// and start-up refused it) to what keeps a task id's uses apart
/// ([`binding::TASKS_DUPLICATE_WINDOW_MAX_S`]: an operator's longer one made the next
/// use's message a duplicate of the last use's, `ok` to a task never queued); only an
/// operator sets it otherwise, hence a warning. The inbox's and the dead letters' is
/// raised to ours ([`outcome_window_s`]), which a stream made under shorter leases (or
/// another broker's) falls short of; the server allows all of them within the stream's
/// `max_age` (ours is capped there; the tasks stream has none) and its own
/// `jetstream.limits.duplicate_window` (a refused raise keeps the stream's, with a
/// warning).
pub fn duplicate_window_update(
    desired: &StreamConfig,
    existing: &Value,
) -> Option<(StreamConfig, String, log::Level)> {
    let have = existing
        .get("duplicate_window")
        .and_then(Value::as_u64)
        .map(Duration::from_nanos)?;
    let outcomes = [binding::inbox_stream(""), binding::dlq_stream("")];
    let (want, what, level) = if desired.retention == Some(RetentionPolicy::WorkQueue) {
        let (min, max) = (
            desired.duplicate_window?,
            Duration::from_secs(binding::TASKS_DUPLICATE_WINDOW_MAX_S),
        );
        let (want, how, why) = if have > max {
            let why = "inside the shortest time a finished task's record is kept";
            (max, "lowered", why)
        } else if have < min {
            (
                min,
                "raised",
                "the broker's, within which a retried submit is a duplicate",
            )
        } else {
            return None;
        };
        let what = format!("{how} to {} s, {why}", want.as_secs());
        (want, what, log::Level::Warn)
    } else if outcomes
        .iter()
        .any(|p| desired.name.starts_with(p.as_str()))
    {
        let need = desired.duplicate_window?;
        let why = if desired.max_age == Some(need) {
            "capped at the stream's max_age".to_string()
        } else {
            format!("the longest lease_s and {REDELIVERY_MARGIN_S} s")
        };
        let what = format!("raised to {} s, {why}", need.as_secs());
        (have < need).then_some((need, what, log::Level::Info))?
    } else {
        return None;
    };
    let mut updated: StreamConfig = serde_json::from_value(existing.clone()).ok()?;
    updated.duplicate_window = Some(want);
    Some((updated, format!("duplicate_window {what}"), level))
}

/// `desired` with the window the broker had before leases counted (120 s, or the
/// stream's `max_age` if shorter), when its own is longer: what an inbox or dead-letter
/// stream keeps when the server refuses the lease's (its `jetstream.limits`), so that a
/// configuration that started under that window still starts.
fn fallback_window(desired: &StreamConfig, settings: StreamSettings) -> Option<StreamConfig> {
    let base = Duration::from_secs(settings.duplicate_window_s);
    let base = match desired.max_age {
        Some(age) if !age.is_zero() => base.min(age),
        _ => base,
    };
    (desired.duplicate_window? > base).then(|| StreamConfig {
        duplicate_window: Some(base),
        ..desired.clone()
    })
}

fn window_refused(desired: &StreamConfig, fallback: &StreamConfig, e: &str) {
    let secs = |c: &StreamConfig| c.duplicate_window.unwrap_or_default().as_secs();
    log::warn!(
        "stream {}: duplicate_window {} s refused by the server ({e}); kept at {} s at the least: a task result or letter published again after a lost ack more than that after the first is stored a second time",
        desired.name,
        secs(desired),
        secs(fallback)
    );
}

/// A registry bucket made when `registry_ttl_s` was shorter keeps markers that age out
/// before the entries do, and a watch resumed within half of `registry_ttl_s` would miss
/// an expiry whose marker is gone already. The server allows the marker TTL to change; a
/// longer one (another broker's longer `registry_ttl_s`) is kept, and none at all is
/// refused by [`binding::check_compatible`].
fn marker_ttl_update(desired: &StreamConfig, existing: &Value) -> Option<StreamConfig> {
    let want = desired.subject_delete_marker_ttl?;
    let have = existing
        .get("subject_delete_marker_ttl")
        .and_then(Value::as_u64)
        .filter(|&n| n > 0)?;
    if u128::from(have) >= want.as_nanos() {
        return None;
    }
    let mut updated: StreamConfig = serde_json::from_value(existing.clone()).ok()?;
    updated.subject_delete_marker_ttl = Some(want);
    Some(updated)
}

/// An existing stream without a consumer limit of its own (`max_consumers` 0 or -1, as
/// the broker's earlier versions created the inbox) gets the server's default, which
/// nats-server 2.15 made 1,000: too few for a namespace's inboxes. Such a stream is updated
/// to the limit we want, everything else kept as it is; a positive limit is an operator's
/// choice and stays.
fn consumer_limit_update(desired: &StreamConfig, existing: &Value) -> Option<StreamConfig> {
    let want = desired.max_consumers.filter(|&n| n > 0)?;
    let have = existing
        .get("max_consumers")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    if have > 0 {
        return None;
    }
    let mut updated: StreamConfig = serde_json::from_value(existing.clone()).ok()?;
    updated.max_consumers = Some(want);
    Some(updated)
}

/// A bucket the broker keeps only for itself (`AMP_MIG_SEEN`, `AMP_TASK_STATE`), made by
/// a version whose keys did not carry their own TTL, gets per-message TTLs switched on (the
/// server allows that, never the reverse) and an age limit no shorter than ours, everything
/// else kept. Streams whose TTLs mean something to others (the registry) are not changed:
/// those are refused by name.
fn message_ttl_update(desired: &StreamConfig, existing: &Value) -> Option<StreamConfig> {
    let own = [
        crate::broker::mig::seen::BUCKET,
        crate::broker::binding::TASK_STATE_BUCKET,
    ]
    .iter()
    .any(|b| desired.name == format!("KV_{b}"));
    let wanted = desired.allow_msg_ttl == Some(true);
    let have = existing.get("allow_msg_ttl").and_then(Value::as_bool) == Some(true);
    if !own || !wanted || have {
        return None;
    }
    let mut updated: StreamConfig = serde_json::from_value(existing.clone()).ok()?;
    updated.allow_msg_ttl = Some(true);
    let shorter = |age: &std::time::Duration| !age.is_zero() && Some(*age) < desired.max_age;
    if updated.max_age.as_ref().is_some_and(shorter) {
        updated.max_age = desired.max_age;
    }
    Some(updated)
}

/// Servers before the update was allowed refuse it: the stream is adopted as it is, with
/// a warning that says what that costs. Whether the limit was raised.
fn raise_consumer_limit(client: &mut Client, api: &ApiPrefix, updated: &StreamConfig) -> bool {
    let name = updated.name.as_str();
    let want = updated.max_consumers.unwrap_or_default();
    match call(client, api.stream_update(updated)) {
        Ok(()) => true,
        Err(e) => {
            log::warn!(
                "stream {name}: max_consumers could not be set to {want} ({e}); the server's default limit applies"
            );
            false
        }
    }
}

/// A request whose answer is only success or why not.
fn call(client: &mut Client, req: Result<Request, JsError>) -> Result<(), String> {
    let req = req.map_err(|e| e.to_string())?;
    match request(client, &req) {
        Ok(reply) => check_error(&reply).map_err(|e| e.to_string()),
        Err(Failure::Away(e) | Failure::Fatal(e)) => Err(e),
    }
}

fn request(client: &mut Client, req: &Request) -> Result<Vec<u8>, Failure> {
    let subject = req.subject.as_str();
    match client.request(subject, None, &req.payload, TIMEOUT) {
        Ok(msg) if msg.status() == Some(503) => Err(Failure::Away(format!(
            "no JetStream answers {subject} (not enabled, or its domain is not connected)"
        ))),
        Ok(msg) => Ok(msg.payload),
        Err(e) => Err(Failure::Away(format!(
            "JetStream did not answer {subject}: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_a_stream_without_a_consumer_limit_of_its_own_is_raised() {
        let desired = binding::inbox_stream_config("acme", 0, 10_000, StreamSettings::default());
        let mut existing = serde_json::to_value(&desired).expect("json");
        existing["future_field"] = json!({"kept": true});
        for none in [json!(-1), json!(0), Value::Null] {
            existing["max_consumers"] = none.clone();
            let updated = consumer_limit_update(&desired, &existing).expect("raised");
            assert_eq!(updated.max_consumers, Some(10_000), "{none}");
            let wire = serde_json::to_value(&updated).expect("json");
            assert_eq!(wire["future_field"], json!({"kept": true}));
            assert_eq!(wire["subjects"], existing["subjects"]);
        }
        existing["max_consumers"] = json!(50);
        assert!(consumer_limit_update(&desired, &existing).is_none());
        let unlimited = StreamConfig {
            max_consumers: None,
            ..binding::tasks_stream_config("acme", StreamSettings::default())
        };
        existing["max_consumers"] = json!(-1);
        assert!(consumer_limit_update(&unlimited, &existing).is_none());
    }

    #[test]
    fn only_the_brokers_own_buckets_get_message_ttls_switched_on() {
        let desired = binding::mig_seen_stream_config(StreamSettings::default());
        let mut existing = serde_json::to_value(&desired).expect("json");
        existing["allow_msg_ttl"] = json!(false);
        existing["max_age"] = json!(300_000_000_000u64);
        let updated = message_ttl_update(&desired, &existing).expect("switched on");
        assert_eq!(updated.allow_msg_ttl, Some(true));
        assert_eq!(updated.max_age, desired.max_age);
        existing["allow_msg_ttl"] = json!(true);
        assert!(message_ttl_update(&desired, &existing).is_none());
        let registry = binding::registry_stream_config("acme", 15, StreamSettings::default());
        let mut existing = serde_json::to_value(&registry).expect("json");
        existing["allow_msg_ttl"] = json!(false);
        assert!(message_ttl_update(&registry, &existing).is_none());
        // The task store as versions before finished records expired made it.
        let tasks = binding::task_state_stream_config(StreamSettings::default());
        let mut existing = serde_json::to_value(&tasks).expect("json");
        existing.as_object_mut().map(|o| o.remove("allow_msg_ttl"));
        let updated = message_ttl_update(&tasks, &existing).expect("switched on");
        assert_eq!(updated.allow_msg_ttl, Some(true));
        assert_eq!(updated.max_msgs_per_subject, tasks.max_msgs_per_subject);
    }

    #[test]
    fn registry_markers_shorter_than_the_entries_are_raised_longer_ones_kept() {
        const S: u64 = 1_000_000_000;
        let desired = binding::registry_stream_config("acme", 20, StreamSettings::default());
        let mut existing = serde_json::to_value(&desired).expect("json");
        existing["future_field"] = json!({"kept": true});
        existing["subject_delete_marker_ttl"] = json!(2 * S);
        let updated = marker_ttl_update(&desired, &existing).expect("raised");
        assert_eq!(
            updated.subject_delete_marker_ttl,
            Some(Duration::from_secs(20))
        );
        let wire = serde_json::to_value(&updated).expect("json");
        assert_eq!(wire["future_field"], json!({"kept": true}));
        for kept in [json!(20 * S), json!(60 * S), json!(0), Value::Null] {
            existing["subject_delete_marker_ttl"] = kept.clone();
            assert!(marker_ttl_update(&desired, &existing).is_none(), "{kept}");
        }
        let inbox = binding::inbox_stream_config("acme", 0, 10_000, StreamSettings::default());
        assert!(marker_ttl_update(&inbox, &serde_json::to_value(&inbox).expect("json")).is_none());
    }
}
