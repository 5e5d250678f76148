//! What a configuration reload (SIGHUP) may change, and which sessions it ends.
//!
//! Participants, credentials, permissions, policies and job settings are read per frame or
//! per task, so swapping them is enough. Members that were turned into sockets, streams or
//! subscriptions at start (limits, the set of namespaces, their inbox and topics stream
//! settings, the callout's trusted servers) are not: a reload that changes one of them is
//! refused as a whole, so what runs is always exactly one file's content.

use super::config::{Config, Participant};

/// The members of `new` that differ from `old` but only take effect after a restart,
/// named as in the file (`limits.max_frame`, `namespaces.acme.inbox`, ...).
pub fn restart_only_changes(old: &Config, new: &Config) -> Vec<String> {
    let mut changed = Vec::new();
    let (a, b) = (&old.limits, &new.limits);
    macro_rules! limits {
        ($($field:ident),*) => {
            $(if a.$field != b.$field {
                changed.push(concat!("limits.", stringify!($field)).to_string());
            })*
        };
    }
    limits!(
        max_frame,
        max_outbound_bytes,
        heartbeat_s,
        hello_timeout_s,
        registry_ttl_s,
        max_sessions,
        max_held_submits,
        max_connections_per_ip,
        max_waiting_connections,
        connects_per_ip_per_s,
        connect_burst_per_ip,
        max_frames_per_s,
        frame_burst,
        max_buffered_bytes,
        max_topic_subscriptions
    );
    if old.callout.server_keys != new.callout.server_keys {
        changed.push("callout.server_keys".to_string());
    }
    // The MIG subscriptions and live-event consumers are made at start.
    if old.mig.enabled != new.mig.enabled {
        changed.push("mig.enabled".to_string());
    }
    if old.nats_tls != new.nats_tls {
        changed.push("nats_tls".to_string());
    }
    if old.tls.plain_listen != new.tls.plain_listen {
        changed.push("tls.plain_listen".to_string());
    }
    for name in old.namespaces.keys() {
        if !new.namespaces.contains_key(name) {
            changed.push(format!("namespaces.{name} (removed)"));
        }
    }
    for (name, ns) in &new.namespaces {
        let Some(before) = old.namespaces.get(name) else {
            changed.push(format!("namespaces.{name} (added)"));
            continue;
        };
        if before.inbox != ns.inbox {
            changed.push(format!("namespaces.{name}.inbox"));
        }
        if before.topics != ns.topics {
            changed.push(format!("namespaces.{name}.topics"));
        }
        // Stream settings, like the inbox's and the topics': applied when the stream is made.
        if before.dead_letters != ns.dead_letters {
            changed.push(format!("namespaces.{name}.dead_letters"));
        }
        if before.jetstream_domain != ns.jetstream_domain {
            changed.push(format!("namespaces.{name}.jetstream_domain"));
        }
    }
    changed
}

/// Participants `new` no longer lists in a namespace it leaves (or makes) `open`, named as
/// in the file. Removing one is meant to revoke it; there, its name would pass to whoever
/// holds the open credential, with the inbox, durable subscriptions and tasks JetStream
/// keeps under that name. Nothing keeps the list of names once listed, so a reload that
/// would do it is refused instead.
pub fn delisted_under_open(old: &Config, new: &Config) -> Vec<String> {
    let mut delisted = Vec::new();
    for (ns, after) in new.namespaces.iter().filter(|(_, n)| n.open.is_some()) {
        let Some(before) = old.namespaces.get(ns) else {
            continue;
        };
        for name in before.participants.keys() {
            if !after.participants.contains_key(name) {
                delisted.push(format!("namespaces.{ns}.participants.{name}"));
            }
        }
    }
    delisted
}

/// Why a reload ends an authenticated session of `ns/name`, if it does. `serving` says
/// whether the session serves jobs: its offers were admitted under the old `serve`
/// permission, which is checked only when serving starts.
pub fn session_verdict(
    old: &Config,
    new: &Config,
    ns: &str,
    name: &str,
    serving: bool,
) -> Option<&'static str> {
    let Some(after) = new.participant(ns, name) else {
        return Some("participant removed");
    };
    let Some(before) = old.participant(ns, name) else {
        // Not reachable for a session that said hello under `old`; treat it as new.
        return Some("credential changed");
    };
    if !same_credential(before, after) {
        return Some("credential changed");
    }
    if serving && before.permissions.serve != after.permissions.serve {
        return Some("serve permission changed");
    }
    None
}

fn same_credential(a: &Participant, b: &Participant) -> bool {
    a.nkey == b.nkey && a.token_sha256 == b.token_sha256
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        match Config::parse(text.as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("test configuration: {e}"),
        }
    }

    const TOKEN_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const TOKEN_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    /// Bob's own: no two participants may share a token.
    const TOKEN_BOB: &str = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

    fn base(extra_limits: &str, alice_token: &str, alice_perms: &str, more: &str) -> Config {
        config(&format!(
            r#"{{"limits": {{{extra_limits}}},
                "namespaces": {{"acme": {{"participants": {{
                  "alice": {{"token_sha256": "{alice_token}", "permissions": {alice_perms}}},
                  "bob": {{"token_sha256": "{TOKEN_BOB}"}}{more}
                }}}}}}}}"#
        ))
    }

    #[test]
    fn participants_and_permissions_are_reloadable() {
        let old = base("", TOKEN_A, r#"{"send": [">"]}"#, "");
        let new = base(
            "",
            TOKEN_B,
            r#"{"send": []}"#,
            &format!(r#", "carol": {{"token_sha256": "{TOKEN_A}"}}"#),
        );
        assert!(restart_only_changes(&old, &new).is_empty());
    }

    #[test]
    fn limits_namespaces_and_stream_settings_are_named() {
        let old = base("", TOKEN_A, "{}", "");
        let new = config(&format!(
            r#"{{"limits": {{"max_frame": 1024, "heartbeat_s": 7}},
                "namespaces": {{
                  "acme": {{"inbox": {{"ack_wait_s": 5}}, "topics": {{"max_bytes": 9}},
                            "dead_letters": {{"max_age_s": 60}},
                            "participants": {{"bob": {{"token_sha256": "{TOKEN_A}"}}}}}},
                  "other": {{}}}}}}"#
        ));
        assert_eq!(
            restart_only_changes(&old, &new),
            vec![
                "limits.max_frame",
                "limits.heartbeat_s",
                "namespaces.acme.inbox",
                "namespaces.acme.topics",
                "namespaces.acme.dead_letters",
                "namespaces.other (added)",
            ]
        );
        assert_eq!(
            restart_only_changes(&new, &old),
            vec![
                "limits.max_frame",
                "limits.heartbeat_s",
                "namespaces.other (removed)",
                "namespaces.acme.inbox",
                "namespaces.acme.topics",
                "namespaces.acme.dead_letters",
            ]
        );
    }

    #[test]
    fn the_connect_rate_is_taken_at_start_and_limits_read_per_use_are_not() {
        // The listener's per-address connect rate is built at bind: a reload that changed
        // it was reported done and changed nothing.
        let old = base("", TOKEN_A, "{}", "");
        let mut new = old.clone();
        new.limits.connects_per_ip_per_s += 1;
        new.limits.connect_burst_per_ip += 1;
        assert_eq!(
            restart_only_changes(&old, &new),
            vec![
                "limits.connects_per_ip_per_s",
                "limits.connect_burst_per_ip"
            ]
        );
        let mut live = old.clone();
        live.limits.max_requests_in_flight += 1;
        live.limits.max_participant_requests_in_flight += 1;
        live.limits.presence_listed_per_s += 1;
        live.limits.max_sessions_per_participant += 1;
        assert!(restart_only_changes(&old, &live).is_empty());
    }

    #[test]
    fn a_listed_name_leaves_a_namespace_only_while_it_is_not_open() {
        let old = base("", TOKEN_A, "{}", "");
        let without_bob = |open: bool| {
            let open = if open {
                format!(r#", "open": {{"token_sha256": "{TOKEN_B}"}}"#)
            } else {
                String::new()
            };
            config(&format!(
                r#"{{"namespaces": {{"acme": {{"participants": {{
                     "alice": {{"token_sha256": "{TOKEN_A}"}}}}{open}}}}}}}"#
            ))
        };
        assert!(delisted_under_open(&old, &without_bob(false)).is_empty());
        // Opening the namespace in the same reload hands the name over as well.
        assert_eq!(
            delisted_under_open(&old, &without_bob(true)),
            ["namespaces.acme.participants.bob"]
        );
        assert!(delisted_under_open(&without_bob(true), &old).is_empty());
        assert!(delisted_under_open(&without_bob(true), &without_bob(false)).is_empty());
    }

    #[test]
    fn removed_or_rekeyed_participants_lose_their_sessions() {
        let old = base("", TOKEN_A, r#"{"serve": ["ocr"]}"#, "");
        let same = base("", TOKEN_A, r#"{"serve": ["ocr"]}"#, "");
        assert_eq!(session_verdict(&old, &same, "acme", "alice", true), None);

        let rekeyed = base("", TOKEN_B, r#"{"serve": ["ocr"]}"#, "");
        assert_eq!(
            session_verdict(&old, &rekeyed, "acme", "alice", false),
            Some("credential changed")
        );
        assert_eq!(session_verdict(&old, &rekeyed, "acme", "bob", false), None);

        let without_bob = config(&format!(
            r#"{{"namespaces": {{"acme": {{"participants": {{
                 "alice": {{"token_sha256": "{TOKEN_A}", "permissions": {{"serve": ["ocr"]}}}}}}}}}}}}"#
        ));
        assert_eq!(
            session_verdict(&old, &without_bob, "acme", "bob", false),
            Some("participant removed")
        );
    }

    #[test]
    fn permission_changes_keep_the_session_unless_it_serves_under_them() {
        let old = base("", TOKEN_A, r#"{"send": [">"], "serve": ["ocr"]}"#, "");
        let fewer_sends = base("", TOKEN_A, r#"{"serve": ["ocr"]}"#, "");
        assert_eq!(
            session_verdict(&old, &fewer_sends, "acme", "alice", true),
            None
        );
        let no_serve = base("", TOKEN_A, r#"{"send": [">"]}"#, "");
        assert_eq!(
            session_verdict(&old, &no_serve, "acme", "alice", false),
            None
        );
        assert_eq!(
            session_verdict(&old, &no_serve, "acme", "alice", true),
            Some("serve permission changed")
        );
    }
}
