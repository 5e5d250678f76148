//! The registry: this broker's participants in the namespace's KV bucket, the watch
//! that mirrors every broker's, and `who` / `watch`.

use super::*;
use crate::broker::registry::{
    Admit, Change, Composed, Entry, MAX_SECTIONS, Section, Serving, compose, mirror_cap,
};
use crate::jetstream::MsgTtl;
use crate::jetstream::kv::Kv;

/// The most bytes of `up` frames one burst of a `watch` snapshot queues.
const SNAPSHOT_BURST: usize = 256 * 1024;

/// The least time between two writes of one participant's entry (a `serve` at the frame
/// rate, or a hello and a close over and over, would otherwise be a KV write, and an
/// `update` to every watcher on every broker, each time); a change within it is written
/// when it has passed, and an entry never written needs no delete.
pub(super) const REGISTRY_WRITE_GAP: Duration = Duration::from_millis(100);
/// Participants whose last registry write here is remembered for the gap.
pub(super) const REGISTRY_RECENT: usize = 65_536;
/// Participants whose unpaid `listing` bucket outlives their sessions, at most: more than
/// leave owing within the seconds a listing takes to pay back, short of an attacker with
/// names to spare, who gains nothing by pushing its own out that a new name would not
/// give it.
pub(super) const LISTING_DEBTS: usize = 4096;
/// Compare-and-set refusals in a row before a write waits for the next refresh: each is
/// another broker's write in between, so more than a few means they keep racing.
const REGISTRY_CAS_TRIES: u8 = 8;

/// A request about a participant's entry: a compare-and-set write or delete on the
/// revision given, or a read.
enum RegistryOp {
    Put(String, u64),
    Delete(u64),
    Read,
}

/// A participant's registry entry as this broker writes it (see `Presence::registry`).
#[derive(Default)]
pub(super) struct Written {
    section: SectionState,
    /// When this broker last wrote or deleted it.
    last: Option<Instant>,
    /// Its `RegistryRefresh` timer is armed.
    pub(super) refreshing: bool,
}

/// What this broker knows of the registry entries of participants no longer present: the
/// write state of those whose delete is still out, the time of the last write while
/// `REGISTRY_WRITE_GAP` runs, and their still armed refresh timers.
pub(super) struct Kept {
    pub(super) sections: HashMap<String, SectionState>,
    pub(super) last: BoundedMap<String, Instant>,
    pub(super) refreshing: HashSet<String>,
}

impl Default for Kept {
    fn default() -> Self {
        Kept {
            sections: HashMap::new(),
            last: BoundedMap::new(REGISTRY_RECENT),
            refreshing: HashSet::new(),
        }
    }
}

impl Kept {
    /// What was kept of a participant's entry since it was last present, for its new
    /// `Presence`.
    pub(super) fn arrived(&mut self, key: &str) -> Written {
        Written {
            section: self.sections.remove(key).unwrap_or_default(),
            last: self.last.remove(&key.to_string()),
            refreshing: self.refreshing.remove(key),
        }
    }

    /// Keeps what a participant's leaving `Presence` knew of its entry: its write state
    /// (its delete is written next), the time of its last write, its armed refresh timer.
    pub(super) fn left(&mut self, key: &str, written: Written) {
        self.sections.insert(key.to_string(), written.section);
        if let Some(at) = written.last {
            *self.last.get_or_insert_with(key.to_string(), || at) = at;
        }
        if written.refreshing {
            self.refreshing.insert(key.to_string());
        }
    }
}

/// Where this broker's section of one participant's entry stands.
#[derive(Default)]
pub(super) struct SectionState {
    /// A write or read of the entry is out; the next waits for its answer.
    busy: bool,
    /// Something changed while busy: written once it is answered.
    again: bool,
    /// Refusals in a row.
    refused: u8,
    /// The highest revision this broker's writes were acknowledged at: a mirror behind
    /// it has yet to see them, and the entry is read instead.
    acked: u64,
    /// The entry as read after a refusal, for the next write.
    read: Option<(u64, BTreeMap<String, Section>)>,
}

/// Presence changes of a namespace, each to be told to every watcher whose snapshot has
/// passed its name (see [`Broker::next_presence_frame`]).
#[derive(Debug)]
pub(super) struct Fanout {
    ns: String,
    /// Each change's name and frame, in the order they came.
    changes: Vec<(String, String)>,
    /// The change being told.
    next: usize,
    /// The last watcher told it.
    told: Option<SessionId>,
}

/// Where a watcher's snapshot stands: the last name sent, and what the session was told
/// before a repeated `watch` started it over.
pub(super) struct Snapshot {
    ns: String,
    after: Option<String>,
    told: Told,
}

/// Names a session was told `up` for, and every change of since: their changes are told
/// at once even while the snapshot has yet to reach them again.
enum Told {
    Nothing,
    UpTo(String),
    All,
}

impl Told {
    fn covers(&self, name: &str) -> bool {
        match self {
            Told::Nothing => false,
            Told::UpTo(last) => name <= last.as_str(),
            Told::All => true,
        }
    }

    /// With the names up to `after` too.
    fn and(self, after: Option<String>) -> Told {
        match (self, after) {
            (Told::All, _) => Told::All,
            (told, None) => told,
            (Told::UpTo(last), Some(after)) => Told::UpTo(last.max(after)),
            (Told::Nothing, Some(after)) => Told::UpTo(after),
        }
    }
}

impl Broker {
    /// This broker's section of the participant's entry: what its sessions here serve,
    /// standing one TTL from `now`. None when it has no session here.
    fn registry_section(&self, ns: &str, name: &str, now: Instant) -> Option<Section> {
        let p = self.presence.get(&participant_key(ns, name))?;
        let (serve, load) = self.jobs.registry_view(ns, name);
        let ttl_ms = self.config.limits.registry_ttl_s.saturating_mul(1000);
        Some(Section {
            until: self
                .clock
                .ms(now)
                .saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX)),
            since: p.since.clone(),
            serve: serve.into_iter().map(|(j, n)| (j, u64::from(n))).collect(),
            load: load.into_iter().map(|(j, n)| (j, u64::from(n))).collect(),
            labels: Some(p.labels.clone()),
        })
    }

    /// Writes the entry and keeps it refreshed while the participant is present. A timer
    /// still armed from an earlier presence carries on the refreshing (it fires within one
    /// interval), so a participant never has more than one chain.
    pub(super) fn registry_put(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        name: &str,
        now: Instant,
    ) {
        self.registry_changed(conn, ns, name, now);
        let key = participant_key(ns, name);
        let armed = match self.presence.get_mut(&key) {
            Some(p) => std::mem::replace(&mut p.registry.refreshing, true),
            None => !self.registry_kept.refreshing.insert(key.clone()),
        };
        if armed {
            return;
        }
        let ttl = self.config.limits.registry_ttl_s;
        let refresh = Duration::from_secs(ttl).div_f64(3.0);
        match now.checked_add(refresh) {
            Some(at) => self.set_timer(at, Timer::RegistryRefresh(key)),
            // Beyond the clock's range: the entry outlives the process anyway.
            None => match self.presence.get_mut(&key) {
                Some(p) => p.registry.refreshing = false,
                None => {
                    self.registry_kept.refreshing.remove(&key);
                }
            },
        }
    }

    /// The participant's entry changed (it came, or what it serves changed): written now,
    /// or once `REGISTRY_WRITE_GAP` has passed since its last write or delete here, with
    /// every change until then.
    pub(super) fn registry_changed(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        name: &str,
        now: Instant,
    ) {
        let key = participant_key(ns, name);
        let Some(p) = self.presence.get_mut(&key) else {
            return;
        };
        if p.registry_due {
            return;
        }
        match p.registry.last.map(|at| after(at, REGISTRY_WRITE_GAP)) {
            Some(next) if next > now => {
                p.registry_due = true;
                self.set_timer(next, Timer::RegistryFlush(key));
            }
            _ => self.registry_write(conn, ns, name, now),
        }
    }

    /// Writes this broker's section of the entry now, without starting another refresh
    /// cycle.
    pub(super) fn registry_write(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        name: &str,
        now: Instant,
    ) {
        self.registry_sync(conn, ns, name, now);
    }

    /// Makes the participant's entry hold this broker's section as it is now (none once
    /// its last session here ended): a compare-and-set on the revision last seen, so
    /// other brokers' sections stay as they are. One write per participant is out at a
    /// time; a change meanwhile is written once it is answered.
    pub(super) fn registry_sync(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        name: &str,
        now: Instant,
    ) {
        let key = participant_key(ns, name);
        let state = self.section_entry(&key);
        if state.busy {
            state.again = true;
            return;
        }
        state.again = false;
        let acked = state.acked;
        let base = match state.read.take() {
            Some(read) => Some(read),
            None => match self.registries.get(ns).and_then(|(r, _)| r.sections(name)) {
                Some((revision, sections)) if revision >= acked => Some((revision, sections)),
                // Not there, as far as this broker knows: a create, refused (and the key
                // read) when it holds a delete marker or a value the mirror has yet to see.
                None if acked == 0 => Some((0, BTreeMap::new())),
                // The mirror has yet to see this broker's own last write: read the key.
                _ => None,
            },
        };
        let Some((revision, sections)) = base else {
            return self.registry_request(conn, ns, name, RegistryOp::Read, now);
        };
        let mine = self.registry_section(ns, name, now);
        match compose(name, sections, &self.broker_id, mine, self.clock.ms(now)) {
            Composed::Put(value) => {
                let op = RegistryOp::Put(value, revision);
                self.registry_request(conn, ns, name, op, now)
            }
            Composed::Delete => {
                self.registry_request(conn, ns, name, RegistryOp::Delete(revision), now)
            }
            Composed::Nothing => match self.presence.get_mut(&key) {
                Some(p) => p.registry.section = SectionState::default(),
                None => {
                    self.registry_kept.sections.remove(&key);
                }
            },
            Composed::Full => log::warn!(
                participant:% = key;
                "registry entry holds {MAX_SECTIONS} other brokers' sections; this one's left out"
            ),
        }
    }

    fn registry_request(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        name: &str,
        op: RegistryOp,
        now: Instant,
    ) {
        let key = participant_key(ns, name);
        let ttl = MsgTtl::After(Duration::from_secs(self.config.limits.registry_ttl_s));
        let request = Kv::new(self.config.js_api(ns), &binding::registry_bucket(ns)).and_then(
            |kv| match &op {
                RegistryOp::Put(value, revision) => {
                    kv.update_ttl_request(name, value.as_bytes(), *revision, ttl)
                }
                RegistryOp::Delete(revision) => {
                    kv.delete_ttl_request(name, Some(*revision), Some(ttl))
                }
                RegistryOp::Read => kv.get_request(name),
            },
        );
        match js_request(conn, request, now) {
            Ok(req) => {
                if let Some(state) = self.section_mut(&key) {
                    state.busy = true;
                }
                if !matches!(op, RegistryOp::Read) {
                    match self.presence.get_mut(&key) {
                        Some(p) => p.registry.last = Some(now),
                        None => {
                            *self
                                .registry_kept
                                .last
                                .get_or_insert_with(key.clone(), || now) = now
                        }
                    }
                }
                let pending = match op {
                    RegistryOp::Read => Pending::RegistryRead { participant: key },
                    RegistryOp::Put(..) | RegistryOp::Delete(_) => {
                        Pending::RegistryWrite { participant: key }
                    }
                };
                self.await_reply(req, now, pending);
            }
            Err(e) => {
                log::warn!(participant:% = key; "registry write failed: {e}");
                self.registry_settled(&key);
            }
        }
    }

    /// A write of this broker's section was answered: its revision, or why not.
    pub(super) fn registry_written(
        &mut self,
        conn: &mut Connection,
        key: String,
        revision: Result<u64, JsError>,
        now: Instant,
    ) {
        let Some(state) = self.section_mut(&key) else {
            return;
        };
        state.busy = false;
        let read = match revision {
            Ok(revision) => {
                state.acked = state.acked.max(revision);
                state.refused = 0;
                false
            }
            // Another broker wrote the entry since this one last saw it.
            Err(JsError::WrongLastSequence(_)) if state.refused < REGISTRY_CAS_TRIES => {
                state.refused += 1;
                true
            }
            Err(e) => {
                state.refused = 0;
                log::warn!(participant:% = key; "registry write refused: {e}");
                false
            }
        };
        let Some((ns, name)) = key.split_once('/') else {
            return;
        };
        let (ns, name) = (ns.to_string(), name.to_string());
        if read {
            self.registry_request(conn, &ns, &name, RegistryOp::Read, now);
        } else if self.section(&key).is_some_and(|s| s.again) {
            self.registry_sync(conn, &ns, &name, now);
        } else {
            self.registry_settled(&key);
        }
    }

    /// The entry as read after a refusal: written again on top of it.
    pub(super) fn registry_read(
        &mut self,
        conn: &mut Connection,
        key: String,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let Some((ns, name)) = key.split_once('/') else {
            return;
        };
        let (ns, name) = (ns.to_string(), name.to_string());
        let read = reply
            .map_err(|e| JsError::Transport(e.to_string()))
            .and_then(|m| {
                Kv::new(self.config.js_api(&ns), &binding::registry_bucket(&ns))?.parse_get(
                    &name,
                    m.headers.as_ref(),
                    &m.payload,
                )
            });
        let read = match read {
            Ok(entry) if entry.is_deleted() => Some((entry.revision, BTreeMap::new())),
            Ok(entry) => {
                let written_ms = i64::try_from(entry.created_nanos / 1_000_000).unwrap_or(0);
                let sections = self
                    .registries
                    .get(&ns)
                    .map(|(r, _)| r.sections_read(&entry.value, written_ms))
                    .unwrap_or_default();
                Some((entry.revision, sections))
            }
            Err(JsError::KeyNotFound) => Some((0, BTreeMap::new())),
            Err(e) => {
                log::warn!(participant:% = key; "registry read failed: {e}");
                None
            }
        };
        let Some(state) = self.section_mut(&key) else {
            return;
        };
        state.busy = false;
        match read {
            Some(read) => {
                state.read = Some(read);
                self.registry_sync(conn, &ns, &name, now);
            }
            None => self.registry_settled(&key),
        }
    }

    /// Nothing of the participant's section is out: its state is forgotten once it has
    /// no session here either.
    fn registry_settled(&mut self, key: &str) {
        let idle = self
            .registry_kept
            .sections
            .get(key)
            .is_some_and(|s| !s.busy);
        if idle && !self.presence.contains_key(key) {
            self.registry_kept.sections.remove(key);
        }
    }

    /// Where this broker's section of the participant's entry stands, if anywhere.
    fn section(&self, key: &str) -> Option<&SectionState> {
        match self.presence.get(key) {
            Some(p) => Some(&p.registry.section),
            None => self.registry_kept.sections.get(key),
        }
    }

    fn section_mut(&mut self, key: &str) -> Option<&mut SectionState> {
        match self.presence.get_mut(key) {
            Some(p) => Some(&mut p.registry.section),
            None => self.registry_kept.sections.get_mut(key),
        }
    }

    fn section_entry(&mut self, key: &str) -> &mut SectionState {
        match self.presence.get_mut(key) {
            Some(p) => &mut p.registry.section,
            None => self
                .registry_kept
                .sections
                .entry(key.to_string())
                .or_default(),
        }
    }

    /// Charges a listing of `ns`'s participants to the participant's `listing` bucket: every
    /// participant counts (a `who` with a `job` looks at each), since each costs the
    /// broker the same however few bytes the asking frame had. Refused: `rate_limited`.
    fn may_list(&mut self, session: SessionId, ns: &str, id: &str, now: Instant) -> bool {
        let count = self.registries.get(ns).map_or(0, |(r, _)| r.present());
        self.charge_listing(session, id, count, now)
    }

    /// Charges `count` entries looked at to the `listing` bucket of the session's
    /// participant; refused (the request answered `rate_limited`), false.
    pub(super) fn charge_listing(
        &mut self,
        session: SessionId,
        id: &str,
        count: usize,
        now: Instant,
    ) -> bool {
        let rate = f64::from(self.config.limits.presence_listed_per_s);
        let Some(p) = self
            .sessions
            .get(&session)
            .and_then(|s| s.state.participant())
            .and_then(|(ns, name)| self.presence.get_mut(&participant_key(ns, name)))
        else {
            return false;
        };
        match p.listing.take(count.max(1) as f64, rate, now) {
            Ok(()) => true,
            Err(wait_ms) => {
                self.fail(session, id, AmpError::rate_limited(wait_ms));
                false
            }
        }
    }

    pub(super) fn who(
        &mut self,
        session: SessionId,
        ns: &str,
        id: &str,
        job: Option<&str>,
        now: Instant,
    ) {
        if !self.may_list(session, ns, id, now) {
            return;
        }
        let participants: Vec<&Entry> = match self.registries.get(ns) {
            Some((registry, _)) => registry
                .entries()
                .map(|(_, entry)| entry)
                .filter(|entry| job.is_none_or(|job| Serving::of(entry).serve.contains_key(job)))
                .collect(),
            None => Vec::new(),
        };
        let count = participants.len();
        // A frame past the session's room could only close it (a slow consumer, or shed
        // for the memory budget): the asker hears why instead, and keeps its session.
        // Entries are kept as the text they are sent as, so the size is known before the
        // frame is built (a `who` refused this way cost a whole frame's writing each time).
        let bound = self.config.limits.session_room();
        let size = participants
            .iter()
            .map(|e| e.get().len() + 1)
            .sum::<usize>()
            + 64
            + 6 * id.len(); // the id as JSON, each character escaped at worst
        if size >= bound {
            let what = format!("the answer lists {count} participants in about {size} bytes");
            let hint = "; `watch` sends them a burst at a time, and `who` with a `job` lists fewer";
            return self.fail(session, id, past_session_room(&what, bound, hint));
        }
        let answer = FrameWriter::ok(Some(id))
            .value("participants", &participants)
            .finish();
        self.answered(session, id);
        self.frame(session, answer);
    }

    /// Answers `watch`, then sends an `up` for every participant present: a burst at a
    /// time, the next once the session's output is written (`Input::Drained`), so a
    /// namespace of any size fits what a session may be sent at once
    /// ([`Limits::session_room`]). Changes meanwhile are told only for names the snapshot
    /// has passed; the others it sends as they are when it gets to them (and not at all
    /// when they left).
    ///
    /// [`Limits::session_room`]: crate::broker::config::Limits::session_room
    pub(super) fn watch(&mut self, session: SessionId, ns: &str, id: &str, now: Instant) {
        if !self.may_list(session, ns, id, now) {
            return;
        }
        self.ok(session, id, FrameWriter::ok(Some(id)));
        let again = !self
            .watchers
            .entry(ns.to_string())
            .or_default()
            .insert(session);
        // A snapshot under way starts over at its next burst: a session repeating `watch`
        // gets no more than one burst per written queue. Names it was told `up` for
        // still hear every change (a `down` the new snapshot would never tell).
        let earlier = self.snapshots.remove(&session);
        let under_way = earlier.is_some();
        let told = match earlier {
            Some(snapshot) => snapshot.told.and(snapshot.after),
            None if again => Told::All,
            None => Told::Nothing,
        };
        self.snapshots.insert(
            session,
            Snapshot {
                ns: ns.to_string(),
                after: None,
                told,
            },
        );
        if !under_way {
            self.continue_snapshot(session);
        }
    }

    pub(super) fn continue_snapshot(&mut self, session: SessionId) {
        let Some(mut snapshot) = self.snapshots.remove(&session) else {
            return;
        };
        // A quarter of the session's room: the answers and changes queued beside it fit.
        let burst = (self.config.limits.session_room() / 4).clamp(1, SNAPSHOT_BURST);
        let mut frames = Vec::new();
        let mut bytes = 0;
        let mut more = false;
        let mut last = None;
        if let Some((registry, _)) = self.registries.get(&snapshot.ns) {
            for (name, entry) in registry.entries_after(snapshot.after.as_deref()) {
                if bytes >= burst {
                    more = true;
                    break;
                }
                let frame = presence_frame(&Change::Up(name.clone(), entry.clone()));
                bytes += frame.len();
                frames.push(frame);
                last = Some(name);
            }
        }
        if let Some(name) = last {
            snapshot.after = Some(name.clone());
        }
        for frame in frames {
            self.frame(session, frame);
        }
        if more {
            self.snapshots.insert(session, snapshot);
            self.out.push_back(Output::WhenDrained { session }.into());
        }
    }

    /// Whether a change of `name` is for `session` now: not while its snapshot has yet
    /// to reach the name, unless the session was told of it before the snapshot started
    /// over.
    fn snapshot_passed(&self, session: SessionId, name: &str) -> bool {
        self.snapshots.get(&session).is_none_or(|s| {
            s.after.as_deref().is_some_and(|after| name <= after) || s.told.covers(name)
        })
    }

    /// Carries out what a registry watch asked for and tells watching sessions what changed.
    pub(super) fn drive_registry(&mut self, conn: &mut Connection, ns: &str, now: Instant) {
        let Some((registry, subs)) = self.registries.get_mut(ns) else {
            return;
        };
        while let Some(action) = registry.poll_action() {
            match action {
                WatchAction::Request { kind, request } => {
                    match conn.request(
                        &request.subject,
                        request.headers.as_ref(),
                        &request.payload,
                        JS_TIMEOUT,
                        now,
                    ) {
                        Ok(req) => {
                            // Field borrow: `registry` still borrows `self.registries`.
                            self.continuations.insert(
                                req,
                                Continuation::Core(Awaiting(Pending::Watch {
                                    ns: ns.to_string(),
                                    kind,
                                })),
                                now,
                            );
                        }
                        Err(e) => registry.watcher().on_reply(
                            kind,
                            Err(JsError::Transport(e.to_string())),
                            now,
                        ),
                    }
                }
                WatchAction::Publish(request) => {
                    let _ = conn.publish(
                        &request.subject,
                        None,
                        request.headers.as_ref(),
                        &request.payload,
                    );
                }
                WatchAction::Subscribe { subject } => match conn.subscribe(&subject, None) {
                    Ok(sid) => {
                        self.routes
                            .insert(sid, Route::Registry { ns: ns.to_string() });
                        subs.insert(subject, sid);
                    }
                    Err(e) => log::warn!(ns:% = ns; "registry watch subscription failed: {e}"),
                },
                WatchAction::Unsubscribe { subject } => {
                    if let Some(sid) = subs.remove(&subject) {
                        self.routes.remove(&sid);
                        let _ = conn.unsubscribe(sid, None);
                    }
                }
            }
        }
        // Field borrow, as above.
        let namespace = self.config.namespaces.get(ns);
        let changes = registry.poll_changes(
            now,
            |name| namespace.map_or(Admit::No, |n| Admit::of(n, name)),
            namespace.map_or(0, mirror_cap),
        );
        if let Some((at, generation)) = registry.deadline_to_file() {
            // Field borrow, as above.
            let timer = Timer::RegistryWatch {
                ns: ns.to_string(),
                generation,
            };
            self.timers.schedule(at, Wake::Core(Alarm(timer)));
        }
        if changes.is_empty() {
            return;
        }
        // The entry of a participant still present here went, or came without this
        // broker's section: a refresh was lost and it expired, or a broker of an earlier
        // release (which knows no sections) deleted or rewrote it, or two first writes
        // crossed. Written again now, not at the next refresh.
        for change in &changes {
            let name = change.name();
            if !self.presence.contains_key(&participant_key(ns, name)) {
                continue;
            }
            let lost = match change {
                Change::Down(_) => true,
                Change::Up(..) | Change::Update(..) => self
                    .registries
                    .get(ns)
                    .is_some_and(|(r, _)| !r.has_section(name, &self.broker_id)),
            };
            if lost {
                self.registry_changed(conn, ns, name, now);
            }
        }
        if self.watchers.get(ns).is_some_and(|w| !w.is_empty()) {
            let changes = changes
                .into_iter()
                .map(|change| {
                    let text = presence_frame(&change);
                    (change.into_name(), text)
                })
                .collect();
            self.out.push_back(Queued::Presence(Fanout {
                ns: ns.to_string(),
                changes,
                next: 0,
                told: None,
            }));
        }
    }

    /// The next frame of a presence fan-out: its change at `next` for the next watcher
    /// after `told` whose snapshot has passed the name. None once every change is told.
    /// Who hears a change is decided here, not when it came: the runtime hands the core
    /// no other input (but timers) until its output is taken, so nothing the sessions
    /// send moves a snapshot or adds a watcher in between.
    pub(super) fn next_presence_frame(&mut self, f: &mut Fanout) -> Option<Output> {
        use std::ops::Bound::{Excluded, Unbounded};
        while let Some((name, text)) = f.changes.get(f.next) {
            let watchers = self.watchers.get(&f.ns)?;
            let from = f.told.map_or(Unbounded, Excluded);
            let next = watchers
                .range((from, Unbounded))
                .copied()
                .find(|&session| self.snapshot_passed(session, name));
            let Some(session) = next else {
                f.next += 1;
                f.told = None;
                continue;
            };
            f.told = Some(session);
            let mut frame = self.frame_buffer(text.len());
            frame.push_str(text);
            return Some(Output::Frame {
                session,
                text: frame,
            });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    //! Presence watches driven in process: the core on the NATS/JetStream model.

    use serde_json::json;

    use crate::testing::harness::Harness;

    #[test]
    fn a_snapshot_in_bursts_tells_each_present_participant_once_as_it_is_when_reached() {
        let mut config = crate::testing::harness::development_config();
        // Bursts of 300 bytes: two or three `up`s each.
        config.limits.max_outbound_bytes = 1200;
        let mut h = Harness::new(config, 1, 1);
        let names = ["b", "c", "d", "e", "f", "g", "h", "x", "y"];
        let mut present: Vec<_> = names.iter().map(|n| h.join(0, n, json!({}))).collect();
        h.hold_drains = true;
        let w = h.join(0, "m", json!({}));
        assert_eq!(h.request(w, json!({"op":"watch"}))["op"], "ok");
        let ups = |frames: &[serde_json::Value]| -> Vec<String> {
            frames
                .iter()
                .filter(|f| f["op"] == "presence")
                .map(|f| format!("{} {}", f["name"].as_str().unwrap_or("?"), f["state"]))
                .collect()
        };
        // Everyone present in name order (the watcher too), some of them in the first burst.
        let all = ["b", "c", "d", "e", "f", "g", "h", "m", "x", "y"].map(|n| format!("{n} \"up\""));
        let first = ups(&h.take(w));
        assert!(
            !first.is_empty() && first.len() < 8 && all.starts_with(&first),
            "{first:?}"
        );
        // Behind the snapshot: told at once. Ahead of it: not now, and then as it is.
        let a = h.join(0, "a", json!({}));
        assert_eq!(h.wait_for(w, |f| f["op"] == "presence")["name"], "a");
        h.close(present.remove(names.len() - 1)); // y leaves before the snapshot gets there
        let z = h.join(0, "z", json!({}));
        h.advance(std::time::Duration::from_millis(100));
        assert_eq!(ups(&h.take(w)), Vec::<String>::new());
        let mut rest = Vec::new();
        let mut bursts = 0;
        while h.release_drains() > 0 {
            bursts += 1;
            rest.extend(ups(&h.take(w)));
        }
        let mut expected: Vec<String> = all[first.len()..all.len() - 1].to_vec();
        expected.push("z \"up\"".into());
        assert_eq!(rest, expected);
        assert!(bursts > 1, "{bursts}");
        assert_eq!(h.broker(0).footprint().presence_snapshots, 0);
        // Past the snapshot, changes are told as they come.
        h.close(z);
        let down = h.wait_for(w, |f| f["op"] == "presence");
        assert_eq!(
            (down["name"].as_str(), down["state"].as_str()),
            (Some("z"), Some("down"))
        );
        // `watch` again mid-snapshot: answered, and the snapshot starts over at the next
        // burst, not at once.
        let now_present =
            ["a", "b", "c", "d", "e", "f", "g", "h", "m", "x"].map(|n| format!("{n} \"up\""));
        h.request(w, json!({"op":"watch"}));
        assert_eq!(h.request(w, json!({"op":"watch"}))["op"], "ok");
        let burst = ups(&h.take(w));
        assert!(
            burst.len() < now_present.len() && now_present.starts_with(&burst),
            "one burst for two watches: {burst:?}"
        );
        let mut again = Vec::new();
        while h.release_drains() > 0 {
            again.extend(ups(&h.take(w)));
        }
        assert_eq!(again, now_present);
        // A watcher that leaves mid-snapshot leaves nothing behind.
        let v = h.join(0, "v", json!({}));
        h.request(v, json!({"op":"watch"}));
        assert_eq!(h.broker(0).footprint().presence_snapshots, 1);
        h.close(v);
        assert_eq!(h.broker(0).footprint().presence_snapshots, 0);
        h.release_drains();
        drop((a, present));
    }

    #[test]
    fn a_watch_repeated_before_a_name_left_still_tells_its_down() {
        // The snapshot started over hid changes of names it had yet to reach again, and
        // one told `up` before that left before it got there: never told `down`.
        let mut config = crate::testing::harness::development_config();
        config.limits.max_outbound_bytes = 1200;
        let mut h = Harness::new(config, 1, 1);
        let names = ["b", "c", "d", "e", "f", "g", "h"];
        let mut present: std::collections::BTreeMap<&str, _> = names
            .iter()
            .map(|n| (*n, h.join(0, n, json!({}))))
            .collect();
        h.hold_drains = true;
        let w = h.join(0, "w", json!({}));
        let told = |frames: Vec<serde_json::Value>| -> Vec<String> {
            frames
                .iter()
                .filter(|f| f["op"] == "presence")
                .map(|f| format!("{} {}", f["name"].as_str().unwrap_or("?"), f["state"]))
                .collect()
        };
        assert_eq!(h.request(w, json!({"op":"watch"}))["op"], "ok");
        let first = told(h.take(w));
        assert!(first.contains(&"b \"up\"".to_string()), "{first:?}");
        // Again while the snapshot is under way; b leaves before the new one gets to it.
        assert_eq!(h.request(w, json!({"op":"watch"}))["op"], "ok");
        if let Some(b) = present.remove("b") {
            h.close(b);
        }
        h.advance(std::time::Duration::from_millis(300));
        let mut rest = told(h.take(w));
        while h.release_drains() > 0 {
            rest.extend(told(h.take(w)));
        }
        assert!(rest.contains(&"b \"down\"".to_string()), "{rest:?}");
        assert!(rest.contains(&"h \"up\"".to_string()), "{rest:?}");
        // Again after a whole snapshot: a name past the new one's first burst leaves.
        assert_eq!(h.request(w, json!({"op":"watch"}))["op"], "ok");
        let burst = told(h.take(w));
        assert!(!burst.contains(&"h \"up\"".to_string()), "{burst:?}");
        if let Some(gone) = present.remove("h") {
            h.close(gone);
        }
        h.advance(std::time::Duration::from_millis(300));
        let mut rest = told(h.take(w));
        while h.release_drains() > 0 {
            rest.extend(told(h.take(w)));
        }
        assert!(rest.contains(&"h \"down\"".to_string()), "{rest:?}");
        drop(present);
    }

    #[test]
    fn serve_changes_at_the_frame_rate_rewrite_the_entry_at_most_ten_times_a_second() {
        // Each `serve` was a KV write of the whole entry and an `update` to every watcher
        // on every broker: a small frame, a large fan-out.
        let mut config = crate::testing::harness::development_config();
        if let Some(ns) = config.namespaces.get_mut("dev") {
            ns.jobs.insert("render".into(), Default::default());
        }
        let mut h = Harness::new(config, 1, 7);
        let watcher = h.join(0, "watcher", json!({}));
        let w = h.join(0, "w", json!({}));
        assert_eq!(h.request(watcher, json!({"op":"watch"}))["op"], "ok");
        h.advance(std::time::Duration::from_millis(200));
        h.take(watcher);
        for i in 0..200 {
            let slots = 1 + i % 2;
            let ok = h.request(w, json!({"op":"serve","job":"render","slots":slots}));
            assert_eq!(ok["op"], "ok", "{ok}");
        }
        h.advance(std::time::Duration::from_millis(300));
        let updates: Vec<_> = h
            .take(watcher)
            .into_iter()
            .filter(|f| f["op"] == "presence" && f["name"] == "w")
            .collect();
        assert!(
            (1..=2).contains(&updates.len()),
            "200 serves within a millisecond: {} updates",
            updates.len()
        );
        let last = updates
            .last()
            .map(|u| u["entry"]["serve"]["render"].clone());
        assert_eq!(last, Some(json!(2)), "the last change is told: {updates:?}");
    }

    #[test]
    fn a_participant_logging_in_and_out_over_and_over_is_written_at_most_ten_times_a_second() {
        // Each first hello was a KV put and each last close a delete, both told to every
        // watcher on every broker, with up to 64 labels of 256 characters in each `up`.
        let mut h = Harness::development(1);
        let watcher = h.join(0, "watcher", json!({}));
        assert_eq!(h.request(watcher, json!({"op":"watch"}))["op"], "ok");
        h.advance(std::time::Duration::from_millis(200));
        h.take(watcher);
        for _ in 0..200 {
            let w = h.join(0, "w", json!({}));
            h.close(w);
        }
        h.advance(std::time::Duration::from_millis(300));
        let told: Vec<_> = h
            .take(watcher)
            .into_iter()
            .filter(|f| f["op"] == "presence" && f["name"] == "w")
            .collect();
        assert!(
            (2..=12).contains(&told.len()),
            "200 logins and closes: {} presence frames",
            told.len()
        );
        assert_eq!(told.last().map(|f| f["state"].clone()), Some(json!("down")));
        // Present again later: told at once.
        h.join(0, "w", json!({}));
        let up = h.wait_for(watcher, |f| f["op"] == "presence" && f["name"] == "w");
        assert_eq!(up["state"], "up", "{up}");
    }

    #[test]
    fn a_participant_lists_at_one_rate_however_many_sessions_it_holds_or_opens_again() {
        // The bucket was each session's, full at its hello: 1,024 sessions listed 1,024
        // times the rate, and logging in again refilled it.
        let mut config = crate::testing::harness::development_config();
        config.limits.presence_listed_per_s = 100;
        let mut h = Harness::new(config, 1, 1);
        let others: Vec<_> = (0..19)
            .map(|i| h.join(0, &format!("p{i}"), json!({})))
            .collect();
        let mut w: Vec<_> = (0..4).map(|_| h.join(0, "w", json!({}))).collect();
        h.advance(std::time::Duration::from_millis(300));
        // 20 present: a second's worth is 5 listings, whichever sessions ask.
        let first = h.request(w[0], json!({"op":"who"}));
        assert_eq!(first["participants"].as_array().map(Vec::len), Some(20));
        h.advance(std::time::Duration::from_secs(2));
        let mut listed = 0;
        let mut refused = None;
        for round in 0..10 {
            for (i, &s) in w.iter().enumerate() {
                let op = if (round + i) % 2 == 0 { "who" } else { "watch" };
                let answer = h.request(s, json!({ "op": op }));
                match answer["op"].as_str() {
                    Some("ok") => listed += 1,
                    _ => refused = Some(answer),
                }
            }
        }
        assert_eq!(listed, 5, "4 sessions listed {listed} times in an instant");
        let refused = refused.expect("refusals");
        assert_eq!(refused["code"], "rate_limited", "{refused}");
        // Logging out and in again: still in debt.
        for s in w.drain(..) {
            h.close(s);
        }
        let again = h.join(0, "w", json!({}));
        let who = h.request(again, json!({"op":"who"}));
        assert_eq!(
            who["code"], "rate_limited",
            "a new session refilled it: {who}"
        );
        let wait = who["retry_after_ms"].as_u64().expect("retry_after_ms");
        assert!(wait > 0 && wait <= 1000, "{who}");
        h.advance(std::time::Duration::from_millis(wait));
        assert_eq!(h.request(again, json!({"op":"who"}))["op"], "ok");
        // Kept while it owes, and only then.
        h.close(again);
        assert_eq!(h.broker(0).listing_debts.len(), 1);
        h.advance(std::time::Duration::from_secs(2));
        let back = h.join(0, "w", json!({}));
        assert_eq!(h.broker(0).listing_debts.len(), 0);
        assert_eq!(h.request(back, json!({"op":"who"}))["op"], "ok");
        h.advance(std::time::Duration::from_secs(2));
        h.close(back);
        assert_eq!(h.broker(0).listing_debts.len(), 0);
        drop(others);
    }

    #[test]
    fn a_watcher_hears_of_changes_until_its_session_ends_and_is_then_forgotten() {
        let mut h = Harness::development(1);
        let w = h.join(0, "watcher", json!({}));
        assert_eq!(h.request(w, json!({"op":"watch"}))["op"], "ok");
        let b = h.join(0, "b", json!({}));
        let up = h.wait_for(w, |f| f["op"] == "presence" && f["name"] == "b");
        assert_eq!(up["state"], "up", "{up}");
        h.close(b);
        let down = h.wait_for(w, |f| f["op"] == "presence" && f["name"] == "b");
        assert_eq!(down["state"], "down", "{down}");
        assert_eq!(h.broker(0).watchers.get("dev").map(|w| w.len()), Some(1));
        h.close(w);
        assert!(
            h.broker(0).watchers.is_empty(),
            "{:?}",
            h.broker(0).watchers
        );
        // Their entries' removals answered, nothing of either is kept.
        h.advance(std::time::Duration::from_millis(300));
        assert_eq!(h.broker(0).footprint().registry_sections, 0);
    }
}
