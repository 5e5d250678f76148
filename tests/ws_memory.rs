//! Per-session memory of idle WebSocket sessions, measured with a counting allocator:
//! the live heap before and after opening many sessions over real sockets (the clients
//! are raw TCP streams that allocate nothing while connected).

mod common;
mod ws_support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use amp_broker::ws::WsConfig;
use ws_support::{raw_upgrade, read_frame, start};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::SeqCst);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::SeqCst);
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

// Two descriptors per session (client and server side) stay under a 1024 soft limit.
const SESSIONS: usize = 400;

/// The allocator counts the whole process: one measurement at a time.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// A masked client text frame.
fn text_frame(s: &str) -> Vec<u8> {
    let mask = [7u8, 1, 2, 3];
    let mut f = vec![0x81, 0x80 | s.len() as u8];
    f.extend_from_slice(&mask);
    f.extend(s.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

#[test]
fn idle_session_costs_less_than_32_kib_of_heap() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    // Every client comes from 127.0.0.1.
    let server = start(WsConfig {
        max_connections_per_ip: SESSIONS + 1,
        ..WsConfig::default()
    });
    let mut clients: Vec<TcpStream> = Vec::with_capacity(SESSIONS + 1);
    // Warm up: the first session grows the server's tables and the recorder once.
    clients.push(raw_upgrade(server.addr));
    assert!(common::wait_until(Duration::from_secs(10), || server
        .seen
        .opened
        .load(Ordering::SeqCst)
        == 1));
    let recorded = || server.seen.events.lock().map(|e| e.capacity()).unwrap_or(0);
    let event_size =
        std::mem::size_of::<(amp_broker::ws::SessionId, amp_broker::ws::SessionEvent)>();
    let (heap0, rss0, rec0) = (LIVE.load(Ordering::SeqCst), rss_bytes(), recorded());

    for _ in 0..SESSIONS {
        clients.push(raw_upgrade(server.addr));
    }
    assert!(common::wait_until(Duration::from_secs(20), || {
        server.seen.opened.load(Ordering::SeqCst) == SESSIONS + 1
    }));
    let recorder = (recorded() - rec0) * event_size;
    let heap = LIVE.load(Ordering::SeqCst) - heap0 - recorder;
    let rss = rss_bytes().saturating_sub(rss0);
    let per_session = heap / SESSIONS;
    eprintln!(
        "idle sessions: {SESSIONS}; server heap {heap} bytes = {per_session} bytes/session; \
         process RSS delta {rss} bytes = {} bytes/session",
        rss / SESSIONS
    );
    assert!(
        per_session < 32 << 10,
        "{per_session} bytes per idle session"
    );

    // After one small message each way, the sessions are idle again at the same cost.
    for c in clients.iter_mut() {
        c.write_all(&text_frame("{\"op\":\"ping\",\"id\":\"1\"}"))
            .expect("send");
    }
    for c in clients.iter_mut() {
        let (op, payload) = read_frame(c).expect("echo");
        assert_eq!(
            (op, payload.as_slice()),
            (0x1, &b"{\"op\":\"ping\",\"id\":\"1\"}"[..])
        );
    }
    let recorder = (recorded() - rec0) * event_size;
    let heap = LIVE.load(Ordering::SeqCst) - heap0 - recorder;
    let per_session_after = heap / SESSIONS;
    eprintln!("after one message each: {per_session_after} bytes/session");
    assert!(
        per_session_after < 32 << 10,
        "{per_session_after} bytes per session after a message"
    );
    let mut buf = [0u8; 1];
    clients[0].set_nonblocking(true).expect("nonblocking");
    assert!(
        clients[0].read(&mut buf).is_err(),
        "nothing unexpected queued"
    );
}

/// A masked client text frame of any length.
fn big_text_frame(payload: &[u8]) -> Vec<u8> {
    let mask = [9u8, 8, 7, 6];
    let mut f = vec![0x81, 0x80 | 127];
    f.extend_from_slice(&(payload.len() as u64).to_be_bytes());
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

#[test]
fn large_message_buffers_are_released_once_the_session_is_idle_again() {
    const N: usize = 8;
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let server = start(WsConfig::default());
    let mut clients: Vec<TcpStream> = (0..N).map(|_| raw_upgrade(server.addr)).collect();
    assert!(common::wait_until(Duration::from_secs(10), || server
        .seen
        .opened
        .load(Ordering::SeqCst)
        == N));
    if let Ok(mut e) = server.seen.events.lock() {
        e.clear();
        e.shrink_to_fit();
    }
    // Logged in: a 1 MiB echo is past the bound of a connection waiting for its hello.
    for c in clients.iter_mut() {
        c.write_all(&text_frame("login")).expect("login");
        assert_eq!(read_frame(c).expect("echo").1, b"login");
    }
    if let Ok(mut e) = server.seen.events.lock() {
        e.clear();
        e.shrink_to_fit();
    }
    let heap0 = LIVE.load(Ordering::SeqCst);
    let payload = vec![b'm'; 1 << 20];
    for c in clients.iter_mut() {
        c.write_all(&big_text_frame(&payload)).expect("send 1 MiB");
        let (op, echoed) = read_frame(c).expect("echo");
        assert_eq!((op, echoed.len()), (0x1, payload.len()));
    }
    drop(payload);
    // The recorder holds the received messages; drop them as an embedder would.
    if let Ok(mut e) = server.seen.events.lock() {
        e.clear();
        e.shrink_to_fit();
    }
    // One small message each afterwards, so every session has read past the big one.
    for c in clients.iter_mut() {
        c.write_all(&text_frame("small")).expect("send");
        assert_eq!(read_frame(c).expect("echo"), (0x1, b"small".to_vec()));
    }
    if let Ok(mut e) = server.seen.events.lock() {
        e.clear();
        e.shrink_to_fit();
    }
    let retained = LIVE.load(Ordering::SeqCst).saturating_sub(heap0) / N;
    eprintln!("retained after a 1 MiB message: {retained} bytes/session");
    assert!(
        retained < 32 << 10,
        "{retained} bytes per session kept after a 1 MiB message"
    );
}
