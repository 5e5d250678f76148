//! Who sent a MIG request (mig-nats.md section 1): the `Authorization` NATS header proves
//! a participant (a token, a scoped user JWT the broker issued, or an NKey signature over
//! message id, timestamp and subject), and the reply subject must lie under that
//! participant's own reply prefix.
//!
//! Failures all answer the same `MIG_UNAUTHORIZED`. Guessing is throttled per claimed
//! participant like failed `hello`s (NATS does not tell the broker the client's address,
//! so only the per-participant bucket applies).

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::broker::auth::{self, Credential};
use crate::broker::bounded_map::BoundedMap;
use crate::broker::config::Config;
use crate::broker::rate_limit::DebtBucket;
use crate::broker::scoped_jwt;
use crate::broker::throttle::{HelloThrottle, ThrottleConfig, Verdict};

use super::subjects;

/// How far an NKey-signed request's timestamp may be from the broker's clock.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(120);

/// Why a request is not served.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// No answer: the reply subject is missing or not the caller's (counted by `reason`).
    Drop(&'static str),
    /// No answer, as `Drop("reply_subject")`, to a request others receive (a PUBLISH)
    /// whose signature by `name` verified: it reached every subscriber of its topic all
    /// the same, so its `id` is used up as a refused PUBLISH's is.
    Misdirected {
        name: String,
        id: String,
    },
    Unauthorized,
    /// Too many failures for this participant: try again after this long.
    Throttled(Duration),
    /// A `Bearer` credential on a subject others receive (see [`Presented::exposed`]).
    Exposed,
    /// The replay cache is full and the caller holds as many of its ids as anyone: its
    /// oldest leaves the window in this long.
    Crowded(Duration),
    /// The credential's key (or all keys) had its Ed25519 checks for now: it was not
    /// checked; one could be in this long.
    Busy(Duration),
}

/// Who a request proved, and the signed message id the front end takes at once.
#[derive(Debug, Clone, PartialEq)]
pub struct Proved {
    pub name: String,
    pub signed_id: Option<String>,
}

/// The request facts authentication looks at.
pub struct Presented<'a> {
    pub ns: &'a str,
    pub subject: &'a str,
    pub reply: Option<&'a str>,
    pub authorization: Option<&'a str>,
    /// The caller's own `message_id` and `timestamp` (signed requests need both), read
    /// from the body only for a signature about to be checked: nothing else of an
    /// unproved request's body is worth reading.
    pub signed_fields: &'a dyn Fn() -> Option<(String, String)>,
    /// The subject is one every subscriber of a topic receives, headers included (a
    /// PUBLISH shares the live events subject): a `Bearer` credential on it has been
    /// handed to them, so it proves nothing; only a signature (over this message's id
    /// and time) does.
    pub exposed: bool,
}

pub struct Authenticator {
    throttle: HelloThrottle,
    seen: ReplayCache,
    /// Ed25519 checks made (NKey signatures and issued JWTs): `amp_mig_verifications_total`.
    verifications: u64,
    /// Ed25519 checks allowed, taken before each is made: any participant may publish MIG
    /// requests, and without it one client sending forged signatures at full speed kept
    /// the broker's one thread verifying until nats-server cut its connection as a slow
    /// consumer.
    budget: Budget,
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
            seen: ReplayCache::default(),
            verifications: 0,
            budget: Budget::default(),
        }
    }

    pub fn verifications(&self) -> u64 {
        self.verifications
    }

    /// The participant name the request proves, or why not. A signed request's id is
    /// not taken here: the front end takes it with [`Authenticator::take_signed`] before
    /// anything can refuse the request, once it knows who signed (a PUBLISH's id is also
    /// recorded for every broker).
    pub fn authenticate(
        &mut self,
        config: &Config,
        issuer: Option<&str>,
        req: &Presented<'_>,
        now: Instant,
        wall_ms: i64,
    ) -> Result<Proved, Refusal> {
        let reply = req.reply.ok_or(Refusal::Drop("no_reply_subject"))?;
        let Some(owner) = subjects::reply_owner(req.ns, reply) else {
            // Only a listed participant's signature names its signer without an owner.
            let signer = req
                .exposed
                .then(|| self.prove(config, issuer, req, None, now, wall_ms).ok())
                .flatten()
                .flatten();
            return Err(misdirected(signer));
        };
        if req.exposed
            && req
                .authorization
                .is_some_and(|a| a.trim().starts_with("Bearer "))
        {
            return Err(Refusal::Exposed);
        }
        let key = guessed(config, req.ns, owner);
        // The key is only the reply subject, which anyone may write: while it is
        // throttled, a signature or an issued JWT (no guess) is still checked, as a
        // throttled hello's NKey is; a raw token is not, so guessing stays slow.
        let throttled = match key.as_ref().map(|k| self.throttle.check(ANY, k, now)) {
            Some(Verdict::Delay(d)) => Some(d),
            _ => None,
        };
        if let Some(d) = throttled
            && is_raw_token(req.authorization)
        {
            return Err(Refusal::Throttled(d));
        }
        let proved = self
            .prove(config, issuer, req, Some(owner), now, wall_ms)
            .map_err(Refusal::Busy)?;
        match (proved, throttled) {
            (Some(p), _) if p.name == owner => Ok(p),
            // A real credential with someone else's reply subject: answer nothing.
            (Some(p), _) => Err(misdirected(Some(p).filter(|_| req.exposed))),
            (None, Some(d)) => Err(Refusal::Throttled(d)),
            (None, None) => {
                if let Some(key) = key {
                    self.throttle.record_failure(ANY, &key, now);
                }
                Err(Refusal::Unauthorized)
            }
        }
    }

    /// Who `req`'s credential proves; `owner` is the participant its reply subject names
    /// (a token is tried against it only, and without it only a signature proves anyone).
    /// `Err`: an Ed25519 check was due and the budget had none left, for this long.
    fn prove(
        &mut self,
        config: &Config,
        issuer: Option<&str>,
        req: &Presented<'_>,
        owner: Option<&str>,
        now: Instant,
        wall_ms: i64,
    ) -> Result<Option<Proved>, Duration> {
        let Some(value) = req.authorization.map(str::trim) else {
            return Ok(None);
        };
        let unsigned = |name| Proved {
            name,
            signed_id: None,
        };
        if let Some(token) = value.strip_prefix("Bearer ") {
            let token = token.trim();
            if token.matches('.').count() == 2 {
                // Only a participant's JWT proves anything, and a Bearer credential on a
                // subject others receive proves nothing (`Refusal::Exposed`).
                let (Some(issuer), Some(owner)) = (issuer, owner) else {
                    return Ok(None);
                };
                if req.exposed || config.participant(req.ns, owner).is_none() {
                    return Ok(None);
                }
                // The JWT names its holder only once verified: the reply prefix stands in.
                self.spend(config, &format!("jwt {}/{owner}", req.ns), now)?;
                self.verifications += 1;
                return Ok(verify_jwt(config, issuer, req.ns, token, wall_ms).map(unsigned));
            }
            let Some(owner) = owner else {
                return Ok(None);
            };
            let presented = auth::present(Credential::Token(token), b"");
            return Ok(owner_presented(config, req.ns, owner, &presented).map(unsigned));
        }
        let Some(rest) = value.strip_prefix("NKey ") else {
            return Ok(None);
        };
        let Some((nkey, sig)) = rest.trim().split_once(' ') else {
            return Ok(None);
        };
        // A key no participant has proves nobody: refused at the cost of a lookup. (The
        // answer is the same either way; only the time tells whether a public key is
        // configured, which is no secret.)
        let Some(holder) = key_holder(config, req.ns, owner, nkey) else {
            return Ok(None);
        };
        if !publishable(config, req, &holder) {
            self.spend(config, &format!("nkey {nkey}"), now)?;
        }
        let Some((id, ts)) = (req.signed_fields)() else {
            return Ok(None);
        };
        let Some(ts_nanos) = crate::rfc3339::parse_nanos(&ts) else {
            return Ok(None);
        };
        let window = REPLAY_WINDOW.as_millis() as i128;
        if (ts_nanos / 1_000_000 - i128::from(wall_ms)).abs() > window {
            return Ok(None);
        }
        let signed = format!("{id}\n{ts}\n{}", req.subject);
        let credential = Credential::NKey {
            nkey,
            sig: sig.trim(),
        };
        self.verifications += 1;
        let Some(name) = who_signed(
            config,
            req.ns,
            owner,
            &auth::present(credential, signed.as_bytes()),
        ) else {
            return Ok(None);
        };
        // Only a fresh id proves this message; one seen already is refused as a
        // failed proof (here, or in `take_signed`).
        let key = format!("{}/{name}", req.ns);
        if self.seen.holds(&key, &id, wall_ms) {
            return Ok(None);
        }
        Ok(Some(Proved {
            name,
            signed_id: Some(id),
        }))
    }

    /// Takes one Ed25519 check for `key` from the budget, or says when one could be made.
    fn spend(&mut self, config: &Config, key: &str, now: Instant) -> Result<(), Duration> {
        let m = &config.mig;
        self.budget.take(
            key,
            m.verifications_per_key_per_s,
            m.verifications_per_s,
            now,
        )
    }

    /// Takes the signed id of a request proved by `ns/name` once within the window, in a
    /// cache of `capacity` ids; a replay counts as a failed authentication. `exposed`: a
    /// PUBLISH's, which every broker refuses again (`AMP_MIG_SEEN`).
    #[allow(clippy::too_many_arguments)]
    pub fn take_signed(
        &mut self,
        ns: &str,
        name: &str,
        id: &str,
        exposed: bool,
        capacity: usize,
        now: Instant,
        wall_ms: i64,
    ) -> Result<(), Refusal> {
        let key = format!("{ns}/{name}");
        match self.seen.take(&key, id, exposed, capacity, wall_ms) {
            Taken::Fresh => Ok(()),
            Taken::Replay => {
                self.throttle.record_failure(ANY, &key, now);
                Err(Refusal::Unauthorized)
            }
            Taken::Crowded(d) => Err(Refusal::Crowded(d)),
        }
    }

    /// The ids of signed PUBLISHes still kept: caller (`ns/name`), id, and the wall time
    /// it leaves at.
    pub fn exposed_ids(&self, wall_ms: i64) -> impl Iterator<Item = (&Arc<str>, &Arc<str>, i64)> {
        self.seen.callers.iter().flat_map(move |(caller, ids)| {
            ids.order
                .iter()
                .filter(move |(until, _, exposed)| *exposed && *until >= wall_ms)
                .map(move |(until, id, _)| (caller, id, *until))
        })
    }
}

/// What [`ReplayCache::take`] made of an id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Taken {
    Fresh,
    Replay,
    Crowded(Duration),
}

/// Signed message ids taken within two windows (a PUBLISH's, as long as `AMP_MIG_SEEN`
/// keeps it: [`ReplayCache::keep_ms`]), per caller, at most `capacity` in all.
/// One cache serves every tenant of the broker, so a full one must not refuse callers
/// who hold little of it: when full, a caller's id takes the place of the oldest id of
/// whoever holds the most, unless that is the caller itself, which is then refused. Each
/// caller's share is thus at least the capacity over the callers holding ids; before, a
/// full cache refused every signed request, and sixteen identities filled it. A forgotten
/// id could be replayed to this broker only; a PUBLISH (the one request others see) is
/// also checked in `AMP_MIG_SEEN`, which forgets nothing.
#[derive(Default)]
struct ReplayCache {
    callers: HashMap<Arc<str>, Ids>,
    /// Callers by how many ids they hold.
    by_count: BTreeSet<(usize, Arc<str>)>,
    /// Callers by when their oldest id leaves.
    by_oldest: BTreeSet<(i64, Arc<str>)>,
    total: usize,
}

#[derive(Default)]
struct Ids {
    /// In the order taken: when each id leaves, and whether it is a PUBLISH's
    /// (`exposed`). One that leaves later than those behind it (a PUBLISH's) keeps them
    /// until it leaves, at most a minute: their signatures are outside the window by then.
    /// One copy of each id, shared with `set` (and with a round claiming it again,
    /// `reclaim.rs`).
    order: VecDeque<(i64, Arc<str>, bool)>,
    set: HashSet<Arc<str>>,
}

impl ReplayCache {
    /// Two windows cover this broker's clock. A PUBLISH's id (`exposed`) may be
    /// replayed to another broker whose clock lags by the minute the bucket allows for,
    /// and a bucket made again gets back only the ids listed here (`reclaim.rs`), so it
    /// stays as long as the bucket keeps it; before, one from 240 s to 300 s old came
    /// back to none.
    fn keep_ms(exposed: bool) -> i64 {
        let keep = if exposed {
            super::seen::KEEP
        } else {
            2 * REPLAY_WINDOW
        };
        keep.as_millis() as i64
    }

    fn holds(&mut self, caller: &str, id: &str, wall_ms: i64) -> bool {
        self.expire(wall_ms);
        self.callers
            .get(caller)
            .is_some_and(|ids| ids.set.contains(id))
    }

    fn take(
        &mut self,
        caller: &str,
        id: &str,
        exposed: bool,
        capacity: usize,
        wall_ms: i64,
    ) -> Taken {
        self.expire(wall_ms);
        let mine = self.callers.get(caller);
        if mine.is_some_and(|ids| ids.set.contains(id)) {
            return Taken::Replay;
        }
        let held = mine.map_or(0, |ids| ids.order.len());
        while self.total >= capacity.max(1) {
            let Some((most, top)) = self.by_count.last().cloned() else {
                break;
            };
            if most <= held {
                let leaves = self
                    .callers
                    .get(caller)
                    .and_then(|ids| ids.order.front())
                    .map_or(wall_ms, |(until, ..)| *until);
                let ms = (leaves - wall_ms).max(1);
                return Taken::Crowded(Duration::from_millis(ms as u64));
            }
            self.change(&top, |ids| {
                if let Some((_, old, _)) = ids.order.pop_front() {
                    ids.set.remove(&old);
                }
            });
        }
        let owned: Arc<str> = Arc::from(id);
        self.change(caller, |ids| {
            ids.set.insert(owned.clone());
            ids.order
                .push_back((wall_ms + Self::keep_ms(exposed), owned, exposed));
        });
        Taken::Fresh
    }

    /// Ids past their time leave.
    fn expire(&mut self, wall_ms: i64) {
        while let Some((until, caller)) = self.by_oldest.first().cloned()
            && until < wall_ms
        {
            self.change(&caller, |ids| {
                while ids
                    .order
                    .front()
                    .is_some_and(|(until, ..)| *until < wall_ms)
                {
                    if let Some((_, old, _)) = ids.order.pop_front() {
                        ids.set.remove(&old);
                    }
                }
            });
        }
    }

    /// Changes `caller`'s ids and keeps the indexes and the total in step.
    fn change(&mut self, caller: &str, f: impl FnOnce(&mut Ids)) {
        let (key, mut ids) = match self.callers.remove_entry(caller) {
            Some(found) => found,
            None => (Arc::from(caller), Ids::default()),
        };
        if let Some((until, ..)) = ids.order.front() {
            self.by_oldest.remove(&(*until, key.clone()));
            self.by_count.remove(&(ids.order.len(), key.clone()));
        }
        let before = ids.order.len();
        f(&mut ids);
        self.total = self.total + ids.order.len() - before;
        if let Some((until, ..)) = ids.order.front() {
            self.by_oldest.insert((*until, key.clone()));
            self.by_count.insert((ids.order.len(), key.clone()));
            self.callers.insert(key, ids);
        }
    }
}

/// The listed participant whose key signed; else, when the namespace's `open` entry
/// accepts it, the reply subject's owner (open entries take any name), if it names one.
/// A signature is no guess: one by another participant's key is told apart (no answer to
/// a reply subject it does not own).
fn who_signed(
    config: &Config,
    ns: &str,
    owner: Option<&str>,
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
        let owner = owner?;
        let open = namespace
            .open
            .as_deref()
            .filter(|_| !namespace.participants.contains_key(owner));
        (open.is_some() && auth::accepts(open, presented)).then(|| owner.to_string())
    })
}

/// Who a signature by `nkey` would prove, found without checking it: the listed
/// participant with that key, else the reply subject's owner when the namespace's `open`
/// entry has it (as [`who_signed`] decides).
fn key_holder(config: &Config, ns: &str, owner: Option<&str>, nkey: &str) -> Option<String> {
    let namespace = config.namespaces.get(ns)?;
    let listed = namespace
        .participants
        .iter()
        .find(|(_, p)| p.nkey.as_deref() == Some(nkey))
        .map(|(name, _)| name.clone());
    listed.or_else(|| {
        let owner = owner.filter(|o| !namespace.participants.contains_key(*o))?;
        let open = namespace.open.as_ref()?.nkey.as_deref();
        (open == Some(nkey)).then(|| owner.to_string())
    })
}

/// Whether `req` is a PUBLISH that `holder`, the participant its key is, may make. Such a
/// request reaches every subscriber of its topic, who may send it again with another body
/// (the signature does not cover it): refused before its signature is checked, its id
/// would not be used up, and the copy sent once the budget allows would be stored as
/// `holder`'s event. So its check is never put off; any other request's copy is refused
/// anyway (nobody else sees a request on any other subject).
fn publishable(config: &Config, req: &Presented<'_>, holder: &str) -> bool {
    use crate::broker::permissions::{Action, allows};
    let Some((_, subjects::Op::Publish(topic))) = subjects::parse(req.subject) else {
        return false;
    };
    req.exposed
        && config
            .participant(req.ns, holder)
            .is_some_and(|p| allows(&p.permissions, Action::Publish, topic))
}

/// Work allowed a second in all and per key (a token bucket each, holding one second's
/// worth), taken before the work is done.
#[derive(Default)]
pub struct Budget {
    all: Option<DebtBucket>,
    per_key: Option<BoundedMap<String, DebtBucket>>,
}

/// Keys whose buckets are remembered at once (the oldest forgotten first, full again).
const BUDGET_KEYS: usize = 65_536;

impl Budget {
    /// Takes one for `key` (then from the whole), or says how long until it could. A key
    /// refused takes nothing from the whole, so one key cannot use it up.
    pub fn take(
        &mut self,
        key: &str,
        per_key: u32,
        all: u32,
        now: Instant,
    ) -> Result<(), Duration> {
        let keys = self
            .per_key
            .get_or_insert_with(|| BoundedMap::new(BUDGET_KEYS));
        keys.get_or_insert_with(key.to_string(), || DebtBucket::new(now))
            .take(1.0, f64::from(per_key), now)
            .map_err(Duration::from_millis)?;
        self.all
            .get_or_insert_with(|| DebtBucket::new(now))
            .take(1.0, f64::from(all), now)
            .map_err(Duration::from_millis)
    }
}

/// The refusal of a request whose reply subject is not its prover's: nothing to answer,
/// and a signed id to use up when `signer` proved one on a subject others receive.
fn misdirected(signer: Option<Proved>) -> Refusal {
    match signer {
        Some(Proved {
            name,
            signed_id: Some(id),
        }) => Refusal::Misdirected { name, id },
        _ => Refusal::Drop("reply_subject"),
    }
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

/// The throttle's key for a request whose reply subject names `owner`: the credential a
/// guess there would be tried against. A listed participant's is its own; every unlisted
/// name shares the `open` entry's (one token, whatever name a guess gives: with a key per
/// name each new name had 20 free guesses); with neither, nothing can be guessed and
/// nothing is kept. So only configured credentials take places in the throttle's bounded
/// map: MIG has no client address, and failures in made-up names had pushed a
/// participant's record out and freed its guesses.
fn guessed(config: &Config, ns: &str, owner: &str) -> Option<String> {
    let namespace = config.namespaces.get(ns)?;
    if namespace.participants.contains_key(owner) {
        Some(format!("{ns}/{owner}"))
    } else {
        // `*` is no name, so this key is no participant's.
        namespace.open.as_ref().map(|_| format!("{ns}/*"))
    }
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
            signed_fields: &m1_now,
            exposed: false,
        }
    }

    /// The message id and timestamp of [`req`]'s message.
    fn m1_now() -> Option<(String, String)> {
        Some(("m1".into(), "2026-12-01T00:00:00Z".into()))
    }

    const NOW_MS: i64 = 1_796_083_200_000; // 2026-12-01T00:00:00Z

    impl Authenticator {
        /// The whole path of a request: its proof, then its signed id taken.
        fn admit(
            &mut self,
            config: &Config,
            issuer: Option<&str>,
            req: &Presented<'_>,
            now: Instant,
            wall_ms: i64,
        ) -> Result<String, Refusal> {
            let p = self.authenticate(config, issuer, req, now, wall_ms)?;
            if let Some(id) = &p.signed_id {
                self.take_signed(req.ns, &p.name, id, false, 65_536, now, wall_ms)?;
            }
            Ok(p.name)
        }
    }

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
            crate::broker::scoped_jwt::subscription_cap(c, "acme"),
            (NOW_MS / 1000) as u64,
            3600,
            Some(&[]),
        )
        .expect("jwt")
    }

    /// Forty failures with `reply`: its participant is throttled after.
    fn fail_often(a: &mut Authenticator, c: &Config, reply: &str, now: Instant) {
        for _ in 0..40 {
            let _ = a.admit(c, None, &req(reply, "Bearer nope"), now, NOW_MS);
        }
    }

    #[test]
    fn tokens_jwts_and_signatures_prove_their_participant() {
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let c = config(&ann.public_key());
        let mut a = Authenticator::new();
        let now = Instant::now();
        assert_eq!(
            a.admit(
                &c,
                None,
                &req("_INBOX_acme_bob.1", "Bearer bob-token"),
                now,
                NOW_MS
            ),
            Ok("bob".into())
        );
        assert_eq!(
            a.admit(
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
            guesser.admit(
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
            a.admit(&c, None, &req("_INBOX_acme_ann.1", &auth), now, NOW_MS),
            Ok("ann".into())
        );
        // The same message id again is a replay.
        assert_eq!(
            a.admit(&c, None, &req("_INBOX_acme_ann.1", &auth), now, NOW_MS),
            Err(Refusal::Unauthorized)
        );
        // Ann's valid signature with Bob's reply subject: no answer.
        let mut other = Authenticator::new();
        assert_eq!(
            other.admit(&c, None, &req("_INBOX_acme_bob.1", &auth), now, NOW_MS),
            Err(Refusal::Drop("reply_subject"))
        );
        // Too old.
        let mut late = Authenticator::new();
        assert_eq!(
            late.admit(
                &c,
                None,
                &req("_INBOX_acme_ann.1", &auth),
                now,
                NOW_MS + 121_000
            ),
            Err(Refusal::Unauthorized)
        );
        assert_eq!(
            a.admit(&c, None, &req("_INBOX.x", "Bearer bob-token"), now, NOW_MS),
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
            a.admit(&c, Some(&pk), &req("_INBOX_acme_bob.1", &auth), now, NOW_MS),
            Ok("bob".into())
        );
        assert_eq!(
            a.admit(&c, Some(&pk), &req("_INBOX_acme_ann.1", &auth), now, NOW_MS),
            Err(Refusal::Drop("reply_subject"))
        );
        // Bob's token rotated: the JWT issued with the old one proves nothing any more.
        let mut rotated = c.clone();
        if let Some(bob) = rotated
            .namespaces
            .get_mut("acme")
            .and_then(|n| n.participants.get_mut("bob"))
            .map(std::sync::Arc::make_mut)
        {
            bob.token_sha256 = Some(hex(&Sha256::digest(b"new-token")));
        }
        assert_eq!(
            Authenticator::new().admit(
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
            a.admit(
                &c,
                Some(&other),
                &req("_INBOX_acme_bob.1", &auth),
                now,
                NOW_MS
            ),
            Err(Refusal::Unauthorized)
        );
        assert_eq!(
            a.admit(
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
            a.admit(&c, None, &req("_INBOX_acme_ann.1", &auth), now, NOW_MS),
            Ok("ann".into())
        );
        // A bearer JWT (Bob's: a token participant) passes while his prefix is throttled.
        let pk = issuer.public_key();
        fail_often(&mut a, &c, "_INBOX_acme_bob.x", now);
        let jwt = hello_jwt(&issuer, &c, "bob");
        assert_eq!(
            a.admit(
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
            a.admit(
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
            a.admit(
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
            Authenticator::new().admit(
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
            a.admit(&c, None, &publish, now, NOW_MS),
            Err(Refusal::Exposed)
        );
        let auth = signed_by(&ann);
        let mut publish = req("_INBOX_acme_ann.1", &auth);
        publish.exposed = true;
        assert_eq!(a.admit(&c, None, &publish, now, NOW_MS), Ok("ann".into()));
    }

    /// A PUBLISH reaches every subscriber of its topic whatever its reply subject: one
    /// dropped for it names its signer, whose id the front end then uses up.
    #[test]
    fn a_signed_publish_with_a_reply_subject_not_its_signers_names_the_signer() {
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let c = config(&ann.public_key());
        let now = Instant::now();
        let auth = signed_by(&ann);
        for reply in ["_INBOX_acme_bob.1", "_INBOX.x"] {
            let mut publish = req(reply, &auth);
            publish.exposed = true;
            assert_eq!(
                Authenticator::new().admit(&c, None, &publish, now, NOW_MS),
                Err(Refusal::Misdirected {
                    name: "ann".into(),
                    id: "m1".into()
                }),
                "{reply}"
            );
            publish.exposed = false;
            assert_eq!(
                Authenticator::new().admit(&c, None, &publish, now, NOW_MS),
                Err(Refusal::Drop("reply_subject")),
                "{reply}"
            );
        }
        // A bad signature on a subject others receive proves nobody.
        let bad = format!("{auth}x");
        let mut forged = req("_INBOX.x", &bad);
        forged.exposed = true;
        assert_eq!(
            Authenticator::new().admit(&c, None, &forged, now, NOW_MS),
            Err(Refusal::Drop("reply_subject"))
        );
    }

    #[test]
    fn guessing_one_participant_is_throttled() {
        let c = config(&KeyPair::generate(KeyKind::User).expect("key").public_key());
        let mut a = Authenticator::new();
        let now = Instant::now();
        let mut throttled = false;
        for _ in 0..30 {
            if let Err(Refusal::Throttled(_)) = a.admit(
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

    /// MIG has no client address, so the throttle's only key is the name the reply
    /// subject gives, which anyone may write: failures in made-up names pushed a
    /// participant's record out of the bounded map, and its guesses were free again.
    #[test]
    fn failures_in_made_up_names_do_not_free_a_participants_guesses() {
        let c = config(&KeyPair::generate(KeyKind::User).expect("key").public_key());
        let mut a = Authenticator::new();
        let now = Instant::now();
        fail_often(&mut a, &c, "_INBOX_acme_bob.x", now);
        for i in 0..65_536 {
            let reply = format!("_INBOX_acme_m{i}.x");
            let _ = a.admit(&c, None, &req(&reply, "Bearer nope"), now, NOW_MS);
        }
        assert!(matches!(
            a.admit(
                &c,
                None,
                &req("_INBOX_acme_bob.1", "Bearer guess"),
                now,
                NOW_MS
            ),
            Err(Refusal::Throttled(_))
        ));
    }

    /// An `open` entry's token is one credential whatever name a request gives: guessed
    /// under a new name each time, each name's allowance was a fresh 20.
    #[test]
    fn guessing_the_open_token_under_many_names_is_throttled() {
        let hash = hex(&Sha256::digest(b"open-token"));
        let v = serde_json::json!({"namespaces": {"acme": {"participants": {},
            "open": {"token_sha256": hash}}}});
        let c = Config::parse(v.to_string().as_bytes()).expect("config");
        let mut a = Authenticator::new();
        let now = Instant::now();
        let throttled = (0..40).any(|i| {
            let reply = format!("_INBOX_acme_n{i}.x");
            matches!(
                a.admit(&c, None, &req(&reply, "Bearer guess"), now, NOW_MS),
                Err(Refusal::Throttled(_))
            )
        });
        assert!(throttled, "40 guesses at the open token, none throttled");
    }

    /// Sixteen identities signing 4,096 ids each filled the broker's 65,536 entries: every
    /// other NKey request, PUBLISH included, was refused for up to 240 s.
    #[test]
    fn a_few_identities_filling_the_replay_cache_do_not_lock_out_another() {
        let mut c = ReplayCache::default();
        for caller in 0..16 {
            for n in 0..4096 {
                let _ = c.take(
                    &format!("acme/n{caller}"),
                    &format!("m{n}"),
                    false,
                    65_536,
                    NOW_MS,
                );
            }
        }
        assert_eq!(c.total, 65_536);
        assert_eq!(
            c.take("other/ann", "m0", false, 65_536, NOW_MS),
            Taken::Fresh,
            "a caller with no id remembered is refused"
        );
        assert_eq!(c.total, 65_536, "the cache stays at its capacity");
    }

    /// What a bucket of taken ids made again gets back: a PUBLISH's ids (others received
    /// them), not those of requests only the broker saw, each until it leaves.
    #[test]
    fn only_a_publishs_ids_still_kept_are_listed_as_exposed() {
        let mut a = Authenticator::new();
        let now = Instant::now();
        let mut take = |name: &str, id: &str, exposed: bool, wall_ms: i64| {
            let taken = a.take_signed("acme", name, id, exposed, 8, now, wall_ms);
            assert_eq!(taken, Ok(()), "{id}");
        };
        take("ann", "p1", true, NOW_MS);
        take("ann", "i1", false, NOW_MS);
        take("bob", "p2", true, NOW_MS + 1000);
        let listed = |wall_ms: i64| {
            let mut ids: Vec<(&str, &str, i64)> = (a.exposed_ids(wall_ms))
                .map(|(caller, id, until)| (&**caller, &**id, until))
                .collect();
            ids.sort();
            ids
        };
        let keep = ReplayCache::keep_ms(true);
        let bobs = ("acme/bob", "p2", NOW_MS + 1000 + keep);
        let anns = ("acme/ann", "p1", NOW_MS + keep);
        assert_eq!(listed(NOW_MS + 1000), [anns, bobs]);
        assert_eq!(listed(NOW_MS + keep + 1), [bobs]);
    }

    /// Another broker takes a signature until 120 s past its timestamp by its own clock,
    /// which may lag this one's by the minute `AMP_MIG_SEEN` allows for (`seen::KEEP`):
    /// a PUBLISH's id taken here at 0 with a timestamp 120 s ahead can be replayed there
    /// until 300 s. A bucket made again gets back only the ids the cache lists, so it
    /// lists a PUBLISH's id as long as the bucket would have kept it.
    #[test]
    fn a_publishs_id_is_listed_as_long_as_the_bucket_of_taken_ids_keeps_it() {
        let mut a = Authenticator::new();
        let now = Instant::now();
        let taken = a.take_signed("acme", "ann", "p1", true, 8, now, NOW_MS);
        assert_eq!(taken, Ok(()));
        let listed = |a: &Authenticator, wall_ms: i64| -> Vec<String> {
            (a.exposed_ids(wall_ms))
                .map(|(caller, id, _)| format!("{caller} {id}"))
                .collect()
        };
        let keep = super::super::seen::KEEP.as_millis() as i64;
        assert_eq!(listed(&a, NOW_MS + 250_000), ["acme/ann p1"]);
        assert_eq!(listed(&a, NOW_MS + keep), ["acme/ann p1"]);
        assert!(listed(&a, NOW_MS + keep + 1).is_empty());
        // An id taken behind it that leaves sooner waits for it; then both leave, and the
        // indexes with them.
        let taken = a.take_signed("acme", "ann", "i1", false, 8, now, NOW_MS + 1);
        assert_eq!(taken, Ok(()));
        a.seen.expire(NOW_MS + 250_000);
        assert_eq!(a.seen.total, 2);
        a.seen.expire(NOW_MS + keep + 1);
        let c = &a.seen;
        assert_eq!(
            (
                c.total,
                c.callers.len(),
                c.by_count.len(),
                c.by_oldest.len()
            ),
            (0, 0, 0, 0)
        );
    }

    #[test]
    fn a_full_replay_cache_refuses_only_who_holds_the_most() {
        let mut c = ReplayCache::default();
        for n in 0..4 {
            assert_eq!(
                c.take("acme/x", &format!("m{n}"), false, 4, NOW_MS),
                Taken::Fresh
            );
        }
        // Full: X holds the most and waits until its oldest id leaves the window.
        assert_eq!(
            c.take("acme/x", "m4", false, 4, NOW_MS + 1000),
            Taken::Crowded(Duration::from_millis(239_000))
        );
        // Y takes the place of X's oldest; X's others are still replays.
        assert_eq!(c.take("acme/y", "m0", false, 4, NOW_MS), Taken::Fresh);
        assert_eq!(c.take("acme/y", "m0", false, 4, NOW_MS), Taken::Replay);
        assert_eq!(c.take("acme/x", "m3", false, 4, NOW_MS), Taken::Replay);
        assert_eq!(c.take("acme/y", "m1", false, 4, NOW_MS), Taken::Fresh);
        // Two each: neither may push the other out.
        assert!(matches!(
            c.take("acme/y", "m2", false, 4, NOW_MS),
            Taken::Crowded(_)
        ));
        assert!(matches!(
            c.take("acme/x", "m9", false, 4, NOW_MS),
            Taken::Crowded(_)
        ));
        assert_eq!(c.callers.get("acme/x").map(|i| i.order.len()), Some(2));
        // Past two windows every id has left, and the indexes with them.
        let later = NOW_MS + 3 * REPLAY_WINDOW.as_millis() as i64;
        assert_eq!(c.take("acme/x", "m0", false, 4, later), Taken::Fresh);
        assert_eq!(
            (
                c.total,
                c.callers.len(),
                c.by_count.len(),
                c.by_oldest.len()
            ),
            (1, 1, 1, 1)
        );
    }

    /// Ed25519 checks are taken from a budget before they are made (per key, then in
    /// all), and a key no participant has costs none.
    #[test]
    fn signatures_are_checked_within_a_budget_and_unknown_keys_not_at_all() {
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let mut c = config(&ann.public_key());
        c.mig.verifications_per_key_per_s = 3;
        c.mig.verifications_per_s = 5;
        let mut a = Authenticator::new();
        let now = Instant::now();
        let stranger = KeyPair::generate(KeyKind::User).expect("key");
        let forged = |k: &KeyPair| format!("NKey {} {}", k.public_key(), "A".repeat(86));
        for n in 0..100 {
            let r = a.authenticate(
                &c,
                None,
                &req(&format!("_INBOX_acme_s{n}.1"), &forged(&stranger)),
                now,
                NOW_MS,
            );
            assert_eq!(r, Err(Refusal::Unauthorized));
        }
        assert_eq!(a.verifications(), 0, "an unknown key was checked");
        let refused: Vec<_> = (0..100)
            .map(|n| {
                a.authenticate(
                    &c,
                    None,
                    &req(&format!("_INBOX_acme_x{n}.1"), &forged(&ann)),
                    now,
                    NOW_MS,
                )
            })
            .collect();
        assert_eq!(a.verifications(), 3);
        assert!(
            refused[3..]
                .iter()
                .all(|r| matches!(r, Err(Refusal::Busy(_)))),
            "{refused:?}"
        );
        // Ann's key spent, the rest of the whole is left for another key.
        let bob = KeyPair::generate(KeyKind::User).expect("key");
        if let Some(p) = c
            .namespaces
            .get_mut("acme")
            .and_then(|n| n.participants.get_mut("bob"))
            .map(std::sync::Arc::make_mut)
        {
            p.nkey = Some(bob.public_key());
        }
        for _ in 0..3 {
            let _ = a.authenticate(
                &c,
                None,
                &req("_INBOX_acme_y.1", &forged(&bob)),
                now,
                NOW_MS,
            );
        }
        assert_eq!(a.verifications(), 5);
        // A second on, Ann's own signature passes again.
        let later = now + Duration::from_secs(1);
        assert_eq!(
            a.admit(
                &c,
                None,
                &req("_INBOX_acme_ann.1", &signed_by(&ann)),
                later,
                NOW_MS
            ),
            Ok("ann".into())
        );
    }

    /// A PUBLISH reaches every subscriber of its topic: put off unchecked, its id would
    /// stay free for a subscriber's copy with another body once the budget allows. So a
    /// PUBLISH its key's participant may make is checked whatever the budget says.
    #[test]
    fn a_publish_its_signer_may_make_is_checked_whatever_the_budget() {
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let mut c = config(&ann.public_key());
        c.mig.verifications_per_key_per_s = 1;
        c.mig.verifications_per_s = 1;
        if let Some(p) = c
            .namespaces
            .get_mut("acme")
            .and_then(|n| n.participants.get_mut("ann"))
            .map(std::sync::Arc::make_mut)
        {
            p.permissions.publish = vec!["chat.>".into()];
        }
        let mut a = Authenticator::new();
        let now = Instant::now();
        let forged = format!("NKey {} {}", ann.public_key(), "A".repeat(86));
        let _ = a.authenticate(&c, None, &req("_INBOX_acme_x.1", &forged), now, NOW_MS);
        assert!(matches!(
            a.authenticate(&c, None, &req("_INBOX_acme_x.2", &forged), now, NOW_MS),
            Err(Refusal::Busy(_))
        ));
        let publish = |subject: &'static str, authorization: &str, a: &mut Authenticator| {
            let mut r = req("_INBOX_acme_ann.1", authorization);
            r.subject = subject;
            r.exposed = true;
            a.admit(&c, None, &r, now, NOW_MS)
        };
        let subject = "mig.v0_1.acme.events.chat.room";
        let signed = format!("m1\n2026-12-01T00:00:00Z\n{subject}");
        let sig =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(ann.sign(signed.as_bytes()));
        let auth = format!("NKey {} {sig}", ann.public_key());
        assert_eq!(publish(subject, &auth, &mut a), Ok("ann".into()));
        // One she may not make would be refused all the same: it waits for the budget.
        assert!(matches!(
            publish("mig.v0_1.acme.events.other", &forged, &mut a),
            Err(Refusal::Busy(_))
        ));
    }
}
