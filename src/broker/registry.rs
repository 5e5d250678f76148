//! One namespace's registry as this broker sees it: a KV watch on `AMP_REGISTRY_<ns>`
//! mirrored into a map, so `who` answers locally and `watch` turns each change into
//! `up` / `update` / `down`. Entries of every broker sharing the JetStream appear here;
//! a broker that dies stops refreshing its keys, and their TTL expiry markers read as
//! `down`.
//!
//! One key per participant serves every broker: the value is the entry clients see plus
//! `brokers`, each broker's section (what its sessions of the participant serve, and
//! until when the section stands unless that broker writes it again). Brokers change
//! only their own section, by compare-and-set, and the entry shown sums them, so a
//! participant on two brokers is one entry that goes `down` only when its last session
//! on either ends.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::value::RawValue;

use super::binding;
use super::config::{Namespace, is_name};
use crate::jetstream::kv::{Kv, KvOperation, KvWatcher, WatchAction, WatchEvent, WatchOptions};
use crate::jetstream::{ApiPrefix, JsError};

/// An entry as its broker wrote it: JSON text checked to be one value. Kept as text
/// because every present participant of the namespace has one here, and a parsed
/// `Value` costs several times its text (about 600 bytes more per entry).
pub type Entry = Box<RawValue>;

/// What an entry says of the jobs its participant serves: per job, its slots (`serve`)
/// and leases held (`load`). An entry that does not say is read as serving nothing.
#[derive(Debug, Default, serde::Deserialize)]
pub struct Serving {
    #[serde(default)]
    pub serve: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    pub load: BTreeMap<String, serde_json::Value>,
}

impl Serving {
    pub fn of(entry: &RawValue) -> Serving {
        serde_json::from_str(entry.get()).unwrap_or_default()
    }
}

/// The most brokers' sections one entry keeps. A participant is on no more brokers than
/// share the namespace; past this a broker leaves its own out (the entry still shows the
/// participant, without what its sessions there serve) rather than grow the value.
pub const MAX_SECTIONS: usize = 64;

/// One broker's part of a participant's entry.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Section {
    /// Unix milliseconds after which any broker's next write drops it: its broker died
    /// or lost its way to NATS without removing it.
    pub until: i64,
    #[serde(default)]
    pub since: String,
    #[serde(default)]
    pub serve: BTreeMap<String, u64>,
    #[serde(default)]
    pub load: BTreeMap<String, u64>,
    /// Left out when the same as the entry's: labels are up to about 21 KB, and one
    /// participant's sessions nearly always say the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

/// An entry's value as brokers write it; brokers of earlier releases wrote no `brokers`.
#[derive(Default, serde::Deserialize)]
struct Written {
    #[serde(default)]
    broker: String,
    #[serde(default)]
    since: String,
    #[serde(default)]
    serve: BTreeMap<String, u64>,
    #[serde(default)]
    load: BTreeMap<String, u64>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// A value as stored: the entry shown to clients (the value without `brokers`) and the
/// `brokers` member's text, if any. None when the value is not JSON.
pub fn split(value: &[u8]) -> Option<(Entry, Option<Entry>)> {
    let mut parsed: serde_json::Value = serde_json::from_slice(value).ok()?;
    let brokers = parsed
        .as_object_mut()
        .and_then(|o| o.remove("brokers"))
        .and_then(|b| serde_json::value::to_raw_value(&b).ok());
    let shown = serde_json::value::to_raw_value(&parsed).ok()?;
    Some((shown, brokers))
}

/// The sections of a stored value. One an earlier release wrote (no `brokers`) is one
/// section of the broker it names, standing a TTL from when it was written.
pub fn sections_of(
    shown: &RawValue,
    brokers: Option<&RawValue>,
    written_ms: i64,
    ttl_ms: i64,
) -> BTreeMap<String, Section> {
    let entry: Written = serde_json::from_str(shown.get()).unwrap_or_default();
    let Some(brokers) = brokers else {
        if entry.broker.is_empty() {
            return BTreeMap::new();
        }
        let section = Section {
            until: written_ms.saturating_add(ttl_ms),
            since: entry.since,
            serve: entry.serve,
            load: entry.load,
            labels: Some(entry.labels),
        };
        return BTreeMap::from([(entry.broker, section)]);
    };
    let mut sections: BTreeMap<String, Section> =
        serde_json::from_str(brokers.get()).unwrap_or_default();
    for section in sections.values_mut() {
        section.labels.get_or_insert_with(|| entry.labels.clone());
    }
    sections
}

/// What a broker writes to make a participant's value hold `mine` as its section.
#[derive(Debug, PartialEq)]
pub enum Composed {
    Put(String),
    /// Its section was the last one standing.
    Delete,
    /// Nothing of it to remove.
    Nothing,
    /// [`MAX_SECTIONS`] other brokers hold sections.
    Full,
}

/// `sections` (as stored) with `me`'s section replaced by `mine` (removed with `None`)
/// and those past their `until` dropped; the entry shown sums what the sections serve,
/// has the earliest `since`, and the `broker` and `labels` of the latest session.
pub fn compose(
    name: &str,
    mut sections: BTreeMap<String, Section>,
    me: &str,
    mine: Option<Section>,
    now_ms: i64,
) -> Composed {
    let had_mine = sections.remove(me).is_some();
    sections.retain(|_, s| s.until > now_ms);
    match mine {
        None if !had_mine => return Composed::Nothing,
        None if sections.is_empty() => return Composed::Delete,
        None => {}
        Some(_) if sections.len() >= MAX_SECTIONS => return Composed::Full,
        Some(mine) => {
            sections.insert(me.to_string(), mine);
        }
    }
    let mut serve: BTreeMap<&str, u64> = BTreeMap::new();
    let mut load: BTreeMap<&str, u64> = BTreeMap::new();
    for section in sections.values() {
        for (job, n) in &section.serve {
            let sum = serve.entry(job).or_default();
            *sum = sum.saturating_add(*n);
        }
        for (job, n) in &section.load {
            let sum = load.entry(job).or_default();
            *sum = sum.saturating_add(*n);
        }
    }
    let since = sections.values().map(|s| s.since.as_str()).min();
    let latest = sections
        .iter()
        .max_by(|a, b| (&a.1.since, a.0).cmp(&(&b.1.since, b.0)));
    let (broker, labels) = match latest {
        Some((broker, s)) => (broker.clone(), s.labels.clone().unwrap_or_default()),
        None => (String::new(), BTreeMap::new()),
    };
    let value = serde_json::json!({
        "name": name,
        "serve": serve,
        "load": load,
        "labels": labels,
        "since": since,
        "broker": broker,
        "brokers": sections
            .iter()
            .map(|(id, s)| {
                let mut s = s.clone();
                if s.labels.as_ref() == Some(&labels) {
                    s.labels = None;
                }
                (id.clone(), s)
            })
            .collect::<BTreeMap<_, _>>(),
    });
    Composed::Put(value.to_string())
}

/// A change the watching sessions of this namespace are told about.
#[derive(Debug, Clone)]
pub enum Change {
    Up(String, Entry),
    Update(String, Entry),
    Down(String),
}

impl Change {
    pub fn name(&self) -> &str {
        match self {
            Change::Up(n, _) | Change::Update(n, _) | Change::Down(n) => n,
        }
    }

    pub fn into_name(self) -> String {
        match self {
            Change::Up(n, _) | Change::Update(n, _) | Change::Down(n) => n,
        }
    }
}

/// Whether the mirror keeps a key: the names of a namespace's participants are its only
/// legitimate keys, and anyone who may publish on `$KV.>` in the broker's account (or a
/// misbehaving server) could add others, each an `up` to every watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// A listed participant: always kept (the configuration bounds them).
    Listed,
    /// A name the namespace's `open` entry admits: kept while the mirror holds fewer than
    /// its cap.
    Open,
    /// Not a participant of the namespace.
    No,
}

impl Admit {
    /// How `ns`'s configuration takes `name` as a key of its registry.
    pub fn of(ns: &Namespace, name: &str) -> Admit {
        if ns.participants.contains_key(name) {
            Admit::Listed
        } else if ns.open.is_some() && is_name(name) {
            Admit::Open
        } else {
            Admit::No
        }
    }
}

/// Entries beyond which the mirror takes no new [`Admit::Open`] key: each present
/// participant holds a consumer on the namespace's inbox stream, and JetStream holds that
/// stream to `inbox.max_consumers` (at least the listed participants).
pub fn mirror_cap(ns: &Namespace) -> usize {
    usize::try_from(ns.inbox.max_consumers).unwrap_or(usize::MAX)
}

/// Keys the mirror left out, and when it last said so.
#[derive(Debug, Default)]
struct Refused {
    names: u64,
    full: u64,
    /// Refusals since the last warning, and when that was.
    unwarned: u64,
    warned: Option<Instant>,
}

/// The most often a registry mirror warns of keys it left out.
const REFUSAL_WARN_GAP: Duration = Duration::from_secs(60);

/// A participant's value as the watch last delivered it.
struct Mirrored {
    shown: Entry,
    brokers: Option<Entry>,
    revision: u64,
    written_ms: i64,
}

pub struct Registry {
    ns: String,
    watcher: KvWatcher,
    entries: BTreeMap<String, Mirrored>,
    ttl_ms: i64,
    /// While the watch reads the bucket again (after a reset): the names of `entries` it
    /// has seen so far; the others are gone when it is done.
    confirmed: Option<BTreeSet<String>>,
    ready: bool,
    /// The watch's deadline as last filed in the timer table, and its generation: a
    /// deadline filed earlier is stale when it fires.
    filed: Option<Instant>,
    generation: u64,
    refused: Refused,
}

impl Registry {
    /// `deliver_prefix` must be a subject nobody else uses; `consumer_base` a unique
    /// consumer name prefix (both per broker and namespace); `ttl_s` the entries' TTL.
    pub fn new(
        ns: &str,
        api: ApiPrefix,
        deliver_prefix: &str,
        consumer_base: &str,
        ttl_s: u64,
        now: Instant,
    ) -> Result<Registry, JsError> {
        let kv = Kv::new(api, &binding::registry_bucket(ns))?;
        // Rebuilt from the bucket after a reset unless the watch was away for less than
        // half of what any message of the bucket lives (every write and delete carries
        // the TTL, markers live as long): a delete that aged out while the watch was
        // away would otherwise stay in the mirror for good.
        // A bucket not there yet (a leaf site's hub that came up after it, before the
        // site made the bucket there) is asked for again, not given up on.
        let options = WatchOptions {
            resync: true,
            resume_within_lifetime: Some(Duration::from_secs(ttl_s)),
            missing_bucket_retry: Some(Duration::from_secs(1)),
            ..WatchOptions::default()
        };
        let watcher = KvWatcher::new(kv, options, deliver_prefix, consumer_base, now)?;
        Ok(Registry {
            ns: ns.to_string(),
            watcher,
            entries: BTreeMap::new(),
            ttl_ms: i64::try_from(ttl_s.saturating_mul(1000)).unwrap_or(i64::MAX),
            confirmed: None,
            ready: false,
            filed: None,
            generation: 0,
            refused: Refused::default(),
        })
    }

    pub fn watcher(&mut self) -> &mut KvWatcher {
        &mut self.watcher
    }

    /// The watch's deadline with its generation, when it is to be filed: none is filed,
    /// or it moved before the one filed. A deadline that moved later (every message of
    /// the watch pushes the silence deadline back) needs nothing: the one filed fires
    /// early and [`Registry::on_deadline`] files the next.
    pub fn deadline_to_file(&mut self) -> Option<(Instant, u64)> {
        let at = self.watcher.poll_timeout()?;
        if self.filed.is_some_and(|filed| filed <= at) {
            return None;
        }
        self.generation = self.generation.wrapping_add(1);
        self.filed = Some(at);
        Some((at, self.generation))
    }

    /// A filed deadline is due: the watch checks its own (retry, silence) unless the
    /// deadline is stale. False when it was.
    pub fn on_deadline(&mut self, generation: u64, now: Instant) -> bool {
        if generation != self.generation {
            return false;
        }
        self.filed = None;
        self.watcher.handle_timeout(now);
        true
    }

    /// The connection to NATS is back, or the bucket was made again (`why`): a new
    /// consumer (one that outlived the outage delivered nothing meanwhile) resumes, or
    /// reads the bucket again when a delete made meanwhile may have aged out of the
    /// stream since or the stream is a new one.
    pub fn restart(&mut self, why: &str, now: Instant) {
        self.watcher.restart(why, now);
    }

    /// How many times the watch read every entry of the bucket.
    pub fn resyncs(&self) -> u64 {
        self.watcher.resyncs()
    }

    pub fn poll_action(&mut self) -> Option<WatchAction> {
        self.watcher.poll_action()
    }

    /// Whether every entry that existed when the watch started has been seen.
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    pub fn entries(&self) -> impl Iterator<Item = (&String, &Entry)> {
        self.entries.iter().map(|(name, m)| (name, &m.shown))
    }

    /// The revision of `name`'s value as last seen here.
    pub fn revision(&self, name: &str) -> Option<u64> {
        self.entries.get(name).map(|m| m.revision)
    }

    /// The revision of `name`'s value as last seen here, and its sections.
    pub fn sections(&self, name: &str) -> Option<(u64, BTreeMap<String, Section>)> {
        let m = self.entries.get(name)?;
        let sections = sections_of(&m.shown, m.brokers.as_deref(), m.written_ms, self.ttl_ms);
        Some((m.revision, sections))
    }

    /// Whether `name`'s value as last seen here has a section of `broker`.
    pub fn has_section(&self, name: &str, broker: &str) -> bool {
        self.sections(name)
            .is_some_and(|(_, sections)| sections.contains_key(broker))
    }

    /// The sections of a value read with a get: as [`Registry::sections`].
    pub fn sections_read(&self, value: &[u8], written_ms: i64) -> BTreeMap<String, Section> {
        split(value)
            .map(|(shown, brokers)| {
                sections_of(&shown, brokers.as_deref(), written_ms, self.ttl_ms)
            })
            .unwrap_or_default()
    }

    /// Entries present (what a listing of them costs).
    pub fn present(&self) -> usize {
        self.entries.len()
    }

    /// The entries named after `after` (all with `None`), in name order.
    pub fn entries_after(&self, after: Option<&str>) -> impl Iterator<Item = (&String, &Entry)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = after.map_or(Unbounded, Excluded);
        self.entries
            .range::<str, _>((from, Unbounded))
            .map(|(name, m)| (name, &m.shown))
    }

    /// Entries that count toward the cap: during a re-read only those it has read again,
    /// since the rest go when it is done. Until then the mirror holds at most the cap
    /// more.
    fn held(&self) -> usize {
        self.confirmed
            .as_ref()
            .map_or(self.entries.len(), BTreeSet::len)
    }

    /// `name` is one of those [`Self::held`] counts: a held name not read again yet
    /// competes with new ones, or each re-read could keep up to the cap more for good.
    fn counted(&self, name: &str) -> bool {
        self.confirmed
            .as_ref()
            .map_or_else(|| self.entries.contains_key(name), |c| c.contains(name))
    }

    /// Keys left out: not a participant's name, and past the cap.
    pub fn refused(&self) -> (u64, u64) {
        (self.refused.names, self.refused.full)
    }

    fn refuse(&mut self, name: &str, why: &str, now: Instant) {
        self.refused.unwarned += 1;
        if self
            .refused
            .warned
            .is_some_and(|at| now.saturating_duration_since(at) < REFUSAL_WARN_GAP)
        {
            return;
        }
        let count = std::mem::take(&mut self.refused.unwarned);
        self.refused.warned = Some(now);
        log::warn!(ns:% = self.ns, key:? = name; "registry mirror left out {count} key(s) since its last warning, this one as {why}");
    }

    /// Applies what the watch reported since the last call; returns the changes. A key
    /// `admit` refuses is left out (and dropped if held), as is a new [`Admit::Open`] one
    /// while `cap` entries are held.
    pub fn poll_changes(
        &mut self,
        now: Instant,
        admit: impl Fn(&str) -> Admit,
        cap: usize,
    ) -> Vec<Change> {
        let mut changes = Vec::new();
        while let Some(event) = self.watcher.poll_event(now) {
            match event {
                WatchEvent::Entry(entry) => {
                    let name = entry.key.clone();
                    let live = entry.operation == KvOperation::Put && entry.marker.is_none();
                    let mut value = if live { split(&entry.value) } else { None };
                    if value.is_some() {
                        match admit(&name) {
                            Admit::Open if self.held() >= cap && !self.counted(&name) => {
                                self.refused.full += 1;
                                self.refuse(&name, "one past the cap", now);
                                continue;
                            }
                            Admit::Listed | Admit::Open => {}
                            Admit::No => {
                                self.refused.names += 1;
                                self.refuse(&name, "no participant's name", now);
                                // One held since a reload delisted it goes.
                                value = None;
                            }
                        }
                    }
                    if let (Some(confirmed), Some(_)) = (&mut self.confirmed, &value) {
                        confirmed.insert(name.clone());
                    }
                    match value {
                        // Entries are compared as shown: a refresh that moves only a
                        // section's `until` tells nobody. Brokers write them with one
                        // serialiser (members sorted), so the same entry is the same text.
                        Some((shown, brokers)) => {
                            let mirrored = Mirrored {
                                shown: shown.clone(),
                                brokers,
                                revision: entry.revision,
                                written_ms: i64::try_from(entry.created_nanos / 1_000_000)
                                    .unwrap_or(0),
                            };
                            match self.entries.insert(name.clone(), mirrored) {
                                None => changes.push(Change::Up(name, shown)),
                                Some(old) if old.shown.get() != shown.get() => {
                                    changes.push(Change::Update(name, shown))
                                }
                                Some(_) => {}
                            }
                        }
                        None => {
                            if self.entries.remove(&name).is_some() {
                                changes.push(Change::Down(name));
                            }
                        }
                    }
                }
                WatchEvent::InitialValuesDone => {
                    self.ready = true;
                    if let Some(confirmed) = self.confirmed.take() {
                        let gone: Vec<String> = self
                            .entries
                            .keys()
                            .filter(|name| !confirmed.contains(*name))
                            .cloned()
                            .collect();
                        for name in gone {
                            self.entries.remove(&name);
                            changes.push(Change::Down(name));
                        }
                    }
                }
                WatchEvent::Reset { reason } => log::info!("registry watch reset: {reason}"),
                WatchEvent::Resync => self.confirmed = Some(BTreeSet::new()),
                WatchEvent::Failed(e) => log::warn!("registry watch failed: {e}"),
            }
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_kept_as_text_still_says_what_its_participant_serves() {
        let entry: Entry = serde_json::from_str(
            r#"{"broker":"b1","labels":{},"load":{"render":1},"name":"w1","serve":{"render":2}}"#,
        )
        .expect("entry");
        let serving = Serving::of(&entry);
        assert_eq!(serving.serve["render"], 2);
        assert_eq!(serving.load["render"], 1);
        let bare: Entry = serde_json::from_str(r#"{"name":"w2"}"#).expect("entry");
        assert!(Serving::of(&bare).serve.is_empty());
        let odd: Entry = serde_json::from_str(r#"{"serve":[1]}"#).expect("entry");
        assert!(
            Serving::of(&odd).serve.is_empty(),
            "an entry in another shape serves nothing"
        );
    }

    fn section(until: i64, since: &str, render: u64) -> Section {
        Section {
            until,
            since: since.into(),
            serve: BTreeMap::from([("render".to_string(), render)]),
            load: BTreeMap::from([("render".to_string(), 0)]),
            labels: Some(BTreeMap::from([("gpu".to_string(), "yes".to_string())])),
        }
    }

    fn put(composed: Composed) -> serde_json::Value {
        match composed {
            Composed::Put(text) => serde_json::from_str(&text).expect("json"),
            other => panic!("{other:?}"),
        }
    }

    /// The sections of a value as a broker writes it, as the watch would deliver it.
    fn read_back(value: &serde_json::Value) -> BTreeMap<String, Section> {
        let (shown, brokers) = split(value.to_string().as_bytes()).expect("value");
        sections_of(&shown, brokers.as_deref(), 0, 15_000)
    }

    #[test]
    fn each_broker_changes_its_own_section_and_the_entry_sums_them() {
        let t = 1_000_000;
        let one = put(compose(
            "p",
            BTreeMap::new(),
            "b1",
            Some(section(t + 15_000, "2026-01-01T00:00:01.000Z", 2)),
            t,
        ));
        assert_eq!(one["serve"]["render"], 2);
        assert_eq!(one["broker"], "b1");
        // Labels the same as the entry's are written once.
        assert!(one["brokers"]["b1"].get("labels").is_none(), "{one}");
        let two = put(compose(
            "p",
            read_back(&one),
            "b2",
            Some(section(t + 15_000, "2026-01-01T00:00:02.000Z", 3)),
            t,
        ));
        assert_eq!(two["serve"]["render"], 5, "{two}");
        assert_eq!(two["since"], "2026-01-01T00:00:01.000Z");
        assert_eq!(two["broker"], "b2", "the latest session's");
        assert_eq!(two["labels"]["gpu"], "yes");
        let sections = read_back(&two);
        assert_eq!(
            sections["b1"].labels,
            section(0, "", 0).labels,
            "labels read back"
        );
        // A refresh that changes nothing but `until` shows the same entry.
        let again = put(compose(
            "p",
            sections.clone(),
            "b1",
            Some(section(t + 20_000, "2026-01-01T00:00:01.000Z", 2)),
            t + 5_000,
        ));
        let shown = |v: &serde_json::Value| {
            split(v.to_string().as_bytes()).map(|(s, _)| s.get().to_string())
        };
        assert_eq!(shown(&again), shown(&two));
        // Removing one's section leaves the other's; the last one's is a delete.
        let left = put(compose("p", sections, "b1", None, t));
        assert_eq!(left["serve"]["render"], 3);
        assert_eq!(left["since"], "2026-01-01T00:00:02.000Z");
        assert_eq!(
            compose("p", read_back(&left), "b2", None, t),
            Composed::Delete
        );
        assert_eq!(
            compose("p", read_back(&left), "b1", None, t),
            Composed::Nothing
        );
    }

    #[test]
    fn a_dead_brokers_section_goes_at_the_next_write_and_an_earlier_release_reads_as_one() {
        let t = 1_000_000;
        let dead = BTreeMap::from([(
            "b9".to_string(),
            section(t - 1, "2026-01-01T00:00:00.000Z", 7),
        )]);
        let mine = section(t + 15_000, "2026-01-01T00:00:05.000Z", 1);
        let value = put(compose("p", dead.clone(), "b1", Some(mine), t));
        assert_eq!(value["serve"]["render"], 1, "{value}");
        assert!(value["brokers"].get("b9").is_none(), "{value}");
        // Nothing of this broker's there: a dead broker's section is left to the key's TTL.
        assert_eq!(compose("p", dead, "b1", None, t), Composed::Nothing);
        // A value without sections is its broker's one, standing a TTL from its write.
        let old = br#"{"broker":"b0","labels":{},"load":{"render":1},"name":"p","serve":{"render":4},"since":"2026-01-01T00:00:00.000Z"}"#;
        let (shown, brokers) = split(old).expect("value");
        assert!(brokers.is_none());
        let sections = sections_of(&shown, None, t, 15_000);
        assert_eq!(sections["b0"].until, t + 15_000);
        assert_eq!(sections["b0"].serve["render"], 4);
        let value = put(compose(
            "p",
            sections,
            "b1",
            Some(section(t + 15_000, "2026-01-01T00:00:05.000Z", 1)),
            t,
        ));
        assert_eq!(value["serve"]["render"], 5, "{value}");
        assert_eq!(value["load"]["render"], 1, "{value}");
    }

    #[test]
    fn an_entry_keeps_at_most_max_sections_and_a_broker_past_them_leaves_its_own_out() {
        let t = 1_000_000;
        let full: BTreeMap<String, Section> = (0..MAX_SECTIONS)
            .map(|i| {
                (
                    format!("b{i:03}"),
                    section(t + 1, "2026-01-01T00:00:00.000Z", 1),
                )
            })
            .collect();
        let mine = section(t + 15_000, "2026-01-01T00:00:05.000Z", 1);
        assert_eq!(
            compose("p", full.clone(), "me", Some(mine.clone()), t),
            Composed::Full
        );
        // One already in keeps its place.
        let value = put(compose("p", full, "b000", Some(mine), t));
        assert_eq!(value["serve"]["render"], MAX_SECTIONS, "{value}");
    }

    #[test]
    fn a_watch_that_finds_no_bucket_asks_again_later() {
        // A leaf site whose hub came up after it: the watch's create reached the hub
        // before the site had made the bucket there, and the watch stopped for good.
        let t0 = Instant::now();
        let mut r = Registry::new("acme", ApiPrefix::new(), "_INBOX.w", "reg_b1_acme", 15, t0)
            .expect("registry");
        let create = |r: &mut Registry| {
            std::iter::from_fn(|| r.poll_action()).find_map(|a| match a {
                WatchAction::Request { kind, .. } => Some(kind),
                _ => None,
            })
        };
        let kind = create(&mut r).expect("a consumer create");
        let gone = br#"{"error":{"code":404,"err_code":10059,"description":"stream not found"}}"#;
        r.watcher().on_reply(kind, Ok(gone), t0);
        assert!(r.poll_changes(t0, |_| Admit::Listed, 1).is_empty());
        assert!(!r.watcher().is_stopped(), "the watch stopped");
        let (at, generation) = r.deadline_to_file().expect("a retry");
        assert!(
            at > t0 && at <= t0 + Duration::from_secs(2),
            "{:?}",
            at - t0
        );
        assert!(r.on_deadline(generation, at));
        assert!(create(&mut r).is_some(), "asked again");
    }

    /// Answers the create of `r`'s watch and delivers `keys` to it, each a put of an
    /// entry, the last with nothing pending after it.
    fn delivered(r: &mut Registry, keys: &[&str], t0: Instant) {
        let kind = std::iter::from_fn(|| r.poll_action())
            .find_map(|a| match a {
                WatchAction::Request { kind, .. } => Some(kind),
                _ => None,
            })
            .expect("a consumer create");
        let consumer = r.watcher().consumer_name().to_string();
        let info = serde_json::json!({
            "stream_name": "KV_AMP_REGISTRY_acme", "name": consumer, "config": {},
            "num_pending": keys.len(),
        });
        r.watcher()
            .on_reply(kind, Ok(info.to_string().as_bytes()), t0);
        for (i, key) in keys.iter().enumerate() {
            let seq = i + 1;
            let pending = keys.len() - seq;
            let reply = format!(
                "$JS.ACK.KV_AMP_REGISTRY_acme.{consumer}.1.{seq}.{seq}.1700000000000000000.{pending}"
            );
            let subject = format!("$KV.AMP_REGISTRY_acme.{key}");
            let payload = format!(r#"{{"name":"{key}","broker":"b9"}}"#);
            r.watcher().on_message(
                &crate::jetstream::Delivery {
                    subject: &subject,
                    reply: Some(&reply),
                    headers: None,
                    payload: payload.as_bytes(),
                },
                t0,
            );
        }
    }

    fn namespace(open: bool, max_consumers: u64) -> Namespace {
        let mut ns = serde_json::json!({
            "participants": {"w1": {"token_sha256": "a".repeat(64)}},
            "inbox": {"max_consumers": max_consumers},
        });
        if open {
            ns["open"] = serde_json::json!({"token_sha256": "b".repeat(64)});
        }
        let config = serde_json::json!({"namespaces": {"acme": ns}});
        let mut config =
            super::super::config::Config::parse(config.to_string().as_bytes()).expect("config");
        config.namespaces.remove("acme").expect("acme")
    }

    fn ups(changes: &[Change]) -> Vec<&str> {
        changes
            .iter()
            .filter(|c| matches!(c, Change::Up(..)))
            .map(Change::name)
            .collect()
    }

    #[test]
    fn the_mirror_keeps_only_participant_names_and_at_most_its_cap_of_open_ones() {
        // Anyone who may publish on `$KV.AMP_REGISTRY_acme.<key>` made every broker mirror
        // the key and tell every watcher `up`, without bound.
        let t0 = Instant::now();
        let keys = ["ceo", "w1", "o1", "o2", "o3", "o4", "a_b-1"];
        let listed_only = namespace(false, 3);
        let mut r = Registry::new("acme", ApiPrefix::new(), "_INBOX.w", "reg_b1_acme", 15, t0)
            .expect("registry");
        delivered(&mut r, &keys, t0);
        let changes = r.poll_changes(t0, |n| Admit::of(&listed_only, n), mirror_cap(&listed_only));
        assert_eq!(ups(&changes), ["w1"]);
        assert_eq!(r.present(), 1);
        assert_eq!(r.refused(), (6, 0));

        // With `open`, any valid name is a participant's, up to the cap; the listed one
        // still fits past it.
        let open = namespace(true, 3);
        let mut r = Registry::new("acme", ApiPrefix::new(), "_INBOX.w", "reg_b1_acme", 15, t0)
            .expect("registry");
        let keys = ["o0", "o1", "o2", "ceo", "o3", "a_b-1", "w1"];
        delivered(&mut r, &keys, t0);
        let changes = r.poll_changes(t0, |n| Admit::of(&open, n), mirror_cap(&open));
        assert_eq!(ups(&changes), ["o0", "o1", "o2", "w1"], "{changes:?}");
        assert_eq!(r.present(), 4);
        assert_eq!(r.refused(), (0, 3));
        assert_eq!(Admit::of(&open, "a.b"), Admit::No);
        assert_eq!(Admit::of(&open, &"x".repeat(65)), Admit::No);
    }

    #[test]
    fn a_re_read_counts_only_the_entries_it_has_read_toward_the_cap() {
        // After an outage the watch reads every key again, and the entries that expired
        // meanwhile are dropped only once that read is done: counted until then, they
        // left the names that came meanwhile out until their brokers' next refresh.
        let t0 = Instant::now();
        let open = namespace(true, 3);
        let mut r = Registry::new("acme", ApiPrefix::new(), "_INBOX.w", "reg_b1_acme", 15, t0)
            .expect("registry");
        delivered(&mut r, &["o0", "o1", "o2"], t0);
        let changes = r.poll_changes(t0, |n| Admit::of(&open, n), mirror_cap(&open));
        assert_eq!(ups(&changes), ["o0", "o1", "o2"]);

        let later = t0 + Duration::from_secs(120);
        r.watcher().restart("reconnected", later);
        delivered(&mut r, &["o2", "o3", "o4", "o5"], later);
        let changes = r.poll_changes(later, |n| Admit::of(&open, n), mirror_cap(&open));
        assert_eq!(ups(&changes), ["o3", "o4"], "{changes:?}");
        let mut present: Vec<&str> = r.entries_after(None).map(|(n, _)| n.as_str()).collect();
        present.sort_unstable();
        assert_eq!(present, ["o2", "o3", "o4"]);
        assert_eq!(r.refused(), (0, 1), "o5 is one past the cap");
    }

    #[test]
    fn a_re_read_keeps_at_most_its_cap_when_held_names_come_after_new_ones() {
        // A held name read again after the cap was filled with new ones was admitted
        // because the mirror still held it: each re-read could add up to the cap more.
        let t0 = Instant::now();
        let open = namespace(true, 3);
        let mut r = Registry::new("acme", ApiPrefix::new(), "_INBOX.w", "reg_b1_acme", 15, t0)
            .expect("registry");
        delivered(&mut r, &["o0", "o1", "o2"], t0);
        r.poll_changes(t0, |n| Admit::of(&open, n), mirror_cap(&open));

        let later = t0 + Duration::from_secs(120);
        r.watcher().restart("reconnected", later);
        delivered(&mut r, &["o3", "o4", "o5", "o0", "o1", "o2"], later);
        r.poll_changes(later, |n| Admit::of(&open, n), mirror_cap(&open));
        let mut present: Vec<&str> = r.entries_after(None).map(|(n, _)| n.as_str()).collect();
        present.sort_unstable();
        assert_eq!(present, ["o3", "o4", "o5"]);
        assert_eq!(r.refused(), (0, 3));
    }

    #[test]
    fn the_watch_deadline_is_filed_once_and_earlier_ones_go_stale() {
        let t0 = Instant::now();
        let mut r = Registry::new("acme", ApiPrefix::new(), "_INBOX.w", "reg_b1_acme", 15, t0)
            .expect("registry");
        let silence = t0 + Duration::from_secs(15);
        let (at, first) = r.deadline_to_file().expect("a deadline to file");
        assert_eq!(at, silence);
        assert_eq!(r.deadline_to_file(), None, "filed already");
        // Fired before the watch is due: nothing happens but the next one is filed.
        let early = t0 + Duration::from_secs(1);
        assert!(r.on_deadline(first, early));
        let (_, second) = r.deadline_to_file().expect("filed again");
        assert_ne!(first, second);
        assert!(!r.on_deadline(first, silence), "an earlier filing is stale");
        assert!(r.on_deadline(second, silence));
    }
}
