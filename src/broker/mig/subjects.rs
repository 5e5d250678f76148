//! MIG/NATS subjects (mig-nats.md section 2).

/// The subject prefix of every MIG subject of this version.
pub const ROOT: &str = "mig.v0_1";

/// One operation, as its subject names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op<'a> {
    Hello,
    Discover,
    /// Every token after `invoke`.
    Invoke(&'a str),
    Cancel(&'a str),
    Heartbeat,
    /// Every token after `events`: a PUBLISH when it has a reply subject.
    Publish(&'a str),
    Subscribe,
}

impl Op<'_> {
    /// The `op` label of metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::Discover => "discover",
            Op::Invoke(_) => "invoke",
            Op::Cancel(_) => "cancel",
            Op::Heartbeat => "heartbeat",
            Op::Publish(_) => "publish",
            Op::Subscribe => "subscribe",
        }
    }
}

/// The tenant of a MIG subject.
pub fn tenant_of(subject: &str) -> Option<&str> {
    let rest = subject.strip_prefix(ROOT)?.strip_prefix('.')?;
    rest.split('.').next().filter(|t| !t.is_empty())
}

/// `(tenant, op)` of a request subject; `None` for anything else.
pub fn parse(subject: &str) -> Option<(&str, Op<'_>)> {
    let rest = subject.strip_prefix(ROOT)?.strip_prefix('.')?;
    let (tenant, rest) = rest.split_once('.')?;
    let op = match rest {
        "hello" => Op::Hello,
        "discover" => Op::Discover,
        "control.heartbeat" => Op::Heartbeat,
        "control.subscribe" => Op::Subscribe,
        _ => {
            if let Some(cap) = rest.strip_prefix("invoke.") {
                Op::Invoke(cap)
            } else if let Some(id) = rest.strip_prefix("control.cancel.") {
                Op::Cancel(id)
            } else if let Some(topic) = rest.strip_prefix("events.") {
                Op::Publish(topic)
            } else {
                return None;
            }
        }
    };
    Some((tenant, op))
}

/// The queue group of `events.>`, which brings PUBLISH requests and every live event.
pub const EVENTS_QUEUE: &str = "amp_mig_events";

/// What the brokers of tenant `ns` subscribe to, each with its queue group, so that one of
/// them answers each request.
pub fn request_subscriptions(ns: &str) -> [(String, &'static str); 5] {
    [
        (format!("{ROOT}.{ns}.events.>"), EVENTS_QUEUE),
        (format!("{ROOT}.{ns}.hello"), "amp_mig_hello"),
        (format!("{ROOT}.{ns}.discover"), "amp_mig_discover"),
        (format!("{ROOT}.{ns}.invoke.>"), "amp_mig_invoke"),
        (format!("{ROOT}.{ns}.control.>"), "amp_mig_control"),
    ]
}

/// The subjects a participant of `ns` may publish MIG requests on.
pub fn request_publish_allow(ns: &str) -> [String; 4] {
    [
        format!("{ROOT}.{ns}.hello"),
        format!("{ROOT}.{ns}.discover"),
        format!("{ROOT}.{ns}.invoke.>"),
        format!("{ROOT}.{ns}.control.>"),
    ]
}

/// The live subject of a topic (or pattern) `t` of `ns`; PUBLISH goes there too.
pub fn events_subject(ns: &str, t: &str) -> String {
    format!("{ROOT}.{ns}.events.{t}")
}

/// Where the dead letters of capability `capability` of `ns` are published as they fail.
pub fn dlq_subject(ns: &str, capability: &str) -> String {
    format!("{ROOT}.{ns}.dlq.{capability}")
}

/// Where the broker holding keyed invocation `message_id` of `ns` takes cancels another
/// broker forwards (a keyed invocation's task id cannot be derived from its message id).
/// Under the brokers' own prefix, which no participant's credential reaches; the message
/// id is hashed, as it need not be a subject token.
pub fn forwarded_cancel_subject(ns: &str, message_id: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [ns, message_id] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let hex: String = h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "{}.MIG.CANCEL.{ns}.{hex}",
        crate::broker::scoped_jwt::BROKER_INBOX_PREFIX
    )
}

/// What a participant of `ns` may subscribe to for MIG: stream frames. The subject names
/// only the stream id (the caller's message id), so any participant of the tenant may
/// listen; callers choose unguessable message ids for streams.
pub fn stream_subscribe_allow(ns: &str) -> String {
    format!("{ROOT}.{ns}.stream.>")
}

/// The participant name a reply subject belongs to: `_INBOX_<ns>_<name>.<anything>`.
pub fn reply_owner<'a>(ns: &str, reply: &'a str) -> Option<&'a str> {
    let rest = reply
        .strip_prefix("_INBOX_")?
        .strip_prefix(ns)?
        .strip_prefix('_')?;
    let (name, tail) = rest.split_once('.')?;
    (!tail.is_empty() && crate::broker::config::is_name(name)).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_name_tenant_and_operation() {
        assert_eq!(parse("mig.v0_1.acme.hello"), Some(("acme", Op::Hello)));
        assert_eq!(
            parse("mig.v0_1.acme.invoke.observatory.models.infer"),
            Some(("acme", Op::Invoke("observatory.models.infer")))
        );
        assert_eq!(
            parse("mig.v0_1.acme.control.cancel.m1"),
            Some(("acme", Op::Cancel("m1")))
        );
        assert_eq!(
            parse("mig.v0_1.acme.control.heartbeat"),
            Some(("acme", Op::Heartbeat))
        );
        assert_eq!(parse("mig.v0_1.acme.stream.x"), None);
        assert_eq!(parse("mig.v0_2.acme.hello"), None);
        assert_eq!(tenant_of("mig.v0_1.acme.discover"), Some("acme"));
    }

    #[test]
    fn a_reply_subject_belongs_to_one_participant() {
        assert_eq!(reply_owner("acme", "_INBOX_acme_bob.x.y"), Some("bob"));
        assert_eq!(reply_owner("acme", "_INBOX_acme_bob_eu.x"), Some("bob_eu"));
        assert_eq!(reply_owner("acme", "_INBOX_acme_bob"), None);
        assert_eq!(reply_owner("acme", "_INBOX.x"), None);
        assert_eq!(reply_owner("acme", "_INBOX_acmex_bob.x"), None);
    }
}
