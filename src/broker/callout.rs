//! The NATS auth callout service (ADR-26): nats-server sends each connecting client's
//! credentials, as an authorization request JWT signed by the server, to
//! `$SYS.REQ.USER.AUTH`; the broker checks them against the same participant store as
//! `hello` and answers with an authorization response JWT signed by its issuing account,
//! carrying either a scoped user JWT ([`super::scoped_jwt`]) or an error.
//!
//! Credentials a NATS client may present (in its CONNECT):
//!
//! - `user` = `ns/name` (or `ns.name`) and `pass` = the participant's token;
//! - `auth_token` = the participant's token (found by its SHA-256);
//! - `nkey` = the participant's NKey and `sig` = its signature of the server's nonce;
//! - `jwt` = a scoped user JWT this broker issued (from `hello`), with `sig` over the nonce
//!   by the JWT's user key, or alone when the JWT is a bearer token. nats-server passes a
//!   client's `jwt` on only in operator mode; in configuration mode a bearer JWT is
//!   presented as the `auth_token` instead.
//!
//! The user JWT is always rebuilt from the current configuration, never copied from a
//! presented JWT. Failures are throttled like `hello` (per client host and participant),
//! and the error sent back never says which part was wrong. At most
//! `callout.max_requests_per_s` requests are looked at; past it the reply is empty.
//!
//! Sans-IO: [`Callout::handle`] takes the request message and returns the reply payload;
//! the runtime subscribes to [`AUTH_CALLOUT_SUBJECT`] and publishes the payload to the
//! request's reply subject. Encrypted requests (an `xkey` in the server's callout
//! configuration) are not supported and are refused.
//!
//! A request is answered only when it is signed by a trusted server key (the pinned keys,
//! or without pins the keys of the servers the broker's own connection has met), carries an
//! `exp` at most [`MAX_REQUEST_AHEAD_S`] ahead, and is the first within its lifetime for its
//! `user_nkey`: anyone able to publish on the callout subject could otherwise sign requests
//! with a key of their own or replay a captured one. The request id is the `user_nkey`, not
//! the `jti`: nats-server 2.15 gives every request signed within one second the same `jti`,
//! while it generates a fresh `user_nkey` per connecting client and binds the response to it.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE, URL_SAFE_NO_PAD};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::config::{Config, Participant};
use super::mig::config::readable_dead_letters;
use super::rate_limit::DebtBucket;
use super::scoped_jwt::{self, UserGrant, VerifyError};
use super::throttle::{HelloThrottle, ThrottleConfig, Verdict};
use crate::jwt::{self, Claims, JwtError};
use crate::nkeys::{KeyKind, KeyPair, PublicKey};
use crate::proto::headers::HeaderMap;

pub const AUTH_CALLOUT_SUBJECT: &str = "$SYS.REQ.USER.AUTH";
/// The queue group brokers serving one server's callout share, so each request is
/// answered (and its signatures checked and made) by one of them, not by every one.
pub const AUTH_CALLOUT_QUEUE: &str = "amp_callout";
/// The `aud` of every authorization request.
pub const AUTH_REQUEST_AUDIENCE: &str = "nats-authorization-request";
/// Present when the server encrypted the request.
pub const SERVER_XKEY_HEADER: &str = "Nats-Server-Xkey";

/// The error text sent back for every refused credential.
const REFUSED: &str = "authentication failed";

/// How far ahead a request's `exp` may be; nats-server sets it a few seconds ahead (its
/// auth timeout), so this only refuses requests built to be replayable for long.
pub const MAX_REQUEST_AHEAD_S: u64 = 300;
/// Request ids remembered for replay detection. Each is kept until its request expires
/// (at most [`MAX_REQUEST_AHEAD_S`]); past this many live ids new requests are refused.
pub const MAX_REMEMBERED_REQUESTS: usize = 16_384;
/// Server keys learned from the broker's own connection (without pins).
const MAX_LEARNED_SERVERS: usize = 64;

#[derive(Debug, Clone)]
pub struct CalloutConfig {
    /// The account whose public key is the `issuer` in the server's `auth_callout` block.
    pub issuer: KeyPair,
    /// The account the user is placed in (the user JWT's `aud`); `$G` without accounts.
    pub account: String,
    /// Pinned server keys (`N...`): when not empty, only requests signed by one of these
    /// are answered. When empty, the keys of servers the broker's own connection has met.
    pub trusted_servers: Vec<String>,
    pub throttle: ThrottleConfig,
}

impl CalloutConfig {
    pub fn new(issuer: KeyPair) -> CalloutConfig {
        CalloutConfig {
            issuer,
            account: "$G".to_string(),
            trusted_servers: Vec::new(),
            throttle: ThrottleConfig::default(),
        }
    }
}

/// What the broker made of one request (for its log and metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Authorized as this participant (`ns/name`).
    Authorized { participant: String },
    /// The client's credential was refused.
    Refused {
        participant: Option<String>,
        reason: String,
    },
    /// The request itself was unusable (not a server-signed authorization request); the
    /// reply is empty, which the server takes as a refusal.
    BadRequest { reason: String },
    /// Past `callout.max_requests_per_s`: not looked at, and the reply is empty.
    Shed,
}

/// The reply to publish, and what happened.
#[derive(Debug, Clone)]
pub struct Reply {
    pub payload: Vec<u8>,
    pub outcome: Outcome,
}

#[derive(Debug, Default, Deserialize)]
struct Request {
    #[serde(default)]
    server_id: ServerId,
    #[serde(default)]
    user_nkey: String,
    #[serde(default)]
    client_info: ClientInfo,
    #[serde(default)]
    connect_opts: ConnectOpts,
}

#[derive(Debug, Default, Deserialize)]
struct ServerId {
    #[serde(default)]
    id: String,
}

#[derive(Debug, Default, Deserialize)]
struct ClientInfo {
    #[serde(default)]
    host: String,
    #[serde(default)]
    nonce: String,
}

#[derive(Debug, Default, Deserialize)]
struct ConnectOpts {
    #[serde(default)]
    jwt: String,
    #[serde(default)]
    nkey: String,
    #[serde(default)]
    sig: String,
    #[serde(default)]
    auth_token: String,
    #[serde(default)]
    user: String,
    #[serde(default)]
    pass: String,
}

#[derive(Debug)]
pub struct Callout {
    config: CalloutConfig,
    throttle: HelloThrottle,
    /// Server keys seen in the INFO of the broker's own connections (the main one and the
    /// callout's ingress, which may be on different servers of a cluster); trusted when
    /// nothing is pinned.
    learned_servers: Vec<String>,
    /// `user_nkey` of each answered request that has not expired yet, with its `exp`.
    seen: HashMap<String, u64>,
    /// Requests looked at, at most `callout.max_requests_per_s`; from the first one on.
    budget: Option<DebtBucket>,
}

impl Callout {
    pub fn new(config: CalloutConfig) -> Callout {
        Callout {
            throttle: HelloThrottle::new(config.throttle.clone()),
            config,
            learned_servers: Vec::new(),
            seen: HashMap::new(),
            budget: None,
        }
    }

    /// Trusts `server_id` (from the INFO of one of the broker's own connections; a server's
    /// id is its public key) while no server key is pinned. Anything not a server key is
    /// ignored.
    pub fn learn_server(&mut self, server_id: &str) {
        if self.learned_servers.iter().any(|k| k == server_id)
            || !crate::nkeys::is_valid_public_key(server_id, KeyKind::Server)
        {
            return;
        }
        if self.learned_servers.len() >= MAX_LEARNED_SERVERS {
            self.learned_servers.remove(0);
        }
        self.learned_servers.push(server_id.to_string());
    }

    fn trusts(&self, server_key: &str) -> bool {
        let trusted = if self.config.trusted_servers.is_empty() {
            &self.learned_servers
        } else {
            &self.config.trusted_servers
        };
        trusted.iter().any(|k| k == server_key)
    }

    /// Remembers a request id until `exp`; false when it was seen before (a replay) or
    /// when too many live ids are remembered to take another.
    fn remember(&mut self, id: &str, exp: u64, unix_s: u64) -> Result<(), String> {
        if self.seen.contains_key(id) {
            return Err("replayed authorization request".into());
        }
        if self.seen.len() >= MAX_REMEMBERED_REQUESTS {
            self.seen.retain(|_, until| still_awaited(*until, unix_s));
            if self.seen.len() >= MAX_REMEMBERED_REQUESTS {
                return Err("too many authorization requests in flight".into());
            }
        }
        self.seen.insert(id.to_string(), exp);
        Ok(())
    }

    /// The issuing account's public key, for the server's `auth_callout { issuer }`.
    pub fn issuer_public_key(&self) -> String {
        self.config.issuer.public_key()
    }

    /// Answers one authorization request message. `now` drives throttling, `unix_s` is
    /// the wall clock for JWT times.
    pub fn handle(
        &mut self,
        participants: &Config,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        now: Instant,
        unix_s: u64,
    ) -> Reply {
        let bad = |reason: String| Reply {
            payload: Vec::new(),
            outcome: Outcome::BadRequest { reason },
        };
        // Before anything that costs: an empty reply is a refusal to the server, signed
        // by nobody. Not answering at all would also do, but the server would hold the
        // client for its whole auth timeout first.
        let rate = f64::from(participants.callout.max_requests_per_s);
        let budget = self.budget.get_or_insert_with(|| DebtBucket::new(now));
        if budget.take(1.0, rate, now).is_err() {
            return Reply {
                payload: Vec::new(),
                outcome: Outcome::Shed,
            };
        }
        if headers.is_some_and(|h| h.get(SERVER_XKEY_HEADER).is_some()) {
            return bad("encrypted authorization requests are not supported".into());
        }
        let request = match self.decode_request(payload, unix_s) {
            Ok(r) => r,
            Err(reason) => return bad(reason),
        };
        // A host that is no address (none reported) shares one key, so its guesses are
        // still counted, and its participant's bucket still applies.
        let ip = request
            .client_info
            .host
            .parse()
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        // A token is a guess: while its address or name is throttled it is not even
        // checked, so guessing stays slow. A signature of this connection's nonce, or a
        // JWT this broker signed, is no guess: it is checked and a good one passes, so
        // failures in a participant's name, from anywhere, cannot lock its NKey or JWT
        // logins out (as `hello` treats an NKey proof).
        let presented = Presented::of(&request.connect_opts);
        let guess = matches!(presented, Presented::User | Presented::Token);
        if guess {
            // An `auth_token` names its participant only once it is checked.
            let (verdict, claimed) = match presented {
                Presented::User => {
                    let name = claimed_name(&request);
                    (self.throttle.check(ip, &name, now), Some(name))
                }
                _ => (self.throttle.check_address(ip, now), None),
            };
            if let Verdict::Delay(_) = verdict {
                return self.refuse(&request, unix_s, claimed, "throttled".into());
            }
        }
        let verdict = self.check(participants, &request, presented, unix_s);
        match verdict {
            Checked::Accepted { ns, name, until } => {
                let participant = format!("{ns}/{name}");
                if guess && let Verdict::Delay(_) = self.throttle.check(ip, &participant, now) {
                    return self.refuse(&request, unix_s, Some(participant), "throttled".into());
                }
                self.throttle.record_success(ip, &participant, now);
                let Some(p) = lookup(participants, &ns, &name) else {
                    return self.refuse(&request, unix_s, None, "vanished".into());
                };
                let dlq = readable_dead_letters(participants, &ns, p);
                let grant = UserGrant {
                    ns: &ns,
                    name: &name,
                    permissions: &p.permissions,
                    user_key: &request.user_nkey,
                    issued_at: unix_s,
                    ttl_s: issued_ttl(participants.callout.jwt_ttl_s, until, unix_s),
                    bearer: false,
                    audience: Some(&self.config.account),
                    mig: dlq.as_deref(),
                    max_subscriptions: scoped_jwt::subscription_cap(participants, &ns),
                };
                count(Work::Ed25519);
                match scoped_jwt::issue(&self.config.issuer, &grant) {
                    Ok(user_jwt) => Reply {
                        payload: self.response(&request, unix_s, Ok(&user_jwt)),
                        outcome: Outcome::Authorized { participant },
                    },
                    Err(e) => self.refuse(&request, unix_s, Some(participant), e.to_string()),
                }
            }
            Checked::Refused {
                participant,
                reason,
            } => {
                let key = participant
                    .clone()
                    .unwrap_or_else(|| claimed_name(&request));
                self.throttle.record_failure(ip, &key, now);
                self.refuse(&request, unix_s, participant, reason)
            }
        }
    }

    fn refuse(
        &self,
        request: &Request,
        unix_s: u64,
        participant: Option<String>,
        reason: String,
    ) -> Reply {
        Reply {
            payload: self.response(request, unix_s, Err(REFUSED)),
            outcome: Outcome::Refused {
                participant,
                reason,
            },
        }
    }

    fn decode_request(&mut self, payload: &[u8], unix_s: u64) -> Result<Request, String> {
        let text = std::str::from_utf8(payload).map_err(|_| "request is not UTF-8".to_string())?;
        count(Work::Ed25519);
        let mut decoded = jwt::decode(text).map_err(|e| e.to_string())?;
        if decoded.issuer.kind() != KeyKind::Server {
            return Err("request not signed by a server key".into());
        }
        let server_key = decoded.issuer.encode();
        if !self.trusts(&server_key) {
            return Err(format!(
                "request signed by untrusted server {server_key} (pin it with --callout-server-key)"
            ));
        }
        if decoded.claim_type() != Some("authorization_request") {
            return Err("not an authorization request".into());
        }
        if decoded.claims.get("aud").and_then(Value::as_str) != Some(AUTH_REQUEST_AUDIENCE) {
            return Err("authorization request with the wrong audience".into());
        }
        let Some(exp) = decoded.claims.get("exp").and_then(Value::as_u64) else {
            return Err("authorization request without exp".into());
        };
        if exp > unix_s.saturating_add(MAX_REQUEST_AHEAD_S) {
            return Err(format!(
                "authorization request expires more than {MAX_REQUEST_AHEAD_S} s ahead"
            ));
        }
        if !still_awaited(exp, unix_s) {
            return Err(VerifyError::Expired.to_string());
        }
        let now = i64::try_from(unix_s).unwrap_or(i64::MAX);
        // `exp` is judged above; what is left to check is `nbf`.
        decoded.claims.remove("exp");
        scoped_jwt::check_times(&decoded.claims, now).map_err(|e| e.to_string())?;
        let nats = decoded.claims.get("nats").cloned().unwrap_or(Value::Null);
        let request: Request =
            serde_json::from_value(nats).map_err(|e| format!("authorization request: {e}"))?;
        if !crate::nkeys::is_valid_public_key(&request.user_nkey, KeyKind::User) {
            return Err("authorization request without a valid user_nkey".into());
        }
        if request.server_id.id.is_empty() {
            return Err("authorization request without server_id.id".into());
        }
        // Last, so a request refused for another reason does not burn its id.
        self.remember(&request.user_nkey, exp, unix_s)?;
        Ok(request)
    }

    /// Which participant the credential proves, if any.
    fn check(
        &self,
        participants: &Config,
        r: &Request,
        presented: Presented<'_>,
        unix_s: u64,
    ) -> Checked {
        let o = &r.connect_opts;
        let refused = Checked::refused;
        match presented {
            Presented::Jwt(token) => self.check_jwt(participants, token, r, unix_s),
            Presented::NKey => check_nkey(participants, r),
            Presented::User => {
                let Some((ns, name)) = split_participant(&o.user) else {
                    return refused(None, "user is not ns/name");
                };
                let who = Some(format!("{ns}/{name}"));
                let Some(p) = lookup(participants, ns, name) else {
                    // Spend the same work as a real check, so timing does not reveal names.
                    let _ = token_matches(None, &o.pass);
                    return refused(who, "unknown participant");
                };
                if !token_matches(p.token_sha256.as_deref(), &o.pass) {
                    return refused(who, "wrong token");
                }
                Checked::accepted(ns, name)
            }
            Presented::Token => match find_by_token(participants, &o.auth_token) {
                Some((ns, name)) => Checked::accepted(&ns, &name),
                None => refused(None, "unknown token"),
            },
            Presented::Nothing => refused(None, "no credential"),
        }
    }

    /// A user JWT this broker issued: valid, unexpired, naming a configured participant;
    /// unless it is a bearer token, `sig` must be the signature of the nonce by its user key.
    fn check_jwt(&self, participants: &Config, token: &str, r: &Request, unix_s: u64) -> Checked {
        let refused = Checked::refused;
        let issuer = self.config.issuer.public_key();
        count(Work::Ed25519);
        let user = match scoped_jwt::verify_user(token, &issuer, unix_s) {
            Ok(u) => u,
            Err(e) => return refused(None, &jwt_reason(&e)),
        };
        let Some((ns, name)) = user.name.as_deref().and_then(split_participant) else {
            return refused(None, "jwt names no participant");
        };
        let who = Some(format!("{ns}/{name}"));
        let Some(p) = lookup(participants, ns, name) else {
            return refused(who, "unknown participant");
        };
        let credential = user
            .claims
            .get(scoped_jwt::CREDENTIAL_CLAIM)
            .and_then(serde_json::Value::as_str);
        if credential != Some(scoped_jwt::credential_fingerprint(p).as_str()) {
            return refused(
                who,
                "jwt issued for a credential the participant no longer has",
            );
        }
        if !user.bearer {
            if !signed_nonce(&user.user_key, &r.client_info.nonce, &r.connect_opts.sig) {
                return refused(who, "jwt without a valid nonce signature");
            }
            if let Some(nkey) = &p.nkey
                && *nkey != user.user_key.encode()
            {
                return refused(who, "jwt user key is not the participant's");
            }
        }
        Checked::Accepted {
            ns: ns.to_string(),
            name: name.to_string(),
            until: user.expires,
        }
    }

    /// The authorization response JWT: `sub` = the server's user key for this client,
    /// `aud` = the server's id, and the user JWT or an error.
    fn response(&self, r: &Request, unix_s: u64, result: Result<&str, &str>) -> Vec<u8> {
        let mut nats = json!({"type": "authorization_response", "version": 2});
        if let Some(map) = nats.as_object_mut() {
            match result {
                Ok(user_jwt) => map.insert("jwt".into(), Value::String(user_jwt.into())),
                Err(error) => map.insert("error".into(), Value::String(error.into())),
            };
        }
        let mut claims = Claims::new();
        claims.insert("sub".into(), Value::String(r.user_nkey.clone()));
        claims.insert("aud".into(), Value::String(r.server_id.id.clone()));
        claims.insert("iat".into(), json!(unix_s));
        claims.insert("nats".into(), nats);
        // Encoding a map of strings and numbers cannot fail; an empty reply is still a
        // refusal to the server.
        count(Work::Ed25519);
        jwt::encode(&claims, &self.config.issuer)
            .map(String::into_bytes)
            .unwrap_or_default()
    }

    /// Drops throttling state that no longer matters; call now and then.
    pub fn prune(&mut self, now: Instant, unix_s: u64) {
        self.throttle.prune(now);
        self.seen.retain(|_, exp| still_awaited(*exp, unix_s));
    }
}

/// Whether the server may still be waiting for the answer to a request with `exp`. It
/// sets `exp` to its deadline (now + its auth timeout) rounded down to the second, so it
/// waits through the whole second `exp` names: refusing at `exp` itself would cut up to
/// a second off a 2 s window, which a loaded host overruns.
fn still_awaited(exp: u64, unix_s: u64) -> bool {
    unix_s <= exp
}

enum Checked {
    Accepted {
        ns: String,
        name: String,
        /// When the JWT that proved it expires (Unix seconds), if one did.
        until: Option<i64>,
    },
    Refused {
        participant: Option<String>,
        reason: String,
    },
}

/// The lifetime of a JWT issued now (`unix_s`): the configured one, and never past the
/// JWT the client presented (a `hello` JWT a second from expiry was exchanged for a
/// fresh full lifetime, again and again).
fn issued_ttl(ttl_s: u64, presented_until: Option<i64>, unix_s: u64) -> u64 {
    let now = i64::try_from(unix_s).unwrap_or(i64::MAX);
    match presented_until {
        Some(until) => ttl_s.min(u64::try_from(until.saturating_sub(now)).unwrap_or(0).max(1)),
        None => ttl_s,
    }
}

impl Checked {
    fn accepted(ns: &str, name: &str) -> Checked {
        Checked::Accepted {
            ns: ns.to_string(),
            name: name.to_string(),
            until: None,
        }
    }

    fn refused(participant: Option<String>, reason: &str) -> Checked {
        Checked::Refused {
            participant,
            reason: reason.to_string(),
        }
    }
}

/// An NKey and its signature of this connection's nonce.
fn check_nkey(participants: &Config, r: &Request) -> Checked {
    let o = &r.connect_opts;
    // The signature is checked before the key is looked up, so an unknown key costs the
    // same Ed25519 work as a known one and timing reveals no keys.
    let Ok(key) = PublicKey::decode_kind(&o.nkey, KeyKind::User) else {
        return Checked::refused(None, "malformed nkey");
    };
    let signed = signed_nonce(&key, &r.client_info.nonce, &o.sig);
    let Some((ns, name)) = find_by_nkey(participants, &o.nkey) else {
        return Checked::refused(None, "unknown nkey");
    };
    if !signed {
        return Checked::refused(Some(format!("{ns}/{name}")), "bad nonce signature");
    }
    Checked::accepted(&ns, &name)
}

/// Which credential a CONNECT presents, in the order they are looked at.
#[derive(Debug, Clone, Copy)]
enum Presented<'r> {
    /// A JWT from `hello` (or the callout): `jwt`, or a token that is one. nats-server
    /// passes a client's `jwt` only in operator mode; in configuration mode a JWT from
    /// `hello` travels as the token.
    Jwt(&'r str),
    NKey,
    /// `user` = `ns/name` and `pass` = its token.
    User,
    /// `auth_token` = some participant's token.
    Token,
    Nothing,
}

impl<'r> Presented<'r> {
    fn of(o: &'r ConnectOpts) -> Presented<'r> {
        if !o.jwt.is_empty() {
            Presented::Jwt(&o.jwt)
        } else if looks_like_jwt(&o.auth_token) {
            Presented::Jwt(&o.auth_token)
        } else if !o.nkey.is_empty() {
            Presented::NKey
        } else if !o.user.is_empty() {
            Presented::User
        } else if !o.auth_token.is_empty() {
            Presented::Token
        } else {
            Presented::Nothing
        }
    }
}

fn jwt_reason(e: &VerifyError) -> String {
    match e {
        VerifyError::Invalid(JwtError::Signature) => "jwt signature does not verify".into(),
        other => other.to_string(),
    }
}

/// The participant a request names, for throttling when the check named none.
fn claimed_name(r: &Request) -> String {
    let o = &r.connect_opts;
    if !o.user.is_empty() {
        return o.user.replacen('.', "/", 1);
    }
    if !o.nkey.is_empty() {
        return o.nkey.clone();
    }
    String::new()
}

fn looks_like_jwt(token: &str) -> bool {
    token.starts_with("eyJ") && token.bytes().filter(|b| *b == b'.').count() == 2
}

/// `ns/name` or `ns.name`.
pub fn split_participant(s: &str) -> Option<(&str, &str)> {
    let at = s.find(['/', '.'])?;
    let (ns, name) = (s.get(..at)?, s.get(at + 1..)?);
    (super::config::is_name(ns) && super::config::is_name(name)).then_some((ns, name))
}

fn lookup<'c>(c: &'c Config, ns: &str, name: &str) -> Option<&'c Participant> {
    c.namespaces.get(ns)?.participants.get(name).map(|p| &**p)
}

fn find_by_nkey(c: &Config, nkey: &str) -> Option<(String, String)> {
    c.namespaces.iter().find_map(|(ns, n)| {
        n.participants
            .iter()
            .find(|(_, p)| p.nkey.as_deref() == Some(nkey))
            .map(|(name, _)| (ns.clone(), name.clone()))
    })
}

fn find_by_token(c: &Config, token: &str) -> Option<(String, String)> {
    let presented = sha256_hex(token);
    let mut found = None;
    // Every stored hash is compared, so the time taken does not depend on where (or
    // whether) the token matches.
    for (ns, n) in &c.namespaces {
        for (name, p) in &n.participants {
            if let Some(stored) = &p.token_sha256
                && constant_time_eq(presented.as_bytes(), stored.to_ascii_lowercase().as_bytes())
            {
                found = Some((ns.clone(), name.clone()));
            }
        }
    }
    found
}

fn token_matches(stored: Option<&str>, token: &str) -> bool {
    let presented = sha256_hex(token);
    match stored {
        Some(stored) => {
            constant_time_eq(presented.as_bytes(), stored.to_ascii_lowercase().as_bytes())
        }
        None => false,
    }
}

fn sha256_hex(s: &str) -> String {
    count(Work::Sha256);
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Whether `sig` (base64url with or without padding, or standard base64, as NATS clients
/// send it) is `key`'s signature of the nonce text.
fn signed_nonce(key: &PublicKey, nonce: &str, sig: &str) -> bool {
    if nonce.is_empty() || sig.is_empty() {
        return false;
    }
    let raw = URL_SAFE_NO_PAD
        .decode(sig)
        .or_else(|_| URL_SAFE.decode(sig))
        .or_else(|_| STANDARD.decode(sig));
    count(Work::Ed25519);
    match raw {
        Ok(raw) => key.verify(nonce.as_bytes(), &raw).is_ok(),
        Err(_) => false,
    }
}

/// The costly steps of answering a request.
#[derive(Debug, Clone, Copy)]
enum Work {
    Sha256,
    Ed25519,
}

/// Counts [`Work`] in unit tests, to show which requests skip it.
fn count(_work: Work) {
    #[cfg(test)]
    WORK.with(|w| {
        let (hashes, signatures) = w.get();
        w.set(match _work {
            Work::Sha256 => (hashes + 1, signatures),
            Work::Ed25519 => (hashes, signatures + 1),
        })
    });
}

#[cfg(test)]
thread_local! {
    /// SHA-256 hashes and Ed25519 operations so far on this thread.
    static WORK: std::cell::Cell<(u32, u32)> = const { std::cell::Cell::new((0, 0)) };
}

#[cfg(test)]
mod tests;
