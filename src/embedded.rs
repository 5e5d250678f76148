//! The `nats-server` child that `serve` runs when no `--nats` URL is given: JetStream on,
//! store under the data directory, a free loopback port, restarted when it dies and
//! stopped when the broker exits.
//!
//! It is locked down: the only user is an NKey generated at start, whose seed is written
//! to `<data dir>/broker.nk` (mode 0600) and used by the broker's own connection, so no
//! other local process can read or write the broker's streams. With an issuer account the
//! same user is the auth callout's, so participants get their scoped credentials exactly
//! as on an external server. Optionally it is a leaf node of a hub, with its own
//! JetStream domain.

use std::io::{self, BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::deadline::after;
use crate::nkeys::{KeyKind, KeyPair};

/// How the child's JetStream persists writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// `sync_interval: always`: every acknowledged write is on disk first. Survives an OS
    /// crash or power loss without losing anything JetStream acknowledged.
    Always,
    /// nats-server's default (flush every two minutes): faster, but an OS crash can lose
    /// up to two minutes of acknowledged writes. A crash of the processes alone loses
    /// nothing, since the data is in the OS page cache.
    Default,
}

/// How much the child may use. nats-server's own defaults (75% of memory, 1 TB of disk)
/// suit a dedicated server, not an edge node shared with other programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    /// JetStream `max_memory_store`, bytes.
    pub max_memory_store: u64,
    /// JetStream `max_file_store`, bytes.
    pub max_file_store: u64,
    /// `GOMEMLIMIT` of the child, bytes: the Go runtime collects harder near it instead
    /// of growing until the kernel's OOM killer ends JetStream.
    pub go_mem_limit: u64,
}

const MIB: u64 = 1024 * 1024;

impl Default for Sizing {
    fn default() -> Self {
        Sizing {
            max_memory_store: 64 * MIB,
            max_file_store: 1024 * MIB,
            go_mem_limit: 256 * MIB,
        }
    }
}

/// The hub the child connects to as a leaf node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafRemote {
    /// `nats-leaf://` or `tls://`, `[user:password@]host:port`.
    pub url: String,
    /// A `.creds` file (user JWT and seed) for the leaf connection.
    pub creds: Option<PathBuf>,
    pub tls: LeafTls,
    /// Subjects kept off the link both ways: those of the namespaces this site keeps in
    /// its own JetStream ([`crate::broker::binding::site_subjects`]).
    pub deny: Vec<String>,
}

/// TLS files of the leaf connection. Any of them turns TLS on, as a `tls` block does in
/// nats-server's own remote configuration, whatever the URL's scheme.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeafTls {
    /// CAs that sign the hub's certificate (default: the system's).
    pub ca: Option<PathBuf>,
    /// Client certificate and key, for a hub that verifies leaf nodes.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    pub binary: PathBuf,
    pub data_dir: PathBuf,
    pub durability: Durability,
    pub ready_timeout: Duration,
    pub sizing: Sizing,
    /// The JetStream domain (also the server's name); `None` keeps JetStream unnamed.
    pub domain: Option<String>,
    pub leaf: Option<LeafRemote>,
    /// The broker's issuing account (`A...`): the child sends every other client to the
    /// broker's auth callout.
    pub callout_issuer: Option<String>,
}

impl EmbeddedOptions {
    /// Durable, edge-sized, unnamed, not a leaf node, no callout.
    pub fn new(binary: PathBuf, data_dir: PathBuf) -> EmbeddedOptions {
        EmbeddedOptions {
            binary,
            data_dir,
            durability: Durability::Always,
            ready_timeout: Duration::from_secs(30),
            sizing: Sizing::default(),
            domain: None,
            leaf: None,
            callout_issuer: None,
        }
    }
}

pub struct EmbeddedServer {
    opts: EmbeddedOptions,
    port: u16,
    /// The only user the child accepts (besides callout-authorised participants).
    user: KeyPair,
    child: Option<Child>,
    restarts: u32,
}

/// Where the broker's NKey seed for the child is kept.
pub const CREDENTIAL_FILE: &str = "broker.nk";

/// The `nats-server` on PATH, if any.
pub fn find_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("nats-server"))
        .find(|p| p.is_file())
}

impl EmbeddedServer {
    /// Starts the child and waits until it accepts clients with JetStream enabled.
    pub fn start(opts: EmbeddedOptions) -> io::Result<EmbeddedServer> {
        std::fs::create_dir_all(&opts.data_dir)?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let user = KeyPair::generate(KeyKind::User).map_err(|e| io::Error::other(e.to_string()))?;
        write_private(&opts.data_dir.join(CREDENTIAL_FILE), &user.seed())?;
        let mut server = EmbeddedServer {
            opts,
            port,
            user,
            child: None,
            restarts: 0,
        };
        server.spawn()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The seed of the broker's user (secret; also in [`Self::credential_path`]).
    pub fn nkey_seed(&self) -> String {
        self.user.seed()
    }

    pub fn credential_path(&self) -> PathBuf {
        self.opts.data_dir.join(CREDENTIAL_FILE)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    fn config_path(&self) -> PathBuf {
        self.opts.data_dir.join("nats-server.conf")
    }

    pub fn log_path(&self) -> PathBuf {
        self.opts.data_dir.join("nats-server.log")
    }

    fn spawn(&mut self) -> io::Result<()> {
        let text = config_text(self.port, &self.user.public_key(), &self.opts);
        write_private(&self.config_path(), &text)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let mut command = Command::new(&self.opts.binary);
        die_with_parent(&mut command);
        let child = command
            .arg("-c")
            .arg(self.config_path())
            .env("GOMEMLIMIT", self.opts.sizing.go_mem_limit.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot start {}: {e}", self.opts.binary.display()),
                )
            })?;
        self.child = Some(child);
        self.wait_ready()
    }

    /// Waits for an INFO line announcing JetStream. Start-up only, so blocking is fine.
    fn wait_ready(&mut self) -> io::Result<()> {
        let deadline = after(Instant::now(), self.opts.ready_timeout);
        loop {
            if let Some(status) = self.exited()? {
                return Err(io::Error::other(format!(
                    "nats-server exited at start ({status}); see {}",
                    self.log_path().display()
                )));
            }
            if let Ok(stream) = TcpStream::connect(("127.0.0.1", self.port)) {
                stream.set_read_timeout(Some(Duration::from_secs(1)))?;
                let mut line = String::new();
                if BufReader::new(stream).read_line(&mut line).is_ok()
                    && line.contains("\"jetstream\":true")
                {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "nats-server did not answer within {:?}; see {}",
                        self.opts.ready_timeout,
                        self.log_path().display()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn exited(&mut self) -> io::Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => child.try_wait(),
            None => Ok(None),
        }
    }

    /// Restarts the child if it died; returns its exit status when it did. Called from a
    /// timer in the event loop.
    pub fn supervise(&mut self) -> io::Result<Option<ExitStatus>> {
        match self.exited()? {
            Some(status) => {
                self.restarts += 1;
                self.spawn()?;
                Ok(Some(status))
            }
            None => Ok(None),
        }
    }

    /// Stops the child: SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(pid) = i32::try_from(child.id()) {
            // SAFETY: kill(2) on our own child's PID; the child is not yet reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = after(Instant::now(), grace);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for EmbeddedServer {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// Creates or truncates `path` readable and writable by this user only. An existing file
/// is narrowed to 0600 before anything is written to it.
fn write_private(path: &Path, text: &str) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(text.as_bytes())
}

/// A broker that dies without stopping its server (SIGKILL, the OOM killer) would leave
/// it running on the data directory and port, and the next broker could not start one:
/// on Linux the child is sent SIGTERM when the broker exits. The broker spawns it from the
/// thread that runs the event loop for the whole life of the process, which is the thread
/// the kernel watches.
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: `getpid` before the fork; between fork and exec only async-signal-safe
    // calls (`prctl`, `getppid`), no allocation.
    let parent = unsafe { libc::getpid() };
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent died between fork and prctl: nobody would stop this child.
            if libc::getppid() != parent {
                return Err(io::Error::other(
                    "the broker exited while starting nats-server",
                ));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

fn config_text(port: u16, user: &str, opts: &EmbeddedOptions) -> String {
    let user = json_string(user);
    let mut text = format!(
        "# Written by amp-broker for its embedded server; rewritten at every start.\n\
         listen: 127.0.0.1:{port}\n\
         authorization {{\n  timeout: 3\n  users: [ {{ nkey: {user} }} ]\n"
    );
    if let Some(issuer) = &opts.callout_issuer {
        text.push_str(&format!(
            "  auth_callout {{\n    issuer: {}\n    auth_users: [ {user} ]\n  }}\n",
            json_string(issuer)
        ));
    }
    text.push_str("}\n");
    if let Some(domain) = &opts.domain {
        // A leaf node's JetStream needs a name that survives restarts.
        text.push_str(&format!("server_name: {}\n", json_string(domain)));
    }
    let s = &opts.sizing;
    text.push_str(&format!(
        "jetstream {{\n  store_dir: {}\n  max_memory_store: {}\n  max_file_store: {}\n",
        json_string(&store_dir(&opts.data_dir)),
        s.max_memory_store,
        s.max_file_store
    ));
    if let Some(domain) = &opts.domain {
        text.push_str(&format!("  domain: {}\n", json_string(domain)));
    }
    if opts.durability == Durability::Always {
        text.push_str("  sync_interval: always\n");
    }
    text.push_str("}\n");
    if let Some(leaf) = &opts.leaf {
        // nats-server's default (a ping every 2 minutes, 2 unanswered) would keep a leaf
        // link that died without a word for minutes; these notice it within ~15 s.
        text.push_str("ping_interval: \"5s\"\nping_max: 2\n");
        text.push_str(&format!(
            "leafnodes {{\n  remotes [ {{\n    url: {}\n",
            json_string(&leaf.url)
        ));
        if let Some(creds) = &leaf.creds {
            text.push_str(&format!(
                "    credentials: {}\n",
                json_string(&creds.to_string_lossy())
            ));
        }
        let files = [
            ("ca_file", &leaf.tls.ca),
            ("cert_file", &leaf.tls.cert),
            ("key_file", &leaf.tls.key),
        ];
        if files.iter().any(|(_, f)| f.is_some()) {
            text.push_str("    tls {\n");
            for (name, file) in files {
                if let Some(file) = file {
                    text.push_str(&format!(
                        "      {name}: {}\n",
                        json_string(&file.to_string_lossy())
                    ));
                }
            }
            text.push_str("    }\n");
        }
        if !leaf.deny.is_empty() {
            let list: Vec<String> = leaf.deny.iter().map(|d| json_string(d)).collect();
            let list = list.join(", ");
            text.push_str(&format!(
                "    deny_imports: [ {list} ]\n    deny_exports: [ {list} ]\n"
            ));
        }
        text.push_str("  } ]\n}\n");
    }
    text
}

/// nats-server keeps JetStream data in `<store_dir>/jetstream`.
fn store_dir(data_dir: &Path) -> String {
    data_dir.join("nats").to_string_lossy().into_owned()
}

/// A quoted string for the nats-server configuration format, which accepts JSON strings.
fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> EmbeddedOptions {
        EmbeddedOptions::new(
            PathBuf::from("nats-server"),
            PathBuf::from("/var/lib/amp \"x\""),
        )
    }

    #[test]
    fn durable_config_flushes_every_write() {
        let mut opts = opts();
        let text = config_text(4321, "UKEY", &opts);
        assert!(text.contains("listen: 127.0.0.1:4321\n"), "{text}");
        assert!(text.contains("sync_interval: always"), "{text}");
        assert!(
            text.contains(r#"store_dir: "/var/lib/amp \"x\"/nats""#),
            "{text}"
        );
        opts.durability = Durability::Default;
        assert!(!config_text(4321, "UKEY", &opts).contains("sync_interval"));
    }

    #[test]
    fn config_admits_only_the_broker_user_and_sizes_jetstream_for_an_edge_node() {
        let text = config_text(4321, "UKEY", &opts());
        assert!(text.contains(r#"users: [ { nkey: "UKEY" } ]"#), "{text}");
        assert!(text.contains("max_memory_store: 67108864\n"), "{text}");
        assert!(text.contains("max_file_store: 1073741824\n"), "{text}");
        assert!(!text.contains("auth_callout"), "{text}");
        assert!(!text.contains("leafnodes"), "{text}");
        assert!(!text.contains("domain"), "{text}");
    }

    #[test]
    fn config_names_the_domain_the_leaf_remote_and_the_callout() {
        let mut opts = opts();
        opts.domain = Some("site1".to_string());
        opts.leaf = Some(LeafRemote {
            url: "nats-leaf://hub:7422".to_string(),
            creds: Some(PathBuf::from("/etc/amp/leaf.creds")),
            tls: LeafTls::default(),
            deny: vec![
                "amp.local.>".to_string(),
                "$KV.AMP_REGISTRY_local.>".to_string(),
            ],
        });
        opts.callout_issuer = Some("AISSUER".to_string());
        let text = config_text(4321, "UKEY", &opts);
        assert!(text.contains("server_name: \"site1\"\n"), "{text}");
        assert!(
            text.contains("ping_interval: \"5s\"\nping_max: 2\n"),
            "{text}"
        );
        assert!(text.contains("  domain: \"site1\"\n"), "{text}");
        assert!(text.contains("url: \"nats-leaf://hub:7422\"\n"), "{text}");
        assert!(
            text.contains("credentials: \"/etc/amp/leaf.creds\"\n"),
            "{text}"
        );
        assert!(
            text.contains("issuer: \"AISSUER\"\n    auth_users: [ \"UKEY\" ]"),
            "{text}"
        );
        assert!(!text.contains("tls"), "{text}");
        let list = r#"[ "amp.local.>", "$KV.AMP_REGISTRY_local.>" ]"#;
        assert!(
            text.contains(&format!("    deny_imports: {list}\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("    deny_exports: {list}\n")),
            "{text}"
        );
    }

    #[test]
    fn leaf_tls_files_go_into_the_remote() {
        let mut opts = opts();
        opts.leaf = Some(LeafRemote {
            url: "tls://hub:7422".to_string(),
            creds: None,
            tls: LeafTls {
                ca: Some(PathBuf::from("/etc/amp/hub-ca.pem")),
                cert: Some(PathBuf::from("/etc/amp/site.pem")),
                key: Some(PathBuf::from("/etc/amp/site-key.pem")),
            },
            deny: Vec::new(),
        });
        let text = config_text(4321, "UKEY", &opts);
        assert!(
            text.contains(
                "    url: \"tls://hub:7422\"\n    tls {\n      ca_file: \"/etc/amp/hub-ca.pem\"\n      \
                 cert_file: \"/etc/amp/site.pem\"\n      key_file: \"/etc/amp/site-key.pem\"\n    }\n  } ]\n"
            ),
            "{text}"
        );
    }
}
