//! Which browser pages may open sessions: the `Origin` header of a WebSocket upgrade
//! checked against a policy. Upgrades without `Origin` (non-browser clients) are not
//! checked: the header only means something when a browser sets it.

/// The policy of one listener.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum OriginPolicy {
    /// Any origin (development mode).
    Any,
    /// A page served by the same host and port the upgrade was sent to (what a browser
    /// app served by the broker's own host needs, and nothing more).
    #[default]
    SameHost,
    /// Exactly these origins (`https://app.example.com`, compared without case and
    /// without a trailing `/`); `*` in the list allows any.
    Only(Vec<String>),
}

impl OriginPolicy {
    /// From the configured list: empty means same host only.
    pub fn from_list(origins: &[String]) -> OriginPolicy {
        if origins.is_empty() {
            OriginPolicy::SameHost
        } else if origins.iter().any(|o| o == "*") {
            OriginPolicy::Any
        } else {
            OriginPolicy::Only(origins.iter().map(|o| normalize(o)).collect())
        }
    }

    /// Whether an upgrade with this `Origin` (and `Host` header, if any) is served.
    pub fn allows(&self, origin: &str, host: Option<&str>) -> bool {
        match self {
            OriginPolicy::Any => true,
            OriginPolicy::Only(list) => {
                let origin = normalize(origin);
                list.contains(&origin)
            }
            OriginPolicy::SameHost => {
                let Some(host) = host else {
                    return false;
                };
                let origin = normalize(origin);
                let Some((scheme, authority)) = origin.split_once("://") else {
                    return false;
                };
                without_default_port(scheme, authority)
                    == without_default_port(scheme, &host.trim().to_ascii_lowercase())
            }
        }
    }
}

fn normalize(origin: &str) -> String {
    origin.trim().trim_end_matches('/').to_ascii_lowercase()
}

fn without_default_port<'a>(scheme: &str, authority: &'a str) -> &'a str {
    let default = match scheme {
        "http" | "ws" => ":80",
        "https" | "wss" => ":443",
        _ => return authority,
    };
    authority.strip_suffix(default).unwrap_or(authority)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listed_origin_is_allowed_and_others_are_not() {
        let p = OriginPolicy::from_list(&["https://App.example.com/".to_string()]);
        assert!(p.allows("https://app.example.com", None));
        assert!(!p.allows("https://evil.example.com", Some("app.example.com")));
        assert!(!p.allows("http://app.example.com", None));
        assert!(!p.allows("null", None));
    }

    #[test]
    fn without_a_list_only_the_same_host_is_allowed() {
        let p = OriginPolicy::from_list(&[]);
        assert!(p.allows("https://broker.example:7420", Some("broker.example:7420")));
        assert!(p.allows("https://broker.example", Some("broker.example:443")));
        assert!(!p.allows("https://evil.example", Some("broker.example")));
        assert!(!p.allows("https://broker.example", None));
        assert!(!p.allows("null", Some("broker.example")));
    }

    #[test]
    fn a_star_or_development_mode_allows_any() {
        assert!(OriginPolicy::from_list(&["*".to_string()]).allows("https://x", None));
        assert!(OriginPolicy::Any.allows("null", None));
    }
}
