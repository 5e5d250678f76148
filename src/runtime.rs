//! The event loop: one `mio::Poll` carrying the WebSocket listener and sessions, the NATS
//! connection and the signal pipe, moving bytes and events between them and the broker
//! core. Everything here is plumbing; decisions are made in `broker::core`.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token};

use crate::broker::core::{Broker, Output};
use crate::broker::embedded::EmbeddedServer;
use crate::nats::{self, Driver, Event as NatsEvent, RequestId};
use crate::signals::Signals;
use crate::ws::connection::{HttpHost, WsConfig};
use crate::ws::server::{SessionEvent, SessionId, WsServer};

const LISTENER: Token = Token(0);
const NATS: Token = Token(1);
const SIGNALS: Token = Token(2);
const FIRST_SESSION: usize = 16;

/// How often JetStream is asked whether it answers, for `/healthz`.
const HEALTH_INTERVAL: Duration = Duration::from_secs(5);
/// How long a drain may take before the broker exits anyway.
const DRAIN_LIMIT: Duration = Duration::from_secs(10);
const SUPERVISE_INTERVAL: Duration = Duration::from_secs(1);
/// Rounds of moving events between the machines per loop turn. Reads are bounded per
/// turn, so the rounds end on their own; this bound only guarantees that `poll`, the
/// NATS socket and the timers come round again whatever the machines do.
const MAX_ROUNDS_PER_TURN: usize = 64;

pub struct RuntimeOptions {
    pub listen: SocketAddr,
    pub ws: WsConfig,
    pub nats: nats::Options,
}

/// What `/healthz` reports: the NATS connection and JetStream's last answer.
struct Health {
    connected: bool,
    jetstream: Result<(), String>,
    probe: Option<RequestId>,
    next_probe: Instant,
}

/// The plain HTTP endpoints' view of the broker.
struct Host<'a> {
    health: &'a Health,
    broker: &'a Broker,
}

impl HttpHost for Host<'_> {
    fn health(&self) -> Result<(), String> {
        if !self.health.connected {
            return Err("NATS connection is down".to_string());
        }
        self.health.jetstream.clone()
    }

    fn metrics(&self, out: &mut String) {
        let up = if self.health.connected { 1 } else { 0 };
        out.push_str("# HELP amp_nats_connected Whether the NATS connection is up.\n");
        out.push_str(&format!(
            "# TYPE amp_nats_connected gauge\namp_nats_connected {up}\n"
        ));
        self.broker.render_metrics(out);
    }
}

/// Runs until SIGINT/SIGTERM, then drains: stops accepting, flushes acks to NATS, tells
/// every session `going away` (1001) and returns.
pub fn run(
    mut broker: Broker,
    opts: RuntimeOptions,
    mut embedded: Option<EmbeddedServer>,
) -> io::Result<()> {
    let mut poll = Poll::new()?;
    let mut signals = Signals::install()?;
    poll.registry()
        .register(&mut signals, SIGNALS, Interest::READABLE)?;
    let mut ws = WsServer::bind(
        opts.listen,
        opts.ws,
        poll.registry(),
        LISTENER,
        FIRST_SESSION,
    )?;
    log(&format!("listening on ws://{}/amp", ws.local_addr()));
    let now = Instant::now();
    let mut nats = Driver::new(nats::Connection::new(opts.nats, now), NATS);
    broker
        .start(nats.connection_mut(), now)
        .map_err(io::Error::other)?;
    nats.drive(poll.registry(), now);
    let mut health = Health {
        connected: false,
        jetstream: Err("JetStream has not answered yet".to_string()),
        probe: None,
        next_probe: now,
    };
    let mut ids: HashMap<u64, SessionId> = HashMap::new();
    let mut events = Events::with_capacity(256);
    let mut drain_until: Option<Instant> = None;
    let mut next_supervise = now + SUPERVISE_INTERVAL;
    // Work was left over by the last turn's bounded rounds: poll without waiting.
    let mut unfinished = false;

    loop {
        let deadline = [
            ws.next_deadline(),
            nats.poll_timeout(),
            broker.next_deadline(),
            Some(health.next_probe),
            embedded.as_ref().map(|_| next_supervise),
            drain_until,
        ]
        .into_iter()
        .flatten()
        .min();
        let timeout = if unfinished {
            Some(Duration::ZERO)
        } else {
            deadline.map(|d| d.saturating_duration_since(Instant::now()))
        };
        match poll.poll(&mut events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        let now = Instant::now();
        for event in events.iter() {
            match event.token() {
                NATS => nats.handle_event(poll.registry(), event, now),
                SIGNALS if !signals.take().is_empty() && drain_until.is_none() => {
                    log("signal received: draining");
                    drain_until = Some(now + DRAIN_LIMIT);
                    // Acks and pending publishes go out before sessions are told to leave.
                    nats.drive(poll.registry(), now);
                    ws.begin_drain(poll.registry(), now);
                }
                token if ws.owns(token) => ws.handle_event(
                    poll.registry(),
                    event,
                    now,
                    &Host {
                        health: &health,
                        broker: &broker,
                    },
                ),
                _ => {}
            }
        }
        ws.handle_timeouts(
            poll.registry(),
            now,
            &Host {
                health: &health,
                broker: &broker,
            },
        );
        nats.drive(poll.registry(), now);
        broker.handle_timeout(nats.connection_mut(), now);

        if now >= health.next_probe {
            health.next_probe = now + HEALTH_INTERVAL;
            if health.probe.is_none() && nats.connection().is_connected() {
                health.probe = nats
                    .connection_mut()
                    .request("$JS.API.INFO", None, b"", HEALTH_INTERVAL, now)
                    .ok();
            }
        }
        if let Some(server) = embedded.as_mut().filter(|_| now >= next_supervise) {
            next_supervise = now + SUPERVISE_INTERVAL;
            match server.supervise() {
                Ok(Some(status)) => log(&format!(
                    "embedded nats-server exited ({status}); restarted it"
                )),
                Ok(None) => {}
                Err(e) => log(&format!("embedded nats-server could not be restarted: {e}")),
            }
        }

        // Move events between the machines until all of them are quiet, or the round
        // bound is reached (the rest waits for the next turn).
        unfinished = true;
        for _ in 0..MAX_ROUNDS_PER_TURN {
            let mut busy = false;
            while let Some((id, event)) = ws.poll_event() {
                busy = true;
                let conn = nats.connection_mut();
                match event {
                    SessionEvent::Opened { peer, .. } => {
                        ids.insert(id.as_u64(), id);
                        broker.session_opened(id.as_u64(), peer, now);
                    }
                    SessionEvent::Text(text) => {
                        broker.session_frame(conn, id.as_u64(), text.as_str(), now)
                    }
                    SessionEvent::Closed { .. } => {
                        ids.remove(&id.as_u64());
                        broker.session_closed(conn, id.as_u64(), now);
                    }
                }
            }
            while let Some(event) = nats.connection_mut().poll_event() {
                busy = true;
                match &event {
                    NatsEvent::Connected { .. } | NatsEvent::Reconnected { .. } => {
                        health.connected = true;
                        health.next_probe = now;
                        log("NATS connection up");
                    }
                    NatsEvent::Disconnected { reason } => {
                        health.connected = false;
                        health.jetstream = Err("NATS connection is down".to_string());
                        health.probe = None;
                        log(&format!("NATS connection down: {reason}"));
                    }
                    NatsEvent::Response { id, msg } if health.probe == Some(*id) => {
                        health.probe = None;
                        health.jetstream = if msg.status() == Some(503) {
                            Err("JetStream is not enabled".to_string())
                        } else {
                            Ok(())
                        };
                        continue;
                    }
                    NatsEvent::RequestFailed { id, error } if health.probe == Some(*id) => {
                        health.probe = None;
                        health.jetstream = Err(format!("JetStream does not answer: {error}"));
                        continue;
                    }
                    _ => {}
                }
                broker.nats_event(nats.connection_mut(), event, now);
            }
            while let Some(out) = broker.poll_output() {
                busy = true;
                match out {
                    Output::Frame { session, text } => {
                        if let Some(&id) = ids.get(&session) {
                            // A full queue closes the session inside the transport (slow consumer).
                            let _ = ws.send_text(id, &text, now);
                        }
                    }
                    Output::Close {
                        session,
                        code,
                        reason,
                    } => {
                        if let Some(&id) = ids.get(&session) {
                            ws.close(id, code, &reason, now);
                        }
                    }
                }
            }
            ws.flush(
                poll.registry(),
                now,
                &Host {
                    health: &health,
                    broker: &broker,
                },
            );
            nats.drive(poll.registry(), now);
            if !busy && !ws.has_events() {
                unfinished = false;
                break;
            }
        }

        if drain_until.is_some_and(|limit| ws.is_drained() || now >= limit) {
            nats.drive(poll.registry(), now);
            log(&format!("drained; {} sessions left", ws.connection_count()));
            return Ok(());
        }
    }
}

fn log(line: &str) {
    eprintln!("amp-broker: {line}");
}
