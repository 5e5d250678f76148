//! The attacking connections. Each runs on its own thread until `stop`, and whenever the
//! broker closes it (or refuses it) it connects again after a short pause: a real
//! attacker does not give up, and a broker that closes attackers must keep doing so.
//! Every socket operation has a timeout, so `stop` is seen within about two seconds.
//! Buffers are fixed: the large attack payloads are built once and shared.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use super::raw_ws::{
    self, CLOSE, FrameReader, PING, PONG, ServerFrame, SocketOptions, TEXT, is_timeout,
};

const IO_TIMEOUT: Duration = Duration::from_millis(500);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);
/// The broker's default `max_frame`.
const MAX_FRAME: usize = 1 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// Pings before `hello`, never reading (so every pong stays queued in the broker).
    PingFlood,
    /// `{"op":"ack","seq":1}` streamed from a logged-in session (no reply is due).
    AckFlood,
    /// Connect, `hello` with a wrong token or an unknown name, repeat.
    HelloChurn,
    /// A 1 MiB message never completed: a declared 1 MiB frame before `hello` (even
    /// connections), or a 1 MiB first fragment from a logged-in session that answers
    /// every ping (odd ones).
    PartialFrame,
    /// Durable and plain `subscribe`s with fresh names, pipelined, from a logged-in session.
    SubscribeSpam,
    /// Connections opened and dropped: at once, after the upgrade, after the challenge,
    /// or in the middle of the request head.
    ConnectionChurn,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::PingFlood,
        Kind::AckFlood,
        Kind::HelloChurn,
        Kind::PartialFrame,
        Kind::SubscribeSpam,
        Kind::ConnectionChurn,
    ];

    /// The name `HOSTILE_LOAD_KINDS` uses.
    pub fn short(self) -> &'static str {
        match self {
            Kind::PingFlood => "ping",
            Kind::AckFlood => "ack",
            Kind::HelloChurn => "hello",
            Kind::PartialFrame => "partial",
            Kind::SubscribeSpam => "subscribe",
            Kind::ConnectionChurn => "churn",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Kind::PingFlood => "ping flood, never reads",
            Kind::AckFlood => "ack flood, logged in",
            Kind::HelloChurn => "hello churn, bad credentials",
            Kind::PartialFrame => "1 MiB partial frames held",
            Kind::SubscribeSpam => "subscribe spam, logged in",
            Kind::ConnectionChurn => "connection churn",
        }
    }

    /// The participant a logged-in attacker of this kind uses, if any.
    pub fn participant(self, index: usize) -> Option<String> {
        match self {
            Kind::AckFlood => Some(format!("atk-ack-{index}")),
            Kind::SubscribeSpam => Some(format!("atk-sub-{index}")),
            Kind::PartialFrame if index % 2 == 1 => Some(format!("atk-part-{index}")),
            _ => None,
        }
    }
}

/// What one kind of attacker did, summed over its connections.
#[derive(Default)]
pub struct Stats {
    /// Connections that got as far as the attack (upgrade done, logged in if needed).
    pub sessions: AtomicU64,
    /// Sessions the broker ended (close frame, EOF, reset, refused hello or login).
    pub ended_by_broker: AtomicU64,
    /// Connects that failed or timed out, and upgrades refused.
    pub refused: AtomicU64,
    pub bytes_sent: AtomicU64,
    /// The first refusal the broker gave in words (an error frame or a close reason).
    pub first_refusal: Mutex<Option<String>>,
    /// The first close reason of a session the broker ended (when the attacker reads).
    pub first_close: Mutex<Option<String>>,
}

impl Stats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn note(slot: &Mutex<Option<String>>, frame: &ServerFrame) {
        let text = if frame.opcode == CLOSE {
            let code = frame
                .head
                .get(..2)
                .map_or(0, |c| u16::from_be_bytes([c[0], c[1]]));
            let reason = String::from_utf8_lossy(frame.head.get(2..).unwrap_or_default());
            format!("close {code} {reason}")
        } else {
            String::from_utf8_lossy(&frame.head).into_owned()
        };
        if let Ok(mut first) = slot.lock() {
            first.get_or_insert(text);
        }
    }
}

/// Where the attackers connect from and to.
#[derive(Clone, Copy)]
pub struct Target {
    pub broker: SocketAddr,
    pub source: Ipv4Addr,
    pub namespace: &'static str,
    /// Connections per second of each churn thread.
    pub churn_per_s: u32,
}

/// Why a session ended.
enum End {
    Stop,
    Broker,
    Refused,
}

impl From<io::Error> for End {
    fn from(_: io::Error) -> End {
        End::Broker
    }
}

/// Runs one attacking connection (reconnecting) until `stop`.
pub fn run(kind: Kind, index: usize, target: Target, stop: &AtomicBool, stats: &Stats) {
    let mut counter = 0u64;
    while !stop.load(Ordering::Relaxed) {
        counter += 1;
        let end = match kind {
            Kind::PingFlood => ping_flood(target, stop, stats),
            Kind::AckFlood => logged_in_flood(kind, index, target, stop, stats, |out| {
                out.extend_from_slice(ack_frames())
            }),
            Kind::SubscribeSpam => {
                let mut k = 0u64;
                logged_in_flood(kind, index, target, stop, stats, move |out| {
                    subscribe_frames(index, &mut k, out)
                })
            }
            Kind::HelloChurn => hello_churn(index, counter, target, stats),
            Kind::PartialFrame if index.is_multiple_of(2) => partial_frame(target, stop, stats),
            Kind::PartialFrame => partial_fragment(kind, index, target, stop, stats),
            Kind::ConnectionChurn => churn(counter, target, stop, stats),
        };
        match end {
            End::Stop => {}
            End::Broker => Stats::add(&stats.ended_by_broker, 1),
            End::Refused => Stats::add(&stats.refused, 1),
        }
        if matches!(end, End::Refused)
            || (matches!(end, End::Broker) && !matches!(kind, Kind::HelloChurn))
        {
            pause(RECONNECT_PAUSE, stop);
        }
    }
}

fn pause(d: Duration, stop: &AtomicBool) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::Relaxed) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        thread::sleep(left.min(Duration::from_millis(20)));
    }
}

/// A connection that has completed the upgrade, with the bytes that followed its head.
fn open(target: Target, options: SocketOptions) -> Result<(TcpStream, Vec<u8>), End> {
    let mut s = raw_ws::connect_from(target.source, target.broker, CONNECT_TIMEOUT, options)
        .map_err(|_| End::Refused)?;
    s.set_read_timeout(Some(ANSWER_TIMEOUT))
        .map_err(|_| End::Refused)?;
    s.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(|_| End::Refused)?;
    let rest = raw_ws::upgrade(&mut s, target.broker).map_err(|_| End::Refused)?;
    Ok((s, rest))
}

/// Feeds `bytes`, judging frames with `want` until it has a verdict (a close is a no).
fn judge(
    reader: &mut FrameReader,
    bytes: &[u8],
    verdict: &mut Option<bool>,
    want: &mut impl FnMut(&ServerFrame) -> Option<bool>,
) {
    reader.feed(bytes, |f| {
        if verdict.is_none() {
            let wanted = want(&f);
            *verdict = if f.opcode == CLOSE {
                Some(false)
            } else {
                wanted
            };
        }
    });
}

/// Reads frames until `want` accepts one (Ok(true)), refuses one (Ok(false)), or the
/// broker closes or `ANSWER_TIMEOUT` passes (Err).
fn wait_for(
    s: &mut TcpStream,
    reader: &mut FrameReader,
    pending: &[u8],
    mut want: impl FnMut(&ServerFrame) -> Option<bool>,
) -> io::Result<bool> {
    let mut verdict = None;
    judge(reader, pending, &mut verdict, &mut want);
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    let mut buf = [0u8; 4096];
    while verdict.is_none() {
        if Instant::now() > deadline {
            return Err(io::ErrorKind::TimedOut.into());
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        judge(reader, &buf[..n], &mut verdict, &mut want);
    }
    Ok(verdict.unwrap_or(false))
}

/// An upgraded connection logged in as `name` (token `<name>-token`).
fn login(target: Target, name: &str, stats: &Stats) -> Result<(TcpStream, FrameReader), End> {
    let (mut s, rest) = open(target, SocketOptions::default())?;
    let mut reader = FrameReader::default();
    let hello = format!(
        r#"{{"op":"hello","id":"h","ns":"{}","name":"{name}","auth":{{"type":"token","token":"{name}-token"}}}}"#,
        target.namespace
    );
    let mut out = Vec::new();
    raw_ws::frame(TEXT, true, hello.as_bytes(), &mut out);
    // A hello the broker does not answer `ok` counts as a refusal, like a failed connect.
    s.write_all(&out).map_err(|_| End::Refused)?;
    let ok = wait_for(&mut s, &mut reader, &rest, |f| {
        if f.text_starts_with(r#"{"op":"ok""#) {
            Some(true)
        } else if f.opcode == CLOSE || f.text_starts_with(r#"{"op":"error""#) {
            Stats::note(&stats.first_refusal, f);
            Some(false)
        } else {
            None
        }
    })
    .map_err(|_| End::Refused)?;
    if ok {
        Ok((s, reader))
    } else {
        Err(End::Refused)
    }
}

/// Writes all of `bytes`, waiting out write timeouts (the broker not reading) until
/// `stop`; returns false when stopped first.
fn write_fully(
    s: &mut TcpStream,
    bytes: &[u8],
    stop: &AtomicBool,
    stats: &Stats,
) -> io::Result<bool> {
    let mut off = 0;
    while off < bytes.len() {
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        match s.write(&bytes[off..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                off += n;
                Stats::add(&stats.bytes_sent, n as u64);
            }
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// `write_fully` of each part in turn.
fn write_parts(
    s: &mut TcpStream,
    parts: &[&[u8]],
    stop: &AtomicBool,
    stats: &Stats,
) -> io::Result<bool> {
    for part in parts {
        if !write_fully(s, part, stop, stats)? {
            return Ok(false);
        }
    }
    Ok(true)
}

fn ping_frames() -> &'static [u8] {
    static FRAMES: OnceLock<Vec<u8>> = OnceLock::new();
    FRAMES.get_or_init(|| {
        let mut one = Vec::new();
        raw_ws::frame(PING, true, &[b'p'; 125], &mut one);
        one.repeat(500)
    })
}

fn ack_frames() -> &'static [u8] {
    static FRAMES: OnceLock<Vec<u8>> = OnceLock::new();
    FRAMES.get_or_init(|| raw_ws::repeated_text(r#"{"op":"ack","seq":1}"#, 2000))
}

/// One MiB of valid UTF-8 payload, shared by every partial-frame attacker.
fn megabyte() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| vec![b'x'; MAX_FRAME])
}

fn subscribe_frames(index: usize, k: &mut u64, out: &mut Vec<u8>) {
    for _ in 0..32 {
        *k += 1;
        let durable = if k.is_multiple_of(2) {
            r#","durable":true"#
        } else {
            ""
        };
        let text = format!(
            r#"{{"op":"subscribe","id":"u{k}","topic":"spam.{index}.{k}","sub":"s{index}_{k}"{durable}}}"#,
            k = *k
        );
        raw_ws::frame(TEXT, true, text.as_bytes(), out);
    }
}

fn ping_flood(target: Target, stop: &AtomicBool, stats: &Stats) -> End {
    let options = SocketOptions {
        small_receive_buffer: true,
        ..SocketOptions::default()
    };
    let mut s = match open(target, options) {
        Ok((s, _)) => s,
        Err(end) => return end,
    };
    Stats::add(&stats.sessions, 1);
    let frames = ping_frames();
    // The buffer holds whole frames, so cycling through it keeps frame boundaries.
    let mut off = 0;
    while !stop.load(Ordering::Relaxed) {
        match s.write(&frames[off..]) {
            Ok(0) => return End::Broker,
            Ok(n) => {
                off = (off + n) % frames.len();
                Stats::add(&stats.bytes_sent, n as u64);
            }
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return End::Broker,
        }
    }
    End::Stop
}

/// Logs in, then writes the chunks `next` produces as fast as the broker takes them,
/// while a second thread reads and discards whatever the broker sends.
fn logged_in_flood(
    kind: Kind,
    index: usize,
    target: Target,
    stop: &AtomicBool,
    stats: &Stats,
    mut next: impl FnMut(&mut Vec<u8>),
) -> End {
    let Some(name) = kind.participant(index) else {
        return End::Stop;
    };
    let (mut s, mut reader) = match login(target, &name, stats) {
        Ok(v) => v,
        Err(end) => return end,
    };
    Stats::add(&stats.sessions, 1);
    let Ok(mut read_side) = s.try_clone() else {
        return End::Broker;
    };
    let closed = AtomicBool::new(false);
    thread::scope(|scope| {
        scope.spawn(|| {
            let _ = read_side.set_read_timeout(Some(IO_TIMEOUT));
            let mut buf = vec![0u8; 16 * 1024];
            while !stop.load(Ordering::Relaxed) && !closed.load(Ordering::Relaxed) {
                match read_side.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => reader.feed(&buf[..n], |f| {
                        if f.opcode == CLOSE {
                            Stats::note(&stats.first_close, &f);
                            closed.store(true, Ordering::Relaxed);
                        }
                    }),
                    Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            closed.store(true, Ordering::Relaxed);
        });
        let mut chunk = Vec::new();
        let end = loop {
            if stop.load(Ordering::Relaxed) {
                break End::Stop;
            }
            if closed.load(Ordering::Relaxed) {
                break End::Broker;
            }
            chunk.clear();
            next(&mut chunk);
            match write_fully(&mut s, &chunk, stop, stats) {
                Ok(true) => {}
                Ok(false) => break End::Stop,
                Err(_) => break End::Broker,
            }
        };
        // Ends the reader's wait at once.
        let _ = s.shutdown(std::net::Shutdown::Both);
        closed.store(true, Ordering::Relaxed);
        end
    })
}

fn hello_churn(index: usize, counter: u64, target: Target, stats: &Stats) -> End {
    let (mut s, rest) = match open(target, SocketOptions::default()) {
        Ok(v) => v,
        Err(end) => return end,
    };
    Stats::add(&stats.sessions, 1);
    let mut reader = FrameReader::default();
    if wait_for(&mut s, &mut reader, &rest, |f| {
        f.text_starts_with(r#"{"op":"challenge""#).then_some(true)
    })
    .is_err()
    {
        return End::Broker;
    }
    // A known participant with a wrong token, or a name nobody has.
    let name = if counter.is_multiple_of(2) {
        "atk-ack-0".to_string()
    } else {
        format!("nobody-{index}-{counter}")
    };
    let hello = format!(
        r#"{{"op":"hello","id":"h","ns":"{}","name":"{name}","auth":{{"type":"token","token":"wrong-{counter}"}}}}"#,
        target.namespace
    );
    let mut out = Vec::new();
    raw_ws::frame(TEXT, true, hello.as_bytes(), &mut out);
    if s.write_all(&out).is_err() {
        return End::Broker;
    }
    // The refusal (error, then close) or a timeout: either way the next round begins.
    let _ = wait_for(&mut s, &mut reader, &[], |f| {
        f.text_starts_with(r#"{"op":"ok""#).then_some(true)
    });
    End::Broker
}

/// Blocks on reads until the broker closes the connection or `stop`, answering pings
/// when `answer_pings` (legal between the fragments of a message).
fn hold(
    s: &mut TcpStream,
    reader: &mut FrameReader,
    answer_pings: bool,
    stop: &AtomicBool,
    stats: &Stats,
) -> End {
    if s.set_read_timeout(Some(IO_TIMEOUT)).is_err() {
        return End::Broker;
    }
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        match s.read(&mut buf) {
            Ok(0) => return End::Broker,
            Ok(n) => {
                let mut pongs = Vec::new();
                let mut closed = false;
                reader.feed(&buf[..n], |f| match f.opcode {
                    PING if answer_pings => raw_ws::frame(PONG, true, &f.head, &mut pongs),
                    CLOSE => {
                        Stats::note(&stats.first_close, &f);
                        closed = true;
                    }
                    _ => {}
                });
                if closed {
                    return End::Broker;
                }
                if !pongs.is_empty() && !matches!(write_fully(s, &pongs, stop, stats), Ok(true)) {
                    return End::Broker;
                }
            }
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return End::Broker,
        }
    }
    End::Stop
}

fn partial_frame(target: Target, stop: &AtomicBool, stats: &Stats) -> End {
    let (mut s, rest) = match open(target, SocketOptions::default()) {
        Ok(v) => v,
        Err(end) => return end,
    };
    Stats::add(&stats.sessions, 1);
    let mut reader = FrameReader::default();
    reader.feed(&rest, |_| {});
    let mut head = Vec::new();
    raw_ws::header(TEXT, true, MAX_FRAME, &mut head);
    match write_parts(&mut s, &[&head, &megabyte()[1..]], stop, stats) {
        Ok(true) => hold(&mut s, &mut reader, false, stop, stats),
        Ok(false) => End::Stop,
        Err(_) => End::Broker,
    }
}

fn partial_fragment(
    kind: Kind,
    index: usize,
    target: Target,
    stop: &AtomicBool,
    stats: &Stats,
) -> End {
    let Some(name) = kind.participant(index) else {
        return End::Stop;
    };
    let (mut s, mut reader) = match login(target, &name, stats) {
        Ok(v) => v,
        Err(end) => return end,
    };
    Stats::add(&stats.sessions, 1);
    let fragment = &megabyte()[1024..];
    let mut head = Vec::new();
    raw_ws::header(TEXT, false, fragment.len(), &mut head);
    match write_parts(&mut s, &[&head, fragment], stop, stats) {
        Ok(true) => hold(&mut s, &mut reader, true, stop, stats),
        Ok(false) => End::Stop,
        Err(_) => End::Broker,
    }
}

fn churn(counter: u64, target: Target, stop: &AtomicBool, stats: &Stats) -> End {
    let started = Instant::now();
    let variant = counter % 4;
    let options = SocketOptions {
        reset_on_close: variant.is_multiple_of(2),
        ..SocketOptions::default()
    };
    let result = match variant {
        0 => raw_ws::connect_from(target.source, target.broker, CONNECT_TIMEOUT, options).map(drop),
        1 | 2 => open(target, options)
            .map_err(|_| io::Error::other("refused"))
            .and_then(|(mut s, rest)| {
                if variant == 2 {
                    let mut reader = FrameReader::default();
                    wait_for(&mut s, &mut reader, &rest, |f| {
                        f.text_starts_with(r#"{"op":"challenge""#).then_some(true)
                    })?;
                }
                Ok(())
            }),
        _ => raw_ws::connect_from(target.source, target.broker, CONNECT_TIMEOUT, options)
            .and_then(|mut s| s.write_all(b"GET /amp HTTP/1.1\r\nHost: churn\r\nUpgr")),
    };
    let period = Duration::from_secs(1) / target.churn_per_s.max(1);
    pause(period.saturating_sub(started.elapsed()), stop);
    match result {
        Ok(()) => {
            Stats::add(&stats.sessions, 1);
            End::Stop
        }
        Err(_) => End::Refused,
    }
}
