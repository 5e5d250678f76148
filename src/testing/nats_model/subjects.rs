//! Client subscriptions and which of them a subject reaches: plain subscribers all get a
//! copy, each queue group gives it to one member, chosen round robin so that runs repeat.

use std::collections::BTreeMap;

use crate::proto::subject::matches;

/// A connection's number in the model, in accept order.
pub type ClientId = u64;

#[derive(Debug, Clone)]
pub struct Subscription {
    pub subject: String,
    pub queue: Option<String>,
    /// Deliveries left before an `UNSUB sid max` removes it.
    pub remaining: Option<u64>,
}

/// One receiver of a routed message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub client: ClientId,
    pub sid: String,
}

#[derive(Debug, Default)]
pub struct SubjectIndex {
    subs: BTreeMap<(ClientId, String), Subscription>,
    /// Per queue group name, how many messages it has handed out.
    rotation: BTreeMap<String, u64>,
}

impl SubjectIndex {
    pub fn insert(&mut self, client: ClientId, sid: &str, sub: Subscription) {
        self.subs.insert((client, sid.to_string()), sub);
    }

    pub fn remove(&mut self, client: ClientId, sid: &str) {
        self.subs.remove(&(client, sid.to_string()));
    }

    pub fn limit(&mut self, client: ClientId, sid: &str, max: u64) {
        if let Some(s) = self.subs.get_mut(&(client, sid.to_string())) {
            s.remaining = Some(max);
        }
    }

    pub fn remove_client(&mut self, client: ClientId) {
        self.subs.retain(|(c, _), _| *c != client);
    }

    pub fn count_of(&self, client: ClientId) -> usize {
        self.subs
            .range((client, String::new())..)
            .take_while(|((c, _), _)| *c == client)
            .count()
    }

    pub fn has_interest(&self, subject: &str) -> bool {
        self.subs
            .values()
            .any(|s| matches(s.subject.as_bytes(), subject.as_bytes()))
    }

    /// Whether `client` itself has a subscription `subject` reaches.
    pub fn client_has_interest(&self, client: ClientId, subject: &str) -> bool {
        self.subs
            .iter()
            .any(|((c, _), s)| *c == client && matches(s.subject.as_bytes(), subject.as_bytes()))
    }

    /// The receivers of one message on `subject`, counting it against `UNSUB max` limits.
    /// `skip` is a publisher that asked not to get its own messages (`echo: false`).
    pub fn route(&mut self, subject: &str, skip: Option<ClientId>) -> Vec<Target> {
        let mut plain = Vec::new();
        let mut groups: BTreeMap<String, Vec<(ClientId, String)>> = BTreeMap::new();
        for ((client, sid), s) in &self.subs {
            if Some(*client) == skip || !matches(s.subject.as_bytes(), subject.as_bytes()) {
                continue;
            }
            match &s.queue {
                None => plain.push((*client, sid.clone())),
                Some(q) => groups
                    .entry(q.clone())
                    .or_default()
                    .push((*client, sid.clone())),
            }
        }
        for (queue, members) in groups {
            let turn = self.rotation.entry(queue).or_insert(0);
            let pick = (*turn % members.len() as u64) as usize;
            *turn = turn.wrapping_add(1);
            if let Some(m) = members.into_iter().nth(pick) {
                plain.push(m);
            }
        }
        plain.sort();
        let mut out = Vec::with_capacity(plain.len());
        for (client, sid) in plain {
            let key = (client, sid);
            if let Some(s) = self.subs.get_mut(&key)
                && let Some(left) = s.remaining.as_mut()
            {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.subs.remove(&key);
                }
            }
            out.push(Target {
                client: key.0,
                sid: key.1,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(subject: &str, queue: Option<&str>) -> Subscription {
        Subscription {
            subject: subject.into(),
            queue: queue.map(String::from),
            remaining: None,
        }
    }

    #[test]
    fn wildcards_reach_the_subjects_they_cover() {
        let mut idx = SubjectIndex::default();
        idx.insert(1, "1", sub("a.*", None));
        idx.insert(1, "2", sub("a.>", None));
        idx.insert(2, "1", sub("a.b.c", None));
        let t = |idx: &mut SubjectIndex, s: &str| {
            idx.route(s, None)
                .into_iter()
                .map(|t| (t.client, t.sid))
                .collect::<Vec<_>>()
        };
        assert_eq!(t(&mut idx, "a.b"), [(1, "1".into()), (1, "2".into())]);
        assert_eq!(t(&mut idx, "a.b.c"), [(1, "2".into()), (2, "1".into())]);
        assert!(t(&mut idx, "b").is_empty());
    }

    #[test]
    fn a_queue_group_hands_each_message_to_one_member_in_turn() {
        let mut idx = SubjectIndex::default();
        idx.insert(1, "1", sub("q", Some("g")));
        idx.insert(2, "1", sub("q", Some("g")));
        idx.insert(3, "1", sub("q", None));
        let picks: Vec<Vec<ClientId>> = (0..4)
            .map(|_| idx.route("q", None).into_iter().map(|t| t.client).collect())
            .collect();
        assert_eq!(picks, [vec![1, 3], vec![2, 3], vec![1, 3], vec![2, 3]]);
    }

    #[test]
    fn unsub_with_max_removes_after_that_many() {
        let mut idx = SubjectIndex::default();
        idx.insert(1, "1", sub("x", None));
        idx.limit(1, "1", 2);
        assert_eq!(idx.route("x", None).len(), 1);
        assert_eq!(idx.route("x", None).len(), 1);
        assert!(idx.route("x", None).is_empty());
    }
}
