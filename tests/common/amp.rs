//! Test support for the broker: the `amp-broker` binary started as a child process against
//! a real nats-server, and a small AMP client over a real WebSocket.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tungstenite::protocol::WebSocket;
use tungstenite::{ClientRequestBuilder, Message};

use super::free_port;

/// SHA-256 hex of a token, as the configuration stores it.
pub fn token_hash(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A configuration with namespace `acme` and token participants `names` (token = name +
/// "-token"), each allowed everything.
pub fn open_config(names: &[&str]) -> Value {
    let all = json!([">"]);
    let participants: serde_json::Map<String, Value> = names
        .iter()
        .map(|n| {
            let p = json!({
                "token_sha256": token_hash(&format!("{n}-token")),
                "permissions": {"send": all, "publish": all, "subscribe": all, "submit": all, "serve": all},
            });
            (n.to_string(), p)
        })
        .collect();
    json!({"namespaces": {"acme": {"participants": participants}}})
}

/// `config`'s namespace `acme` with an `open` entry (token `open-token`, no permissions):
/// registry entries other brokers write of participants not listed here are mirrored
/// only when a name is admissible this way.
pub fn open_to_any_name(mut config: Value) -> Value {
    config["namespaces"]["acme"]["open"] = json!({"token_sha256": token_hash("open-token")});
    config
}

/// A running broker process, killed when dropped.
pub struct Broker {
    child: Option<Child>,
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
    args: Vec<String>,
    /// Another build of the broker (a benchmark's baseline); this crate's when None.
    bin: Option<std::path::PathBuf>,
}

impl Broker {
    /// Starts `amp-broker serve --nats <url> --config <config> --listen <free port>` and
    /// waits until `/healthz` answers 200.
    pub fn start(nats_url: &str, config: &Value) -> Broker {
        Broker::start_with(nats_url, config, &[])
    }

    pub fn start_with(nats_url: &str, config: &Value, extra: &[&str]) -> Broker {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        Broker::start_at(addr, nats_url, config, extra)
    }

    /// Like `start_with`, probing `/healthz` in plain HTTP at `addr` (the `--listen`
    /// address unless `extra` moves it, e.g. to `--plain-listen` beside a TLS one).
    pub fn start_at(addr: SocketAddr, nats_url: &str, config: &Value, extra: &[&str]) -> Broker {
        let mut broker = Broker::unstarted(addr, nats_url, config, extra);
        broker.spawn();
        broker
    }

    /// Like `start`, with the broker binary at `bin`.
    pub fn start_bin(bin: &Path, nats_url: &str, config: &Value) -> Broker {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let mut broker = Broker::unstarted(addr, nats_url, config, &[]);
        broker.bin = Some(bin.to_path_buf());
        broker.spawn();
        broker
    }

    fn unstarted(addr: SocketAddr, nats_url: &str, config: &Value, extra: &[&str]) -> Broker {
        let dir = tempfile::tempdir().expect("broker dir");
        let config_path = dir.path().join("config.json");
        std::fs::write(&config_path, config.to_string()).expect("write config");
        let mut args = vec![
            "serve".to_string(),
            "--nats".to_string(),
            nats_url.to_string(),
            "--config".to_string(),
            config_path.display().to_string(),
            "--listen".to_string(),
            addr.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Broker {
            child: None,
            addr,
            dir,
            args,
            bin: None,
        }
    }

    /// Starts `amp-broker serve` with its embedded nats-server (store under the broker's
    /// directory), `--config <config> --listen <free port>`, then `extra`.
    pub fn start_embedded(config: &Value, extra: &[&str]) -> Broker {
        let dir = tempfile::tempdir().expect("broker dir");
        let config_path = dir.path().join("config.json");
        std::fs::write(&config_path, config.to_string()).expect("write config");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let mut args = vec![
            "serve".to_string(),
            "--config".to_string(),
            config_path.display().to_string(),
            "--listen".to_string(),
            addr.to_string(),
            "--data-dir".to_string(),
            dir.path().join("data").display().to_string(),
            "--nats-server".to_string(),
            super::nats_server_bin().display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut broker = Broker {
            child: None,
            addr,
            dir,
            args,
            bin: None,
        };
        broker.spawn();
        broker
    }

    /// Starts `amp-broker <args>` as given; `args` must listen on `addr`.
    pub fn start_raw(args: Vec<String>, addr: SocketAddr) -> Broker {
        let mut broker = Broker {
            child: None,
            addr,
            dir: tempfile::tempdir().expect("broker dir"),
            args,
            bin: None,
        };
        broker.spawn();
        broker
    }

    /// Starts a broker that is expected to refuse to start; returns what it said.
    pub fn start_expecting_failure(nats_url: &str, config: &Value) -> String {
        let dir = tempfile::tempdir().expect("broker dir");
        let config_path = dir.path().join("config.json");
        std::fs::write(&config_path, config.to_string()).expect("write config");
        let out = Command::new(env!("CARGO_BIN_EXE_amp-broker"))
            .args(["serve", "--nats", nats_url, "--config"])
            .arg(&config_path)
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .output()
            .expect("run amp-broker");
        assert!(!out.status.success(), "start-up should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("broker.log")).expect("log");
        // A profiler in front of the broker (`valgrind --tool=callgrind ...`): it keeps
        // the broker's pid, so the CPU and memory figures of benches stay its own.
        let bin = self
            .bin
            .clone()
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_amp-broker").into());
        let wrapper = std::env::var("AMP_BROKER_WRAPPER").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut command = match words.next() {
            Some(program) => {
                let mut c = Command::new(program);
                c.args(words).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        let child = command
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn amp-broker");
        self.child = Some(child);
        let start_within = if wrapper.is_empty() { 20 } else { 120 };
        let deadline = Instant::now() + Duration::from_secs(start_within);
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "amp-broker exited at start ({status}); log:\n{}",
                    self.log()
                );
            }
            if http_get(self.addr, "/healthz").is_some_and(|(status, _)| status == 200) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "amp-broker not healthy in time; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("broker.log")).unwrap_or_default()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, no chance to clean up.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for the exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        child.wait().ok()
    }

    /// Sends `signal` to the broker process (kill(2)).
    pub fn signal(&self, signal: i32) {
        let pid = self.pid().expect("broker is running");
        let pid = i32::try_from(pid).expect("pid fits");
        // SAFETY: kill(2) with our own child's pid.
        assert_eq!(
            unsafe { libc::kill(pid, signal) },
            0,
            "kill({pid}, {signal})"
        );
    }

    /// Waits up to `timeout` for the process to exit on its own; its status, or None.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The configuration file the broker was started with (SIGHUP re-reads it).
    pub fn config_path(&self) -> std::path::PathBuf {
        self.dir.path().join("config.json")
    }

    /// Rewrites the configuration file, sends SIGHUP and waits until the broker has logged
    /// the outcome (`marker`) once more than before.
    pub fn reload(&self, config: &Value, marker: &str) {
        let before = self.log().matches(marker).count();
        std::fs::write(self.config_path(), config.to_string()).expect("write config");
        self.signal(libc::SIGHUP);
        assert!(
            super::wait_until(Duration::from_secs(10), || self
                .log()
                .matches(marker)
                .count()
                > before),
            "no `{marker}` after SIGHUP; log:\n{}",
            self.log()
        );
    }

    /// Starts it again with the same arguments.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn url(&self) -> String {
        format!("ws://{}/amp", self.addr)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Under `AMP_BROKER_WRAPPER=valgrind --tool=callgrind ...`: collects only while on.
pub fn profile(pid: &str, on: bool) {
    let wrapper = std::env::var("AMP_BROKER_WRAPPER").unwrap_or_default();
    if wrapper.contains("callgrind") {
        // Off: dump the profile first, as the broker is killed at the end of the run.
        let steps: &[&[&str]] = if on {
            &[&["-i", "on"]]
        } else {
            &[&["-d"], &["-i", "off"]]
        };
        for args in steps {
            let status = Command::new("callgrind_control")
                .args(*args)
                .arg(pid)
                .stdout(Stdio::null())
                .status();
            assert!(
                status.is_ok_and(|s| s.success()),
                "callgrind_control {args:?} {pid}"
            );
        }
    }
}

/// A plain HTTP/1.1 GET: status and body, or None if nothing answered.
/// The value of an unlabelled series of the broker's `/metrics` (`None`: no answer, or no
/// such line).
pub fn metric(broker: &Broker, name: &str) -> Option<f64> {
    let (_, body) = http_get(broker.addr, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// An AMP participant over a real WebSocket.
pub struct Client {
    ws: WebSocket<TcpStream>,
    pub nonce: Vec<u8>,
    pub challenge: Value,
    backlog: VecDeque<Value>,
    next_id: u64,
}

impl Client {
    /// Connects with subprotocol `amp.v1` and reads the challenge.
    pub fn connect(broker: &Broker) -> Client {
        Client::connect_over(
            broker,
            TcpStream::connect(broker.addr).expect("tcp connect"),
        )
    }

    /// [`Client::connect`] over a TCP connection already made (e.g. with a small
    /// receive buffer, `common::connect_with`).
    pub fn connect_over(broker: &Broker, stream: TcpStream) -> Client {
        let uri: tungstenite::http::Uri = broker.url().parse().expect("uri");
        let request = ClientRequestBuilder::new(uri).with_sub_protocol("amp.v1");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        // Nagle off, as browsers have it for WebSockets: with it on, a frame the broker
        // never answers (an `ack`) followed by another (the next `submit`) holds the
        // second one until the broker's delayed ACK, some 40 ms.
        stream.set_nodelay(true).expect("TCP_NODELAY");
        let (ws, _) = tungstenite::client(request, stream).expect("websocket upgrade");
        let mut client = Client {
            ws,
            nonce: Vec::new(),
            challenge: Value::Null,
            backlog: VecDeque::new(),
            next_id: 0,
        };
        let challenge = client
            .next_frame(Duration::from_secs(5))
            .expect("challenge");
        assert_eq!(challenge["op"], "challenge", "{challenge}");
        use base64::Engine;
        client.nonce = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(challenge["nonce"].as_str().expect("nonce"))
            .expect("base64url nonce");
        client.challenge = challenge;
        client
    }

    /// Connects and says hello with a token; panics unless the broker answers `ok`.
    pub fn login(broker: &Broker, ns: &str, name: &str, token: &str) -> Client {
        Client::connect(broker).hello(ns, name, token)
    }

    /// Says hello with a token; panics unless the broker answers `ok`.
    pub fn hello(mut self, ns: &str, name: &str, token: &str) -> Client {
        let ok = self.request(
            json!({"op":"hello","ns":ns,"name":name,"auth":{"type":"token","token":token}}),
        );
        assert_eq!(ok["op"], "ok", "hello: {ok}");
        self
    }

    /// The WebSocket itself, for load generators that pipeline frames.
    pub fn into_websocket(self) -> WebSocket<TcpStream> {
        self.ws
    }

    pub fn send_text(&mut self, text: &str) {
        self.ws.send(Message::text(text)).expect("send frame");
    }

    pub fn send_binary(&mut self, bytes: &[u8]) {
        self.ws
            .send(Message::binary(bytes.to_vec()))
            .expect("send binary frame");
    }

    /// Stops reading from the socket (and shrinks the receive buffer) so the broker's
    /// outbound queue for this session fills up.
    pub fn stop_reading(&mut self) {
        use std::os::fd::AsRawFd;
        let size: libc::c_int = 4096;
        // SAFETY: setsockopt on our own socket with a pointer to a live c_int.
        unsafe {
            libc::setsockopt(
                self.ws.get_ref().as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }

    pub fn send(&mut self, frame: &Value) {
        self.send_text(&frame.to_string());
    }

    /// Sends `frame` with a fresh `id` (unless it has one) and returns the answer to it;
    /// other frames arriving meanwhile are kept for `next_frame`.
    pub fn request(&mut self, mut frame: Value) -> Value {
        if frame.get("id").is_none() {
            self.next_id += 1;
            frame["id"] = json!(format!("r{}", self.next_id));
        }
        let id = frame["id"].as_str().unwrap_or_default().to_string();
        self.send(&frame);
        self.answer_to(&id)
    }

    /// [`request`](Self::request), sent again while it is answered `unavailable` for a
    /// main NATS connection that has read nothing since its PING (a nats-server just
    /// resumed after SIGSTOP has not been heard yet): what a client is told to retry.
    pub fn request_once_heard(&mut self, frame: Value) -> Value {
        let silent = |a: &Value| {
            a["code"] == "unavailable"
                && a["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("connection silent"))
        };
        let mut answer = self.request(frame.clone());
        super::wait_until(Duration::from_secs(15), || {
            if silent(&answer) {
                answer = self.request(frame.clone());
            }
            !silent(&answer)
        });
        answer
    }

    /// The answer to the request with `id` sent earlier; other frames arriving meanwhile
    /// are kept for `next_frame`.
    pub fn answer_to(&mut self, id: &str) -> Value {
        if let Some(i) = self.backlog.iter().position(|f| f["re"] == id)
            && let Some(f) = self.backlog.remove(i)
        {
            return f;
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(f) = self.read(left) else {
                panic!("no answer to request {id}")
            };
            if f["re"] == id {
                return f;
            }
            self.backlog.push_back(f);
        }
    }

    /// The next frame (answers not claimed by `request` included), or None on timeout.
    pub fn next_frame(&mut self, timeout: Duration) -> Option<Value> {
        self.backlog.pop_front().or_else(|| self.read(timeout))
    }

    /// The next frame with this `op`, keeping others.
    pub fn next_op(&mut self, op: &str, timeout: Duration) -> Option<Value> {
        if let Some(i) = self.backlog.iter().position(|f| f["op"] == op) {
            return self.backlog.remove(i);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let f = self.read(deadline.saturating_duration_since(Instant::now()))?;
            if f["op"] == op {
                return Some(f);
            }
            self.backlog.push_back(f);
        }
    }

    fn read(&mut self, timeout: Duration) -> Option<Value> {
        // Pings and pongs do not count: a broker pinging more often than `timeout` must
        // not keep the wait going forever.
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.ws.get_mut().set_read_timeout(Some(left)).ok()?;
            match self.ws.read() {
                Ok(Message::Text(t)) => {
                    return Some(serde_json::from_str(t.as_str()).expect("frame is JSON"));
                }
                Ok(Message::Close(frame)) => {
                    return Some(
                        json!({"op": "_closed", "code": frame.as_ref().map(|f| u16::from(f.code)), "reason": frame.map(|f| f.reason.to_string())}),
                    );
                }
                Ok(_) => continue,
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return None;
                }
                Err(_) => return Some(json!({"op": "_closed", "code": null})),
            }
        }
    }

    /// Waits for the close frame and returns its code.
    pub fn closed_with(&mut self, timeout: Duration) -> Option<u16> {
        let f = self.next_op("_closed", timeout)?;
        f["code"].as_u64().and_then(|c| u16::try_from(c).ok())
    }
}

/// nats-server with `auth_callout` whose auth user is the broker's NKey, and the flags
/// that make the broker binary the callout and the issuer of scoped JWTs.
pub struct CalloutServer {
    pub nats: super::NatsServer,
    pub broker_key: amp_broker::nkeys::KeyPair,
    pub account: amp_broker::nkeys::KeyPair,
    dir: tempfile::TempDir,
}

impl CalloutServer {
    pub fn start() -> CalloutServer {
        CalloutServer::start_with("")
    }

    /// With `extra` server configuration (e.g. a `tls {}` block).
    pub fn start_with(extra: &str) -> CalloutServer {
        use amp_broker::nkeys::{KeyKind, KeyPair};
        let broker_key = KeyPair::generate(KeyKind::User).expect("key");
        let account = KeyPair::generate(KeyKind::Account).expect("key");
        let nats = super::NatsServer::with_config(&format!(
            // A 5 s auth timeout (2 s by default): on a loaded 2-core CI host a debug
            // broker behind a dozen parallel tests has overrun the default.
            "authorization {{\n  timeout: 5\n  users: [ {{ nkey: \"{b}\" }} ]\n  auth_callout {{\n    issuer: \"{a}\"\n    auth_users: [ \"{b}\" ]\n  }}\n}}\n{extra}",
            b = broker_key.public_key(),
            a = account.public_key()
        ));
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("broker.seed"), broker_key.seed()).expect("write");
        std::fs::write(dir.path().join("issuer.seed"), account.seed()).expect("write");
        CalloutServer {
            nats,
            broker_key,
            account,
            dir,
        }
    }

    /// `--nats-nkey` and `--issuer-seed-file` for the broker, then `extra`.
    pub fn broker_args(&self, extra: &[&str]) -> Vec<String> {
        let seed = |name: &str| self.dir.path().join(name).display().to_string();
        let mut args = vec![
            "--nats-nkey".to_string(),
            seed("broker.seed"),
            "--issuer-seed-file".to_string(),
            seed("issuer.seed"),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// The broker binary as this server's callout, with `config`.
    pub fn broker(&self, config: &Value, extra: &[&str]) -> Broker {
        self.broker_at(&self.nats.url(), config, extra)
    }

    /// The same, connecting to `url` (a `tls://` one for a TLS server).
    pub fn broker_at(&self, url: &str, config: &Value, extra: &[&str]) -> Broker {
        let args = self.broker_args(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Broker::start_with(url, config, &args)
    }
}
