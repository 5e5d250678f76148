//! Who sent a MIG request (mig-nats.md section 1): the `Authorization` NATS header proves
//! a participant (a token, a scoped user JWT the broker issued, or an NKey signature over
//! message id, timestamp and subject), and the reply subject must lie under that
//! participant's own reply prefix.
//!
//! Failures all answer the same `MIG_UNAUTHORIZED`. Guessing is throttled per claimed
//! participant like failed `hello`s (NATS does not tell the broker the client's address,
//! so only the per-participant bucket applies).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use crate::broker::auth::{self, Credential};
use crate::broker::config::Config;
use crate::broker::scoped_jwt;
use crate::broker::throttle::{HelloThrottle, ThrottleConfig, Verdict};

use super::subjects;

/// How far an NKey-signed request's timestamp may be from the broker's clock.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(120);
/// Signed message ids remembered at once; past it signed requests are refused until some
/// leave the window.
pub const MAX_REMEMBERED: usize = 65_536;
/// One caller's share of it: a participant signing as fast as it can fills its own share,
/// not the cache every other NKey caller needs.
const MAX_REMEMBERED_PER_CALLER: usize = 4_096;

/// Why a request is not served.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// No answer: the reply subject is missing or not the caller's (counted by `reason`).
    Drop(&'static str),
    Unauthorized,
    /// Too many failures for this participant: try again after this long.
    Throttled(Duration),
    /// A `Bearer` credential on a subject others receive (see [`Presented::exposed`]).
    Exposed,
}

/// The request facts authentication looks at.
pub struct Presented<'a> {
    pub ns: &'a str,
    pub subject: &'a str,
    pub reply: Option<&'a str>,
    pub authorization: Option<&'a str>,
    /// The caller's own `message_id` and `timestamp` (signed requests need both).
    pub message_id: Option<&'a str>,
    pub timestamp: Option<&'a str>,
    /// The subject is one every subscriber of a topic receives, headers included (a
    /// PUBLISH shares the live events subject): a `Bearer` credential on it has been
    /// handed to them, so it proves nothing; only a signature (over this message's id
    /// and time) does.
    pub exposed: bool,
}

pub struct Authenticator {
    throttle: HelloThrottle,
    seen: HashSet<String>,
    seen_order: VecDeque<(i64, String)>,
    /// Remembered ids per caller (`ns/name`).
    per_caller: HashMap<String, usize>,
}

impl Default for Authenticator {
    fn default() -> Self {
        Authenticator::new()
    }
}

impl Authenticator {
    pub fn new() -> Authenticator {
        let config = ThrottleConfig {
            // Every caller shares one "address" here; only the participant bucket counts.
            address_free_failures: u32::MAX,
            ..ThrottleConfig::default()
        };
        Authenticator {
            throttle: HelloThrottle::new(config),
            seen: HashSet::new(),
            seen_order: VecDeque::new(),
            per_caller: HashMap::new(),
        }
    }

    /// The participant name the request proves, or why not.
    pub fn authenticate(
        &mut self,
        config: &Config,
        issuer: Option<&str>,
        req: &Presented<'_>,
        now: Instant,
        wall_ms: i64,
    ) -> Result<String, Refusal> {
        let reply = req.reply.ok_or(Refusal::Drop("no_reply_subject"))?;
        let owner = subjects::reply_owner(req.ns, reply).ok_or(Refusal::Drop("reply_subject"))?;
        if req.exposed
            && req
                .authorization
                .is_some_and(|a| a.trim().starts_with("Bearer "))
        {
            return Err(Refusal::Exposed);
        }
        let key = format!("{}/{owner}", req.ns);
        // The key is only the reply subject, which anyone may write: while it is
        // throttled, a signature or an issued JWT (no guess) is still checked, as a
        // throttled hello's NKey is; a raw token is not, so guessing stays slow.
        let throttled = match self.throttle.check(ANY, &key, now) {
            Verdict::Delay(d) => Some(d),
            Verdict::Allow => None,
        };
        if let Some(d) = throttled
            && is_raw_token(req.authorization)
        {
            return Err(Refusal::Throttled(d));
        }
        let proved = self.prove(config, issuer, req, wall_ms);
        match (proved, throttled) {
            (Some(name), _) if name == owner => Ok(name),
            // A real credential with someone else's reply subject: answer nothing.
            (Some(_), _) => Err(Refusal::Drop("reply_subject")),
            (None, Some(d)) => Err(Refusal::Throttled(d)),
            (None, None) => {
                self.throttle.record_failure(ANY, &key, now);
                Err(Refusal::Unauthorized)
            }
        }
    }

    fn prove(
        &mut self,
        config: &Config,
        issuer: Option<&str>,
        req: &Presented<'_>,
        wall_ms: i64,
    ) -> Option<String> {
        let value = req.authorization?.trim();
        let owner = subjects::reply_owner(req.ns, req.reply?)?;
        if let Some(token) = value.strip_prefix("Bearer ") {
            let token = token.trim();
            if token.matches('.').count() == 2 {
                return verify_jwt(config, issuer?, req.ns, token, wall_ms);
            }
            return owner_presented(
                config,
                req.ns,
                owner,
                &auth::present(Credential::Token(token), b""),
            );
        }
        if let Some(rest) = value.strip_prefix("NKey ") {
            let (nkey, sig) = rest.trim().split_once(' ')?;
            let (id, ts) = (req.message_id?, req.timestamp?);
            let ts_ms = crate::rfc3339::parse_nanos(ts)? / 1_000_000;
            let window = REPLAY_WINDOW.as_millis() as i128;
            if (ts_ms - i128::from(wall_ms)).abs() > window {
                return None;
            }
            let signed = format!("{id}\n{ts}\n{}", req.subject);
            let credential = Credential::NKey {
                nkey,
                sig: sig.trim(),
            };
            let name = who_signed(
                config,
                req.ns,
                owner,
                &auth::present(credential, signed.as_bytes()),
            )?;
            return self
                .remember(format!("{}/{name}", req.ns), id, wall_ms)
                .then_some(name);
        }
        None
    }

    /// Accepts a signed message id once within the window.
    fn remember(&mut self, caller: String, id: &str, wall_ms: i64) -> bool {
        let window = REPLAY_WINDOW.as_millis() as i64;
        while let Some((at, _)) = self.seen_order.front() {
            if *at + 2 * window >= wall_ms {
                break;
            }
            if let Some((_, k)) = self.seen_order.pop_front() {
                self.seen.remove(&k);
                // `ns/name/id`: names hold no `/`, an id may.
                let owner = k.match_indices('/').nth(1).map_or("", |(i, _)| &k[..i]);
                if let Some(n) = self.per_caller.get_mut(owner) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.per_caller.remove(owner);
                    }
                }
            }
        }
        let key = format!("{caller}/{id}");
        let share = self.per_caller.get(&caller).copied().unwrap_or(0);
        if self.seen.contains(&key)
            || self.seen.len() >= MAX_REMEMBERED
            || share >= MAX_REMEMBERED_PER_CALLER
        {
            return false;
        }
        self.seen.insert(key.clone());
        self.seen_order.push_back((wall_ms, key));
        *self.per_caller.entry(caller).or_insert(0) += 1;
        true
    }
}

/// The listed participant whose key signed; else, when the namespace's `open` entry
/// accepts it, the reply subject's owner (open entries take any name). A signature is
/// no guess: one by another participant's key is told apart (no answer to a reply
/// subject it does not own).
fn who_signed(
    config: &Config,
    ns: &str,
    owner: &str,
    presented: &auth::Presented<'_>,
) -> Option<String> {
    let namespace = config.namespaces.get(ns)?;
    let mut found = None;
    for (name, p) in &namespace.participants {
        if auth::accepts(Some(p), presented) && found.is_none() {
            found = Some(name.clone());
        }
    }
    found.or_else(|| {
        let open = namespace
            .open
            .as_ref()
            .filter(|_| !namespace.participants.contains_key(owner));
        (open.is_some() && auth::accepts(open, presented)).then(|| owner.to_string())
    })
}

/// `owner` (the participant the reply subject names) when the token presented is its
/// own: listed with it, or unlisted and accepted by the namespace's `open` entry. Only
/// the owner's is tried: a token that is someone else's is a failure like any other.
/// Trying every participant's made a hit on another one answer nothing (its reply
/// subject is not theirs) where a miss answered `MIG_UNAUTHORIZED`, and counted no
/// failure: an oracle that tested each guess against every token of the tenant.
fn owner_presented(
    config: &Config,
    ns: &str,
    owner: &str,
    presented: &auth::Presented<'_>,
) -> Option<String> {
    let p = config.participant(ns, owner)?;
    auth::accepts(Some(p), presented).then(|| owner.to_string())
}

/// The stand-in address of every MIG caller in the throttle.
const ANY: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);

/// A bearer user JWT signed by the broker's issuing account, valid now, for a participant
/// of `ns` whose credential is still the one it was issued for: the name it was issued
/// to. A JWT without `bearer_token` (an NKey participant's, whose `sub` is its key) is
/// worth nothing without a proof of that key, which a MIG request does not carry; as a
/// `Bearer` credential it was accepted, so one who saw it (every subscriber of a topic
/// sees each PUBLISH's `Authorization`) could invoke and cancel as its owner.
fn verify_jwt(
    config: &Config,
    issuer: &str,
    ns: &str,
    token: &str,
    wall_ms: i64,
) -> Option<String> {
    let now = u64::try_from(wall_ms / 1000).unwrap_or(0);
    let user = scoped_jwt::verify_user(token, issuer, now).ok()?;
    if !user.bearer {
        return None;
    }
    let (jwt_ns, who) = user.name.as_deref()?.split_once('/')?;
    let p = config.participant(ns, who).filter(|_| jwt_ns == ns)?;
    let credential = user.claims.get(scoped_jwt::CREDENTIAL_CLAIM)?.as_str()?;
    (credential == scoped_jwt::credential_fingerprint(p)).then(|| who.to_string())
}

/// A `Bearer` credential that is not a JWT: what a guesser would try.
fn is_raw_token(authorization: Option<&str>) -> bool {
    authorization
        .map(str::trim)
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| t.trim().matches('.').count() != 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nkeys::{KeyKind, KeyPair};
    use base64::Engine;
    use sha2::{Digest, Sha256};

    fn config(nkey: &str) -> Config {
        let hash = hex(&Sha256::digest(b"bob-token"));
        let v = serde_json::json!({"namespaces": {"acme": {"participants": {
            "bob": {"token_sha256": hash},
            "ann": {"nkey": nkey},
        }}}});
        Config::parse(v.to_string().as_bytes()).expect("config")
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn req<'a>(reply: &'a str, authorization: &'a str) -> Presented<'a> {
        Presented {
            ns: "acme",
            subject: "mig.v0_1.acme.discover",
            reply: Some(reply),
            authorization: Some(authorization),
            message_id: Some("m1"),
            timestamp: Some("2026-12-01T00:00:00Z"),
            exposed: false,
        }
    }

    const NOW_MS: i64 = 1_796_083_200_000; // 2026-12-01T00:00:00Z

    /// Ann's `Authorization` for [`req`]'s message on `mig.v0_1.acme.discover`.
    fn signed_by(ann: &KeyPair) -> String {
        let signed = "m1\n2026-12-01T00:00:00Z\nmig.v0_1.acme.discover";
        let sig =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(ann.sign(signed.as_bytes()));
        format!("NKey {} {sig}", ann.public_key())
    }

    /// The JWT `hello` would give `acme/<name>`, issued by `issuer`, valid at [`NOW_MS`].
    fn hello_jwt(issuer: &KeyPair, c: &Config, name: &str) -> String {
        let p = c.participant("acme", name).expect("participant");
        crate::broker::scoped_jwt::hello_jwt(
            issuer,
            "acme",
            name,
            p,
            (NOW_MS / 1000) as u64,
            3600,
            Some(&[]),
        )
        .expect("jwt")
    }

    /// Forty failures with `reply`: its participant is throttled after.
    fn fail_often(a: &mut Authenticator, c: &Config, reply: &str, now: Instant) {
        for _ in 0..40 {
            let _ = a.authenticate(c, None, &req(reply, "Bearer nope"), now, NOW_MS);
        }
    }

    #[test]
    fn tokens_jwts_and_signatures_prove_their_participant() {
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let c = config(&ann.public_key());
        let mut a = Authenticator::new();
        let now = Instant::now();
        assert_eq!(
            a.authenticate(
                &c,
                None,
                &req("_INBOX_acme_bob.1", "Bearer bob-token"),
                now,
                NOW_MS
            ),
            Ok("bob".into())
        );
        assert_eq!(
            a.authenticate(
                &c,
                None,
                &req("_INBOX_acme_bob.1", "Bearer wrong"),
                now,
                NOW_MS
            ),
            Err(Refusal::Unauthorized)
        );
        // Bob's token with Ann's reply subject is no credential of Ann's: refused like any
        // wrong token. (It was answered with nothing, so a guesser using its own reply
        // subject learnt that a guess was somebody's token, and no failure was counted.)
        let mut guesser = Authenticator::new();
        assert_eq!(
            guesser.authenticate(
                &c,
                None,
                &req("_INBOX_acme_ann.1", "Bearer bob-token"),
                now,
                NOW_MS
            ),
            Err(Refusal::Unauthorized)
        );
        let auth = signed_by(&ann);
        assert_eq!(
            a.authenticate(&c, None, &req("_INBOX_acme_ann.1", &auth), now, NOW_MS),
            Ok("ann".into())
        );
        // The same message id again is a replay.
        assert_eq!(
            a.authenticate(&c, None, &req("_INBOX_acme_ann.1", &auth), now, NOW_MS),
            Err(Refusal::Unauthorized)
        );
        // Ann's valid signature with Bob's reply subject: no answer.
        let mut other = Authenticator::new();
        assert_eq!(
            other.authenticate(&c, None, &req("_INBOX_acme_bob.1", &auth), now, NOW_MS),
            Err(Refusal::Drop("reply_subject"))
        );
        // Too old.
        let mut late = Authenticator::new();
        assert_eq!(
            late.authenticate(
                &c,
                None,
                &req("_INBOX_acme_ann.1", &auth),
                now,
                NOW_MS + 121_000
            ),
            Err(Refusal::Unauthorized)
        );
        assert_eq!(
            a.authenticate(&c, None, &req("_INBOX.x", "Bearer bob-token"), now, NOW_MS),
            Err(Refusal::Drop("reply_subject"))
        );
    }

    #[test]
    fn a_jwt_for_one_participant_with_anothers_reply_subject_is_dropped() {
        let issuer = KeyPair::generate(KeyKind::Account).expect("key");
        let c = config(&KeyPair::generate(KeyKind::User).expect("key").public_key());
        let token = hello_jwt(&issuer, &c, "bob");
        let mut a = Authenticator::new();
        let now = Instant::now();
        let auth = format!("Bearer {token}");
        let pk = issuer.public_key();
        assert_eq!(
            a.authenticate(&c, Some(&pk), &req("_INBOX_acme_bob.1", &auth), now, NOW_MS),
            Ok("bob".into())
        );
        assert_eq!(
            a.authenticate(&c, Some(&pk), &req("_INBOX_acme_ann.1", &auth), now, NOW_MS),
            Err(Refusal::Drop("reply_subject"))
        );
        // Bob's token rotated: the JWT issued with the old one proves nothing any more.
        let mut rotated = c.clone();
        if let Some(bob) = rotated
            .namespaces
            .get_mut("acme")
            .and_then(|n| n.participants.get_mut("bob"))
        {
            bob.token_sha256 = Some(hex(&Sha256::digest(b"new-token")));
        }
        assert_eq!(
            Authenticator::new().authenticate(
                &rotated,
                Some(&pk),
                &req("_INBOX_acme_bob.1", &auth),
                now,
                NOW_MS
            ),
            Err(Refusal::Unauthorized)
        );
        let other = KeyPair::generate(KeyKind::Account)
            .expect("key")
            .public_key();
        assert_eq!(
            a.authenticate(
                &c,
                Some(&other),
                &req("_INBOX_acme_bob.1", &auth),
                now,
                NOW_MS
            ),
            Err(Refusal::Unauthorized)
        );
        assert_eq!(
            a.authenticate(
                &c,
                Some(&pk),
                &req("_INBOX_acme_bob.1", &auth),
                now,
                NOW_MS + 3_601_000
            ),
            Err(Refusal::Unauthorized)
        );
    }

    #[test]
    fn failures_aimed_at_a_participants_reply_prefix_do_not_lock_out_its_signature_or_jwt() {
        // Anyone may put Ann's reply prefix on a request: the key of the throttle is not a
        // proof. Her own signed requests and her issued JWT must still pass.
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let issuer = KeyPair::generate(KeyKind::Account).expect("key");
        let c = config(&ann.public_key());
        let mut a = Authenticator::new();
        let now = Instant::now();
        fail_often(&mut a, &c, "_INBOX_acme_ann.x", now);
        let auth = signed_by(&ann);
        assert_eq!(
            a.authenticate(&c, None, &req("_INBOX_acme_ann.1", &auth), now, NOW_MS),
            Ok("ann".into())
        );
        // A bearer JWT (Bob's: a token participant) passes while his prefix is throttled.
        let pk = issuer.public_key();
        fail_often(&mut a, &c, "_INBOX_acme_bob.x", now);
        let jwt = hello_jwt(&issuer, &c, "bob");
        assert_eq!(
            a.authenticate(
                &c,
                Some(&pk),
                &req("_INBOX_acme_bob.1", &format!("Bearer {jwt}")),
                now,
                NOW_MS
            ),
            Ok("bob".into())
        );
        // A bad signature while throttled is still only throttled (not checked as a guess).
        assert!(matches!(
            a.authenticate(
                &c,
                None,
                &req("_INBOX_acme_ann.1", &format!("{auth}x")),
                now,
                NOW_MS
            ),
            Err(Refusal::Throttled(_))
        ));
        // Raw tokens stay unchecked while throttled: guessing stays slow.
        fail_often(&mut a, &c, "_INBOX_acme_bob.x", now);
        assert!(matches!(
            a.authenticate(
                &c,
                None,
                &req("_INBOX_acme_bob.1", "Bearer bob-token"),
                now,
                NOW_MS
            ),
            Err(Refusal::Throttled(_))
        ));
    }

    /// An NKey participant's `hello` JWT names its key as `sub` and is no bearer token:
    /// NATS takes it only with a signature by that key. As MIG `Bearer` it was enough, and
    /// it travels in every PUBLISH's `Authorization` to every subscriber of the topic.
    #[test]
    fn a_jwt_that_is_no_bearer_token_is_not_taken_as_one() {
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let issuer = KeyPair::generate(KeyKind::Account).expect("key");
        let c = config(&ann.public_key());
        let jwt = hello_jwt(&issuer, &c, "ann");
        let pk = issuer.public_key();
        assert_eq!(
            Authenticator::new().authenticate(
                &c,
                Some(&pk),
                &req("_INBOX_acme_ann.1", &format!("Bearer {jwt}")),
                Instant::now(),
                NOW_MS
            ),
            Err(Refusal::Unauthorized)
        );
    }

    #[test]
    fn a_bearer_credential_on_a_subject_others_receive_proves_nothing() {
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let c = config(&ann.public_key());
        let mut a = Authenticator::new();
        let now = Instant::now();
        let mut publish = req("_INBOX_acme_bob.1", "Bearer bob-token");
        publish.exposed = true;
        assert_eq!(
            a.authenticate(&c, None, &publish, now, NOW_MS),
            Err(Refusal::Exposed)
        );
        let auth = signed_by(&ann);
        let mut publish = req("_INBOX_acme_ann.1", &auth);
        publish.exposed = true;
        assert_eq!(
            a.authenticate(&c, None, &publish, now, NOW_MS),
            Ok("ann".into())
        );
    }

    #[test]
    fn guessing_one_participant_is_throttled() {
        let c = config(&KeyPair::generate(KeyKind::User).expect("key").public_key());
        let mut a = Authenticator::new();
        let now = Instant::now();
        let mut throttled = false;
        for _ in 0..30 {
            if let Err(Refusal::Throttled(_)) = a.authenticate(
                &c,
                None,
                &req("_INBOX_acme_bob.1", "Bearer guess"),
                now,
                NOW_MS,
            ) {
                throttled = true;
            }
        }
        assert!(throttled);
    }

    #[test]
    fn one_caller_fills_only_its_own_share_of_the_replay_cache() {
        let mut a = Authenticator::new();
        for n in 0..MAX_REMEMBERED_PER_CALLER {
            assert!(a.remember("acme/x".into(), &format!("m/{n}"), NOW_MS));
        }
        assert!(!a.remember("acme/x".into(), "one more", NOW_MS));
        assert!(
            a.remember("acme/y".into(), "m/0", NOW_MS),
            "another caller still has room"
        );
        assert!(!a.remember("acme/y".into(), "m/0", NOW_MS), "a replay");
        // Past two windows the share is free again.
        let later = NOW_MS + 3 * REPLAY_WINDOW.as_millis() as i64;
        assert!(a.remember("acme/x".into(), "after", later));
        assert_eq!(a.per_caller.get("acme/x"), Some(&1));
    }
}
