//! One namespace's registry as this broker sees it: a KV watch on `AMP_REGISTRY_<ns>`
//! mirrored into a map, so `who` answers locally and `watch` turns each change into
//! `up` / `update` / `down`. Entries of every broker sharing the JetStream appear here;
//! a broker that dies stops refreshing its keys, and their TTL expiry markers read as
//! `down`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::value::RawValue;

use super::binding;
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
}

pub struct Registry {
    watcher: KvWatcher,
    entries: BTreeMap<String, Entry>,
    /// While the watch reads the bucket again (after a reset): the names of `entries` it
    /// has seen so far; the others are gone when it is done.
    confirmed: Option<BTreeSet<String>>,
    ready: bool,
    /// The watch's deadline as last filed in the timer table, and its generation: a
    /// deadline filed earlier is stale when it fires.
    filed: Option<Instant>,
    generation: u64,
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
            watcher,
            entries: BTreeMap::new(),
            confirmed: None,
            ready: false,
            filed: None,
            generation: 0,
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

    /// The connection to NATS is back: a new consumer (one that outlived the outage
    /// delivered nothing meanwhile) resumes, or reads the bucket again when a delete made
    /// meanwhile may have aged out of the stream since.
    pub fn restart(&mut self, now: Instant) {
        self.watcher.restart("the NATS connection was lost", now);
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
        self.entries.iter()
    }

    /// Entries present (what a listing of them costs).
    pub fn present(&self) -> usize {
        self.entries.len()
    }

    /// The entries named after `after` (all with `None`), in name order.
    pub fn entries_after(&self, after: Option<&str>) -> impl Iterator<Item = (&String, &Entry)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = after.map_or(Unbounded, Excluded);
        self.entries.range::<str, _>((from, Unbounded))
    }

    /// Applies what the watch reported since the last call; returns the changes.
    pub fn poll_changes(&mut self, now: Instant) -> Vec<Change> {
        let mut changes = Vec::new();
        while let Some(event) = self.watcher.poll_event(now) {
            match event {
                WatchEvent::Entry(entry) => {
                    let name = entry.key.clone();
                    let live = entry.operation == KvOperation::Put && entry.marker.is_none();
                    let value = if live {
                        serde_json::from_slice::<Entry>(&entry.value).ok()
                    } else {
                        None
                    };
                    if let (Some(confirmed), Some(_)) = (&mut self.confirmed, &value) {
                        confirmed.insert(name.clone());
                    }
                    match value {
                        // Brokers write entries with one serialiser (members sorted), so
                        // the same entry is the same text.
                        Some(value) => match self.entries.insert(name.clone(), value.clone()) {
                            None => changes.push(Change::Up(name, value)),
                            Some(old) if old.get() != value.get() => {
                                changes.push(Change::Update(name, value))
                            }
                            Some(_) => {}
                        },
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
        assert!(r.poll_changes(t0).is_empty());
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
