//! Address permissions (spec section 3): what a participant may `send` to, `publish`,
//! `subscribe` to, `submit` and `serve`. Patterns are dot-separated tokens where `*`
//! matches one token and a trailing `>` one or more; names are single-token subjects.

use super::config::Permissions;

/// What a permission check is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Send,
    Publish,
    Subscribe,
    Submit,
    Serve,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Send => "send",
            Action::Publish => "publish",
            Action::Subscribe => "subscribe",
            Action::Submit => "submit",
            Action::Serve => "serve",
        }
    }
}

fn list(p: &Permissions, action: Action) -> &[String] {
    match action {
        Action::Send => &p.send,
        Action::Publish => &p.publish,
        Action::Subscribe => &p.subscribe,
        Action::Submit => &p.submit,
        Action::Serve => &p.serve,
    }
}

/// Whether `target` (a name, a topic, or for `Subscribe` a topic pattern) is allowed. A
/// subscribe pattern is allowed only when one allowed pattern covers every topic it can
/// match, so a wildcard can never reach a forbidden topic. (A pattern covered only by the
/// union of several allowed patterns is refused: conservative, never too permissive.)
pub fn allows(p: &Permissions, action: Action, target: &str) -> bool {
    list(p, action)
        .iter()
        .any(|allowed| covers(allowed, target))
}

/// Whether every subject matched by `inner` is also matched by `outer`. With a literal
/// `inner` this is ordinary wildcard matching.
pub fn covers(outer: &str, inner: &str) -> bool {
    // Split a byte at a time: patterns and names are short, and `str::split` set up a
    // `memchr` search for every token (every `send` checks its target).
    let mut o = outer.as_bytes().split(|&b| b == b'.');
    let mut i = inner.as_bytes().split(|&b| b == b'.');
    loop {
        match (o.next(), i.next()) {
            (None, None) => return true,
            // `>` stands for one or more tokens; whatever remains of `inner` is at least one.
            (Some(b">"), Some(_)) => return true,
            (Some(b"*"), Some(t)) => {
                if t == b">" {
                    return false;
                }
            }
            (Some(a), Some(b)) => {
                if a != b || b == b"*" || b == b">" {
                    return false;
                }
            }
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perms(publish: &[&str], subscribe: &[&str]) -> Permissions {
        Permissions {
            publish: publish.iter().map(|s| s.to_string()).collect(),
            subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
            ..Permissions::default()
        }
    }

    #[test]
    fn literal_subjects_match_wildcard_patterns() {
        assert!(covers("orders.*.created", "orders.eu.created"));
        assert!(covers("orders.>", "orders.eu.created"));
        assert!(covers(">", "x"));
        assert!(!covers("orders.>", "orders"));
        assert!(!covers("orders.*", "orders.eu.created"));
        assert!(!covers("orders.eu", "orders.us"));
        assert!(covers("w1", "w1"));
        assert!(covers("*", "w1"));
    }

    #[test]
    fn a_pattern_covers_another_only_if_it_matches_all_it_can_match() {
        assert!(covers("orders.>", "orders.*.created"));
        assert!(covers("orders.>", "orders.>"));
        assert!(covers("orders.*.>", "orders.*.>"));
        assert!(covers(">", ">"));
        assert!(covers("orders.*", "orders.*"));
        assert!(!covers("orders.*", "orders.>"));
        assert!(!covers("orders.eu", "orders.*"));
        assert!(!covers("orders.*.created", "orders.>"));
        assert!(!covers("orders.*.created", "orders.*.*"));
        assert!(!covers("orders.eu.>", "orders.*.x"));
    }

    /// The walk as it was, over `str::split`: the oracle of the byte-wise one.
    fn by_str_split(outer: &str, inner: &str) -> bool {
        let mut o = outer.split('.');
        let mut i = inner.split('.');
        loop {
            match (o.next(), i.next()) {
                (None, None) => return true,
                (Some(">"), Some(_)) => return true,
                (Some("*"), Some(t)) => {
                    if t == ">" {
                        return false;
                    }
                }
                (Some(a), Some(b)) => {
                    if a != b || b == "*" || b == ">" {
                        return false;
                    }
                }
                _ => return false,
            }
        }
    }

    #[test]
    fn covering_reads_every_short_pair_as_str_split_and_nats_matching_do() {
        // Every string of up to four characters over these: empty tokens, `>` not last,
        // `*` inside a token, doubled and trailing dots, a non-ASCII character.
        let alphabet = ["a", "b", ".", "*", ">", "é"];
        let mut strings = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..4 {
            last = last
                .iter()
                .flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}")))
                .collect();
            strings.extend(last.iter().cloned());
        }
        use crate::proto::subject::{matches, validate_pattern, validate_subject};
        for outer in &strings {
            let pattern = validate_pattern(outer.as_bytes()).is_ok();
            for inner in &strings {
                let covered = covers(outer, inner);
                assert_eq!(covered, by_str_split(outer, inner), "{outer:?} {inner:?}");
                // A literal target is covered exactly when NATS would match it.
                if pattern && validate_subject(inner.as_bytes()).is_ok() {
                    assert_eq!(
                        covered,
                        matches(outer.as_bytes(), inner.as_bytes()),
                        "{outer:?} {inner:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn covering_reads_tokens_as_str_split_does() {
        let tokens = ["", "a", "b", "*", ">", "é", "a*", ">>"];
        let mut subjects: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
        for a in tokens {
            for b in tokens {
                subjects.push(format!("{a}.{b}"));
                for c in ["a", "*", ">"] {
                    subjects.push(format!("{a}.{b}.{c}"));
                }
            }
        }
        for outer in &subjects {
            for inner in &subjects {
                assert_eq!(
                    covers(outer, inner),
                    by_str_split(outer, inner),
                    "{outer:?} {inner:?}"
                );
            }
        }
    }

    #[test]
    fn subscribe_patterns_that_could_reach_a_forbidden_topic_are_refused() {
        let p = perms(&["orders.eu.*"], &["orders.eu.>", "news.*"]);
        assert!(allows(&p, Action::Subscribe, "orders.eu.created"));
        assert!(allows(&p, Action::Subscribe, "orders.eu.*"));
        assert!(allows(&p, Action::Subscribe, "news.today"));
        assert!(!allows(&p, Action::Subscribe, "orders.*.created"));
        assert!(!allows(&p, Action::Subscribe, "news.>"));
        assert!(!allows(&p, Action::Subscribe, ">"));
        assert!(allows(&p, Action::Publish, "orders.eu.created"));
        assert!(!allows(&p, Action::Publish, "orders.eu.created.x"));
        assert!(
            !allows(&p, Action::Send, "w1"),
            "an absent list allows nothing"
        );
    }
}
