//! The command line: `amp-broker serve [flags]`, `amp-broker check-config FILE`,
//! `amp-broker keygen`, `--help`, `--version`.
//!
//! Every serve flag can also come from the environment (for containers): `--nats-creds`
//! is `AMP_NATS_CREDS`, i.e. `AMP_` + the flag without `--`, upper case, `-` as `_`. A flag
//! given on the command line wins over its variable. Parsing takes the environment as data
//! so it stays a pure function of its inputs.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::broker::binding::StreamSettings;
use crate::broker::config::{Config, Limits};
use crate::broker::setup;

const SERVE_FLAGS: &str = "\
serve flags (each also read from the environment, see below):
  --listen ADDR          WebSocket/HTTP listen address (default 127.0.0.1:7420)
  --config FILE          configuration file (JSON); without it the broker runs in development
                         mode: namespace `dev`, any participant name, a token printed at start,
                         loopback addresses only
  --nats URL[,URL...]    use these NATS servers (repeatable) instead of starting nats-server
  --nats-creds FILE      .creds file for the broker's own NATS connection
  --nats-nkey FILE       NKey seed file (SU...) for the broker's own NATS connection
  --data-dir DIR         where the embedded nats-server keeps its store (default ./amp-data)
  --no-sync              embedded nats-server: flush JetStream writes every 2 minutes instead of
                         before each acknowledgement (faster; an OS crash can lose acknowledged
                         messages)
  --nats-server PATH     the nats-server binary to run (default: the one on PATH)
  --js-max-memory SIZE   embedded nats-server: JetStream max_memory_store (default 64MiB;
                         SIZE is bytes or a number with KiB, MiB or GiB)
  --js-max-file SIZE     embedded nats-server: JetStream max_file_store (default 1GiB)
  --nats-mem-limit SIZE  embedded nats-server: GOMEMLIMIT of the child (default 256MiB)
  --leaf-remote URL      embedded nats-server: connect as a leaf node to this hub
                         (nats-leaf:// or tls://, [user:password@]host:port)
  --leaf-creds FILE      .creds file for the leaf connection
  --leaf-tls-ca FILE     CAs that sign the hub's leaf certificate (turns TLS on; default for
                         tls:// URLs: the system's CA bundle)
  --leaf-tls-cert FILE   client certificate for a hub that verifies leaf nodes (turns TLS on)
  --leaf-tls-key FILE    its private key
  --js-domain NAME       embedded nats-server: its JetStream domain (default with
                         --leaf-remote: the broker id)
  --broker-id ID         this broker's id in challenges and registry entries (default: random)
  --replicas N           JetStream replicas for the streams the broker creates (default 1)
  --issuer-seed-file F   an NATS account seed (SA...): hello returns a scoped user JWT signed by
                         it, and the broker answers the NATS auth callout ($SYS.REQ.USER.AUTH)
  --callout-server-key K answer auth callout requests signed by this nats-server public key
                         (N..., the server's INFO server_id; repeatable, at most 64); without
                         it, the servers the broker's own NATS connection has met
  --tls-cert FILE        PEM certificate chain (leaf first): the listener serves wss:// and
                         https:// (TLS 1.2/1.3); reloaded on SIGHUP
  --tls-key FILE         PEM private key of --tls-cert
  --tls-client-ca FILE   verify client certificates against these CAs (optional for clients
                         unless --tls-require-client-cert)
  --tls-require-client-cert  refuse TLS clients without a certificate
  --plain-listen ADDR    a second, plain HTTP/WebSocket listener for internal use (metrics on
                         loopback) beside the TLS one; with it, /metrics is served there only
  --allowed-origin O     a browser Origin (https://app.example.com) that may open sessions
                         (repeatable, `*` for any); default: the same host only
  --nats-tls-ca FILE     CAs that sign the NATS servers' certificates (asks for TLS; default
                         for tls:// URLs: the system's CA bundle)
  --nats-tls-cert FILE   client certificate for mutual TLS with NATS
  --nats-tls-key FILE    its private key
  --nats-tls-first       start TLS before the server's INFO (nats-server handshake_first)
  --log-level LEVEL      error, warn, info, debug or trace (default info)
  --log-format FORMAT    text or json: one line per event with time, level and ids (default text)
  --drain-timeout SECS   lame duck period (SIGUSR2): sessions are closed one by one over it
                         (default 30, 1 to 3600)
  -h, --help             print this help

environment: every flag has a variable named AMP_ + the flag without `--`, upper case, `-`
as `_` (AMP_LISTEN, AMP_NATS_CREDS, AMP_CALLOUT_SERVER_KEY, ...); AMP_NATS,
AMP_CALLOUT_SERVER_KEY and AMP_ALLOWED_ORIGIN take comma-separated lists; the switches
(AMP_NO_SYNC, AMP_TLS_REQUIRE_CLIENT_CERT, AMP_NATS_TLS_FIRST) take 1/true/yes/on or
0/false/no/off. A flag on the command line wins over its variable.
";

const COMMANDS: &str = "\
usage: amp-broker serve [flags]          run the broker
       amp-broker check-config [FILE]    validate a configuration (default: $AMP_CONFIG) and
                                         print what it would serve
       amp-broker keygen                 print a new participant credential (NKey seed and
                                         public key, token and its SHA-256)
       amp-broker COMMAND --help         help for one command
       amp-broker --help | --version
";

pub const SERVE_USAGE: &str = "usage: amp-broker serve [flags]    run the broker\n\n";

pub const KEYGEN_HELP: &str = "\
usage: amp-broker keygen

Prints a new participant credential: an NKey user seed (keep it secret) with its public key
(`nkey` in the configuration), and a random token with its SHA-256 (`token_sha256`). Takes no
flags.

  -h, --help             print this help
";

pub const CHECK_CONFIG_HELP: &str = "\
usage: amp-broker check-config [FILE]

Loads FILE (default: the AMP_CONFIG environment variable) exactly as `serve --config` does and
prints what it would serve: namespaces, participants, jobs and the limits that differ from the
defaults. Exits 0 when the file is valid; otherwise prints the problem with the member it
concerns and exits 1.

  -h, --help             print this help
";

/// The overview `amp-broker --help` prints.
pub fn usage() -> String {
    format!("{COMMANDS}\n{SERVE_FLAGS}")
}

/// `amp-broker serve --help`.
pub fn serve_help() -> String {
    format!("{SERVE_USAGE}{SERVE_FLAGS}")
}

/// Which help text to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Help {
    Overview,
    Serve,
    Keygen,
    CheckConfig,
}

impl Help {
    pub fn text(self) -> String {
        match self {
            Help::Overview => usage(),
            Help::Serve => serve_help(),
            Help::Keygen => KEYGEN_HELP.to_string(),
            Help::CheckConfig => CHECK_CONFIG_HELP.to_string(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Serve(Box<ServeArgs>),
    CheckConfig(PathBuf),
    Keygen,
    Help(Help),
    Version,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServeArgs {
    pub listen: SocketAddr,
    pub config: Option<PathBuf>,
    pub nats: Vec<String>,
    pub nats_creds: Option<PathBuf>,
    pub nats_nkey: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub sync: bool,
    pub nats_server: Option<PathBuf>,
    pub sizing: crate::embedded::Sizing,
    pub leaf_remote: Option<String>,
    pub leaf_creds: Option<PathBuf>,
    pub leaf_tls: crate::embedded::LeafTls,
    pub js_domain: Option<String>,
    pub broker_id: Option<String>,
    pub replicas: u32,
    pub issuer_seed_file: Option<PathBuf>,
    pub callout_server_keys: Vec<String>,
    pub log_level: log::LevelFilter,
    pub log_format: crate::logging::Format,
    /// The lame duck period, seconds.
    pub drain_timeout_s: u64,
    pub listener_tls: crate::tls::ListenerTls,
    pub nats_tls: crate::tls::NatsTls,
    pub allowed_origins: Vec<String>,
}

impl Default for ServeArgs {
    fn default() -> Self {
        ServeArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 7420)),
            config: None,
            nats: Vec::new(),
            nats_creds: None,
            nats_nkey: None,
            data_dir: PathBuf::from("amp-data"),
            sync: true,
            nats_server: None,
            sizing: crate::embedded::Sizing::default(),
            leaf_remote: None,
            leaf_creds: None,
            leaf_tls: crate::embedded::LeafTls::default(),
            js_domain: None,
            broker_id: None,
            replicas: 1,
            issuer_seed_file: None,
            callout_server_keys: Vec::new(),
            log_level: log::LevelFilter::Info,
            log_format: crate::logging::Format::Text,
            drain_timeout_s: 30,
            listener_tls: crate::tls::ListenerTls::default(),
            nats_tls: crate::tls::NatsTls::default(),
            allowed_origins: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Takes one value.
    Value,
    /// Takes one value; its variable holds a comma-separated list (one flag per item).
    List,
    /// Takes no value; its variable holds a boolean.
    Switch,
}

/// Every serve flag. The environment variables derive from these names, so a new flag is
/// settable from the environment without further code.
const FLAGS: &[(&str, Kind)] = &[
    ("--listen", Kind::Value),
    ("--config", Kind::Value),
    ("--nats", Kind::List),
    ("--nats-creds", Kind::Value),
    ("--nats-nkey", Kind::Value),
    ("--data-dir", Kind::Value),
    ("--no-sync", Kind::Switch),
    ("--nats-server", Kind::Value),
    ("--js-max-memory", Kind::Value),
    ("--js-max-file", Kind::Value),
    ("--nats-mem-limit", Kind::Value),
    ("--leaf-remote", Kind::Value),
    ("--leaf-creds", Kind::Value),
    ("--leaf-tls-ca", Kind::Value),
    ("--leaf-tls-cert", Kind::Value),
    ("--leaf-tls-key", Kind::Value),
    ("--js-domain", Kind::Value),
    ("--broker-id", Kind::Value),
    ("--replicas", Kind::Value),
    ("--issuer-seed-file", Kind::Value),
    ("--callout-server-key", Kind::List),
    ("--log-level", Kind::Value),
    ("--log-format", Kind::Value),
    ("--drain-timeout", Kind::Value),
    ("--tls-cert", Kind::Value),
    ("--tls-key", Kind::Value),
    ("--tls-client-ca", Kind::Value),
    ("--tls-require-client-cert", Kind::Switch),
    ("--plain-listen", Kind::Value),
    ("--allowed-origin", Kind::List),
    ("--nats-tls-ca", Kind::Value),
    ("--nats-tls-cert", Kind::Value),
    ("--nats-tls-key", Kind::Value),
    ("--nats-tls-first", Kind::Switch),
];

/// At most this many `--allowed-origin`s.
const MAX_ALLOWED_ORIGINS: usize = 256;

/// At most this many `--callout-server-key`s, flags and variable together.
const MAX_CALLOUT_SERVER_KEYS: usize = 64;

/// `--nats-creds` → `AMP_NATS_CREDS`.
pub fn env_name(flag: &str) -> String {
    format!(
        "AMP_{}",
        flag.trim_start_matches('-')
            .to_ascii_uppercase()
            .replace('-', "_")
    )
}

/// The `AMP_*` environment variables, taken as data so parsing stays pure. A value that is
/// not UTF-8 is kept as such and becomes an error only where it is read, so it cannot
/// stop `--help` or a command that does not use it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Env {
    vars: BTreeMap<String, String>,
    not_utf8: BTreeSet<String>,
}

impl Env {
    /// The process environment's `AMP_*` variables.
    pub fn from_process() -> Env {
        let mut env = Env::default();
        for (name, value) in std::env::vars_os() {
            let Some(name) = name.to_str().filter(|n| n.starts_with("AMP_")) else {
                continue;
            };
            match value.into_string() {
                Ok(value) => {
                    env.vars.insert(name.to_string(), value);
                }
                Err(_) => {
                    env.not_utf8.insert(name.to_string());
                }
            }
        }
        env
    }

    /// The variable's value; empty counts as unset, as container templates often pass every
    /// name.
    pub fn get(&self, name: &str) -> Result<Option<&str>, String> {
        if self.not_utf8.contains(name) {
            return Err(format!("{name}: the value is not valid UTF-8"));
        }
        Ok(self
            .vars
            .get(name)
            .map(String::as_str)
            .filter(|v| !v.is_empty()))
    }
}

impl FromIterator<(String, String)> for Env {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Env {
        Env {
            vars: iter.into_iter().collect(),
            not_utf8: BTreeSet::new(),
        }
    }
}

/// Parses the arguments after the program name, with the environment's `AMP_*` variables.
pub fn parse<I: IntoIterator<Item = String>>(args: I, env: &Env) -> Result<Command, String> {
    let mut args = args.into_iter();
    let command = match args.next().as_deref() {
        None | Some("-h") | Some("--help") => return Ok(Command::Help(Help::Overview)),
        Some("help") => match args.next().as_deref() {
            None => Command::Help(Help::Overview),
            Some("serve") => Command::Help(Help::Serve),
            Some("keygen") => Command::Help(Help::Keygen),
            Some("check-config") => Command::Help(Help::CheckConfig),
            Some(other) => return Err(format!("help: unknown command `{other}`")),
        },
        Some("-V") | Some("--version") => return Ok(Command::Version),
        Some("keygen") => match args.next().as_deref() {
            Some("-h") | Some("--help") => Command::Help(Help::Keygen),
            Some(extra) => return Err(format!("keygen: unexpected argument `{extra}`")),
            None => Command::Keygen,
        },
        Some("check-config") => match args.next().as_deref() {
            Some("-h") | Some("--help") => Command::Help(Help::CheckConfig),
            Some(flag) if flag.starts_with('-') => {
                return Err(format!("check-config: unknown flag `{flag}`"));
            }
            Some(file) => Command::CheckConfig(PathBuf::from(file)),
            None => match env.get("AMP_CONFIG")? {
                Some(file) => Command::CheckConfig(PathBuf::from(file)),
                None => return Err("check-config needs a FILE (or AMP_CONFIG)".to_string()),
            },
        },
        Some("serve") => return parse_serve(args, env),
        Some(other) => return Err(format!("unknown command `{other}`")),
    };
    match args.next() {
        Some(extra) => Err(format!("unexpected argument `{extra}`")),
        None => Ok(command),
    }
}

fn parse_serve(mut args: impl Iterator<Item = String>, env: &Env) -> Result<Command, String> {
    let mut given: Vec<(&'static str, Option<String>)> = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help(Help::Serve));
        }
        let Some(&(flag, kind)) = FLAGS.iter().find(|(name, _)| *name == arg) else {
            return Err(format!("serve: unknown flag `{arg}`"));
        };
        let value = match kind {
            Kind::Switch => None,
            Kind::Value | Kind::List => {
                Some(args.next().ok_or_else(|| format!("{flag} needs a value"))?)
            }
        };
        given.push((flag, value));
    }

    let mut serve = ServeArgs::default();
    for &(flag, kind) in FLAGS {
        if given.iter().any(|(name, _)| *name == flag) {
            continue;
        }
        let var = env_name(flag);
        let Some(raw) = env.get(&var)? else {
            continue;
        };
        let named = |e: String| format!("{var}: {e}");
        match kind {
            Kind::Switch => {
                if parse_bool(raw).map_err(named)? {
                    apply(&mut serve, flag, None).map_err(named)?;
                }
            }
            Kind::Value => apply(&mut serve, flag, Some(raw)).map_err(named)?,
            Kind::List => {
                for item in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    apply(&mut serve, flag, Some(item)).map_err(named)?;
                }
            }
        }
    }
    for (flag, value) in &given {
        apply(&mut serve, flag, value.as_deref()).map_err(|e| format!("{flag}: {e}"))?;
    }

    if !serve.nats.is_empty() {
        let embedded_only = [
            ("--leaf-remote", serve.leaf_remote.is_some()),
            ("--leaf-creds", serve.leaf_creds.is_some()),
            ("--leaf-tls-ca", serve.leaf_tls.ca.is_some()),
            ("--leaf-tls-cert", serve.leaf_tls.cert.is_some()),
            ("--leaf-tls-key", serve.leaf_tls.key.is_some()),
            ("--js-domain", serve.js_domain.is_some()),
        ];
        if let Some((flag, _)) = embedded_only.iter().find(|(_, set)| *set) {
            return Err(format!(
                "{flag} configures the embedded nats-server; with --nats configure the server itself"
            ));
        }
    }
    if serve.nats.is_empty() && (serve.nats_creds.is_some() || serve.nats_nkey.is_some()) {
        return Err(
            "--nats-creds and --nats-nkey are for --nats servers; the embedded one gets a \
             credential generated at start"
                .to_string(),
        );
    }
    let leaf_tls = &serve.leaf_tls;
    let leaf_only = [
        ("--leaf-creds", serve.leaf_creds.is_some()),
        ("--leaf-tls-ca", leaf_tls.ca.is_some()),
        ("--leaf-tls-cert", leaf_tls.cert.is_some()),
        ("--leaf-tls-key", leaf_tls.key.is_some()),
    ];
    if serve.leaf_remote.is_none()
        && let Some((flag, _)) = leaf_only.iter().find(|(_, set)| *set)
    {
        return Err(format!("{flag} needs --leaf-remote"));
    }
    if leaf_tls.cert.is_some() != leaf_tls.key.is_some() {
        return Err("--leaf-tls-cert and --leaf-tls-key go together".to_string());
    }
    if serve.config.is_none() && !serve.listen.ip().is_loopback() {
        return Err(
            "development mode (no --config) listens on loopback addresses only".to_string(),
        );
    }
    Ok(Command::Serve(Box::new(serve)))
}

fn parse_bool(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!(
            "`{v}` is not a boolean (1/true/yes/on or 0/false/no/off)"
        )),
    }
}

/// Sets one flag; `value` is `None` only for switches. The error leaves out which flag or
/// variable it came from, the caller names that.
fn apply(serve: &mut ServeArgs, flag: &str, value: Option<&str>) -> Result<(), String> {
    let v = value.unwrap_or_default();
    match flag {
        "--listen" => {
            serve.listen = v
                .parse()
                .map_err(|_| format!("`{v}` is not an address like 127.0.0.1:7420"))?;
        }
        "--config" => serve.config = Some(PathBuf::from(v)),
        "--nats" => serve.nats.extend(
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
        ),
        "--nats-creds" => serve.nats_creds = Some(PathBuf::from(v)),
        "--nats-nkey" => serve.nats_nkey = Some(PathBuf::from(v)),
        "--data-dir" => serve.data_dir = PathBuf::from(v),
        "--no-sync" => serve.sync = false,
        "--nats-server" => serve.nats_server = Some(PathBuf::from(v)),
        "--js-max-memory" => serve.sizing.max_memory_store = parse_size(v)?,
        "--js-max-file" => serve.sizing.max_file_store = parse_size(v)?,
        "--nats-mem-limit" => serve.sizing.go_mem_limit = parse_size(v)?,
        "--leaf-remote" => {
            check_leaf_url(v)?;
            serve.leaf_remote = Some(v.to_string());
        }
        "--leaf-creds" => serve.leaf_creds = Some(PathBuf::from(v)),
        "--leaf-tls-ca" => serve.leaf_tls.ca = Some(PathBuf::from(v)),
        "--leaf-tls-cert" => serve.leaf_tls.cert = Some(PathBuf::from(v)),
        "--leaf-tls-key" => serve.leaf_tls.key = Some(PathBuf::from(v)),
        "--js-domain" => {
            if !crate::broker::config::is_name(v) {
                return Err(format!("`{v}` must be 1-64 of A-Z a-z 0-9 _ -"));
            }
            serve.js_domain = Some(v.to_string());
        }
        "--broker-id" => {
            if !crate::broker::config::is_name(v) {
                return Err(format!("`{v}` must be 1-64 of A-Z a-z 0-9 _ -"));
            }
            serve.broker_id = Some(v.to_string());
        }
        "--replicas" => {
            serve.replicas = match v.parse() {
                Ok(n @ 1..=5) => n,
                _ => return Err(format!("`{v}` must be 1 to 5")),
            };
        }
        "--log-level" => serve.log_level = crate::logging::parse_level(v)?,
        "--log-format" => serve.log_format = crate::logging::Format::parse(v)?,
        "--issuer-seed-file" => serve.issuer_seed_file = Some(PathBuf::from(v)),
        "--callout-server-key" => {
            if !crate::broker::config::is_server_key(v) {
                return Err(format!(
                    "`{v}` is not a server public key (N..., 56 characters)"
                ));
            }
            if serve.callout_server_keys.len() >= MAX_CALLOUT_SERVER_KEYS {
                return Err(format!("at most {MAX_CALLOUT_SERVER_KEYS}"));
            }
            serve.callout_server_keys.push(v.to_string());
        }
        "--drain-timeout" => {
            serve.drain_timeout_s = match v.parse() {
                Ok(n @ 1..=3600) => n,
                _ => return Err(format!("`{v}` must be 1 to 3600 seconds")),
            };
        }
        "--tls-cert" => serve.listener_tls.cert = Some(PathBuf::from(v)),
        "--tls-key" => serve.listener_tls.key = Some(PathBuf::from(v)),
        "--tls-client-ca" => serve.listener_tls.client_ca = Some(PathBuf::from(v)),
        "--tls-require-client-cert" => serve.listener_tls.require_client_cert = true,
        "--plain-listen" => {
            serve.listener_tls.plain_listen = Some(
                v.parse()
                    .map_err(|_| format!("`{v}` is not an address like 127.0.0.1:7421"))?,
            );
        }
        "--allowed-origin" => {
            if serve.allowed_origins.len() >= MAX_ALLOWED_ORIGINS {
                return Err(format!("at most {MAX_ALLOWED_ORIGINS}"));
            }
            serve.allowed_origins.push(v.to_string());
        }
        "--nats-tls-ca" => serve.nats_tls.ca = Some(PathBuf::from(v)),
        "--nats-tls-cert" => serve.nats_tls.cert = Some(PathBuf::from(v)),
        "--nats-tls-key" => serve.nats_tls.key = Some(PathBuf::from(v)),
        "--nats-tls-first" => serve.nats_tls.handshake_first = true,
        other => return Err(format!("unknown flag `{other}`")),
    }
    Ok(())
}

/// Sizes from 1 MiB to 1 TiB: bytes, or a number followed by KiB, MiB or GiB (K, M, G and
/// KB, MB, GB mean the same binary units, as in nats-server's own configuration).
fn parse_size(v: &str) -> Result<u64, String> {
    let digits = v.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = v.split_at(digits);
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("`{v}`: the unit must be KiB, MiB or GiB")),
    };
    let bytes = number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|b| (1 << 20..=1 << 40).contains(b));
    bytes.ok_or_else(|| format!("`{v}` must be a size from 1MiB to 1024GiB"))
}

const LEAF_URL_FORM: &str = "nats-leaf:// or tls://, then [user:password@]host:port";

/// A hub address the embedded server can dial as a leaf node.
fn check_leaf_url(v: &str) -> Result<(), String> {
    let rest = ["nats-leaf://", "nats://", "tls://"]
        .iter()
        .find_map(|scheme| v.strip_prefix(scheme))
        .ok_or_else(|| format!("`{v}` must be {LEAF_URL_FORM}"))?;
    let host_port = rest.rsplit('@').next().unwrap_or(rest);
    let port_ok = host_port
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if !port_ok || v.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("`{v}` must be {LEAF_URL_FORM}"));
    }
    Ok(())
}

/// Participant names shown per namespace before the rest is counted.
const NAMES_SHOWN: usize = 10;

/// What `check-config` prints for a valid configuration: short enough to read at a glance.
pub fn describe(config: &Config) -> String {
    let mut out = String::new();
    let participants: usize = config
        .namespaces
        .values()
        .map(|n| n.participants.len())
        .sum();
    out.push_str(&format!(
        "{} namespace(s), {} participant(s)\n",
        config.namespaces.len(),
        participants
    ));
    for (name, ns) in &config.namespaces {
        let mut names: Vec<&str> = ns.participants.keys().map(String::as_str).collect();
        let hidden = names.len().saturating_sub(NAMES_SHOWN);
        names.truncate(NAMES_SHOWN);
        let mut list = names.join(", ");
        if hidden > 0 {
            list.push_str(&format!(", and {hidden} more"));
        }
        let nkeys = ns
            .participants
            .values()
            .filter(|p| p.nkey.is_some())
            .count();
        let tokens = ns
            .participants
            .values()
            .filter(|p| p.token_sha256.is_some())
            .count();
        let policies = ns
            .participants
            .values()
            .filter(|p| p.policy.is_some())
            .count();
        out.push_str(&format!(
            "namespace {name}: {} participant(s) ({nkeys} nkey, {tokens} token, {policies} with a policy){}{}\n",
            ns.participants.len(),
            if list.is_empty() { String::new() } else { format!(": {list}") },
            if ns.open.is_some() { "; open to any name" } else { "" },
        ));
        for (job, j) in &ns.jobs {
            out.push_str(&format!(
                "  job {job}: lease {} s, offer {} ms, at most {} attempt(s)",
                j.lease_s, j.offer_ms, j.max_attempts
            ));
            if let Some(n) = j.max_queued {
                out.push_str(&format!(", at most {n} queued"));
            }
            if let Some(c) = &j.mig {
                out.push_str(&format!(
                    ", MIG capability {} ({})",
                    c.id,
                    c.modes.join(", ")
                ));
            }
            out.push('\n');
        }
        let settings = StreamSettings::default();
        let window = setup::outcome_window_s(ns, settings);
        if window > settings.duplicate_window_s {
            out.push_str(&format!(
                "  inbox and dead letters: duplicate_window {window} s (the longest lease_s and {} s), message ids kept in the server's memory that long\n",
                setup::REDELIVERY_MARGIN_S
            ));
        }
        for cap in setup::window_caps(name, ns, settings) {
            out.push_str(&format!("  warning: {cap}\n"));
        }
        out.push_str(&format!(
            "  warning: namespace {name}: nothing in this configuration bounds its {}; client input fills them until JetStream's storage is full (set limits on the streams, or the account's storage; README \"A store that is full\")\n",
            unbounded_stores(ns).join(", ")
        ));
    }
    let changed = changed_limits(&config.limits);
    if changed.is_empty() {
        out.push_str("limits: defaults\n");
    } else {
        out.push_str(&format!("limits (not default): {}\n", changed.join(", ")));
    }
    let m = &config.mig;
    if m.enabled {
        let capabilities = (config.namespaces.values())
            .flat_map(|n| n.jobs.values())
            .filter(|j| j.mig.is_some())
            .count();
        out.push_str(&format!(
            "MIG over NATS: on, {capabilities} capability(ies), deadline {} ms (at most {}), at most {} invocations waiting\n",
            m.default_deadline_ms, m.max_deadline_ms, m.max_pending
        ));
    } else {
        out.push_str("MIG over NATS: off\n");
    }
    if !config.callout.server_keys.is_empty() {
        out.push_str(&format!(
            "auth callout: {} trusted server key(s)\n",
            config.callout.server_keys.len()
        ));
    }
    out
}

/// The namespace's streams client input fills that its configuration sets no bound on,
/// each with the members that would. The tasks stream has none of its own: a limit is
/// set on the stream itself.
fn unbounded_stores(ns: &crate::broker::config::Namespace) -> Vec<&'static str> {
    let mut stores = Vec::new();
    if ns.inbox.max_age_s == 0 {
        stores.push("inbox (inbox.max_age_s)");
    }
    if ns.topics.max_age_s == 0 && ns.topics.max_bytes == 0 {
        stores.push("topics (topics.max_age_s, topics.max_bytes)");
    }
    stores.push("tasks");
    stores
}

fn changed_limits(l: &Limits) -> Vec<String> {
    let d = Limits::default();
    let pairs: [(&str, u64, u64); 13] = [
        ("max_frame", l.max_frame as u64, d.max_frame as u64),
        (
            "max_outbound_bytes",
            l.max_outbound_bytes as u64,
            d.max_outbound_bytes as u64,
        ),
        ("heartbeat_s", l.heartbeat_s, d.heartbeat_s),
        ("hello_timeout_s", l.hello_timeout_s, d.hello_timeout_s),
        ("registry_ttl_s", l.registry_ttl_s, d.registry_ttl_s),
        ("max_sessions", l.max_sessions as u64, d.max_sessions as u64),
        (
            "max_held_submits",
            l.max_held_submits as u64,
            d.max_held_submits as u64,
        ),
        (
            "max_connections_per_ip",
            l.max_connections_per_ip as u64,
            d.max_connections_per_ip as u64,
        ),
        (
            "max_waiting_connections",
            l.max_waiting_connections as u64,
            d.max_waiting_connections as u64,
        ),
        (
            "max_frames_per_s",
            u64::from(l.max_frames_per_s),
            u64::from(d.max_frames_per_s),
        ),
        (
            "frame_burst",
            u64::from(l.frame_burst),
            u64::from(d.frame_burst),
        ),
        (
            "max_buffered_bytes",
            l.max_buffered_bytes as u64,
            d.max_buffered_bytes as u64,
        ),
        (
            "max_topic_subscriptions",
            l.max_topic_subscriptions as u64,
            d.max_topic_subscriptions as u64,
        ),
    ];
    pairs
        .iter()
        .filter(|(_, value, default)| value != default)
        .map(|(name, value, _)| format!("{name} {value}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_env(s: &str, env: &[(&str, &str)]) -> Result<Command, String> {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        parse(s.split_whitespace().map(String::from), &env)
    }

    fn parse_str(s: &str) -> Result<Command, String> {
        parse_env(s, &[])
    }

    fn serve(s: &str, env: &[(&str, &str)]) -> ServeArgs {
        match parse_env(s, env) {
            Ok(Command::Serve(args)) => *args,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn serve_defaults_to_a_self_contained_durable_development_broker() {
        assert_eq!(parse_str("serve"), Ok(Command::Serve(Box::default())));
        assert!(ServeArgs::default().sync);
        assert!(ServeArgs::default().listen.ip().is_loopback());
    }

    #[test]
    fn serve_reads_every_flag() {
        let s = serve(
            "serve --listen 0.0.0.0:9000 --config c.json --nats nats://a:4222,nats://b:4222 --nats nats://c:4222 \
             --nats-creds x.creds --data-dir /d --no-sync --nats-server /bin/ns --broker-id b1 --replicas 3 --issuer-seed-file acct.seed",
            &[],
        );
        assert_eq!(s.listen, "0.0.0.0:9000".parse().expect("addr"));
        assert_eq!(s.config, Some(PathBuf::from("c.json")));
        assert_eq!(s.nats, ["nats://a:4222", "nats://b:4222", "nats://c:4222"]);
        assert_eq!(s.nats_creds, Some(PathBuf::from("x.creds")));
        assert_eq!(s.data_dir, PathBuf::from("/d"));
        assert!(!s.sync);
        assert_eq!(s.nats_server, Some(PathBuf::from("/bin/ns")));
        assert_eq!(s.broker_id.as_deref(), Some("b1"));
        assert_eq!(s.replicas, 3);
        assert_eq!(s.issuer_seed_file, Some(PathBuf::from("acct.seed")));
    }

    fn server_keys(n: usize) -> Vec<String> {
        use crate::nkeys::{KeyKind, KeyPair};
        (0..n)
            .map(|_| {
                KeyPair::generate(KeyKind::Server)
                    .expect("key")
                    .public_key()
            })
            .collect()
    }

    #[test]
    fn callout_server_keys_repeat() {
        let keys = server_keys(2);
        let s = serve(
            &format!(
                "serve --callout-server-key {} --callout-server-key {}",
                keys[0], keys[1]
            ),
            &[],
        );
        assert_eq!(s.callout_server_keys, keys);
    }

    #[test]
    fn tls_flags_fill_the_listener_and_nats_settings() {
        let s = serve(
            "serve --tls-cert c.pem --tls-key k.pem --tls-client-ca ca.pem --tls-require-client-cert \
             --plain-listen 127.0.0.1:9001 --allowed-origin https://a --allowed-origin https://b \
             --nats-tls-ca n.pem --nats-tls-cert nc.pem --nats-tls-key nk.pem --nats-tls-first",
            &[],
        );
        let l = &s.listener_tls;
        assert_eq!(l.cert, Some(PathBuf::from("c.pem")));
        assert_eq!(l.key, Some(PathBuf::from("k.pem")));
        assert_eq!(l.client_ca, Some(PathBuf::from("ca.pem")));
        assert!(l.require_client_cert);
        assert_eq!(
            l.plain_listen,
            Some("127.0.0.1:9001".parse().expect("addr"))
        );
        assert_eq!(s.allowed_origins, ["https://a", "https://b"]);
        assert_eq!(s.nats_tls.ca, Some(PathBuf::from("n.pem")));
        assert_eq!(s.nats_tls.cert, Some(PathBuf::from("nc.pem")));
        assert_eq!(s.nats_tls.key, Some(PathBuf::from("nk.pem")));
        assert!(s.nats_tls.handshake_first);
        assert!(parse_str("serve --plain-listen nowhere").is_err());
    }

    #[test]
    fn every_flag_has_its_variable() {
        let keys = server_keys(2);
        let joined = keys.join(",");
        let env = [
            ("AMP_LISTEN", "0.0.0.0:9000"),
            ("AMP_CONFIG", "c.json"),
            ("AMP_NATS", "nats://a:4222, nats://b:4222"),
            ("AMP_NATS_CREDS", "x.creds"),
            ("AMP_NATS_NKEY", "x.nk"),
            ("AMP_DATA_DIR", "/d"),
            ("AMP_NO_SYNC", "true"),
            ("AMP_NATS_SERVER", "/bin/ns"),
            ("AMP_BROKER_ID", "b1"),
            ("AMP_REPLICAS", "3"),
            ("AMP_ISSUER_SEED_FILE", "acct.seed"),
            ("AMP_CALLOUT_SERVER_KEY", joined.as_str()),
            ("AMP_LOG_LEVEL", "debug"),
            ("AMP_LOG_FORMAT", "json"),
            ("AMP_DRAIN_TIMEOUT", "5"),
            ("AMP_TLS_CERT", "c.pem"),
            ("AMP_TLS_KEY", "k.pem"),
            ("AMP_TLS_CLIENT_CA", "ca.pem"),
            ("AMP_TLS_REQUIRE_CLIENT_CERT", "yes"),
            ("AMP_PLAIN_LISTEN", "127.0.0.1:9001"),
            ("AMP_ALLOWED_ORIGIN", "https://a.example, https://b.example"),
            ("AMP_NATS_TLS_CA", "nca.pem"),
            ("AMP_NATS_TLS_CERT", "nc.pem"),
            ("AMP_NATS_TLS_KEY", "nk.pem"),
            ("AMP_NATS_TLS_FIRST", "1"),
        ];
        // The embedded server's own flags cannot go with AMP_NATS.
        let embedded = [
            ("AMP_JS_MAX_MEMORY", "32MiB"),
            ("AMP_JS_MAX_FILE", "2GiB"),
            ("AMP_NATS_MEM_LIMIT", "100M"),
            ("AMP_LEAF_REMOTE", "nats-leaf://leaf:pw@hub.example:7422"),
            ("AMP_LEAF_CREDS", "leaf.creds"),
            ("AMP_LEAF_TLS_CA", "hub-ca.pem"),
            ("AMP_LEAF_TLS_CERT", "site.pem"),
            ("AMP_LEAF_TLS_KEY", "site-key.pem"),
            ("AMP_JS_DOMAIN", "site1"),
        ];
        assert_eq!(env.len() + embedded.len(), FLAGS.len());
        for (flag, _) in FLAGS {
            assert!(
                env.iter()
                    .chain(&embedded)
                    .any(|(var, _)| *var == env_name(flag)),
                "{flag}"
            );
        }
        let e = serve("serve", &embedded);
        assert_eq!(e.sizing.max_memory_store, 32 << 20);
        assert_eq!(e.sizing.max_file_store, 2 << 30);
        assert_eq!(e.sizing.go_mem_limit, 100 << 20);
        assert_eq!(
            e.leaf_remote.as_deref(),
            Some("nats-leaf://leaf:pw@hub.example:7422")
        );
        assert_eq!(e.leaf_creds, Some(PathBuf::from("leaf.creds")));
        assert_eq!(e.leaf_tls.ca, Some(PathBuf::from("hub-ca.pem")));
        assert_eq!(e.leaf_tls.cert, Some(PathBuf::from("site.pem")));
        assert_eq!(e.leaf_tls.key, Some(PathBuf::from("site-key.pem")));
        assert_eq!(e.js_domain.as_deref(), Some("site1"));
        let s = serve("serve", &env);
        assert_eq!(s.listen, "0.0.0.0:9000".parse().expect("addr"));
        assert_eq!(s.config, Some(PathBuf::from("c.json")));
        assert_eq!(s.nats, ["nats://a:4222", "nats://b:4222"]);
        assert_eq!(s.nats_creds, Some(PathBuf::from("x.creds")));
        assert_eq!(s.nats_nkey, Some(PathBuf::from("x.nk")));
        assert_eq!(s.data_dir, PathBuf::from("/d"));
        assert!(!s.sync);
        assert_eq!(s.nats_server, Some(PathBuf::from("/bin/ns")));
        assert_eq!(s.broker_id.as_deref(), Some("b1"));
        assert_eq!(s.replicas, 3);
        assert_eq!(s.issuer_seed_file, Some(PathBuf::from("acct.seed")));
        assert_eq!(s.callout_server_keys, keys);
        assert_eq!(s.log_level, log::LevelFilter::Debug);
        assert_eq!(s.log_format, crate::logging::Format::Json);
        assert_eq!(s.drain_timeout_s, 5);
    }

    #[test]
    fn the_drain_timeout_is_bounded() {
        assert_eq!(serve("serve", &[]).drain_timeout_s, 30);
        assert_eq!(
            serve("serve --drain-timeout 3600", &[]).drain_timeout_s,
            3600
        );
        for bad in ["0", "3601", "-1", "soon"] {
            assert!(
                parse_str(&format!("serve --drain-timeout {bad}")).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn log_flags_default_to_info_text_and_refuse_unknown_values() {
        let s = serve("serve", &[]);
        assert_eq!(s.log_level, log::LevelFilter::Info);
        assert_eq!(s.log_format, crate::logging::Format::Text);
        let s = serve("serve --log-level warn --log-format json", &[]);
        assert_eq!(s.log_level, log::LevelFilter::Warn);
        assert_eq!(s.log_format, crate::logging::Format::Json);
        let e = parse_env("serve --log-level loud", &[]).expect_err("bad level");
        assert!(e.contains("--log-level") && e.contains("loud"), "{e}");
        let e = parse_env("serve", &[("AMP_LOG_FORMAT", "xml")]).expect_err("bad format");
        assert!(e.contains("AMP_LOG_FORMAT") && e.contains("xml"), "{e}");
    }

    #[test]
    fn flags_win_over_variables_and_lists_are_replaced_not_merged() {
        let env = [
            ("AMP_LISTEN", "127.0.0.1:1111"),
            ("AMP_NATS", "nats://env:4222"),
            ("AMP_REPLICAS", "2"),
            ("AMP_NO_SYNC", "0"),
        ];
        let s = serve(
            "serve --listen 127.0.0.1:2222 --nats nats://flag:4222",
            &env,
        );
        assert_eq!(s.listen, "127.0.0.1:2222".parse().expect("addr"));
        assert_eq!(s.nats, ["nats://flag:4222"]);
        assert_eq!(s.replicas, 2);
        assert!(s.sync, "AMP_NO_SYNC=0 keeps sync on");
        assert!(!serve("serve --no-sync", &[("AMP_NO_SYNC", "no")]).sync);
        // Empty is unset.
        assert_eq!(serve("serve", &[("AMP_REPLICAS", "")]).replicas, 1);
        // Variables that name no flag are ignored, as other programs' AMP_* may be set.
        assert_eq!(serve("serve", &[("AMP_OTHER", "x")]), ServeArgs::default());
    }

    #[test]
    fn a_bad_variable_is_named() {
        for (var, value) in [
            ("AMP_LISTEN", "nowhere"),
            ("AMP_REPLICAS", "9"),
            ("AMP_NO_SYNC", "maybe"),
            ("AMP_BROKER_ID", "a.b"),
            ("AMP_CALLOUT_SERVER_KEY", "Nbogus"),
        ] {
            let e = parse_env("serve", &[(var, value)]).expect_err(var);
            assert!(e.starts_with(&format!("{var}: ")), "{e}");
            assert!(e.contains(value), "{e}");
        }
        // A variable the command line overrides is never looked at.
        assert!(parse_env("serve --replicas 2", &[("AMP_REPLICAS", "9")]).is_ok());
        // The loopback rule holds whichever side the address came from.
        assert!(
            parse_env("serve", &[("AMP_LISTEN", "0.0.0.0:1")])
                .is_err_and(|e| e.contains("loopback"))
        );
        assert!(parse_env("serve", &[("AMP_LISTEN", "0.0.0.0:1"), ("AMP_CONFIG", "c")]).is_ok());
    }

    #[test]
    fn a_variable_that_is_not_utf8_matters_only_where_it_is_read() {
        let env = Env {
            not_utf8: BTreeSet::from(["AMP_LISTEN".to_string()]),
            ..Env::default()
        };
        let args = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        assert_eq!(
            parse(args("serve"), &env),
            Err("AMP_LISTEN: the value is not valid UTF-8".to_string())
        );
        assert_eq!(
            parse(args("serve --help"), &env),
            Ok(Command::Help(Help::Serve))
        );
        assert!(parse(args("serve --listen 127.0.0.1:1"), &env).is_ok());
        assert_eq!(parse(args("keygen"), &env), Ok(Command::Keygen));
    }

    #[test]
    fn callout_keys_stay_bounded_across_flag_and_variable() {
        let keys = server_keys(MAX_CALLOUT_SERVER_KEYS + 1);
        let joined = keys.join(",");
        assert!(
            parse_env("serve", &[("AMP_CALLOUT_SERVER_KEY", joined.as_str())])
                .is_err_and(|e| e.contains("AMP_CALLOUT_SERVER_KEY") && e.contains("at most"))
        );
    }

    #[test]
    fn help_for_each_command() {
        for s in ["", "-h", "--help", "help"] {
            assert_eq!(parse_str(s), Ok(Command::Help(Help::Overview)), "{s}");
        }
        for s in [
            "serve --help",
            "serve -h",
            "serve --no-sync --help",
            "help serve",
        ] {
            assert_eq!(parse_str(s), Ok(Command::Help(Help::Serve)), "{s}");
        }
        // Help comes before the environment is looked at, so a broken variable cannot hide it.
        assert_eq!(
            parse_env("serve --help", &[("AMP_LISTEN", "nowhere")]),
            Ok(Command::Help(Help::Serve))
        );
        for s in ["keygen --help", "keygen -h", "help keygen"] {
            assert_eq!(parse_str(s), Ok(Command::Help(Help::Keygen)), "{s}");
        }
        for s in [
            "check-config --help",
            "check-config -h",
            "help check-config",
        ] {
            assert_eq!(parse_str(s), Ok(Command::Help(Help::CheckConfig)), "{s}");
        }
        assert!(serve_help().contains("--callout-server-key"));
        assert!(serve_help().contains("AMP_"));
        assert!(usage().contains("check-config"));
        assert!(KEYGEN_HELP.contains("keygen"));
    }

    #[test]
    fn check_config_takes_a_file_or_amp_config() {
        assert_eq!(
            parse_str("check-config c.json"),
            Ok(Command::CheckConfig(PathBuf::from("c.json")))
        );
        assert_eq!(
            parse_env("check-config", &[("AMP_CONFIG", "e.json")]),
            Ok(Command::CheckConfig(PathBuf::from("e.json")))
        );
        assert_eq!(
            parse_env("check-config c.json", &[("AMP_CONFIG", "e.json")]),
            Ok(Command::CheckConfig(PathBuf::from("c.json")))
        );
        assert!(parse_str("check-config").is_err_and(|e| e.contains("AMP_CONFIG")));
        assert!(parse_str("check-config a b").is_err_and(|e| e.contains("`b`")));
        assert!(parse_str("check-config --bogus").is_err_and(|e| e.contains("--bogus")));
    }

    #[test]
    fn describe_names_what_differs_from_the_defaults() {
        let text = r#"{"limits": {"max_sessions": 500},
            "namespaces": {"acme": {"participants": {
                "alice": {"token_sha256": "2bd806c97f0e00af1a1fc3328fa763a9269723c8db8fac4f93af71db186d6e90"}},
              "jobs": {"resize": {"lease_s": 60}}}}}"#;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("c.json");
        std::fs::write(&path, text).expect("write");
        let config = Config::load(&path).expect("valid");
        let out = describe(&config);
        assert!(out.contains("1 namespace(s), 1 participant(s)"), "{out}");
        assert!(
            out.contains("namespace acme: 1 participant(s) (0 nkey, 1 token"),
            "{out}"
        );
        assert!(out.contains(": alice"), "{out}");
        assert!(
            out.contains("job resize: lease 60 s, offer 5000 ms"),
            "{out}"
        );
        assert!(
            out.contains("inbox and dead letters: duplicate_window 150 s"),
            "{out}"
        );
        assert!(
            out.contains("limits (not default): max_sessions 500\n"),
            "{out}"
        );
        assert!(describe(&Config::development(String::new())).contains("limits: defaults"));
    }

    /// An operator turning MIG on checks the file first: the summary said nothing of it,
    /// nor of which jobs are capabilities or bounded by `max_queued`.
    #[test]
    fn describe_shows_mig_and_the_capabilities() {
        let text = r#"{"mig": {"enabled": true},
            "namespaces": {"acme": {"participants": {
                "alice": {"token_sha256": "2bd806c97f0e00af1a1fc3328fa763a9269723c8db8fac4f93af71db186d6e90"}},
              "jobs": {"infer": {"max_queued": 100, "mig": {"id": "models.infer",
                "modes": ["unary", "server_stream"]}}, "plain": {}}}}}"#;
        let config = Config::parse(text.as_bytes()).expect("valid");
        let out = describe(&config);
        assert!(
            out.contains(
                "job infer: lease 30 s, offer 5000 ms, at most 3 attempt(s), at most 100 queued, MIG capability models.infer (unary, server_stream)\n"
            ),
            "{out}"
        );
        assert!(
            out.contains("job plain: lease 30 s, offer 5000 ms, at most 3 attempt(s)\n"),
            "{out}"
        );
        assert!(
            out.contains("MIG over NATS: on, 1 capability(ies), deadline 30000 ms (at most 300000), at most 4096 invocations waiting\n"),
            "{out}"
        );
        let off = describe(&Config::development(String::new()));
        assert!(off.contains("MIG over NATS: off\n"), "{off}");
    }

    #[test]
    fn mistakes_are_named() {
        assert_eq!(
            parse_str("serve --listen"),
            Err("--listen needs a value".into())
        );
        assert!(parse_str("serve --listen nowhere").is_err_and(|e| e.contains("nowhere")));
        assert!(parse_str("serve --bogus").is_err_and(|e| e.contains("--bogus")));
        assert!(parse_str("serve --replicas 0").is_err());
        assert!(parse_str("serve --broker-id a.b").is_err());
        assert!(
            parse_str("serve --callout-server-key UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4")
                .is_err_and(|e| e.contains("--callout-server-key"))
        );
        assert!(parse_str("serve --listen 0.0.0.0:1").is_err_and(|e| e.contains("loopback")));
        assert!(parse_str("frobnicate").is_err());
        for bad in [
            "serve --js-max-memory 1000",
            "serve --js-max-memory 2TiB",
            "serve --js-max-file 5XB",
            "serve --nats-mem-limit -1",
            "serve --leaf-remote hub:7422",
            "serve --leaf-remote nats-leaf://hub",
            "serve --leaf-remote tls://hub",
            "serve --leaf-tls-ca ca.pem",
            "serve --leaf-remote tls://hub:7422 --leaf-tls-cert c.pem",
            "serve --leaf-remote tls://hub:7422 --leaf-tls-key k.pem",
            "serve --nats nats://a:4222 --leaf-tls-ca ca.pem",
            "serve --js-domain a.b",
            "serve --leaf-creds x.creds",
            "serve --nats nats://a:4222 --leaf-remote nats-leaf://hub:7422",
            "serve --nats nats://a:4222 --js-domain d",
            "serve --nats-nkey x.nk",
        ] {
            assert!(parse_str(bad).is_err(), "{bad}");
        }
        assert!(
            parse_str("serve --leaf-remote tls://site:pw@hub:7422 --leaf-tls-ca ca.pem").is_ok()
        );
        assert!(parse_str("keygen extra").is_err());
        assert_eq!(parse_str("keygen"), Ok(Command::Keygen));
    }
}
