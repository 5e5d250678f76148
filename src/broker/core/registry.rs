//! The registry: this broker's participants in the namespace's KV bucket, the watch
//! that mirrors every broker's, and `who` / `watch`.

use super::*;
use crate::broker::registry::{Entry, Serving};

impl Broker {
    pub(super) fn registry_entry(&self, ns: &str, name: &str) -> Option<Value> {
        let p = self.presence.get(&participant_key(ns, name))?;
        let (serve, load) = self.jobs.registry_view(ns, name);
        Some(json!({
            "name": name,
            "serve": serve,
            "load": load,
            "labels": p.labels,
            "since": p.since,
            "broker": self.broker_id,
        }))
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
        self.registry_write(conn, ns, name, now);
        let key = participant_key(ns, name);
        if !self.refreshing.insert(key.clone()) {
            return;
        }
        let ttl = self.config.limits.registry_ttl_s;
        let refresh = Duration::from_secs(ttl).div_f64(3.0);
        match now.checked_add(refresh) {
            Some(at) => self.set_timer(at, Timer::RegistryRefresh(key)),
            // Beyond the clock's range: the entry outlives the process anyway.
            None => {
                self.refreshing.remove(&key);
            }
        }
    }

    /// Writes the registry entry now, without starting another refresh cycle.
    pub(super) fn registry_write(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        name: &str,
        now: Instant,
    ) {
        let Some(entry) = self.registry_entry(ns, name) else {
            return;
        };
        let ttl = self.config.limits.registry_ttl_s;
        let mut headers = HeaderMap::new();
        let _ = headers.insert("Nats-TTL", &format!("{ttl}s"));
        let subject = self
            .config
            .js_api(ns)
            .kv_write_subject(&binding::registry_bucket(ns), name);
        match conn.request(
            &subject,
            Some(&headers),
            entry.to_string().as_bytes(),
            JS_TIMEOUT,
            now,
        ) {
            Ok(req) => {
                self.await_reply(
                    req,
                    now,
                    Pending::RegistryPut {
                        participant: participant_key(ns, name),
                    },
                );
            }
            Err(e) => {
                log::warn!(participant:% = format_args!("{ns}/{name}"); "registry put failed: {e}")
            }
        }
    }

    pub(super) fn registry_delete(&mut self, conn: &mut Connection, ns: &str, name: &str) {
        let mut headers = HeaderMap::new();
        let _ = headers.insert("KV-Operation", "DEL");
        let subject = self
            .config
            .js_api(ns)
            .kv_write_subject(&binding::registry_bucket(ns), name);
        let _ = conn.publish(&subject, None, Some(&headers), b"");
    }

    pub(super) fn who(&mut self, session: SessionId, ns: &str, id: &str, job: Option<&str>) {
        let participants: Vec<&Entry> = match self.registries.get(ns) {
            Some((registry, _)) => registry
                .entries()
                .map(|(_, entry)| entry)
                .filter(|entry| job.is_none_or(|job| Serving::of(entry).serve.contains_key(job)))
                .collect(),
            None => Vec::new(),
        };
        let answer = FrameWriter::ok(Some(id)).value("participants", &participants);
        self.ok(session, id, answer);
    }

    pub(super) fn watch(&mut self, session: SessionId, ns: &str, id: &str) {
        self.ok(session, id, FrameWriter::ok(Some(id)));
        let present: Vec<Change> = match self.registries.get(ns) {
            Some((registry, _)) => registry
                .entries()
                .map(|(n, e)| Change::Up(n.clone(), e.clone()))
                .collect(),
            None => Vec::new(),
        };
        for change in &present {
            self.frame(session, presence_frame(change));
        }
        self.watchers
            .entry(ns.to_string())
            .or_default()
            .insert(session);
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
        let changes = registry.poll_changes(now);
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
        let watchers: Vec<SessionId> = self
            .watchers
            .get(ns)
            .map(|w| w.iter().copied().collect())
            .unwrap_or_default();
        for change in &changes {
            let text = presence_frame(change);
            for &session in &watchers {
                self.frame(session, text.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Presence watches driven in process: the core on the NATS/JetStream model.

    use serde_json::json;

    use crate::testing::harness::Harness;

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
    }
}
