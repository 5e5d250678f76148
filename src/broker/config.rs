//! The broker's configuration file: namespaces, participants with their credentials and
//! address permissions, jobs, and policy. Loaded once at start-up; a file that is missing,
//! malformed or inconsistent stops the broker with a message naming the problem.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Deserializer};

use crate::jetstream::ApiPrefix;

/// A validated configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub namespaces: BTreeMap<String, Namespace>,
    #[serde(default)]
    pub callout: CalloutTrust,
    #[serde(default)]
    pub mig: super::mig::config::MigSettings,
    /// The listener's TLS (see the README's TLS section); flags win over it.
    #[serde(default)]
    pub tls: crate::tls::ListenerTls,
    /// The broker's own NATS connection's TLS.
    #[serde(default)]
    pub nats_tls: crate::tls::NatsTls,
    /// Origins whose pages may open sessions (besides `--allowed-origin`).
    #[serde(default)]
    pub allowed_origins: Vec<String>,
}

/// Which nats-servers the auth callout answers, and how long what it issues lasts.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CalloutTrust {
    /// Server public keys (`N...`, a server's INFO `server_id`) whose authorization
    /// requests are answered; added to those given with `--callout-server-key`. Empty
    /// (and no flag): the servers the broker's own NATS connection has met.
    #[serde(default)]
    pub server_keys: Vec<String>,
    /// Lifetime of the user JWTs the callout and `hello` issue. nats-server ends a
    /// connection when its JWT expires, and nothing else ends one: this is how long a
    /// removed participant, or one whose permissions were narrowed, keeps what its NATS
    /// connection had.
    #[serde(default = "default_jwt_ttl_s")]
    pub jwt_ttl_s: u64,
    /// Authorization requests answered per second (one second's worth at once): each
    /// costs up to five Ed25519 operations, and every NATS connect to a server using the
    /// callout is one. Past it a request gets an empty reply, which the server takes as
    /// a refusal, without any checking.
    #[serde(default = "default_callout_requests_per_s")]
    pub max_requests_per_s: u32,
}

fn default_jwt_ttl_s() -> u64 {
    3600
}

fn default_callout_requests_per_s() -> u32 {
    500
}

impl Default for CalloutTrust {
    fn default() -> Self {
        CalloutTrust {
            server_keys: Vec::new(),
            jwt_ttl_s: default_jwt_ttl_s(),
            max_requests_per_s: default_callout_requests_per_s(),
        }
    }
}

/// Per-session and per-broker limits (spec 2.7 defaults).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_frame: usize,
    pub max_outbound_bytes: usize,
    pub heartbeat_s: u64,
    pub hello_timeout_s: u64,
    pub registry_ttl_s: u64,
    pub max_sessions: usize,
    /// Sessions of one participant open at once on this broker: its share of
    /// `max_sessions`.
    pub max_sessions_per_participant: usize,
    /// Submits of one participant waiting for a budget reservation (each holds its frame);
    /// past it a submit answers `unavailable` with `retry_after_ms`.
    pub max_held_submits: usize,
    /// Connections open at once from one address (IPv6: one /64).
    pub max_connections_per_ip: usize,
    /// Connections open at once that have not logged in yet (a share of `max_sessions`);
    /// a new one past it, or past `max_sessions`, pushes out the oldest of the address
    /// (IPv6: /48) holding the most.
    pub max_waiting_connections: usize,
    pub connects_per_ip_per_s: u32,
    pub connect_burst_per_ip: u32,
    /// Frames a session may send per second, sustained, and at once.
    pub max_frames_per_s: u32,
    pub frame_burst: u32,
    /// Input held and output queued over all connections.
    pub max_buffered_bytes: usize,
    /// Topic subscriptions of all sessions of this broker (each one NATS subscription and
    /// one consumer); past it `subscribe` answers `forbidden`.
    pub max_topic_subscriptions: usize,
    /// Participants a session's `who` and `watch` list per second, sustained (each
    /// counts every participant of the namespace); one second's worth at once.
    pub presence_listed_per_s: u32,
    /// Requests (frames with an `id`) of one session not yet answered; past it a request
    /// answers `rate_limited`. Each may hold one of the broker's NATS request slots.
    pub max_requests_in_flight: usize,
    /// The same over all sessions of one participant on this broker: more sessions do
    /// not buy a participant more of the NATS request slots every session shares.
    pub max_participant_requests_in_flight: usize,
}

impl Limits {
    /// The most the broker queues for one session at once: past `max_outbound_bytes` the
    /// session is closed as a slow consumer, and past `max_buffered_bytes` (all
    /// connections together, which an operator may set lower) shed as the connection
    /// holding the most. An answer past it is refused instead; bursts take a quarter.
    pub fn session_room(&self) -> usize {
        self.max_outbound_bytes.min(self.max_buffered_bytes)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame: 1 << 20,
            max_outbound_bytes: 4 << 20,
            heartbeat_s: 10,
            hello_timeout_s: 5,
            registry_ttl_s: 15,
            max_sessions: 10_000,
            max_sessions_per_participant: 1024,
            max_held_submits: 64,
            max_connections_per_ip: 256,
            max_waiting_connections: 2048,
            connects_per_ip_per_s: 256,
            connect_burst_per_ip: 1024,
            max_frames_per_s: 1_000,
            frame_burst: 2_000,
            max_buffered_bytes: 256 << 20,
            max_topic_subscriptions: 16_384,
            presence_listed_per_s: 20_000,
            max_requests_in_flight: 1024,
            max_participant_requests_in_flight: 4096,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Namespace {
    /// Shared: a session holds its participant's entry (`Session::entry`), so a frame
    /// reads its permissions and policy without looking its name up.
    #[serde(default, deserialize_with = "shared_entries")]
    pub participants: BTreeMap<String, Arc<Participant>>,
    #[serde(default)]
    pub jobs: BTreeMap<String, Job>,
    #[serde(default)]
    pub inbox: Inbox,
    #[serde(default)]
    pub topics: Topics,
    #[serde(default)]
    pub dead_letters: DeadLetters,
    /// Accepts any valid participant name not listed above, with this credential and these
    /// permissions. Development mode uses it; in production every participant is listed.
    #[serde(default, deserialize_with = "shared_entry")]
    pub open: Option<Arc<Participant>>,
    /// The JetStream domain that holds this namespace's streams, consumers and buckets,
    /// used through `$JS.<domain>.API`; `None`: the JetStream the broker is connected to.
    #[serde(default)]
    pub jetstream_domain: Option<String>,
}

fn shared_entries<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, Arc<Participant>>, D::Error> {
    let entries = BTreeMap::<String, Participant>::deserialize(d)?;
    Ok(entries.into_iter().map(|(k, p)| (k, Arc::new(p))).collect())
}

fn shared_entry<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Arc<Participant>>, D::Error> {
    Ok(Option::<Participant>::deserialize(d)?.map(Arc::new))
}

impl Namespace {
    /// Where this namespace's JetStream API lives.
    pub fn js_api(&self) -> ApiPrefix {
        self.jetstream_domain
            .as_deref()
            .and_then(|d| ApiPrefix::domain(d).ok())
            .unwrap_or_default()
    }
}

impl Config {
    /// The JetStream API of namespace `ns` (the local one for an unknown namespace).
    pub fn js_api(&self, ns: &str) -> ApiPrefix {
        self.namespaces
            .get(ns)
            .map(Namespace::js_api)
            .unwrap_or_default()
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Participant {
    /// NKey user public key (`U...`); the participant signs the challenge nonce with it.
    #[serde(default)]
    pub nkey: Option<String>,
    /// SHA-256 of the participant's token, lowercase hex. The token itself is never stored.
    #[serde(default)]
    pub token_sha256: Option<String>,
    #[serde(default)]
    pub permissions: Permissions,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub policy: Option<Policy>,
}

/// Address permissions: each a list of patterns. Names (`send`, `submit`, `serve`) are
/// single tokens, so their patterns are a name or `*`/`>` (any); topic patterns may use
/// `*` for one token and a trailing `>`. An absent list allows nothing.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Permissions {
    #[serde(default)]
    pub send: Vec<String>,
    #[serde(default)]
    pub publish: Vec<String>,
    #[serde(default)]
    pub subscribe: Vec<String>,
    #[serde(default)]
    pub submit: Vec<String>,
    #[serde(default)]
    pub serve: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Job {
    pub lease_s: u64,
    pub offer_ms: u64,
    pub max_attempts: u32,
    /// How long a finished task's record stays in the task store (its `status`, and a
    /// resubmit of its id answered `dup`).
    pub keep_finished_s: u64,
    /// Tasks waiting or running past which a MIG invoke answers `MIG_BACKPRESSURE`.
    pub max_queued: Option<u64>,
    /// The job as a MIG capability.
    pub mig: Option<super::mig::config::Capability>,
}

impl Default for Job {
    fn default() -> Self {
        Job {
            lease_s: 30,
            offer_ms: 5000,
            max_attempts: 3,
            keep_finished_s: 7 * 24 * 3600,
            max_queued: None,
            mig: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Inbox {
    pub ack_wait_s: u64,
    pub inbox_window: u32,
    /// How long the inbox stream keeps a message, acknowledged or not: the stream keeps
    /// by age, not by acknowledgement. 0 keeps every message for good.
    pub max_age_s: u64,
    /// The inbox stream's `max_consumers`: how many participants of the namespace have an
    /// inbox consumer (each keeps its durable once created). Always set, because
    /// nats-server 2.15 caps a stream that sets none at 1,000 consumers.
    pub max_consumers: u64,
}

impl Default for Inbox {
    fn default() -> Self {
        Inbox {
            ack_wait_s: 30,
            inbox_window: 64,
            max_age_s: 0,
            max_consumers: 10_000,
        }
    }
}

/// `AMP_DLQ_<ns>`: tasks failed with no attempts left (mig-nats.md section 6).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DeadLetters {
    /// 0 keeps letters until `max_bytes` pushes the oldest out.
    pub max_age_s: u64,
    /// 0 is unlimited.
    pub max_bytes: u64,
}

impl Default for DeadLetters {
    fn default() -> Self {
        DeadLetters {
            max_age_s: 7 * DAY,
            max_bytes: 256 << 20,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Topics {
    /// 0 keeps events until the stream's other limits remove them.
    pub max_age_s: u64,
    /// 0 is unlimited.
    pub max_bytes: u64,
    /// Subscriptions, plain and durable, one session holds at once.
    pub max_subscriptions_per_session: usize,
    /// Subscriptions, plain and durable, all sessions of one participant hold at once on
    /// a broker: its share of `limits.max_topic_subscriptions`. Also the `subs` of its
    /// NATS JWT, so one direct connection holds no more.
    pub max_subscriptions_per_participant: usize,
    /// Durable subscriptions one participant has in the namespace, counted in JetStream
    /// when a new one would be created.
    pub max_durables_per_participant: usize,
    /// A durable subscription nobody pulls or acks for this long is deleted by JetStream.
    pub durable_inactive_s: u64,
    /// The topics stream's `max_consumers`, set when the broker creates the stream.
    pub max_consumers: u64,
}

impl Default for Topics {
    fn default() -> Self {
        Topics {
            max_age_s: 0,
            max_bytes: 0,
            max_subscriptions_per_session: 64,
            max_subscriptions_per_participant: 1024,
            max_durables_per_participant: 128,
            durable_inactive_s: DAY,
            max_consumers: 10_000,
        }
    }
}

/// Publish-path policy for one participant.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub msgs_per_s: Option<f64>,
    pub burst: Option<u32>,
    pub bytes_per_s: Option<f64>,
    pub tasks_per_window: Option<u64>,
    pub window_s: Option<u64>,
}

/// A configuration problem, with the dotted path of the offending member.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub path: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "{}: {}", self.path, self.problem)
        }
    }
}

impl std::error::Error for ConfigError {}

fn err(path: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.into(),
        problem: problem.into(),
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read(path).map_err(|e| {
            err(
                "",
                format!("cannot read configuration file {}: {e}", path.display()),
            )
        })?;
        Config::parse(&text).map_err(|e| ConfigError {
            path: e.path,
            problem: format!("{} (in {})", e.problem, path.display()),
        })
    }

    /// Development mode: one namespace `dev`, any participant name, the given token
    /// (stored as its SHA-256), every permission.
    pub fn development(token_sha256: String) -> Config {
        let all = || vec![">".to_string()];
        let open = Participant {
            nkey: None,
            token_sha256: Some(token_sha256),
            permissions: Permissions {
                send: all(),
                publish: all(),
                subscribe: all(),
                submit: all(),
                serve: all(),
            },
            labels: BTreeMap::new(),
            policy: None,
        };
        let dev = Namespace {
            open: Some(Arc::new(open)),
            ..Namespace::default()
        };
        Config {
            limits: Limits::default(),
            namespaces: BTreeMap::from([("dev".to_string(), dev)]),
            callout: CalloutTrust::default(),
            mig: Default::default(),
            tls: crate::tls::ListenerTls::default(),
            nats_tls: crate::tls::NatsTls::default(),
            allowed_origins: Vec::new(),
        }
    }

    /// The participant `ns/name`, listed or accepted by the namespace's `open` entry.
    pub fn participant(&self, ns: &str, name: &str) -> Option<&Participant> {
        self.entry(ns, name).map(|p| &**p)
    }

    /// [`participant`](Self::participant), shared.
    pub fn entry(&self, ns: &str, name: &str) -> Option<&Arc<Participant>> {
        let namespace = self.namespaces.get(ns)?;
        namespace.participants.get(name).or(if is_name(name) {
            namespace.open.as_ref()
        } else {
            None
        })
    }

    pub fn parse(text: &[u8]) -> Result<Config, ConfigError> {
        reject_duplicate_members(text)?;
        let config: Config = serde_json::from_slice(text).map_err(|e| {
            err(
                member_at(text, e.line(), e.column()),
                format!("invalid configuration: {e}"),
            )
        })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        super::mig::config::validate_settings(&self.mig)?;
        within("callout.server_keys", self.callout.server_keys.len(), 0, 64)?;
        within("callout.jwt_ttl_s", self.callout.jwt_ttl_s, 60, DAY)?;
        // Each answered request's id is remembered until the end of the second its `exp`
        // names (nats-server's auth timeout ahead, 2 s by default): one second's worth at
        // once and three seconds' worth after it stay within
        // `callout::MAX_REMEMBERED_REQUESTS` at 4,000 a second.
        within(
            "callout.max_requests_per_s",
            self.callout.max_requests_per_s,
            1,
            4_000,
        )?;
        within("allowed_origins", self.allowed_origins.len(), 0, 256)?;
        for (i, key) in self.callout.server_keys.iter().enumerate() {
            if !is_server_key(key) {
                return Err(err(
                    format!("callout.server_keys[{i}]"),
                    "not an NKey server public key (N..., 56 characters)",
                ));
            }
        }
        let l = &self.limits;
        within("limits.max_frame", l.max_frame, 1, 64 * MIB)?;
        within(
            "limits.max_outbound_bytes",
            l.max_outbound_bytes,
            1,
            1024 * MIB,
        )?;
        within("limits.heartbeat_s", l.heartbeat_s, 1, HOUR)?;
        within("limits.hello_timeout_s", l.hello_timeout_s, 1, HOUR)?;
        within("limits.registry_ttl_s", l.registry_ttl_s, 1, DAY)?;
        within("limits.max_sessions", l.max_sessions, 1, 1_000_000)?;
        within(
            "limits.max_sessions_per_participant",
            l.max_sessions_per_participant,
            1,
            1_000_000,
        )?;
        within("limits.max_held_submits", l.max_held_submits, 1, 4096)?;
        within(
            "limits.max_connections_per_ip",
            l.max_connections_per_ip,
            1,
            1_000_000,
        )?;
        within(
            "limits.max_waiting_connections",
            l.max_waiting_connections,
            1,
            1_000_000,
        )?;
        within(
            "limits.connects_per_ip_per_s",
            l.connects_per_ip_per_s,
            1,
            1_000_000,
        )?;
        within(
            "limits.connect_burst_per_ip",
            l.connect_burst_per_ip,
            1,
            1_000_000,
        )?;
        within("limits.max_frames_per_s", l.max_frames_per_s, 1, 1_000_000)?;
        within("limits.frame_burst", l.frame_burst, 1, 1_000_000)?;
        within(
            "limits.max_buffered_bytes",
            l.max_buffered_bytes,
            1,
            64 * 1024 * MIB,
        )?;
        within(
            "limits.max_topic_subscriptions",
            l.max_topic_subscriptions,
            1,
            32_768,
        )?;
        within(
            "limits.max_requests_in_flight",
            l.max_requests_in_flight,
            1,
            65_536,
        )?;
        within(
            "limits.max_participant_requests_in_flight",
            l.max_participant_requests_in_flight,
            1,
            65_536,
        )?;
        within(
            "limits.presence_listed_per_s",
            l.presence_listed_per_s,
            1,
            100_000_000,
        )?;
        for (ns_name, ns) in &self.namespaces {
            let at = format!("namespaces.{ns_name}");
            check_name(&at, ns_name)?;
            check_reply_prefixes(&self.namespaces, ns_name)?;
            let inbox = &ns.inbox;
            within(&format!("{at}.inbox.ack_wait_s"), inbox.ack_wait_s, 1, DAY)?;
            within(
                &format!("{at}.inbox.inbox_window"),
                inbox.inbox_window,
                1,
                65_536,
            )?;
            within(
                &format!("{at}.inbox.max_age_s"),
                inbox.max_age_s,
                0,
                10 * YEAR,
            )?;
            within(
                &format!("{at}.inbox.max_consumers"),
                inbox.max_consumers,
                1,
                1_000_000,
            )?;
            if ns.participants.len() as u64 > inbox.max_consumers {
                return Err(err(
                    format!("{at}.inbox.max_consumers"),
                    format!(
                        "{} is below the namespace's {} participants, whose inboxes would not all be delivered",
                        inbox.max_consumers,
                        ns.participants.len()
                    ),
                ));
            }
            let dlq = &ns.dead_letters;
            within(
                &format!("{at}.dead_letters.max_age_s"),
                dlq.max_age_s,
                0,
                10 * YEAR,
            )?;
            within(
                &format!("{at}.dead_letters.max_bytes"),
                dlq.max_bytes,
                0,
                1 << 50,
            )?;
            let topics = &ns.topics;
            within(
                &format!("{at}.topics.max_age_s"),
                topics.max_age_s,
                0,
                10 * YEAR,
            )?;
            within(
                &format!("{at}.topics.max_bytes"),
                topics.max_bytes,
                0,
                1 << 50,
            )?;
            within(
                &format!("{at}.topics.max_subscriptions_per_session"),
                topics.max_subscriptions_per_session,
                1,
                1024,
            )?;
            within(
                &format!("{at}.topics.max_subscriptions_per_participant"),
                topics.max_subscriptions_per_participant,
                1,
                32_768,
            )?;
            within(
                &format!("{at}.topics.max_durables_per_participant"),
                topics.max_durables_per_participant,
                1,
                10_000,
            )?;
            within(
                &format!("{at}.topics.durable_inactive_s"),
                topics.durable_inactive_s,
                1,
                YEAR,
            )?;
            within(
                &format!("{at}.topics.max_consumers"),
                topics.max_consumers,
                1,
                100_000,
            )?;
            for (job_name, job) in &ns.jobs {
                let at = format!("{at}.jobs.{job_name}");
                check_name(&at, job_name)?;
                within(&format!("{at}.lease_s"), job.lease_s, 1, DAY)?;
                within(&format!("{at}.offer_ms"), job.offer_ms, 1, HOUR * 1000)?;
                within(&format!("{at}.max_attempts"), job.max_attempts, 1, 1000)?;
                within(
                    &format!("{at}.keep_finished_s"),
                    job.keep_finished_s,
                    300,
                    365 * DAY,
                )?;
            }
            for (name, p) in &ns.participants {
                let at = format!("{at}.participants.{name}");
                check_name(&at, name)?;
                p.validate(&at)?;
            }
            if let Some(open) = &ns.open {
                open.validate(&format!("{at}.open"))?;
            }
            if let Some(domain) = &ns.jetstream_domain {
                check_name(&format!("{at}.jetstream_domain"), domain)?;
                // MIG reads task records, queue depths and events through the local
                // JetStream API and watches record changes on local subjects: over a
                // domain it would answer from the wrong store.
                if self.mig.enabled {
                    return Err(err(
                        format!("{at}.jetstream_domain"),
                        "MIG over NATS (mig.enabled) does not serve namespaces on another JetStream domain yet".to_string(),
                    ));
                }
            }
            super::mig::config::validate_namespace(&at, ns)?;
        }
        self.check_unique_credentials()
    }

    /// No two entries (participants or `open` entries, in any namespaces) hold the same
    /// token or NKey: the auth callout finds the participant of a NATS `auth_token` or
    /// NKey login by the credential alone, and a listed participant sharing its
    /// namespace's `open` credential could be anyone holding that.
    fn check_unique_credentials(&self) -> Result<(), ConfigError> {
        let mut holders: std::collections::HashMap<String, String> = Default::default();
        for (ns_name, ns) in &self.namespaces {
            let at = |name: &str| format!("namespaces.{ns_name}.participants.{name}");
            let listed = ns.participants.iter().map(|(name, p)| (at(name), p));
            let open = ns
                .open
                .iter()
                .map(|p| (format!("namespaces.{ns_name}.open"), p));
            for (at, p) in listed.chain(open) {
                // Validated: exactly one of the two, a token's hash in either case.
                let (kind, credential) = match (&p.nkey, &p.token_sha256) {
                    (Some(key), _) => ("NKey", key.clone()),
                    (None, Some(hash)) => ("token", hash.to_ascii_lowercase()),
                    (None, None) => continue,
                };
                if let Some(first) = holders.insert(format!("{kind} {credential}"), at.clone()) {
                    return Err(err(
                        at,
                        format!("holds the same {kind} as {first}; give each its own"),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Participant {
    fn validate(&self, at: &str) -> Result<(), ConfigError> {
        match (&self.nkey, &self.token_sha256) {
            (None, None) => return Err(err(at, "needs a credential: `nkey` or `token_sha256`")),
            (Some(_), Some(_)) => {
                return Err(err(
                    at,
                    "has both `nkey` and `token_sha256`; give exactly one",
                ));
            }
            (Some(key), None) => {
                if !looks_like_user_nkey(key) {
                    return Err(err(
                        format!("{at}.nkey"),
                        "not an NKey user public key (U..., 56 characters)",
                    ));
                }
            }
            (None, Some(hex)) => {
                if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(err(
                        format!("{at}.token_sha256"),
                        "not a SHA-256 hex digest (64 hex digits)",
                    ));
                }
            }
        }
        let perms = &self.permissions;
        for (kind, list, topic) in [
            ("send", &perms.send, false),
            ("publish", &perms.publish, true),
            ("subscribe", &perms.subscribe, true),
            ("submit", &perms.submit, false),
            ("serve", &perms.serve, false),
        ] {
            for (i, pattern) in list.iter().enumerate() {
                let ok = if topic {
                    is_topic_pattern(pattern)
                } else {
                    is_name_pattern(pattern)
                };
                if !ok {
                    return Err(err(
                        format!("{at}.permissions.{kind}[{i}]"),
                        format!(
                            "`{pattern}` is not a valid {} pattern",
                            if topic { "topic" } else { "name" }
                        ),
                    ));
                }
            }
        }
        for key in self.labels.keys() {
            check_name(&format!("{at}.labels"), key)?;
        }
        if let Some(policy) = &self.policy {
            let at = format!("{at}.policy");
            if let Some(rate) = policy.msgs_per_s {
                within_f64(&format!("{at}.msgs_per_s"), rate, 0.001, 1e6)?;
            }
            if let Some(rate) = policy.bytes_per_s {
                within_f64(&format!("{at}.bytes_per_s"), rate, 1.0, 1e12)?;
            }
            if let Some(burst) = policy.burst {
                within(&format!("{at}.burst"), burst, 1, 1_000_000)?;
            }
            if policy.tasks_per_window.is_some() != policy.window_s.is_some() {
                return Err(err(at, "`tasks_per_window` and `window_s` go together"));
            }
            if let Some(tasks) = policy.tasks_per_window {
                within(&format!("{at}.tasks_per_window"), tasks, 0, 1_000_000_000)?;
            }
            if let Some(window) = policy.window_s {
                within(&format!("{at}.window_s"), window, 1, 31 * DAY)?;
            }
        }
        Ok(())
    }
}

/// Refuses a member given twice in one object, anywhere in the file, naming it: serde
/// keeps the last of a map's duplicate keys without a word (a struct's duplicate fields
/// are errors, but without the path). Anything else wrong is left to the parse proper.
fn reject_duplicate_members(text: &[u8]) -> Result<(), ConfigError> {
    let duplicate = std::cell::RefCell::new(None);
    let walk = Members {
        at: String::new(),
        duplicate: &duplicate,
    };
    let _ = serde::de::DeserializeSeed::deserialize(
        walk,
        &mut serde_json::Deserializer::from_slice(text),
    );
    match duplicate.into_inner() {
        Some(at) => Err(err(at, "given twice; each member may appear once")),
        None => Ok(()),
    }
}

/// The path (`a.b[2].c`) of the member serde was reading at `line` and `column` (1-based,
/// the last byte it read, as its errors give them; line 0 is no position): its own message names a misspelt or
/// mistyped member by its last key alone. Scans the text up to there; an object's key is
/// current from the key until the next `,`.
fn member_at(text: &[u8], line: usize, column: usize) -> String {
    enum Frame {
        Object(Option<String>),
        Array(usize),
    }
    if line == 0 {
        return String::new();
    }
    let line_start: usize = text
        .split(|&b| b == b'\n')
        .take(line - 1)
        .map(|l| l.len() + 1)
        .sum();
    // Up to the last byte serde read, not including it: a closing `}` there ends the
    // member the error is about.
    let end = (line_start + column.saturating_sub(1)).min(text.len());
    let mut stack = Vec::new();
    let mut key_next = false;
    let mut i = 0;
    while i < end {
        match text[i] {
            b'"' => {
                let start = i;
                i += 1;
                while i < text.len() && text[i] != b'"' {
                    i += if text[i] == b'\\' { 2 } else { 1 };
                }
                if std::mem::take(&mut key_next)
                    && let Some(Frame::Object(key)) = stack.last_mut()
                {
                    *key = text
                        .get(start..=i)
                        .and_then(|quoted| serde_json::from_slice(quoted).ok());
                }
            }
            b'{' => {
                stack.push(Frame::Object(None));
                key_next = true;
            }
            b'[' => stack.push(Frame::Array(0)),
            b'}' | b']' => {
                stack.pop();
                key_next = false;
            }
            b',' => match stack.last_mut() {
                Some(Frame::Object(key)) => {
                    *key = None;
                    key_next = true;
                }
                Some(Frame::Array(n)) => *n += 1,
                None => {}
            },
            _ => {}
        }
        i += 1;
    }
    let mut path = String::new();
    for frame in stack {
        match frame {
            Frame::Object(Some(key)) if path.is_empty() => path = key,
            Frame::Object(Some(key)) => path = format!("{path}.{key}"),
            Frame::Object(None) => {}
            Frame::Array(n) => path = format!("{path}[{n}]"),
        }
    }
    path
}

/// A walk over any JSON value at path `at` that stops at the first object member seen
/// twice, leaving its path in `duplicate`.
struct Members<'a> {
    at: String,
    duplicate: &'a std::cell::RefCell<Option<String>>,
}

impl<'de> serde::de::DeserializeSeed<'de> for Members<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Members<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        loop {
            let element = Members {
                at: format!("{}[{i}]", self.at),
                duplicate: self.duplicate,
            };
            if seq.next_element_seed(element)?.is_none() {
                return Ok(());
            }
            i += 1;
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut keys = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            let at = if self.at.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.at)
            };
            if !keys.insert(key) {
                *self.duplicate.borrow_mut() = Some(at);
                return Err(serde::de::Error::custom("duplicate member"));
            }
            map.next_value_seed(Members {
                at,
                duplicate: self.duplicate,
            })?;
        }
        Ok(())
    }
}

const MIB: u64 = 1 << 20;
const HOUR: u64 = 3600;
const DAY: u64 = 24 * HOUR;
const YEAR: u64 = 365 * DAY;

/// Checks a numeric member against its inclusive bounds. Every duration, size and count in
/// the file goes through here (or [`within_f64`]), so an absurd value stops the broker at
/// load, naming the member, instead of overflowing time or size arithmetic in a session.
pub fn within<T: TryInto<u64>>(
    path: &str,
    value: T,
    min: u64,
    max: u64,
) -> Result<(), ConfigError> {
    // A value that does not fit u64 (only possible for u128-like types) is above any bound.
    let value = value.try_into().unwrap_or(u64::MAX);
    if value < min {
        Err(err(path, format!("must be at least {min}")))
    } else if value > max {
        Err(err(path, format!("must be at most {max}")))
    } else {
        Ok(())
    }
}

/// [`within`] for rates: also refuses NaN and infinities.
pub fn within_f64(path: &str, value: f64, min: f64, max: f64) -> Result<(), ConfigError> {
    if !value.is_finite() || value < min {
        Err(err(path, format!("must be a number of at least {min}")))
    } else if value > max {
        Err(err(path, format!("must be at most {max}")))
    } else {
        Ok(())
    }
}

/// `^[A-Za-z0-9_-]{1,64}$`, the spec's alphabet for namespaces, names and jobs.
/// A participant's NATS reply prefix is `_INBOX_<ns>_<name>` (spec section 3). Two
/// prefixes can only be equal across namespaces when one namespace is another's name plus
/// `_` (`acme` + `eu_x` and `acme_eu` + `x`), so such pairs are refused: a participant must
/// never be able to subscribe to another's replies.
fn check_reply_prefixes(
    namespaces: &BTreeMap<String, Namespace>,
    ns: &str,
) -> Result<(), ConfigError> {
    let shadowed = namespaces.keys().find(|other| {
        other
            .strip_prefix(ns)
            .is_some_and(|rest| rest.starts_with('_'))
    });
    match shadowed {
        Some(other) => Err(err(
            format!("namespaces.{other}"),
            format!(
                "clashes with namespace `{ns}`: NATS reply prefixes `_INBOX_{ns}_<name>` of the two \
                 could be equal; rename one so that neither is the other's name followed by `_`"
            ),
        )),
        None => Ok(()),
    }
}

pub fn is_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn check_name(at: &str, name: &str) -> Result<(), ConfigError> {
    if is_name(name) {
        Ok(())
    } else {
        Err(err(
            at,
            format!("`{name}` is not a valid name (1-64 of A-Z a-z 0-9 _ -)"),
        ))
    }
}

fn is_name_pattern(p: &str) -> bool {
    p == "*" || p == ">" || is_name(p)
}

/// A topic pattern: 1..16 tokens of the name alphabet or `*`, optionally ending in `>`.
pub fn is_topic_pattern(p: &str) -> bool {
    let tokens: Vec<&str> = p.split('.').collect();
    if tokens.is_empty() || tokens.len() > 16 {
        return false;
    }
    let last = tokens.len() - 1;
    tokens
        .iter()
        .enumerate()
        .all(|(i, t)| *t == "*" || (*t == ">" && i == last) || is_name(t))
}

/// A server's public NKey, as its INFO `server_id` and the `iss` of its callout requests.
pub fn is_server_key(key: &str) -> bool {
    crate::nkeys::is_valid_public_key(key, crate::nkeys::KeyKind::Server)
}

fn looks_like_user_nkey(key: &str) -> bool {
    key.len() == 56
        && key.starts_with('U')
        && key.bytes().all(|b| matches!(b, b'A'..=b'Z' | b'2'..=b'7'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4";

    fn parse(json: &str) -> Result<Config, ConfigError> {
        Config::parse(json.as_bytes())
    }

    #[test]
    fn mig_is_refused_beside_a_namespace_on_another_jetstream_domain() {
        let e =
            parse(r#"{"mig":{"enabled":true},"namespaces":{"acme":{"jetstream_domain":"hub"}}}"#)
                .expect_err("refused");
        assert!(
            e.to_string().contains("namespaces.acme.jetstream_domain"),
            "{e}"
        );
        parse(r#"{"mig":{"enabled":true},"namespaces":{"acme":{}}}"#).expect("no domain: fine");
        parse(r#"{"namespaces":{"acme":{"jetstream_domain":"hub"}}}"#).expect("no MIG: fine");
    }

    #[test]
    fn applies_spec_defaults_to_omitted_sections() {
        let c = parse(&format!(
            r#"{{"namespaces":{{"acme":{{"participants":{{"w1":{{"nkey":"{KEY}"}}}},"jobs":{{"render":{{}}}}}}}}}}"#
        ))
        .expect("valid");
        assert_eq!(c.limits.max_frame, 1 << 20);
        assert_eq!(c.limits.heartbeat_s, 10);
        assert_eq!(c.limits.registry_ttl_s, 15);
        let ns = &c.namespaces["acme"];
        assert_eq!(ns.inbox.ack_wait_s, 30);
        assert_eq!(ns.inbox.inbox_window, 64);
        assert_eq!(ns.jobs["render"].lease_s, 30);
        assert_eq!(ns.jobs["render"].offer_ms, 5000);
        assert_eq!(ns.jobs["render"].max_attempts, 3);
        assert!(ns.participants["w1"].permissions.send.is_empty());
    }

    #[test]
    fn names_the_member_of_each_semantic_problem() {
        let cases = [
            (r#"{"namespaces":{"a b":{}}}"#.to_string(), "namespaces.a b"),
            (
                r#"{"namespaces":{"acme":{"participants":{"w1":{}}}}}"#.to_string(),
                "namespaces.acme.participants.w1",
            ),
            (
                r#"{"namespaces":{"acme":{"participants":{"w1":{"nkey":"SU123"}}}}}"#.to_string(),
                "namespaces.acme.participants.w1.nkey",
            ),
            (
                r#"{"namespaces":{"acme":{"participants":{"w1":{"token_sha256":"xyz"}}}}}"#
                    .to_string(),
                "namespaces.acme.participants.w1.token_sha256",
            ),
            (
                format!(
                    r#"{{"namespaces":{{"acme":{{"participants":{{"w1":{{"nkey":"{KEY}","permissions":{{"publish":["a.>.b"]}}}}}}}}}}}}"#
                ),
                "namespaces.acme.participants.w1.permissions.publish[0]",
            ),
            (
                r#"{"namespaces":{"acme":{"jobs":{"render":{"lease_s":0}}}}}"#.to_string(),
                "namespaces.acme.jobs.render.lease_s",
            ),
            (
                r#"{"limits":{"max_frame":0}}"#.to_string(),
                "limits.max_frame",
            ),
            (
                r#"{"limits":{"max_frames_per_s":1000001}}"#.to_string(),
                "limits.max_frames_per_s",
            ),
            (
                r#"{"limits":{"frame_burst":0}}"#.to_string(),
                "limits.frame_burst",
            ),
            (
                r#"{"limits":{"max_connections_per_ip":18446744073709551615}}"#.to_string(),
                "limits.max_connections_per_ip",
            ),
            (
                r#"{"limits":{"max_buffered_bytes":68719476737}}"#.to_string(),
                "limits.max_buffered_bytes",
            ),
        ];
        for (json, path) in cases {
            let e = parse(&json).expect_err(&json);
            assert_eq!(e.path, path, "{json}: {e}");
        }
    }

    #[test]
    fn refuses_values_beyond_their_bound_naming_the_member() {
        let huge = u64::MAX;
        let job = |m: &str| format!(r#"{{"namespaces":{{"acme":{{"jobs":{{"r":{{{m}}}}}}}}}}}"#);
        let policy = |m: &str| {
            format!(
                r#"{{"namespaces":{{"acme":{{"participants":{{"w1":{{"nkey":"{KEY}","policy":{{{m}}}}}}}}}}}}}"#
            )
        };
        let cases = [
            (
                format!(r#"{{"limits":{{"hello_timeout_s":{huge}}}}}"#),
                "limits.hello_timeout_s",
                "at most 3600",
            ),
            (
                format!(r#"{{"limits":{{"heartbeat_s":{huge}}}}}"#),
                "limits.heartbeat_s",
                "at most 3600",
            ),
            (
                format!(r#"{{"limits":{{"registry_ttl_s":{huge}}}}}"#),
                "limits.registry_ttl_s",
                "at most 86400",
            ),
            (
                format!(r#"{{"limits":{{"max_frame":{huge}}}}}"#),
                "limits.max_frame",
                "at most 67108864",
            ),
            (
                format!(r#"{{"limits":{{"max_outbound_bytes":{huge}}}}}"#),
                "limits.max_outbound_bytes",
                "at most",
            ),
            (
                format!(r#"{{"limits":{{"max_sessions":{huge}}}}}"#),
                "limits.max_sessions",
                "at most 1000000",
            ),
            (
                format!(r#"{{"limits":{{"max_sessions_per_participant":{huge}}}}}"#),
                "limits.max_sessions_per_participant",
                "at most 1000000",
            ),
            (
                format!(r#"{{"namespaces":{{"acme":{{"inbox":{{"max_consumers":{huge}}}}}}}}}"#),
                "namespaces.acme.inbox.max_consumers",
                "at most 1000000",
            ),
            (
                r#"{"namespaces":{"acme":{"inbox":{"max_consumers":0}}}}"#.to_string(),
                "namespaces.acme.inbox.max_consumers",
                "at least 1",
            ),
            (
                format!(
                    r#"{{"namespaces":{{"acme":{{"inbox":{{"max_consumers":1}},"participants":{{"w1":{{"nkey":"{KEY}"}},"w2":{{"nkey":"{KEY}"}}}}}}}}}}"#
                ),
                "namespaces.acme.inbox.max_consumers",
                "1 is below the namespace's 2 participants",
            ),
            (
                format!(r#"{{"namespaces":{{"acme":{{"inbox":{{"ack_wait_s":{huge}}}}}}}}}"#),
                "namespaces.acme.inbox.ack_wait_s",
                "at most 86400",
            ),
            (
                format!(
                    r#"{{"namespaces":{{"acme":{{"inbox":{{"inbox_window":{}}}}}}}}}"#,
                    u32::MAX
                ),
                "namespaces.acme.inbox.inbox_window",
                "at most 65536",
            ),
            (
                format!(r#"{{"namespaces":{{"acme":{{"inbox":{{"max_age_s":{huge}}}}}}}}}"#),
                "namespaces.acme.inbox.max_age_s",
                "at most",
            ),
            (
                format!(r#"{{"namespaces":{{"acme":{{"topics":{{"max_age_s":{huge}}}}}}}}}"#),
                "namespaces.acme.topics.max_age_s",
                "at most",
            ),
            (
                format!(r#"{{"namespaces":{{"acme":{{"topics":{{"max_bytes":{huge}}}}}}}}}"#),
                "namespaces.acme.topics.max_bytes",
                "at most",
            ),
            (
                job(&format!(r#""lease_s":{huge}"#)),
                "namespaces.acme.jobs.r.lease_s",
                "at most 86400",
            ),
            (
                job(&format!(r#""offer_ms":{huge}"#)),
                "namespaces.acme.jobs.r.offer_ms",
                "at most 3600000",
            ),
            (
                job(r#""max_attempts":4294967295"#),
                "namespaces.acme.jobs.r.max_attempts",
                "at most 1000",
            ),
            (
                policy(r#""msgs_per_s":1e300"#),
                "namespaces.acme.participants.w1.policy.msgs_per_s",
                "at most",
            ),
            (
                policy(r#""msgs_per_s":1e-300"#),
                "namespaces.acme.participants.w1.policy.msgs_per_s",
                "at least",
            ),
            (
                policy(r#""bytes_per_s":1e300"#),
                "namespaces.acme.participants.w1.policy.bytes_per_s",
                "at most",
            ),
            (
                policy(r#""msgs_per_s":5,"burst":4294967295"#),
                "namespaces.acme.participants.w1.policy.burst",
                "at most",
            ),
            (
                policy(&format!(r#""tasks_per_window":{huge},"window_s":60"#)),
                "namespaces.acme.participants.w1.policy.tasks_per_window",
                "at most",
            ),
            (
                policy(&format!(r#""tasks_per_window":5,"window_s":{huge}"#)),
                "namespaces.acme.participants.w1.policy.window_s",
                "at most",
            ),
        ];
        for (json, path, text) in cases {
            let e = parse(&json).expect_err(&json);
            assert_eq!(e.path, path, "{json}: {e}");
            assert!(e.problem.contains(text), "{json}: {e}");
        }
        let at_bounds = r#"{"limits":{"hello_timeout_s":3600,"heartbeat_s":3600,"registry_ttl_s":86400,"max_frame":67108864},"namespaces":{"acme":{"jobs":{"r":{"lease_s":86400,"offer_ms":3600000,"max_attempts":1000}},"inbox":{"ack_wait_s":86400,"inbox_window":65536}}}}"#;
        parse(at_bounds).expect("values at their bounds are accepted");
    }

    #[test]
    fn callout_server_keys_must_be_server_public_keys() {
        let server = crate::nkeys::KeyPair::generate(crate::nkeys::KeyKind::Server)
            .expect("key")
            .public_key();
        let c = parse(&format!(r#"{{"callout":{{"server_keys":["{server}"]}}}}"#)).expect("valid");
        assert_eq!(c.callout.server_keys, std::slice::from_ref(&server));
        let e = parse(&format!(
            r#"{{"callout":{{"server_keys":["{server}","{KEY}"]}}}}"#
        ))
        .expect_err("a user key");
        assert_eq!(e.path, "callout.server_keys[1]", "{e}");
        assert_eq!(c.callout.jwt_ttl_s, 3600);
        let e = parse(r#"{"callout":{"jwt_ttl_s":30}}"#).expect_err("too short");
        assert_eq!(e.path, "callout.jwt_ttl_s", "{e}");
        assert_eq!(c.callout.max_requests_per_s, 500);
        for rate in [0, 4001] {
            let e = parse(&format!(r#"{{"callout":{{"max_requests_per_s":{rate}}}}}"#))
                .expect_err("out of bounds");
            assert_eq!(e.path, "callout.max_requests_per_s", "{e}");
        }
    }

    #[test]
    fn rejects_unknown_members_and_bad_json_with_serde_position() {
        let e = parse(r#"{"limits":{"max_frames":5}}"#).expect_err("typo");
        assert!(e.problem.contains("unknown field `max_frames`"), "{e}");
        let e = parse("{").expect_err("truncated");
        assert!(e.problem.contains("line 1"), "{e}");
    }

    #[test]
    fn namespaces_whose_reply_prefixes_could_collide_are_refused() {
        let e = parse(r#"{"namespaces": {"acme": {}, "acme_eu": {}}}"#).expect_err("clash");
        assert_eq!(e.path, "namespaces.acme_eu");
        assert!(e.problem.contains("`acme`"), "{e}");
        assert!(parse(r#"{"namespaces": {"acme": {}, "acme-eu": {}, "acmeeu": {}}}"#).is_ok());
    }

    #[test]
    fn development_mode_accepts_any_valid_name_in_dev_only() {
        let c = Config::development("ab".repeat(32));
        assert!(
            c.participant("dev", "anyone")
                .is_some_and(|p| p.permissions.send == [">"])
        );
        assert!(c.participant("dev", "not valid").is_none());
        assert!(c.participant("other", "anyone").is_none());
    }

    #[test]
    fn topic_patterns_follow_the_spec_alphabet() {
        for ok in [
            "orders.eu.created",
            "orders.*.created",
            "orders.>",
            ">",
            "*",
        ] {
            assert!(is_topic_pattern(ok), "{ok}");
        }
        for bad in [
            "",
            "orders..x",
            "orders.>.x",
            "orders.e u",
            "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q",
            "ord*",
        ] {
            assert!(!is_topic_pattern(bad), "{bad}");
        }
    }

    #[test]
    fn held_submits_default_to_64_and_are_bounded() {
        assert_eq!(parse("{}").expect("empty").limits.max_held_submits, 64);
        for (value, problem) in [("0", "at least 1"), ("4097", "at most 4096")] {
            let e =
                parse(&format!(r#"{{"limits":{{"max_held_submits":{value}}}}}"#)).expect_err(value);
            assert_eq!(e.path, "limits.max_held_submits");
            assert!(e.problem.contains(problem), "{e}");
        }
    }

    #[test]
    fn topic_caps_have_defaults_and_bounds_named_at_load() {
        let c = parse(r#"{"namespaces":{"acme":{}}}"#).expect("defaults");
        let t = &c.namespaces["acme"].topics;
        assert_eq!(
            (
                t.max_subscriptions_per_session,
                t.max_subscriptions_per_participant,
                t.max_durables_per_participant,
                t.durable_inactive_s,
                t.max_consumers
            ),
            (64, 1024, 128, 86_400, 10_000)
        );
        assert_eq!(c.limits.max_topic_subscriptions, 16_384);
        for (member, bad) in [
            ("max_subscriptions_per_session", "1025"),
            ("max_subscriptions_per_participant", "32769"),
            ("max_subscriptions_per_participant", "0"),
            ("max_durables_per_participant", "10001"),
            ("durable_inactive_s", "31536001"),
            ("max_consumers", "100001"),
            ("max_consumers", "0"),
        ] {
            let json = format!(r#"{{"namespaces":{{"acme":{{"topics":{{"{member}":{bad}}}}}}}}}"#);
            let e = parse(&json).expect_err(&json);
            assert_eq!(e.path, format!("namespaces.acme.topics.{member}"), "{e}");
        }
        let e = parse(r#"{"limits":{"max_topic_subscriptions":32769}}"#).expect_err("too many");
        assert_eq!(e.path, "limits.max_topic_subscriptions");
    }

    #[test]
    fn no_two_entries_may_hold_the_same_credential() {
        // The callout finds the participant of a NATS `auth_token` by its hash alone and
        // of an NKey by the key alone: two holding the same one were accepted, and a
        // token login came in as the last of them, an NKey login as the first.
        let hash = "ab".repeat(32);
        let token = |h: &str| format!(r#"{{"token_sha256":"{h}"}}"#);
        let nkey = format!(r#"{{"nkey":"{KEY}"}}"#);
        let cases = [
            (
                format!(
                    r#"{{"acme":{{"participants":{{"a":{t},"b":{t}}}}}}}"#,
                    t = token(&hash)
                ),
                "namespaces.acme.participants.b",
                "namespaces.acme.participants.a",
            ),
            (
                format!(
                    r#"{{"acme":{{"participants":{{"a":{}}}}},"beta":{{"participants":{{"a":{}}}}}}}"#,
                    token(&hash),
                    token(&hash.to_uppercase())
                ),
                "namespaces.beta.participants.a",
                "namespaces.acme.participants.a",
            ),
            (
                format!(r#"{{"acme":{{"participants":{{"a":{nkey},"b":{nkey}}}}}}}"#),
                "namespaces.acme.participants.b",
                "namespaces.acme.participants.a",
            ),
            (
                format!(
                    r#"{{"acme":{{"participants":{{"a":{t}}},"open":{t}}}}}"#,
                    t = token(&hash)
                ),
                "namespaces.acme.open",
                "namespaces.acme.participants.a",
            ),
        ];
        for (namespaces, second, first) in cases {
            let e = parse(&format!(r#"{{"namespaces":{namespaces}}}"#)).expect_err(second);
            assert_eq!(e.path, second, "{e}");
            assert!(e.problem.contains(first), "{e}");
        }
        let distinct = format!(
            r#"{{"namespaces":{{"acme":{{"participants":{{"a":{},"b":{nkey}}},"open":{}}}}}}}"#,
            token(&hash),
            token(&"cd".repeat(32))
        );
        parse(&distinct).expect("distinct credentials");
    }

    #[test]
    fn a_member_given_twice_is_refused_naming_it() {
        // serde keeps the last of a map's duplicate keys: a participant listed twice
        // (the second pasted from another, its permissions meant for that one) loaded
        // silently as one, and so did namespaces, jobs and labels.
        let p = format!(r#"{{"nkey":"{KEY}"}}"#);
        let cases = [
            (
                format!(r#"{{"namespaces":{{"acme":{{"participants":{{"a":{p},"a":{p}}}}}}}}}"#),
                "namespaces.acme.participants.a",
            ),
            (
                r#"{"namespaces":{"acme":{},"acme":{}}}"#.to_string(),
                "namespaces.acme",
            ),
            (
                r#"{"namespaces":{"acme":{"jobs":{"render":{},"render":{"lease_s":5}}}}}"#
                    .to_string(),
                "namespaces.acme.jobs.render",
            ),
            (
                format!(
                    r#"{{"namespaces":{{"acme":{{"participants":{{"a":{{"nkey":"{KEY}","labels":{{"tier":"x","tier":"y"}}}}}}}}}}}}"#
                ),
                "namespaces.acme.participants.a.labels.tier",
            ),
            (
                r#"{"limits":{"max_frame":1,"max_frame":2}}"#.to_string(),
                "limits.max_frame",
            ),
            // The same key spelled with an escape.
            (
                r#"{"namespaces":{"acme":{},"\u0061cme":{}}}"#.to_string(),
                "namespaces.acme",
            ),
            (
                r#"{"allowed_origins":[],"mig":{"enabled":false},"allowed_origins":[]}"#
                    .to_string(),
                "allowed_origins",
            ),
        ];
        for (json, path) in cases {
            let e = parse(&json).expect_err(path);
            assert_eq!(e.path, path, "{e}");
            assert!(e.problem.contains("twice"), "{e}");
        }
        let e = parse(r#"{"namespaces":{"acme":{}}"#).expect_err("truncated");
        assert!(e.problem.contains("invalid configuration"), "{e}");
    }
}
