//! The event loop: one `mio::Poll` carrying the WebSocket listener and sessions, the NATS
//! connections and the signal pipe, moving bytes and events between them and the broker
//! core. Everything here is plumbing; decisions are made in `broker::core`.

use std::collections::HashSet;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token};

use crate::broker::config::Config;
use crate::broker::core::{Broker, Ingress, Input, Output};
use crate::embedded::EmbeddedServer;
use crate::lame_duck::LameDuck;
use crate::nats::{self, Driver, Event as NatsEvent, RequestError, RequestId};
use crate::signals::{Request, Signals};
use crate::tls::ListenerTls;
use crate::ws::connection::{HttpHost, WsConfig};
use crate::ws::metrics;
use crate::ws::origin::OriginPolicy;
use crate::ws::server::{SessionEvent, SessionId, WsServer};

const LISTENER: Token = Token(0);
const NATS: Token = Token(1);
const SIGNALS: Token = Token(2);
const PLAIN_LISTENER: Token = Token(3);
/// The first ingress connection's token; the next one's is the next.
const INGRESS: Token = Token(4);
const FIRST_SESSION: usize = 16;
const GOING_AWAY: u16 = crate::broker::core::close::GOING_AWAY;

/// How often JetStream is asked whether it answers, for `/healthz`.
const HEALTH_INTERVAL: Duration = Duration::from_secs(5);
/// The main connection's `nats::Options::silence_probe`. A link that dies without a word
/// is found stale by the keepalive only after 60 to 90 s, and the ingresses' queue group
/// subscriptions (`Broker::tend_ingress`) took this broker's share of MIG and callout
/// requests all that time, answered into the dead link. With this, they are ended 1.5 to
/// 3 s after what is written finds a link that carries nothing; a PONG waits that long
/// only on a server or link in trouble, and a busy connection reads all the time.
const SILENCE_PROBE: Duration = Duration::from_millis(1500);
/// The main connection's `nats::Options::silence_limit`: silent this long, it is given up
/// and dialed again, where the keepalive took 60 to 90 s, all that time every session's
/// JetStream request going into the dead link. nats-server gives a client that takes none
/// of its output as long (its default `write_deadline`) before it cuts it; a live server
/// answers a PING within milliseconds even while JetStream is slow, and a PING held up
/// behind a backlog the link is still taking does not count as unanswered.
const SILENCE_LIMIT: Duration = Duration::from_secs(10);
/// How long a drain may take before the broker exits anyway.
const DRAIN_LIMIT: Duration = Duration::from_secs(10);
const SUPERVISE_INTERVAL: Duration = Duration::from_secs(1);
/// Rounds of moving events between the machines per loop turn. Reads are bounded per
/// turn, so the rounds end on their own; this bound only guarantees that `poll`, the
/// NATS socket and the timers come round again whatever the machines do.
const MAX_ROUNDS_PER_TURN: usize = 64;
/// The loop wakes at least this often, so a stalled loop shows as a late wake-up even
/// when nothing else is scheduled.
const LIVENESS_TICK: Duration = Duration::from_secs(1);
/// A wake-up this much past its deadline counts as a stall of the loop.
const LIVENESS_MAX_LAG: Duration = Duration::from_secs(2);
/// How long `/livez` keeps answering 503 after a stall.
const LIVENESS_WINDOW: Duration = Duration::from_secs(5);
/// Bytes the requests and callout ingress connections each read per loop turn (the main
/// one and the events ingress read 1 MiB): a flood of tiny MIG requests (30 bytes each)
/// costs the core microseconds a message, a connect loop's callout requests each up to
/// five signature operations, and what one turn reads of either delays everything else
/// the turn does.
const INGRESS_READ_ALLOWANCE: usize = 16 * 1024;

pub struct RuntimeOptions {
    pub listen: SocketAddr,
    pub ws: WsConfig,
    pub nats: nats::Options,
    /// The file SIGHUP re-reads; none in development mode.
    pub config_path: Option<PathBuf>,
    /// The lame duck period (SIGUSR2).
    pub drain_timeout: Duration,
    /// The listener's TLS configuration; `None`: plain ws:// and http://.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The TLS flags, laid over the file's `tls` again at each SIGHUP.
    pub tls_flags: ListenerTls,
    /// `--allowed-origin`s, joined with the file's `allowed_origins` at each SIGHUP.
    pub origin_flags: Vec<String>,
    /// Development mode: any origin.
    pub any_origin: bool,
    /// The origin policy at start (flags and file).
    pub origins: OriginPolicy,
    /// A second, plain listener beside the TLS one.
    pub plain_listen: Option<SocketAddr>,
}

/// The origin policy of the flags and the file's list together.
pub fn origin_policy(any: bool, flags: &[String], file: &[String]) -> OriginPolicy {
    if any {
        return OriginPolicy::Any;
    }
    let all: Vec<String> = flags.iter().chain(file).cloned().collect();
    OriginPolicy::from_list(&all)
}

/// What `/healthz` reports: the NATS connection and JetStream's last answer. It asks
/// JetStream itself (`$JS.API.INFO` every [`HEALTH_INTERVAL`]) and takes its own answer
/// out of the event stream; everything else goes on to the broker.
struct Health {
    connected: bool,
    /// `nats::Connection::silent_since` at the last tick.
    silent_since: Option<Instant>,
    jetstream: Result<(), String>,
    probe: Option<RequestId>,
    next_probe: Instant,
}

impl Health {
    fn new(now: Instant) -> Health {
        Health {
            connected: false,
            silent_since: None,
            jetstream: Err("JetStream has not answered yet".to_string()),
            probe: None,
            next_probe: now,
        }
    }

    /// Sends the next probe when one is due and none is out; logs the connection going
    /// silent and answering again.
    fn tick(&mut self, conn: &mut nats::Connection, now: Instant) {
        let was_silent = self.silent_since.is_some();
        self.silent_since = conn.silent_since();
        if self.silent_since.is_some() != was_silent {
            if !was_silent {
                log::warn!(
                    "NATS connection silent: a PING unanswered for {} ms, nothing read",
                    SILENCE_PROBE.as_millis()
                );
            } else if conn.is_connected() {
                log::info!("NATS connection answers again");
            }
        }
        if now < self.next_probe {
            return;
        }
        self.next_probe = now + HEALTH_INTERVAL;
        if self.probe.is_none() && conn.is_connected() {
            self.probe = conn
                .request("$JS.API.INFO", None, b"", HEALTH_INTERVAL, now)
                .ok();
        }
    }

    /// Follows the connection through `event`; true when the event was the probe's own
    /// answer and goes no further.
    fn observe(&mut self, event: &NatsEvent, now: Instant) -> bool {
        match event {
            NatsEvent::Connected { .. } | NatsEvent::Reconnected { .. } => {
                self.connected = true;
                self.next_probe = now;
                log::info!("NATS connection up");
            }
            NatsEvent::Disconnected { reason } => {
                self.connected = false;
                self.jetstream = Err("NATS connection is down".to_string());
                self.probe = None;
                log::warn!("NATS connection down: {reason}");
            }
            NatsEvent::Response { id, .. } if self.probe == Some(*id) => {
                self.probe = None;
                self.jetstream = Ok(());
                return true;
            }
            // A server without JetStream has nobody on `$JS.API.INFO`: the connection
            // reports its 503 as no responders.
            NatsEvent::RequestFailed {
                id,
                error: RequestError::NoResponders,
            } if self.probe == Some(*id) => {
                self.probe = None;
                self.jetstream = Err("JetStream is not enabled".to_string());
                return true;
            }
            NatsEvent::RequestFailed { id, error } if self.probe == Some(*id) => {
                self.probe = None;
                self.jetstream = Err(format!("JetStream does not answer: {error}"));
                return true;
            }
            _ => {}
        }
        false
    }

    fn check(&self, now: Instant) -> Result<(), String> {
        if !self.connected {
            return Err("NATS connection is down".to_string());
        }
        // Ahead of JetStream's answer: its probe waits out its timeout on a dead link.
        if let Some(since) = self.silent_since {
            return Err(format!(
                "NATS connection silent: nothing read for {} ms, a PING unanswered",
                now.saturating_duration_since(since).as_millis()
            ));
        }
        self.jetstream.clone()
    }
}

/// A NATS connection of its own for what untrusted parties send (`Broker::start_ingress`):
/// the auth callout's requests, MIG's, or MIG's live events. Its state is only
/// reported, as `amp_nats_ingress_*{connection}`; `/healthz` follows the main connection.
struct IngressConn {
    which: Ingress,
    driver: Driver,
    connected: bool,
    reconnects: u64,
}

impl IngressConn {
    fn new(which: Ingress, token: Token, options: &nats::Options, now: Instant) -> IngressConn {
        let mut options = options.clone();
        options.name = options.name.map(|name| format!("{name} ingress {which}"));
        let driver = Driver::new(nats::Connection::new(options, now), token);
        let driver = match which {
            Ingress::Callout | Ingress::Requests => {
                driver.with_read_allowance(INGRESS_READ_ALLOWANCE)
            }
            // The brokers' own live events come back here, at the pace the main
            // connection brings their deliveries: read at its pace too, or they queue
            // in the server (ahead of PUBLISH requests) until it cuts the connection.
            Ingress::Events => driver,
        };
        IngressConn {
            which,
            driver,
            connected: false,
            reconnects: 0,
        }
    }

    fn observe(&mut self, event: &NatsEvent) {
        let which = self.which;
        match event {
            NatsEvent::Connected { .. } | NatsEvent::Reconnected { .. } => {
                let again = matches!(event, NatsEvent::Reconnected { .. });
                self.reconnects = self.reconnects.saturating_add(u64::from(again));
                self.connected = true;
                log::info!("NATS ingress connection ({which}) up");
            }
            NatsEvent::Disconnected { reason } => {
                self.connected = false;
                log::warn!("NATS ingress connection ({which}) down: {reason}");
            }
            _ => {}
        }
    }
}

/// What `/livez` reports: whether the loop's recent wake-ups came on time. A loop that is
/// blocked right now answers nothing at all, which is why probes need a timeout.
#[derive(Debug, Default)]
struct Liveness {
    /// The last stall: when the loop woke up and how late it was.
    last_stall: Option<(Instant, Duration)>,
    /// The worst lag seen, for `/metrics`.
    max_lag: Duration,
    stalls: u64,
}

impl Liveness {
    /// Records a wake-up at `now` for a deadline of `due` (none when the loop woke for
    /// events before any deadline).
    fn woke(&mut self, due: Option<Instant>, now: Instant) {
        let Some(due) = due else {
            return;
        };
        let lag = now.saturating_duration_since(due);
        self.max_lag = self.max_lag.max(lag);
        if lag > LIVENESS_MAX_LAG {
            self.last_stall = Some((now, lag));
            self.stalls = self.stalls.saturating_add(1);
        }
    }

    /// Records a turn's work from `from` to `to`. Lateness alone missed turns that each
    /// took just under the bound: the 1 s tick then fired less than 2 s late every time
    /// while every pong waited as long as a turn.
    fn worked(&mut self, from: Instant, to: Instant) {
        let took = to.saturating_duration_since(from);
        if took > LIVENESS_MAX_LAG {
            self.max_lag = self.max_lag.max(took);
            self.last_stall = Some((to, took));
            self.stalls = self.stalls.saturating_add(1);
        }
    }

    fn check(&self, now: Instant) -> Result<(), String> {
        match self.last_stall {
            Some((at, lag)) if now.saturating_duration_since(at) < LIVENESS_WINDOW => Err(format!(
                "event loop stalled: a timer fired or a turn ended {} ms late",
                lag.as_millis()
            )),
            _ => Ok(()),
        }
    }
}

/// The plain HTTP endpoints' view of the broker.
struct Host<'a> {
    health: &'a Health,
    liveness: &'a Liveness,
    broker: &'a Broker,
    /// NATS socket bytes (in, out) as of this turn.
    nats_bytes: (u64, u64),
    ingress: &'a [IngressConn],
}

impl HttpHost for Host<'_> {
    fn health(&self) -> Result<(), String> {
        let now = Instant::now();
        self.health
            .check(now)
            .and_then(|()| self.broker.readiness())
    }

    fn live(&self) -> Result<(), String> {
        self.liveness.check(Instant::now())
    }

    fn metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        let up = if self.health.connected { 1 } else { 0 };
        out.push_str("# HELP amp_nats_connected Whether the NATS connection is up.\n");
        out.push_str(&format!(
            "# TYPE amp_nats_connected gauge\namp_nats_connected {up}\n"
        ));
        let (nats_in, nats_out) = self.nats_bytes;
        out.push_str("# HELP amp_nats_bytes_total Bytes read from (in) and written to (out) the NATS server socket.\n");
        let _ = writeln!(
            out,
            "# TYPE amp_nats_bytes_total counter\namp_nats_bytes_total{{direction=\"in\"}} {nats_in}\namp_nats_bytes_total{{direction=\"out\"}} {nats_out}"
        );
        let l = self.liveness;
        out.push_str(
            "# HELP amp_event_loop_stalls_total Loop wake-ups more than 2 s past their deadline.\n",
        );
        let _ = writeln!(
            out,
            "# TYPE amp_event_loop_stalls_total counter\namp_event_loop_stalls_total {}",
            l.stalls
        );
        out.push_str(
            "# HELP amp_event_loop_max_lag_seconds The latest any loop wake-up came after its deadline.\n",
        );
        let _ = writeln!(
            out,
            "# TYPE amp_event_loop_max_lag_seconds gauge\namp_event_loop_max_lag_seconds {}",
            l.max_lag.as_secs_f64()
        );
        if !self.ingress.is_empty() {
            let of = "of the NATS ingress connections (callout: auth callout requests; requests: MIG requests; events: MIG live events and PUBLISH)";
            let _ = writeln!(
                out,
                "# HELP amp_nats_ingress_connected Whether each {of} is up.\n\
                 # TYPE amp_nats_ingress_connected gauge"
            );
            for i in self.ingress {
                let (which, up) = (i.which, u8::from(i.connected));
                let _ = writeln!(
                    out,
                    "amp_nats_ingress_connected{{connection=\"{which}\"}} {up}"
                );
            }
            let _ = writeln!(
                out,
                "# HELP amp_nats_ingress_reconnects_total Reconnections of each {of}.\n\
                 # TYPE amp_nats_ingress_reconnects_total counter"
            );
            for i in self.ingress {
                let _ = writeln!(
                    out,
                    "amp_nats_ingress_reconnects_total{{connection=\"{}\"}} {}",
                    i.which, i.reconnects
                );
            }
            let _ = writeln!(
                out,
                "# HELP amp_nats_ingress_bytes_total Bytes read from (in) and written to (out) each {of}.\n\
                 # TYPE amp_nats_ingress_bytes_total counter"
            );
            for i in self.ingress {
                let (which, (bytes_in, bytes_out)) = (i.which, i.driver.bytes());
                let _ = writeln!(
                    out,
                    "amp_nats_ingress_bytes_total{{connection=\"{which}\",direction=\"in\"}} {bytes_in}\n\
                     amp_nats_ingress_bytes_total{{connection=\"{which}\",direction=\"out\"}} {bytes_out}"
                );
            }
        }
        metrics::render_build_info(out);
        metrics::render_process(out);
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
    let tls = opts.tls.is_some();
    ws.set_tls(opts.tls.clone());
    ws.set_origin_policy(opts.origins.clone());
    let scheme = if tls { "wss" } else { "ws" };
    log::info!("listening on {scheme}://{}/amp", ws.local_addr());
    if let Some(addr) = opts.plain_listen {
        let local = ws.bind_plain(addr, poll.registry(), PLAIN_LISTENER)?;
        log::info!("listening on ws://{local}/amp (plain, for internal use)");
    }
    let now = Instant::now();
    let mut main_options = opts.nats.clone();
    main_options.silence_probe = Some(SILENCE_PROBE);
    main_options.silence_limit = Some(SILENCE_LIMIT);
    let mut nats = Driver::new(nats::Connection::new(main_options, now), NATS);
    let mut ingress: Vec<IngressConn> = (broker.ingresses().into_iter().enumerate())
        .map(|(n, which)| IngressConn::new(which, Token(INGRESS.0 + n), &opts.nats, now))
        .collect();
    if !ingress.is_empty() {
        broker.start_ingress();
    }
    for i in &mut ingress {
        i.driver.drive(poll.registry(), now);
    }
    broker
        .start(nats.connection_mut(), now)
        .map_err(io::Error::other)?;
    nats.drive(poll.registry(), now);
    let mut health = Health::new(now);
    // Session ids are the broker's own numbers: no client picks them.
    let mut ids: crate::id_map::IdMap<u64, SessionId> = Default::default();
    // Sessions whose `watch` snapshot waits for their output to be written.
    let mut drain_waiters: HashSet<u64> = HashSet::new();
    // The last of them told, where the next round of telling starts.
    let mut drained_last = 0;
    let mut events = Events::with_capacity(256);
    let mut drain_until: Option<Instant> = None;
    let mut lame_duck: Option<LameDuck> = None;
    let mut next_supervise = now + SUPERVISE_INTERVAL;
    let mut liveness = Liveness::default();
    let mut next_tick = now + LIVENESS_TICK;
    let mut trimmer = crate::heap::Trimmer::new(now);
    let mut trimmed_when_ready = false;
    // Work was left over by the last turn's bounded rounds: poll without waiting.
    let mut unfinished = false;
    // When the wait a signal interrupted began: the wait goes on from then.
    let mut interrupted: Option<Instant> = None;

    loop {
        let deadline = [
            ws.next_deadline(),
            nats.poll_timeout(),
            ingress.iter().filter_map(|i| i.driver.poll_timeout()).min(),
            broker.poll_timeout(),
            Some(health.next_probe),
            embedded.as_ref().map(|_| next_supervise),
            drain_until,
            lame_duck.as_ref().and_then(LameDuck::next_deadline),
            Some(next_tick),
            Some(trimmer.deadline()),
        ]
        .into_iter()
        .flatten()
        .min();
        let waits_from = interrupted.take().unwrap_or_else(Instant::now);
        let timeout = if unfinished {
            Some(Duration::ZERO)
        } else {
            deadline.map(|d| d.saturating_duration_since(Instant::now()))
        };
        match poll.poll(&mut events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                interrupted = Some(waits_from);
                continue;
            }
            Err(e) => return Err(e),
        }
        let now = Instant::now();
        broker.observe_wall_clock(
            now,
            crate::rfc3339::unix_millis(std::time::SystemTime::now()),
        );
        // Lag is measured before any work of this turn, so the first probe served after a
        // stall already sees it. A deadline already past when the wait began is due at
        // once, not late by how long ago it passed: that was the work before the wait,
        // which `worked` measures.
        let due = deadline.map(|d| d.max(waits_from));
        liveness.woke(due.filter(|d| *d <= now), now);
        if now >= next_tick {
            next_tick = now + LIVENESS_TICK;
        }
        for event in events.iter() {
            match event.token() {
                NATS => nats.handle_event(poll.registry(), event, now),
                token if ingress.iter().any(|i| i.driver.token() == token) => {
                    for i in &mut ingress {
                        i.driver.handle_event(poll.registry(), event, now);
                    }
                }
                SIGNALS => {
                    for request in signals.take() {
                        match request {
                            Request::Reload => reload(&mut broker, &mut ws, &opts),
                            Request::LameDuck if lame_duck.is_none() && drain_until.is_none() => {
                                ws.stop_accepting(poll.registry());
                                let sessions: Vec<u64> = ids.keys().copied().collect();
                                log::info!(
                                    "SIGUSR2: lame duck, listener closed; closing {} sessions over {} s",
                                    sessions.len(),
                                    opts.drain_timeout.as_secs()
                                );
                                lame_duck = Some(LameDuck::new(sessions, now, opts.drain_timeout));
                            }
                            Request::Stop if drain_until.is_none() => {
                                log::info!("signal received: draining");
                                drain_until = Some(now + DRAIN_LIMIT);
                                // Acks and pending publishes go out before sessions are told to leave.
                                nats.drive_writes(poll.registry(), now);
                                ws.begin_drain(poll.registry(), now);
                            }
                            Request::LameDuck | Request::Stop => {}
                        }
                    }
                }
                token if ws.owns(token) => ws.handle_event(
                    poll.registry(),
                    event,
                    now,
                    &Host {
                        health: &health,
                        liveness: &liveness,
                        broker: &broker,
                        nats_bytes: nats.bytes(),
                        ingress: &ingress,
                    },
                ),
                _ => {}
            }
        }
        if let Some(duck) = lame_duck.as_mut().filter(|_| drain_until.is_none()) {
            for session in duck.due(now) {
                if let Some(&id) = ids.get(&session) {
                    ws.close(id, GOING_AWAY, "going away", now);
                }
            }
            if duck.next_deadline().is_none() {
                // Every session has had its turn: what is left (handshakes, HTTP
                // requests) goes the fast way.
                log::info!("lame duck period over: draining");
                drain_until = Some(now + DRAIN_LIMIT);
                nats.drive_writes(poll.registry(), now);
                ws.begin_drain(poll.registry(), now);
            }
        }
        ws.handle_timeouts(
            poll.registry(),
            now,
            &Host {
                health: &health,
                liveness: &liveness,
                broker: &broker,
                nats_bytes: nats.bytes(),
                ingress: &ingress,
            },
        );
        nats.drive(poll.registry(), now);
        for i in &mut ingress {
            i.driver.drive(poll.registry(), now);
        }
        // Not held for `room` as other input is: what timers queue is bounded by what
        // the broker holds (each deadline fires once), not by what an input brings, and
        // is delivered within the budget all the same; registry refreshes, pull checks
        // and leases keep their time while a fan-out waits.
        broker.handle(nats.connection_mut(), Input::Timeout, now);

        health.tick(nats.connection_mut(), now);
        if let Some(server) = embedded.as_mut().filter(|_| now >= next_supervise) {
            next_supervise = now + SUPERVISE_INTERVAL;
            match server.supervise() {
                Ok(Some(status)) => {
                    log::info!("embedded nats-server exited ({status}); restarted it")
                }
                Ok(None) => {}
                Err(e) => log::warn!("embedded nats-server could not be restarted: {e}"),
            }
        }

        // Move events between the machines until all of them are quiet, or the round
        // bound is reached (the rest waits for the next turn).
        unfinished = true;
        for round in 0..MAX_ROUNDS_PER_TURN {
            // Each event's output goes to the sessions before the next event is handled,
            // frame by frame until their output is over the memory budget, and no event
            // is handled while any of it waits (`room`): one burst (a thousand presence
            // changes, each a frame to every watcher; a `who` of a few bytes from each of
            // hundreds of sessions, each answered with up to `max_outbound_bytes`; one
            // registry resync telling every watcher thousands of `down`s) would otherwise
            // queue all of its frames before any budget saw them. The flush below writes
            // what sockets take and sheds the connections holding the most until within
            // the budget; what is left waits for the next round. The sessions and NATS
            // take turns at going first, as whichever does may fill the budget for the
            // round: a flood of frames must not hold up every session's NATS traffic (nor
            // its events pile up, read while the budget allows but never taken), nor the
            // reverse.
            let mut busy = false;
            if round % 2 == 1 {
                busy |= take_nats_events(
                    &mut broker,
                    &mut ws,
                    &mut nats,
                    &mut health,
                    &ids,
                    &mut drain_waiters,
                    now,
                );
            }
            busy |= take_session_events(
                &mut broker,
                &mut ws,
                &mut nats,
                &mut ids,
                &mut drain_waiters,
                now,
            );
            if round % 2 == 0 {
                busy |= take_nats_events(
                    &mut broker,
                    &mut ws,
                    &mut nats,
                    &mut health,
                    &ids,
                    &mut drain_waiters,
                    now,
                );
            }
            // The same for the ingress connections; what they bring is answered on the
            // main one, and they are subscribed only while that one is up.
            for i in &mut ingress {
                broker.tend_ingress(nats.connection(), i.which, i.driver.connection_mut());
                while room(&mut broker, &mut ws, &ids, &mut drain_waiters, now)
                    && let Some(event) = i.driver.connection_mut().poll_event()
                {
                    busy = true;
                    i.observe(&event);
                    // The server a callout request came from is the one the ingress is
                    // connected to: not the INFO of an attempt that failed or has yet
                    // to complete its handshake.
                    let connection = i.driver.connection();
                    let server_id = connection
                        .server_info()
                        .filter(|_| connection.is_connected())
                        .map(|info| info.server_id.as_str());
                    let which = i.which;
                    let input = Input::Ingress {
                        which,
                        event,
                        server_id,
                    };
                    broker.handle(nats.connection_mut(), input, now);
                }
            }
            busy |= deliver(&mut broker, &mut ws, &ids, &mut drain_waiters, now);
            // NATS first: what a frame reports (an offer's watch subscription, say) is
            // on its way to the server before the frame is on its way to the client.
            // Written, not read: NATS reads its allowance once per turn, as each
            // WebSocket connection does.
            nats.drive_writes(poll.registry(), now);
            for i in &mut ingress {
                i.driver.drive_writes(poll.registry(), now);
            }
            ws.flush(
                poll.registry(),
                now,
                &Host {
                    health: &health,
                    liveness: &liveness,
                    broker: &broker,
                    nats_bytes: nats.bytes(),
                    ingress: &ingress,
                },
            );
            // Should the output still be over the budget after the flush, or the broker
            // hold output the budget left for later, the NATS socket is not read, so the
            // server waits rather than events queueing.
            let held = ws.over_budget() || broker.has_output();
            nats.hold_reads(held);
            // Events the budget held back are taken in the next round.
            busy |= held || nats.connection_mut().has_events();
            for i in &mut ingress {
                i.driver.hold_reads(held);
                busy |= i.driver.connection_mut().has_events();
            }
            busy |= take_drained(
                &mut broker,
                &mut ws,
                &mut nats,
                &ids,
                &mut drain_waiters,
                &mut drained_last,
                now,
            );
            if !busy && !ws.has_events() {
                unfinished = false;
                break;
            }
        }

        if !trimmed_when_ready && health.check(now).is_ok() && broker.readiness().is_ok() {
            trimmed_when_ready = true;
            trimmer.soon(now);
        }
        if !unfinished && trimmer.due(now) {
            broker.compact(now);
            ws.compact();
            nats.connection_mut().compact();
            for i in &mut ingress {
                i.driver.connection_mut().compact();
            }
            crate::heap::Compact::compact(&mut ids);
            trimmer.trim(now);
        }
        liveness.worked(now, Instant::now());
        if drain_until.is_some_and(|limit| ws.is_drained() || now >= limit) {
            nats.drive_writes(poll.registry(), now);
            log::info!("drained; {} sessions left", ws.connection_count());
            return Ok(());
        }
    }
}

/// SIGHUP: the file is re-read and swapped in whole, or refused whole with the old
/// configuration kept. The listener's certificate and key are read again with it (also
/// in development mode, from the flags).
fn reload(broker: &mut Broker, ws: &mut WsServer, opts: &RuntimeOptions) {
    let Some(path) = opts.config_path.as_ref() else {
        reload_tls(ws, &opts.tls_flags);
        log::warn!("SIGHUP: development mode has no configuration file; nothing else reloaded");
        return;
    };
    let config = match Config::load(path) {
        Ok(config) => config,
        Err(e) => {
            log::error!("SIGHUP: reload refused, the running configuration is kept: {e}");
            return;
        }
    };
    let tls = opts.tls_flags.over(&config.tls);
    let origins = origin_policy(opts.any_origin, &opts.origin_flags, &config.allowed_origins);
    match broker.reload(config) {
        Ok(closed) => {
            reload_tls(ws, &tls);
            ws.set_origin_policy(origins);
            log::info!(
                "SIGHUP: configuration {} reloaded; {closed} sessions closed",
                path.display()
            )
        }
        Err(e) => log::error!(
            "SIGHUP: reload of {} refused, the running configuration is kept: {e}",
            path.display()
        ),
    }
}

/// New handshakes use the pair read now; open sessions keep theirs. A pair that does not
/// load leaves the running one in place.
fn reload_tls(ws: &mut WsServer, tls: &ListenerTls) {
    if !ws.is_tls() {
        return;
    }
    let loaded = tls.files().and_then(|files| {
        let files = files.ok_or("the configuration no longer names a certificate".to_string())?;
        files.load().map(|config| (files, config))
    });
    match loaded {
        Ok((files, config)) => {
            ws.set_tls(Some(config));
            log::info!(
                "SIGHUP: TLS certificate {} reloaded; new handshakes use it",
                files.cert.display()
            );
        }
        Err(e) => log::error!("SIGHUP: TLS certificate not reloaded, the old one is kept: {e}"),
    }
}

/// Hands the broker the sessions' events (opened, frames, closed), each one's output
/// to the sessions before the next, while there is [`room`]; whether it handed any.
fn take_session_events(
    broker: &mut Broker,
    ws: &mut WsServer,
    nats: &mut Driver,
    ids: &mut crate::id_map::IdMap<u64, SessionId>,
    drain_waiters: &mut HashSet<u64>,
    now: Instant,
) -> bool {
    let mut any = false;
    while room(broker, ws, ids, drain_waiters, now)
        && let Some((id, event)) = ws.poll_event()
    {
        any = true;
        let conn = nats.connection_mut();
        match event {
            SessionEvent::Opened { peer, .. } => {
                ids.insert(id.as_u64(), id);
                broker.handle(
                    conn,
                    Input::SessionOpened {
                        session: id.as_u64(),
                        peer,
                    },
                    now,
                );
            }
            SessionEvent::Text(text) => broker.handle(
                conn,
                Input::Frame {
                    session: id.as_u64(),
                    text: text.as_str(),
                },
                now,
            ),
            SessionEvent::Closed {
                code,
                reason,
                by_peer,
            } => {
                ids.remove(&id.as_u64());
                broker.handle(
                    conn,
                    Input::SessionClosed {
                        session: id.as_u64(),
                        code,
                        reason: &reason,
                        by_peer,
                    },
                    now,
                );
            }
        }
    }
    any
}

/// The same for what the NATS connection reported (the health probe's answers stop at
/// `health`).
fn take_nats_events(
    broker: &mut Broker,
    ws: &mut WsServer,
    nats: &mut Driver,
    health: &mut Health,
    ids: &crate::id_map::IdMap<u64, SessionId>,
    drain_waiters: &mut HashSet<u64>,
    now: Instant,
) -> bool {
    let mut any = false;
    while room(broker, ws, ids, drain_waiters, now)
        && let Some(event) = nats.connection_mut().poll_event()
    {
        any = true;
        if !health.observe(&event, now) {
            broker.handle(nats.connection_mut(), Input::Nats(event), now);
        }
    }
    any
}

/// Tells the broker of the sessions waiting for their output to be written that it is
/// (a `watch` snapshot goes on with its next burst, up to 256 KiB; pulls resume), and
/// forgets those gone; each one's output goes to the sessions before the next is told,
/// and none is told without [`room`]: the others wait in
/// `drain_waiters` for a later round, which starts after the last one told
/// (`told_last`), so all take turns. Told all at once, sessions that each held back a
/// few bytes of a burst and then read together had a burst each queued before any
/// budget saw them. Whether it told any.
fn take_drained(
    broker: &mut Broker,
    ws: &mut WsServer,
    nats: &mut Driver,
    ids: &crate::id_map::IdMap<u64, SessionId>,
    drain_waiters: &mut HashSet<u64>,
    told_last: &mut u64,
    now: Instant,
) -> bool {
    if drain_waiters.is_empty() {
        return false;
    }
    let mut written: Vec<u64> = drain_waiters
        .iter()
        .copied()
        .filter(|s| ids.get(s).is_none_or(|&id| ws.queued_bytes(id) == 0))
        .collect();
    written.sort_unstable();
    let after = written.partition_point(|&s| s <= *told_last);
    written.rotate_left(after);
    let mut any = false;
    for session in written {
        let Some(&id) = ids.get(&session) else {
            drain_waiters.remove(&session);
            continue;
        };
        if !room(broker, ws, ids, drain_waiters, now) {
            break;
        }
        // The output of one told before may have been for this one.
        if ws.queued_bytes(id) > 0 {
            continue;
        }
        drain_waiters.remove(&session);
        *told_last = session;
        any = true;
        broker.handle(nats.connection_mut(), Input::Drained { session }, now);
    }
    any
}

/// Whether the broker may be handed another input: its output, handed to the sessions
/// first as far as the budget allows, is all with them, and within the memory budget.
/// An input's output is thus queued only once the last one's is, and the budget sees
/// each frame of a fan-out, not only whole fan-outs between inputs.
fn room(
    broker: &mut Broker,
    ws: &mut WsServer,
    ids: &crate::id_map::IdMap<u64, SessionId>,
    drain_waiters: &mut HashSet<u64>,
    now: Instant,
) -> bool {
    deliver(broker, ws, ids, drain_waiters, now);
    !ws.over_budget() && !broker.has_output()
}

/// Hands the broker's output to the sessions until it is over the memory budget: the
/// rest waits in the broker for a later round, after the flush has written what sockets
/// take and shed the connections holding the most. Whether it handed any.
fn deliver(
    broker: &mut Broker,
    ws: &mut WsServer,
    ids: &crate::id_map::IdMap<u64, SessionId>,
    drain_waiters: &mut HashSet<u64>,
    now: Instant,
) -> bool {
    let mut any = false;
    while !ws.over_budget()
        && let Some(out) = broker.poll_output()
    {
        any = true;
        match out {
            Output::Frame { session, text } => {
                // A full queue closes the session inside the transport (slow consumer).
                let sent = ids
                    .get(&session)
                    .is_some_and(|&id| ws.send_text(id, &text, now).is_ok());
                broker.frame_done(text, sent);
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
            Output::LoggedIn { session } => {
                if let Some(&id) = ids.get(&session) {
                    ws.admit(id);
                }
            }
            Output::WhenDrained { session } => {
                drain_waiters.insert(session);
            }
        }
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nats::Options;

    /// A NATS connection through its handshake, on a virtual clock, its output consumed.
    fn connected(now: Instant) -> nats::Connection {
        connected_with(Options::new("nats://127.0.0.1:4222"), now)
    }

    fn connected_with(options: Options, now: Instant) -> nats::Connection {
        let mut conn = nats::Connection::new(options, now);
        conn.poll_connect(now).expect("a server to dial");
        conn.on_transport_open(now);
        conn.receive(
            b"INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\n",
            now,
        );
        conn.receive(b"PONG\r\n", now);
        let n = conn.output().len();
        conn.consume_output(n);
        conn
    }

    /// The events the connection has, each shown to `health`; those it lets through.
    fn observed(health: &mut Health, conn: &mut nats::Connection, now: Instant) -> Vec<NatsEvent> {
        std::iter::from_fn(|| conn.poll_event())
            .filter(|e| !health.observe(e, now))
            .collect()
    }

    /// The inbox and reply subject of the probe the connection just wrote.
    fn probe_reply(conn: &mut nats::Connection) -> String {
        let out = String::from_utf8_lossy(conn.output()).into_owned();
        let n = conn.output().len();
        conn.consume_output(n);
        let line = out
            .lines()
            .find(|l| l.starts_with("PUB $JS.API.INFO "))
            .unwrap_or_else(|| panic!("no probe written: {out:?}"));
        line.split(' ').nth(2).unwrap_or_default().to_string()
    }

    #[test]
    fn health_follows_the_connection_and_its_probe_answers_never_reach_the_broker() {
        let t0 = Instant::now();
        let mut conn = connected(t0);
        let mut health = Health::new(t0);
        assert!(health.check(t0).is_err(), "down before the first event");
        let passed = observed(&mut health, &mut conn, t0);
        assert!(
            matches!(passed[..], [NatsEvent::Connected { .. }]),
            "{passed:?}"
        );
        assert_eq!(
            health.check(t0),
            Err("JetStream has not answered yet".into())
        );

        health.tick(&mut conn, t0);
        let reply = probe_reply(&mut conn);
        conn.receive(format!("MSG {reply} 1 2\r\n{{}}\r\n").as_bytes(), t0);
        assert!(
            observed(&mut health, &mut conn, t0).is_empty(),
            "the probe's answer went on"
        );
        assert_eq!(health.check(t0), Ok(()));

        // Not again before the interval; then JetStream is switched off.
        health.tick(&mut conn, t0 + Duration::from_secs(1));
        assert!(conn.output().is_empty(), "probed again within the interval");
        let t1 = t0 + HEALTH_INTERVAL;
        health.tick(&mut conn, t1);
        let reply = probe_reply(&mut conn);
        conn.receive(
            format!("HMSG {reply} 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n").as_bytes(),
            t1,
        );
        let passed = observed(&mut health, &mut conn, t1);
        assert!(passed.is_empty(), "{passed:?}");
        assert_eq!(health.check(t1), Err("JetStream is not enabled".into()));

        // A probe nobody answers fails at its deadline.
        let t2 = t1 + HEALTH_INTERVAL;
        health.tick(&mut conn, t2);
        probe_reply(&mut conn);
        let t3 = t2 + HEALTH_INTERVAL + Duration::from_millis(1);
        conn.handle_timeout(t3);
        assert!(observed(&mut health, &mut conn, t3).is_empty());
        let err = health.check(t3).err().unwrap_or_default();
        assert!(err.starts_with("JetStream does not answer"), "{err}");

        conn.on_transport_closed(t3, "test");
        let passed = observed(&mut health, &mut conn, t3);
        assert!(
            matches!(passed[..], [NatsEvent::Disconnected { .. }]),
            "{passed:?}"
        );
        assert_eq!(health.check(t3), Err("NATS connection is down".into()));
    }

    #[test]
    fn health_is_not_ready_while_the_main_connection_is_silent() {
        // A dead link was reported only once the JetStream probe out timed out, 5 to
        // 10 s on, and the broker stayed ready meanwhile.
        let t0 = Instant::now();
        let mut options = Options::new("nats://127.0.0.1:4222");
        options.silence_probe = Some(SILENCE_PROBE);
        options.silence_limit = Some(SILENCE_LIMIT);
        let mut conn = connected_with(options, t0);
        let mut health = Health::new(t0);
        observed(&mut health, &mut conn, t0);
        health.tick(&mut conn, t0);
        let reply = probe_reply(&mut conn);
        conn.receive(format!("MSG {reply} 1 2\r\n{{}}\r\n").as_bytes(), t0);
        observed(&mut health, &mut conn, t0);
        assert_eq!(health.check(t0), Ok(()));

        // The next probe finds the link dead: its PING, then silent.
        let mut now = t0 + HEALTH_INTERVAL;
        health.tick(&mut conn, now);
        probe_reply(&mut conn);
        while !conn.is_silent() {
            now = conn.poll_timeout().expect("the probe's deadline");
            conn.handle_timeout(now);
            let n = conn.output().len();
            conn.consume_output_at(n, now);
        }
        health.tick(&mut conn, now);
        assert_eq!(
            health.check(now + Duration::from_millis(100)),
            Err("NATS connection silent: nothing read for 3100 ms, a PING unanswered".into())
        );
        // Anything read ends it; its PING still unanswered, silent again.
        conn.receive(b"+OK\r\n", now);
        health.tick(&mut conn, now);
        assert_eq!(health.check(now), Ok(()));

        // Silent for the limit: given up, and down.
        let silent = now + SILENCE_PROBE;
        conn.handle_timeout(silent);
        health.tick(&mut conn, silent);
        assert!(health.check(silent).is_err_and(|e| e.contains("silent")));
        let limit = silent + SILENCE_LIMIT;
        conn.handle_timeout(limit);
        assert!(conn.poll_close(), "given up");
        let passed = observed(&mut health, &mut conn, limit);
        assert!(
            matches!(&passed[..], [NatsEvent::Disconnected { reason }, ..] if reason.contains("stale")),
            "{passed:?}"
        );
        health.tick(&mut conn, limit);
        assert_eq!(health.check(limit), Err("NATS connection is down".into()));
    }

    #[test]
    fn liveness_fails_for_a_window_after_a_late_wake_up() {
        let t0 = Instant::now();
        let mut l = Liveness::default();
        l.woke(None, t0);
        l.woke(Some(t0), t0 + Duration::from_millis(1500));
        assert!(
            l.check(t0 + Duration::from_secs(2)).is_ok(),
            "lag under the bound"
        );
        let woke = t0 + Duration::from_secs(10);
        l.woke(Some(t0 + Duration::from_secs(7)), woke);
        let err = l.check(woke).err().unwrap_or_default();
        assert!(err.contains("3000 ms late"), "{err}");
        assert!(
            l.check(woke + LIVENESS_WINDOW - Duration::from_millis(1))
                .is_err()
        );
        assert!(l.check(woke + LIVENESS_WINDOW).is_ok());
        assert_eq!(l.stalls, 1);
        assert_eq!(l.max_lag, Duration::from_secs(3));
        // A turn that took 2.5 s: on time at every wake-up, stalled all the same.
        let start = woke + Duration::from_secs(20);
        l.woke(Some(start), start);
        l.worked(start, start + Duration::from_millis(1900));
        assert!(l.check(start + Duration::from_secs(2)).is_ok());
        l.worked(start, start + Duration::from_millis(2500));
        let err = l
            .check(start + Duration::from_secs(3))
            .err()
            .unwrap_or_default();
        assert!(err.contains("2500 ms late"), "{err}");
    }
}
