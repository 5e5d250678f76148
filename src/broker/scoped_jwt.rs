//! The scoped user JWT: a NATS JWT v2 user claim, signed by the broker's issuing account,
//! that `hello` returns and the auth callout issues to a NATS client that authenticated as a
//! participant. It gives the participant on NATS less than its permissions give it over
//! WebSocket: it may read what is addressed to it and the topics it may subscribe to, and
//! nothing else; every write that names a sender or that policy governs (sends, publishes,
//! submits, claims, task outcomes, registry entries) goes through the broker, which stamps
//! `from`/`kind` and applies rate limits, budgets and the task store.
//!
//! | need | allow |
//! |---|---|
//! | replies to its own requests | sub `_INBOX_<ns>_<name>.>` (its reply prefix) |
//! | `subscribe: [t]` | sub `amp.<ns>.topic.<t>` (live events, core NATS) |
//! | MIG requests (README "MIG over NATS") | pub `mig.v0_1.<ns>.{hello,discover,invoke.>,control.>}` |
//! | MIG stream frames | sub `mig.v0_1.<ns>.stream.>` |
//! | MIG `publish: [t]` / `subscribe: [t]` | pub / sub `mig.v0_1.<ns>.events.<t>` |
//!
//! Everything else is denied, in particular every `_INBOX.>` subject (the broker's own
//! replies and pull deliveries travel under [`BROKER_INBOX_PREFIX`], which no participant's
//! allow list matches), every inbox and consumer (its own too), the task stream and its
//! acks, `$KV`, `$SYS` and all of `$JS.API` and `$JS.ACK`: nats-server checks the subject of
//! a publish, never its reply subject, and JetStream answers (a pull's messages, an info, an
//! ack's confirmation) go to whatever reply subject a request names, streams and KV keys
//! included. Every subject a participant may publish on is answered by the broker, which
//! answers only under the caller's own reply prefix.

use serde_json::{Map, Value, json};

use super::binding;
use super::config::{Config, Permissions, Topics};
use crate::jwt::{self, Claims, JwtError};
use crate::nkeys::{KeyKind, KeyPair, PublicKey};

/// The reply/inbox prefix of the broker's own NATS connection: request replies and pull
/// deliveries (message bodies, `$JS.ACK` reply subjects) arrive under it, so it must be one
/// that no participant's subscribe allow list can match.
pub const BROKER_INBOX_PREFIX: &str = "_AMP_BROKER";

/// The subjects a participant may publish to and subscribe to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AllowLists {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
}

fn push_unique(list: &mut Vec<String>, subject: String) {
    if !list.contains(&subject) {
        list.push(subject);
    }
}

/// The inbox prefix a participant's NATS client must use (nats-py `inbox_prefix`, nats.go
/// `nats.CustomInboxPrefix`) for replies to reach it. Injective across a configuration
/// because `Config::validate` refuses namespaces where one is another's name plus `_`.
pub fn reply_prefix(ns: &str, name: &str) -> String {
    format!("_INBOX_{ns}_{name}")
}

/// `mig`: MIG over NATS is on, with the capabilities whose dead letters the participant
/// may read (those of jobs it may serve: their task bodies reach it in offers anyway).
pub fn allow_lists(ns: &str, name: &str, p: &Permissions, mig: Option<&[String]>) -> AllowLists {
    let mut publish = Vec::new();
    let mut subscribe = vec![format!("{}.>", reply_prefix(ns, name))];
    for t in &p.subscribe {
        push_unique(&mut subscribe, binding::topic_subject(ns, t));
    }
    // With MIG off nothing of it is granted. With it on: the broker authenticates each
    // MIG request and answers only under the caller's reply prefix, so publishing them
    // lets a participant do nothing it could not do over WebSocket. Every participant
    // gets them, so the work an unproved request costs is budgeted (mig::caller).
    if let Some(dlq) = mig {
        publish.extend(super::mig::subjects::request_publish_allow(ns));
        for t in &p.publish {
            push_unique(&mut publish, super::mig::subjects::events_subject(ns, t));
        }
        for t in &p.subscribe {
            push_unique(&mut subscribe, super::mig::subjects::events_subject(ns, t));
        }
        push_unique(
            &mut subscribe,
            super::mig::subjects::stream_subscribe_allow(ns),
        );
        for cap in dlq {
            push_unique(&mut subscribe, super::mig::subjects::dlq_subject(ns, cap));
        }
    }
    AllowLists { publish, subscribe }
}

/// The `subs` limit of `ns`'s participants on NATS: over WebSocket all sessions of one
/// participant on a broker hold at most this many, so one NATS connection may too.
pub fn subscription_cap(config: &Config, ns: &str) -> usize {
    config.namespaces.get(ns).map_or_else(
        || Topics::default().max_subscriptions_per_participant,
        |n| n.topics.max_subscriptions_per_participant,
    )
}

/// What goes into one scoped user JWT.
#[derive(Debug, Clone)]
pub struct UserGrant<'a> {
    pub ns: &'a str,
    pub name: &'a str,
    pub permissions: &'a Permissions,
    /// `sub`: the user's public NKey (`U...`): the participant's own, the server's
    /// generated one (auth callout), or a fresh one with `bearer` set.
    pub user_key: &'a str,
    pub issued_at: u64,
    pub ttl_s: u64,
    /// The server accepts the JWT without a nonce signature (for token participants, who
    /// hold no seed for `user_key`).
    pub bearer: bool,
    /// `aud`: in server-configuration mode the auth callout names the account to place the
    /// user in (`$G` for the global account).
    pub audience: Option<&'a str>,
    /// MIG over NATS is enabled: the grant includes its subjects (see [`allow_lists`]).
    pub mig: Option<&'a [String]>,
    /// `subs`: what one connection may hold on the shared server, the namespace's
    /// `topics.max_subscriptions_per_participant`.
    pub max_subscriptions: usize,
}

fn object(value: Value) -> Claims {
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// The user claims of a grant, unsigned.
pub fn user_claims(g: &UserGrant<'_>) -> Claims {
    let lists = allow_lists(g.ns, g.name, g.permissions, g.mig);
    // An empty allow list would restrict nothing: a participant that may publish nowhere
    // is denied everything instead.
    let publish = if lists.publish.is_empty() {
        json!({"deny": [">"]})
    } else {
        json!({"allow": lists.publish})
    };
    let mut nats = json!({
        "pub": publish,
        "sub": {"allow": lists.subscribe},
        // Its reply prefix alone would take any number of subscriptions on the server all
        // brokers and participants share. Payload stays the server's `max_payload`, and
        // nats-server counts no data for users.
        "subs": g.max_subscriptions,
        "data": -1,
        "payload": -1,
        "type": "user",
        "version": 2,
    });
    if g.bearer
        && let Some(map) = nats.as_object_mut()
    {
        map.insert("bearer_token".into(), Value::Bool(true));
    }
    let mut claims = object(json!({
        "sub": g.user_key,
        "name": format!("{}/{}", g.ns, g.name),
        "iat": g.issued_at,
        "exp": g.issued_at.saturating_add(g.ttl_s),
        "nats": nats,
    }));
    if let Some(aud) = g.audience {
        claims.insert("aud".into(), Value::String(aud.to_string()));
    }
    claims
}

/// Signs the grant's claims with the issuing account key.
pub fn issue(issuer: &KeyPair, g: &UserGrant<'_>) -> Result<String, JwtError> {
    jwt::encode(&user_claims(g), issuer)
}

/// The JWT `hello` returns to `ns/name`: for an NKey participant its `sub` is the
/// participant's own key (so the participant connects to NATS with this JWT and its seed);
/// for a token participant a fresh user key, and the JWT is a bearer token.
#[allow(clippy::too_many_arguments)]
pub fn hello_jwt(
    issuer: &KeyPair,
    ns: &str,
    name: &str,
    participant: &super::config::Participant,
    max_subscriptions: usize,
    unix_s: u64,
    ttl_s: u64,
    mig: Option<&[String]>,
) -> Result<String, JwtError> {
    let (user_key, bearer) = match &participant.nkey {
        Some(nkey) => (nkey.clone(), false),
        None => (
            KeyPair::generate(KeyKind::User)
                .map_err(JwtError::Issuer)?
                .public_key(),
            true,
        ),
    };
    let mut claims = user_claims(&UserGrant {
        ns,
        name,
        permissions: &participant.permissions,
        user_key: &user_key,
        issued_at: unix_s,
        ttl_s,
        bearer,
        audience: None,
        mig,
        max_subscriptions,
    });
    claims.insert(
        CREDENTIAL_CLAIM.into(),
        Value::String(credential_fingerprint(participant)),
    );
    jwt::encode(&claims, issuer)
}

/// The claim of a `hello` JWT naming the credential it was issued for: the auth callout
/// takes the JWT only while the participant's credential is still that one, so rotating
/// a leaked token or key ends the JWTs handed out with it, not only its sessions.
pub const CREDENTIAL_CLAIM: &str = "amp_credential";

/// What the configuration holds as the participant's credential, hashed (the configured
/// values are public keys and token hashes; this adds nothing to them).
pub fn credential_fingerprint(p: &super::config::Participant) -> String {
    let text = format!("{:?}\n{:?}", p.nkey, p.token_sha256);
    let mut hex = crate::keygen::token_sha256(&text);
    hex.truncate(32);
    hex
}

/// Why a presented JWT was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyError {
    /// Malformed, bad header, or the signature does not verify.
    Invalid(JwtError),
    /// Signed by someone other than the expected issuer.
    WrongIssuer,
    /// `exp` is not in the future.
    Expired,
    /// `nbf` is in the future.
    NotYetValid,
    /// Not a user claim, or `sub` is not a user key.
    NotAUser,
}

impl std::fmt::Display for VerifyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VerifyError::Invalid(e) => write!(f, "{e}"),
            VerifyError::WrongIssuer => f.write_str("jwt: not issued by this broker's account"),
            VerifyError::Expired => f.write_str("jwt: expired"),
            VerifyError::NotYetValid => f.write_str("jwt: not yet valid"),
            VerifyError::NotAUser => f.write_str("jwt: not a user JWT"),
        }
    }
}

impl std::error::Error for VerifyError {}

/// A user JWT that verified.
#[derive(Debug, Clone)]
pub struct VerifiedUser {
    pub user_key: PublicKey,
    pub name: Option<String>,
    pub bearer: bool,
    pub expires: Option<i64>,
    pub claims: Claims,
}

/// Verifies a user JWT: signature, issued by `issuer` (an account public key), not
/// expired and already valid at `now_unix`, a user claim with a user key as `sub`.
pub fn verify_user(token: &str, issuer: &str, now_unix: u64) -> Result<VerifiedUser, VerifyError> {
    let decoded = jwt::decode(token).map_err(VerifyError::Invalid)?;
    let now = i64::try_from(now_unix).unwrap_or(i64::MAX);
    check_times(&decoded.claims, now)?;
    if decoded.issuer.encode() != issuer || decoded.issuer.kind() != KeyKind::Account {
        return Err(VerifyError::WrongIssuer);
    }
    if decoded.claim_type() != Some("user") {
        return Err(VerifyError::NotAUser);
    }
    let user_key = decoded
        .subject()
        .and_then(|s| PublicKey::decode_kind(s, KeyKind::User).ok())
        .ok_or(VerifyError::NotAUser)?;
    let bearer = decoded
        .claims
        .get("nats")
        .and_then(|n| n.get("bearer_token"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(VerifiedUser {
        user_key,
        name: decoded
            .claims
            .get("name")
            .and_then(Value::as_str)
            .map(str::to_string),
        bearer,
        expires: decoded.expires(),
        claims: decoded.claims,
    })
}

/// `exp` (when set) must be in the future and `nbf` (when set) not.
pub fn check_times(claims: &Claims, now_unix: i64) -> Result<(), VerifyError> {
    if let Some(exp) = claims.get("exp") {
        match exp.as_i64() {
            Some(exp) if exp > now_unix => {}
            _ => return Err(VerifyError::Expired),
        }
    }
    if let Some(nbf) = claims.get("nbf") {
        match nbf.as_i64() {
            Some(nbf) if nbf <= now_unix => {}
            _ => return Err(VerifyError::NotYetValid),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;

    fn perms() -> Permissions {
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect();
        Permissions {
            send: v(&["w2", "*"]),
            publish: v(&["orders.eu.*"]),
            subscribe: v(&["orders.>"]),
            submit: v(&["render"]),
            serve: v(&["render"]),
        }
    }

    fn grant<'a>(p: &'a Permissions, user: &'a str) -> UserGrant<'a> {
        UserGrant {
            ns: "acme",
            name: "w1",
            permissions: p,
            user_key: user,
            issued_at: 1_700_000_000,
            ttl_s: 3600,
            bearer: false,
            audience: None,
            mig: Some(&[]),
            max_subscriptions: 1024,
        }
    }

    #[test]
    fn with_mig_off_no_mig_subject_is_granted() {
        let lists = allow_lists("acme", "w1", &perms(), None);
        let all = lists.publish.iter().chain(&lists.subscribe);
        assert!(all.clone().count() > 0);
        assert!(all.clone().all(|s| !s.starts_with("mig.")), "{lists:?}");
    }

    #[test]
    fn only_reads_of_what_is_addressed_to_the_participant_are_allowed() {
        let lists = allow_lists("acme", "w1", &perms(), Some(&[]));
        assert_eq!(
            lists.publish,
            [
                "mig.v0_1.acme.hello",
                "mig.v0_1.acme.discover",
                "mig.v0_1.acme.invoke.>",
                "mig.v0_1.acme.control.>",
                "mig.v0_1.acme.events.orders.eu.*",
            ]
        );
        assert_eq!(
            lists.subscribe,
            [
                "_INBOX_acme_w1.>",
                "amp.acme.topic.orders.>",
                "mig.v0_1.acme.events.orders.>",
                "mig.v0_1.acme.stream.>"
            ]
        );
        // send, publish, submit and serve grant nothing on NATS: those writes go through
        // the broker. Nor is any JetStream subject granted, its own inbox's neither: a
        // request's reply subject is not checked, and JetStream answers there.
        for subject in lists.publish.iter().chain(&lists.subscribe) {
            assert!(!subject.starts_with("$JS."), "{subject}");
            assert!(!subject.starts_with("amp.acme.inbox"), "{subject}");
            assert!(!subject.starts_with("amp.acme.job"), "{subject}");
            assert!(!subject.contains("AMP_TASKS"), "{subject}");
            assert!(!subject.starts_with("_INBOX."), "{subject}");
            assert!(!subject.starts_with(BROKER_INBOX_PREFIX), "{subject}");
        }
    }

    #[test]
    fn with_mig_off_a_participant_publishes_nowhere() {
        let p = perms();
        let mut g = grant(&p, "U");
        g.mig = None;
        let claims = user_claims(&g);
        assert_eq!(claims["nats"]["pub"], json!({"deny": [">"]}));
        assert_eq!(
            claims["nats"]["sub"],
            json!({"allow": ["_INBOX_acme_w1.>", "amp.acme.topic.orders.>"]})
        );
    }

    #[test]
    fn a_connection_may_hold_as_many_subscriptions_as_the_participant_over_websocket() {
        let w1 = |hash: &str| json!({"w1": {"token_sha256": hash.repeat(64)}});
        let config = json!({"namespaces": {
            "acme": {"participants": w1("a"), "topics": {"max_subscriptions_per_participant": 8}},
            "beta": {"participants": w1("b")},
        }});
        let config = Config::parse(config.to_string().as_bytes()).expect("config");
        assert_eq!(subscription_cap(&config, "acme"), 8);
        assert_eq!(subscription_cap(&config, "beta"), 1024);
        let p = perms();
        let mut g = grant(&p, "U");
        g.max_subscriptions = subscription_cap(&config, "acme");
        let claims = user_claims(&g);
        assert_eq!(claims["nats"]["subs"], json!(8));
        // -1: the server's own `max_payload`.
        assert_eq!(claims["nats"]["payload"], json!(-1));
    }

    #[test]
    fn issued_jwt_is_a_signed_nats_v2_user_claim() {
        let account = KeyPair::generate(KeyKind::Account).expect("key");
        let user = KeyPair::generate(KeyKind::User).expect("key");
        let p = perms();
        let uk = user.public_key();
        let token = issue(&account, &grant(&p, &uk)).expect("issue");
        let header: Value = serde_json::from_slice(
            &URL_SAFE_NO_PAD
                .decode(token.split('.').next().expect("header"))
                .expect("b64"),
        )
        .expect("json");
        assert_eq!(header, json!({"typ":"JWT","alg":"ed25519-nkey"}));
        let v = verify_user(&token, &account.public_key(), 1_700_000_001).expect("verifies");
        assert_eq!(v.user_key.encode(), uk);
        assert_eq!(v.name.as_deref(), Some("acme/w1"));
        assert!(!v.bearer);
        assert_eq!(v.expires, Some(1_700_003_600));
        assert_eq!(v.claims["iss"], json!(account.public_key()));
        assert_eq!(v.claims["nats"]["type"], json!("user"));
        assert_eq!(v.claims["nats"]["version"], json!(2));
        assert_eq!(
            v.claims["nats"]["sub"]["allow"][0],
            json!("_INBOX_acme_w1.>")
        );
        assert!(v.claims["jti"].as_str().is_some_and(|j| j.len() == 52));
    }

    #[test]
    fn a_participant_without_permissions_may_only_hear_its_replies_and_make_mig_requests() {
        let none = Permissions::default();
        let mut g = grant(&none, "U");
        g.bearer = true;
        g.audience = Some("$G");
        let claims = user_claims(&g);
        assert_eq!(
            claims["nats"]["pub"],
            json!({"allow": [
                "mig.v0_1.acme.hello",
                "mig.v0_1.acme.discover",
                "mig.v0_1.acme.invoke.>",
                "mig.v0_1.acme.control.>",
            ]})
        );
        assert_eq!(
            claims["nats"]["sub"],
            json!({"allow": ["_INBOX_acme_w1.>", "mig.v0_1.acme.stream.>"]})
        );
        assert_eq!(claims["nats"]["bearer_token"], json!(true));
        assert_eq!(claims["aud"], json!("$G"));
    }

    #[test]
    fn expired_tampered_foreign_and_non_user_jwts_are_refused() {
        let account = KeyPair::generate(KeyKind::Account).expect("key");
        let other = KeyPair::generate(KeyKind::Account).expect("key");
        let user = KeyPair::generate(KeyKind::User).expect("key");
        let p = perms();
        let uk = user.public_key();
        let token = issue(&account, &grant(&p, &uk)).expect("issue");
        let iss = account.public_key();
        assert_eq!(
            verify_user(&token, &iss, 1_700_003_600).map(|_| ()),
            Err(VerifyError::Expired)
        );
        assert_eq!(
            verify_user(&token, &other.public_key(), 1_700_000_001).map(|_| ()),
            Err(VerifyError::WrongIssuer)
        );
        // Widen the permissions in the claims without re-signing.
        let parts: Vec<&str> = token.split('.').collect();
        let mut claims: Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[1]).expect("b64")).expect("json");
        claims["nats"]["pub"]["allow"] = json!([">"]);
        let forged = format!(
            "{}.{}.{}",
            parts[0],
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).expect("json")),
            parts[2]
        );
        assert_eq!(
            verify_user(&forged, &iss, 1_700_000_001).map(|_| ()),
            Err(VerifyError::Invalid(JwtError::Signature))
        );
        let truncated = &token[..token.len() - 4];
        assert!(matches!(
            verify_user(truncated, &iss, 1_700_000_001),
            Err(VerifyError::Invalid(_))
        ));
        let account_jwt =
            jwt::encode(&jwt::account_claims(&other.public_key(), "x"), &account).expect("jwt");
        assert_eq!(
            verify_user(&account_jwt, &iss, 1_700_000_001).map(|_| ()),
            Err(VerifyError::NotAUser)
        );
        let mut early = user_claims(&grant(&p, &uk));
        early.insert("nbf".into(), json!(1_800_000_000));
        let early = jwt::encode(&early, &account).expect("jwt");
        assert_eq!(
            verify_user(&early, &iss, 1_700_000_001).map(|_| ()),
            Err(VerifyError::NotYetValid)
        );
    }
}
