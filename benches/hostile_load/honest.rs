//! The honest side: sender/receiver pairs of WebSocket sessions (blocking tungstenite
//! clients, one thread each) doing `send` -> `message` -> `ack` at a fixed rate, and a
//! newcomer probe timing how long a fresh connection waits for its challenge.
//!
//! Honest clients behave like a careful application: a session the broker ends (or that
//! stops answering) is replaced, and sends not yet confirmed are sent again with the
//! same `idem` key, so a message counts as lost only if the broker confirmed it and never
//! delivered it. Latency is first delivery minus first send, on one monotonic clock, so
//! time spent reconnecting counts against the broker.

use std::collections::{HashSet, VecDeque};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use tungstenite::{ClientRequestBuilder, Message, WebSocket};

use super::raw_ws::{self, FrameReader, SocketOptions};

const LOGIN_TIMEOUT: Duration = Duration::from_secs(10);
const WARMUP_TIMEOUT: Duration = Duration::from_secs(30);
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// A newcomer that has no challenge by then is recorded with this wait.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Nanoseconds on one monotonic clock shared by every thread of this process.
pub fn clock() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

#[derive(Clone, Copy)]
pub struct Load {
    pub broker: SocketAddr,
    pub namespace: &'static str,
    /// Sends per second of each sender.
    pub rate: u32,
    /// Sends in flight (not yet confirmed) per sender at most.
    pub window: usize,
    pub body_bytes: usize,
}

/// The phase's switches, flipped by the main thread.
#[derive(Default)]
pub struct Flags {
    /// Senders send new messages while set.
    pub sending: AtomicBool,
    /// Everyone keeps going (confirming, delivering) while set; cleared at the end of
    /// the drain.
    pub receiving: AtomicBool,
    /// Receivers that have every confirmed message of their pair.
    pub complete: AtomicUsize,
}

/// What a sender hands its receiver once it has stopped: the confirmed sends.
#[derive(Default)]
pub struct PairShare {
    pub confirmed: OnceLock<Vec<u64>>,
}

#[derive(Default)]
pub struct SenderResult {
    pub sent: u64,
    pub confirmed: Vec<u64>,
    /// Confirmations that came while the phase was sending.
    pub confirmed_in_phase: u64,
    /// Sends answered with an error.
    pub refused: u64,
    /// Sends still unconfirmed at the end of the drain.
    pub unconfirmed: u64,
    pub reconnects: u64,
    pub warmed_up: bool,
}

#[derive(Default)]
pub struct ReceiverResult {
    /// (arrival on `clock()`, latency) in ns of each message's first delivery.
    pub deliveries: Vec<(u64, u64)>,
    pub seen: HashSet<u64>,
    pub reconnects: u64,
    pub warmed_up: bool,
}

type Ws = WebSocket<TcpStream>;

fn try_login(load: &Load, name: &str) -> Option<Ws> {
    let stream = raw_ws::connect_from(
        Ipv4Addr::LOCALHOST,
        load.broker,
        Duration::from_secs(2),
        SocketOptions::default(),
    )
    .ok()?;
    stream.set_read_timeout(Some(LOGIN_TIMEOUT)).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .ok()?;
    let uri: tungstenite::http::Uri = format!("ws://{}/amp", load.broker).parse().ok()?;
    let request = ClientRequestBuilder::new(uri).with_sub_protocol("amp.v1");
    let (mut ws, _) = tungstenite::client(request, stream).ok()?;
    let hello = format!(
        r#"{{"op":"hello","id":"h","ns":"{}","name":"{name}","auth":{{"type":"token","token":"{name}-token"}}}}"#,
        load.namespace
    );
    ws.send(Message::text(hello)).ok()?;
    let deadline = Instant::now() + LOGIN_TIMEOUT;
    while Instant::now() < deadline {
        match ws.read().ok()? {
            Message::Text(t) if t.as_str().starts_with(r#"{"op":"ok""#) => return Some(ws),
            Message::Text(t) if t.as_str().starts_with(r#"{"op":"error""#) => return None,
            Message::Close(_) => return None,
            _ => {}
        }
    }
    None
}

/// Logs in, retrying while `keep_trying` holds.
fn login(load: &Load, name: &str, mut keep_trying: impl FnMut() -> bool) -> Option<Ws> {
    loop {
        if let Some(ws) = try_login(load, name) {
            return Some(ws);
        }
        if !keep_trying() {
            return None;
        }
        std::thread::sleep(RETRY_PAUSE);
    }
}

enum Read {
    Frame(Value),
    Nothing,
    Dead,
}

fn read(ws: &mut Ws, timeout: Duration) -> Read {
    if ws
        .get_mut()
        .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
        .is_err()
    {
        return Read::Dead;
    }
    match ws.read() {
        Ok(Message::Text(t)) => serde_json::from_str(t.as_str()).map_or(Read::Nothing, Read::Frame),
        Ok(Message::Close(_)) => Read::Dead,
        Ok(_) => Read::Nothing,
        Err(tungstenite::Error::Io(e)) if raw_ws::is_timeout(&e) => Read::Nothing,
        Err(_) => Read::Dead,
    }
}

fn send_frame(load: &Load, to: &str, me: &str, k: u64, t: u64) -> String {
    let head = format!(r#"{{"t":{t},"k":{k},"pad":""#);
    let pad = load.body_bytes.saturating_sub(head.len() + 2);
    format!(
        r#"{{"op":"send","id":"{k}","to":"{to}","idem":"{me}-{k}","body":{head}{}"}}}}"#,
        "x".repeat(pad)
    )
}

pub fn sender_name(phase: usize, i: usize) -> String {
    format!("p{phase}-s{i}")
}

pub fn receiver_name(phase: usize, i: usize) -> String {
    format!("p{phase}-r{i}")
}

/// One sender: warm-up send, `ready`, `go`, then `rate` sends per second while
/// `flags.sending`, then waits for the outstanding confirmations.
pub fn sender(
    load: &Load,
    phase: usize,
    i: usize,
    gates: [&Barrier; 2],
    flags: &Flags,
    share: &PairShare,
) -> SenderResult {
    let (me, to) = (sender_name(phase, i), receiver_name(phase, i));
    let mut result = SenderResult::default();
    let warmup_deadline = Instant::now() + WARMUP_TIMEOUT;
    let mut ws = login(load, &me, || Instant::now() < warmup_deadline);
    if let Some(s) = ws.as_mut() {
        let sent = s
            .send(Message::text(send_frame(load, &to, &me, 0, 0)))
            .is_ok();
        while sent && Instant::now() < warmup_deadline {
            match read(s, Duration::from_millis(100)) {
                Read::Frame(f) if f["re"] == "0" => {
                    result.warmed_up = f["op"] == "ok";
                    break;
                }
                Read::Dead => break,
                _ => {}
            }
        }
    }
    gates[0].wait();
    gates[1].wait();

    let period = Duration::from_secs(1) / load.rate.max(1);
    let mut next_due = Instant::now();
    // Sends awaiting confirmation, with their frame for a resend after a reconnect.
    let mut in_flight: VecDeque<(u64, String)> = VecDeque::with_capacity(load.window);
    let mut k = 0u64;
    loop {
        let sending = flags.sending.load(Ordering::Relaxed);
        if (!sending && in_flight.is_empty()) || !flags.receiving.load(Ordering::Relaxed) {
            break;
        }
        let Some(s) = ws.as_mut() else {
            ws = login(load, &me, || false);
            match ws.as_mut() {
                Some(s) => {
                    result.reconnects += 1;
                    let resent = in_flight
                        .iter()
                        .all(|(_, text)| s.send(Message::text(text.clone())).is_ok());
                    if !resent {
                        ws = None;
                    }
                }
                None => std::thread::sleep(RETRY_PAUSE),
            }
            continue;
        };
        let now = Instant::now();
        if sending && in_flight.len() < load.window && now >= next_due {
            k += 1;
            let text = send_frame(load, &to, &me, k, clock());
            result.sent += 1;
            let ok = s.send(Message::text(text.clone())).is_ok();
            in_flight.push_back((k, text));
            // After a stall, catch up at most one period's worth at once.
            next_due = (next_due + period).max(now.checked_sub(period).unwrap_or(now));
            if !ok {
                ws = None;
            }
            continue;
        }
        let wait = if sending && in_flight.len() < load.window {
            next_due.saturating_duration_since(now)
        } else {
            Duration::from_millis(50)
        };
        match read(s, wait.min(Duration::from_millis(50))) {
            Read::Frame(f) => {
                let Some(re) = f["re"].as_str().and_then(|r| r.parse::<u64>().ok()) else {
                    continue;
                };
                let Some(at) = in_flight.iter().position(|(id, _)| *id == re) else {
                    continue;
                };
                in_flight.remove(at);
                if f["op"] == "ok" {
                    result.confirmed.push(re);
                    if flags.sending.load(Ordering::Relaxed) {
                        result.confirmed_in_phase += 1;
                    }
                } else {
                    result.refused += 1;
                }
            }
            Read::Nothing => {}
            Read::Dead => ws = None,
        }
    }
    result.unconfirmed = in_flight.len() as u64;
    let _ = share.confirmed.set(result.confirmed.clone());
    result
}

/// One receiver: takes the warm-up message, `ready`, `go`, then acknowledges every
/// delivery and records first deliveries until `flags.receiving` is cleared.
pub fn receiver(
    load: &Load,
    phase: usize,
    i: usize,
    gates: [&Barrier; 2],
    flags: &Flags,
    share: &PairShare,
) -> ReceiverResult {
    let me = receiver_name(phase, i);
    let mut result = ReceiverResult::default();
    let warmup_deadline = Instant::now() + WARMUP_TIMEOUT;
    let mut ws = login(load, &me, || Instant::now() < warmup_deadline);
    if let Some(s) = ws.as_mut() {
        while !result.warmed_up && Instant::now() < warmup_deadline {
            match read(s, Duration::from_millis(100)) {
                Read::Frame(f) if f["op"] == "message" => {
                    let ack = format!(r#"{{"op":"ack","seq":{}}}"#, f["seq"]);
                    result.warmed_up = s.send(Message::text(ack)).is_ok();
                }
                Read::Dead => break,
                _ => {}
            }
        }
    }
    gates[0].wait();
    gates[1].wait();

    let mut complete = false;
    let mut checked = usize::MAX;
    while flags.receiving.load(Ordering::Relaxed) {
        if !complete
            && checked != result.seen.len()
            && let Some(confirmed) = share.confirmed.get()
        {
            checked = result.seen.len();
            if confirmed.iter().all(|k| result.seen.contains(k)) {
                complete = true;
                flags.complete.fetch_add(1, Ordering::Relaxed);
            }
        }
        let Some(s) = ws.as_mut() else {
            ws = login(load, &me, || false);
            if ws.is_some() {
                result.reconnects += 1;
            } else {
                std::thread::sleep(RETRY_PAUSE);
            }
            continue;
        };
        match read(s, Duration::from_millis(50)) {
            Read::Frame(f) if f["op"] == "message" => {
                let now = clock();
                let ack = format!(r#"{{"op":"ack","seq":{}}}"#, f["seq"]);
                if s.send(Message::text(ack)).is_err() {
                    ws = None;
                }
                let (Some(k), Some(t)) = (f["body"]["k"].as_u64(), f["body"]["t"].as_u64()) else {
                    continue;
                };
                if k > 0 && result.seen.insert(k) {
                    result.deliveries.push((now, now.saturating_sub(t)));
                }
            }
            Read::Frame(_) | Read::Nothing => {}
            Read::Dead => ws = None,
        }
    }
    result
}

/// Connects a newcomer every `every` while `flags.sending`, recording how long each
/// waited for its challenge (ns; `PROBE_TIMEOUT` when none came).
pub fn probe(load: &Load, every: Duration, flags: &Flags, waits: &Mutex<Vec<u64>>) {
    while flags.sending.load(Ordering::Relaxed) {
        let started = Instant::now();
        let got = challenge(load, started + PROBE_TIMEOUT);
        let waited = if got {
            started.elapsed()
        } else {
            PROBE_TIMEOUT
        };
        if let Ok(mut w) = waits.lock() {
            w.push(waited.as_nanos() as u64);
        }
        std::thread::sleep(every.saturating_sub(started.elapsed()));
    }
}

fn challenge(load: &Load, deadline: Instant) -> bool {
    let left = || deadline.saturating_duration_since(Instant::now());
    let Ok(mut s) = raw_ws::connect_from(
        Ipv4Addr::LOCALHOST,
        load.broker,
        left(),
        SocketOptions::default(),
    ) else {
        return false;
    };
    if s.set_read_timeout(Some(left().max(Duration::from_millis(1))))
        .is_err()
    {
        return false;
    }
    let Ok(rest) = raw_ws::upgrade(&mut s, load.broker) else {
        return false;
    };
    let mut reader = FrameReader::default();
    let mut got = false;
    let mut buf = [0u8; 1024];
    let mut bytes = rest;
    loop {
        reader.feed(&bytes, |f| {
            got |= f.text_starts_with(r#"{"op":"challenge""#)
        });
        if got || left().is_zero() {
            return got;
        }
        match std::io::Read::read(&mut s, &mut buf) {
            Ok(n) if n > 0 => bytes = buf[..n].to_vec(),
            _ => return false,
        }
    }
}
