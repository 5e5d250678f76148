//! Connection options, server URLs and credentials.

use super::creds;
use super::error::Error;
use crate::nkeys::KeyPair;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub const DEFAULT_PORT: u16 = 4222;

/// A server to dial: host and port (no name resolution here; the shell resolves).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServerAddr {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// One entry of the server list: where, and credentials that came with its URL.
/// `Debug` shows no secret.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerUrl {
    pub addr: ServerAddr,
    /// `nats://user:pass@host` gives both; `nats://token@host` only `user`, used as a token.
    pub user: Option<String>,
    pub pass: Option<String>,
    /// Given as `tls://`: the whole connection then requires TLS.
    pub tls: bool,
}

impl fmt::Debug for ServerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let credentials = match (&self.user, &self.pass) {
            (Some(u), Some(_)) => format!("{u}:<redacted>@"),
            (Some(_), None) => "<redacted>@".to_string(),
            _ => String::new(),
        };
        let scheme = if self.tls { "tls" } else { "nats" };
        write!(f, "ServerUrl({scheme}://{credentials}{})", self.addr)
    }
}

/// A server list as given (`nats://user:pass@host,...`) with the credentials in it
/// replaced, for error messages and logs: a password or token never leaves in a message.
pub fn redacted(urls: &str) -> String {
    urls.split(',')
        .map(|one| {
            let (scheme, rest) = match one.split_once("://") {
                Some((scheme, rest)) => (&one[..scheme.len() + 3], rest),
                None => ("", one),
            };
            match rest.rsplit_once('@') {
                Some((userinfo, host)) => {
                    let shown = match userinfo.split_once(':') {
                        Some((user, _)) => format!("{user}:<redacted>"),
                        None => "<redacted>".to_string(),
                    };
                    format!("{scheme}{shown}@{host}")
                }
                None => one.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl ServerUrl {
    /// Parses `nats://[user[:pass]@]host[:port]` (or `tls://...`), also without a scheme
    /// and with IPv6 hosts in brackets.
    pub fn parse(text: &str) -> Result<ServerUrl, Error> {
        let bad = |why: &str| Error::InvalidUrl(format!("{:?}: {why}", redacted(text)));
        let text = text.trim();
        let (tls, rest) = match text.split_once("://") {
            Some((scheme, rest)) => {
                if scheme.eq_ignore_ascii_case("tls") {
                    (true, rest)
                } else if scheme.eq_ignore_ascii_case("nats") {
                    (false, rest)
                } else {
                    return Err(bad("only nats:// and tls:// are supported"));
                }
            }
            None => (false, text),
        };
        let rest = rest.trim_end_matches('/');
        if rest.contains('/') || rest.contains('?') {
            return Err(bad("unexpected path or query"));
        }
        let (userinfo, hostport) = match rest.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, rest),
        };
        let (user, pass) = match userinfo {
            None => (None, None),
            Some(u) => match u.split_once(':') {
                Some((user, pass)) => (Some(percent_decode(user)), Some(percent_decode(pass))),
                None => (Some(percent_decode(u)), None),
            },
        };
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or_else(|| bad("unclosed '['"))?;
            let port = match after.strip_prefix(':') {
                Some(p) => Some(p),
                None if after.is_empty() => None,
                None => return Err(bad("junk after IPv6 address")),
            };
            (host, port)
        } else {
            match hostport.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hostport, None),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let port = match port {
            Some(p) => p.parse::<u16>().map_err(|_| bad("bad port"))?,
            None => DEFAULT_PORT,
        };
        Ok(ServerUrl {
            addr: ServerAddr {
                host: host.to_string(),
                port,
            },
            user: user.filter(|u| !u.is_empty()),
            pass,
            tls,
        })
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes.get(i), bytes.get(i + 1), bytes.get(i + 2)) {
            (Some(b'%'), Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let v = hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0);
                out.push(v as u8);
                i += 3;
            }
            (Some(&b), _, _) => {
                out.push(b);
                i += 1;
            }
            (None, _, _) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How the connection proves who it is. URL credentials apply when this is `None`.
/// `Debug` shows no secret.
#[derive(Clone, Default)]
pub enum Auth {
    #[default]
    None,
    UserPassword {
        user: String,
        pass: String,
    },
    Token(String),
    /// Signs the server's nonce; the public key goes in `nkey`.
    NKey(KeyPair),
    /// A user JWT and the seed that signs the nonce (from a `.creds` file).
    Jwt {
        jwt: String,
        key: KeyPair,
    },
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Auth::None => f.write_str("None"),
            Auth::UserPassword { user, .. } => write!(f, "UserPassword({user}, <redacted>)"),
            Auth::Token(_) => f.write_str("Token(<redacted>)"),
            Auth::NKey(key) => write!(f, "NKey({})", key.public_key()),
            Auth::Jwt { key, .. } => write!(f, "Jwt({})", key.public_key()),
        }
    }
}

/// Everything a [`Connection`](super::Connection) is configured with. Build with
/// [`Options::new`] and the `with_*` helpers, or set fields directly.
#[derive(Debug, Clone)]
pub struct Options {
    /// Servers tried in order (rotated on failure); servers from `connect_urls` are added.
    pub servers: Vec<ServerUrl>,
    /// URLs [`Options::new`] could not parse; when no server is left, connecting fails
    /// with the first of these.
    pub invalid_urls: Vec<Error>,
    pub auth: Auth,
    /// Client name sent in CONNECT (shows in the server's monitoring).
    pub name: Option<String>,
    /// Receive our own publishes on matching subscriptions.
    pub echo: bool,
    /// Between keepalive PINGs while connected.
    pub ping_interval: Duration,
    /// Unanswered keepalive PINGs tolerated; one more and the connection is stale.
    pub max_pings_outstanding: u32,
    /// Probing a quiet connection (`None`: not probed): once something is written with
    /// nothing read for this long, a PING; that PING unanswered with nothing read for as
    /// long again, the connection is *silent* (`Connection::is_silent`) until it reads
    /// again. It stays up, unless `silence_limit` gives it up sooner than the keepalive
    /// (after `ping_interval` times `max_pings_outstanding` or more).
    pub silence_probe: Option<Duration>,
    /// A connection silent (`silence_probe`) this long, counted from when its PING was
    /// written if that was later, is dropped as the keepalive drops a stale one (`None`:
    /// only the keepalive drops it). A PING held up by a backlog the link is still taking
    /// is not yet unanswered.
    pub silence_limit: Option<Duration>,
    /// For dialing plus the INFO/CONNECT/PONG handshake.
    pub connect_timeout: Duration,
    /// Reconnect after losing an established connection.
    pub allow_reconnect: bool,
    /// Keep retrying when the very first connect fails (else: closed with the error).
    pub retry_on_failed_connect: bool,
    /// Failed attempts in a row before giving up; `None` retries forever.
    pub max_reconnect_attempts: Option<u32>,
    /// First backoff delay; doubles per failed round up to `reconnect_delay_max`.
    pub reconnect_delay: Duration,
    pub reconnect_delay_max: Duration,
    /// Bytes of publishes held while disconnected; beyond it `publish` fails.
    pub reconnect_buffer_size: usize,
    /// Bytes of unwritten output while connected; beyond it `publish` fails.
    pub max_write_buffer: usize,
    /// Inbound messages queued as events and not yet taken; beyond it new ones are dropped
    /// and counted (a slow consumer).
    pub max_pending_messages: usize,
    pub max_subscriptions: usize,
    /// Requests waiting for a reply at once.
    pub max_pending_requests: usize,
    /// Servers learned from `connect_urls` are capped at this many.
    pub max_discovered_servers: usize,
    /// Ignore `connect_urls` from the server.
    pub ignore_discovered_servers: bool,
    pub inbox_prefix: String,
    /// Try servers in the given order instead of shuffling them.
    pub no_randomize: bool,
    /// Largest control line accepted from the server.
    pub max_control_line: usize,
    /// TLS for every server (a `tls://` URL asks for it too; without a configuration the
    /// system's CA bundle is trusted). Never downgraded to plaintext.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Start TLS before the server's INFO (nats-server `handshake_first`), instead of
    /// upgrading after it.
    pub tls_handshake_first: bool,
    /// Seeds the connection's random source (server shuffle, backoff jitter, inbox
    /// names) instead of the OS: for deterministic tests and simulators.
    pub rng_seed: Option<u64>,
}

impl Options {
    /// Options for one URL or a comma-separated list of URLs. Invalid URLs are reported
    /// when connecting (see [`Options::parse_servers`] to check them early).
    pub fn new(urls: &str) -> Options {
        let mut servers = Vec::new();
        let mut invalid_urls = Vec::new();
        for u in urls.split(',').filter(|s| !s.trim().is_empty()) {
            match ServerUrl::parse(u) {
                Ok(url) => servers.push(url),
                Err(e) => invalid_urls.push(e),
            }
        }
        Options {
            servers,
            invalid_urls,
            ..Options::default()
        }
    }

    /// Like [`Options::new`] but refuses any invalid URL.
    pub fn parse_servers(urls: &str) -> Result<Options, Error> {
        let mut o = Options::default();
        for u in urls.split(',').filter(|s| !s.trim().is_empty()) {
            o.servers.push(ServerUrl::parse(u)?);
        }
        if o.servers.is_empty() {
            return Err(Error::InvalidUrl("no server URL".into()));
        }
        Ok(o)
    }

    pub fn with_name(mut self, name: &str) -> Options {
        self.name = Some(name.to_string());
        self
    }

    /// The prefix of the connection's request inbox and of `new_inbox` subjects.
    pub fn with_inbox_prefix(mut self, prefix: &str) -> Options {
        self.inbox_prefix = prefix.to_string();
        self
    }

    pub fn with_user_password(mut self, user: &str, pass: &str) -> Options {
        self.auth = Auth::UserPassword {
            user: user.into(),
            pass: pass.into(),
        };
        self
    }

    pub fn with_token(mut self, token: &str) -> Options {
        self.auth = Auth::Token(token.into());
        self
    }

    /// NKey authentication with an encoded user seed (`SU...`).
    pub fn with_nkey_seed(mut self, seed: &str) -> Result<Options, Error> {
        let key = KeyPair::from_seed(seed).map_err(|e| Error::Credentials(e.to_string()))?;
        self.auth = Auth::NKey(key);
        Ok(self)
    }

    /// JWT authentication from the text of a `.creds` file.
    pub fn with_credentials(mut self, creds_text: &str) -> Result<Options, Error> {
        let (jwt, key) = creds::parse(creds_text)?;
        self.auth = Auth::Jwt { jwt, key };
        Ok(self)
    }

    /// JWT authentication from a `.creds` file.
    pub fn with_credentials_file(self, path: impl AsRef<Path>) -> Result<Options, Error> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::Credentials(format!("{}: {e}", path.display())))?;
        if meta.len() > creds::MAX_CREDS_FILE {
            return Err(Error::Credentials(format!(
                "{}: larger than {} bytes",
                path.display(),
                creds::MAX_CREDS_FILE
            )));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Credentials(format!("{}: {e}", path.display())))?;
        self.with_credentials(&text)
    }

    pub fn with_ping_interval(mut self, interval: Duration, max_outstanding: u32) -> Options {
        self.ping_interval = interval;
        self.max_pings_outstanding = max_outstanding;
        self
    }

    /// TLS with this configuration (trust anchors, client certificate) for every server.
    pub fn with_tls(mut self, config: Arc<rustls::ClientConfig>) -> Options {
        self.tls = Some(config);
        self
    }

    /// Whether the connection must be TLS: a configuration or a `tls://` URL.
    pub fn tls_required(&self) -> bool {
        self.tls.is_some() || self.tls_handshake_first || self.servers.iter().any(|s| s.tls)
    }

    pub fn with_reconnect_delay(mut self, first: Duration, max: Duration) -> Options {
        self.reconnect_delay = first;
        self.reconnect_delay_max = max;
        self
    }
}

impl Default for Options {
    fn default() -> Options {
        Options {
            servers: Vec::new(),
            invalid_urls: Vec::new(),
            auth: Auth::None,
            name: None,
            echo: true,
            ping_interval: Duration::from_secs(30),
            max_pings_outstanding: 2,
            silence_probe: None,
            silence_limit: None,
            connect_timeout: Duration::from_secs(2),
            allow_reconnect: true,
            retry_on_failed_connect: false,
            max_reconnect_attempts: None,
            reconnect_delay: Duration::from_millis(50),
            reconnect_delay_max: Duration::from_secs(4),
            reconnect_buffer_size: 8 * 1024 * 1024,
            max_write_buffer: 64 * 1024 * 1024,
            max_pending_messages: 65_536,
            max_subscriptions: 65_536,
            max_pending_requests: 65_536,
            max_discovered_servers: 64,
            ignore_discovered_servers: false,
            inbox_prefix: "_INBOX".into(),
            no_randomize: false,
            max_control_line: 4096,
            tls: None,
            tls_handshake_first: false,
            rng_seed: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_urls_never_reach_a_message() {
        assert_eq!(
            redacted("nats://alice:hunter2@a:4222,tls://tok3n@b,c:4222"),
            "nats://alice:<redacted>@a:4222,tls://<redacted>@b,c:4222"
        );
        let e = ServerUrl::parse("http://alice:hunter2@a").expect_err("scheme");
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    #[test]
    fn urls_with_credentials_ports_and_ipv6_parse() {
        let u = ServerUrl::parse("nats://alice:s%40cret@example.com:4333").expect("url");
        assert_eq!(u.addr.host, "example.com");
        assert_eq!(u.addr.port, 4333);
        assert_eq!(u.user.as_deref(), Some("alice"));
        assert_eq!(u.pass.as_deref(), Some("s@cret"));

        let u = ServerUrl::parse("nats://tok123@127.0.0.1").expect("url");
        assert_eq!(u.addr.port, DEFAULT_PORT);
        assert_eq!(u.user.as_deref(), Some("tok123"));
        assert_eq!(u.pass, None);

        let u = ServerUrl::parse("[::1]:4500").expect("url");
        assert_eq!(u.addr.host, "::1");
        assert_eq!(u.addr.to_string(), "[::1]:4500");

        let u = ServerUrl::parse("localhost").expect("url");
        assert_eq!(u.addr.to_string(), "localhost:4222");
    }

    #[test]
    fn bad_urls_are_refused_with_the_url_in_the_error() {
        for bad in [
            "http://h:1",
            "nats://:4222",
            "nats://h:99999",
            "nats://h:1/path",
            "[::1",
        ] {
            let err = ServerUrl::parse(bad).expect_err(bad);
            assert!(err.to_string().contains(bad), "{err}");
        }
        assert!(Options::parse_servers("").is_err());
    }

    #[test]
    fn debug_output_hides_passwords_and_tokens() {
        let o = Options::new("nats://u:hunter2@h:1,nats://tok@h:2").with_token("t0ps3cret");
        let text = format!("{o:?}");
        for secret in ["hunter2", "tok@", "t0ps3cret"] {
            assert!(!text.contains(secret), "{text}");
        }
        assert!(text.contains("u:<redacted>@h:1"), "{text}");
    }

    #[test]
    fn a_tls_url_asks_for_tls_for_the_whole_connection() {
        let u = ServerUrl::parse("TLS://alice:pw@[::1]:4443").expect("url");
        assert!(u.tls);
        assert_eq!(u.addr.to_string(), "[::1]:4443");
        assert_eq!(
            format!("{u:?}"),
            "ServerUrl(tls://alice:<redacted>@[::1]:4443)"
        );
        assert!(Options::new("nats://a:1,tls://b:2").tls_required());
        assert!(!Options::new("nats://a:1").tls_required());
    }

    #[test]
    fn comma_separated_list_keeps_order() {
        let o = Options::parse_servers("nats://a:1, nats://b:2,c").expect("list");
        let hosts: Vec<String> = o.servers.iter().map(|s| s.addr.to_string()).collect();
        assert_eq!(hosts, ["a:1", "b:2", "c:4222"]);
    }
}
