//! The `nats-server` child that `serve` runs when no `--nats` URL is given: JetStream on,
//! store under the data directory, a free loopback port, restarted when it dies and
//! stopped when the broker exits.

use std::io::{self, BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::deadline::after;

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

#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    pub binary: PathBuf,
    pub data_dir: PathBuf,
    pub durability: Durability,
    pub ready_timeout: Duration,
}

pub struct EmbeddedServer {
    opts: EmbeddedOptions,
    port: u16,
    child: Option<Child>,
    restarts: u32,
}

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
        let mut server = EmbeddedServer {
            opts,
            port,
            child: None,
            restarts: 0,
        };
        server.spawn()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
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
        std::fs::write(self.config_path(), config_text(self.port, &self.opts))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new(&self.opts.binary)
            .arg("-c")
            .arg(self.config_path())
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

fn config_text(port: u16, opts: &EmbeddedOptions) -> String {
    let sync = match opts.durability {
        Durability::Always => "  sync_interval: always\n",
        Durability::Default => "",
    };
    format!(
        "# Written by amp-broker for its embedded server; rewritten at every start.\n\
         listen: 127.0.0.1:{port}\n\
         jetstream {{\n  store_dir: {}\n{sync}}}\n",
        json_string(&store_dir(&opts.data_dir)),
    )
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

    #[test]
    fn durable_config_flushes_every_write() {
        let mut opts = EmbeddedOptions {
            binary: PathBuf::from("nats-server"),
            data_dir: PathBuf::from("/var/lib/amp \"x\""),
            durability: Durability::Always,
            ready_timeout: Duration::from_secs(1),
        };
        let text = config_text(4321, &opts);
        assert!(text.contains("listen: 127.0.0.1:4321\n"), "{text}");
        assert!(text.contains("sync_interval: always"), "{text}");
        assert!(
            text.contains(r#"store_dir: "/var/lib/amp \"x\"/nats""#),
            "{text}"
        );
        opts.durability = Durability::Default;
        assert!(!config_text(4321, &opts).contains("sync_interval"));
    }
}
