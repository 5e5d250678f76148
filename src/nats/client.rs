//! A blocking client for tests, benchmarks and command-line tools: one [`Driver`] in its
//! own small `mio::Poll` loop. The broker does not use this; it embeds the driver.

use super::connection::{Connection, Event, Message, PingId};
use super::driver::Driver;
use super::error::{Error, RequestError};
use super::options::Options;
use super::requests::RequestId;
use super::subscriptions::Sid;
use crate::deadline::after;
use crate::proto::headers::HeaderMap;
use mio::{Events, Poll, Token};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

const TOKEN: Token = Token(0);
/// Unwritten output beyond which `publish` writes at once instead of waiting for the
/// next pump (batching small publishes into few writes).
const WRITE_THRESHOLD: usize = 64 * 1024;
/// Unwritten output beyond which `publish` blocks until the socket takes some: a blocking
/// client's back-pressure, well below `max_write_buffer`.
const BLOCK_THRESHOLD: usize = 1024 * 1024;

pub struct Client {
    poll: Poll,
    events: Events,
    driver: Driver,
    /// Events taken from the connection while waiting for something else.
    stash: VecDeque<Event>,
    stash_limit: usize,
    /// Set once the connection closed for good.
    closed: Option<Error>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("connection", self.driver.connection())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects and completes the handshake (authentication included), or returns why not:
    /// `Error::Authorization` for refused credentials, `Error::ConnectFailed` when no
    /// server answered.
    pub fn connect(options: Options) -> Result<Client, Error> {
        let poll = Poll::new().map_err(|e| Error::Io(e.to_string()))?;
        let stash_limit = options.max_pending_messages.max(1);
        let conn = Connection::new(options, Instant::now());
        let mut client = Client {
            poll,
            events: Events::with_capacity(64),
            driver: Driver::new(conn, TOKEN),
            stash: VecDeque::new(),
            stash_limit,
            closed: None,
        };
        loop {
            client.pump(None)?;
            while let Some(event) = client.driver.connection_mut().poll_event() {
                match event {
                    Event::Connected { .. } => return Ok(client),
                    Event::Closed { reason } => return Err(reason),
                    other => client.stash_event(other),
                }
            }
        }
    }

    pub fn connection(&self) -> &Connection {
        self.driver.connection()
    }

    pub fn connection_mut(&mut self) -> &mut Connection {
        self.driver.connection_mut()
    }

    pub fn is_connected(&self) -> bool {
        self.connection().is_connected()
    }

    pub fn publish(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        headers: Option<&HeaderMap>,
        payload: &[u8],
    ) -> Result<(), Error> {
        self.driver
            .connection_mut()
            .publish(subject, reply, headers, payload)?;
        let unwritten = self.connection().output().len();
        if unwritten >= WRITE_THRESHOLD && !self.driver.is_write_blocked() {
            self.drive();
        }
        while self.connection().output().len() >= BLOCK_THRESHOLD {
            self.drive();
            if self.connection().output().len() >= BLOCK_THRESHOLD {
                self.pump(Some(Instant::now() + Duration::from_millis(100)))?;
            }
        }
        Ok(())
    }

    pub fn subscribe(&mut self, subject: &str, queue: Option<&str>) -> Result<Sid, Error> {
        let sid = self.driver.connection_mut().subscribe(subject, queue)?;
        self.drive();
        Ok(sid)
    }

    pub fn unsubscribe(&mut self, sid: Sid, max_msgs: Option<u64>) -> Result<(), Error> {
        self.driver.connection_mut().unsubscribe(sid, max_msgs)?;
        self.drive();
        Ok(())
    }

    /// Writes everything and waits for the server's PONG: all earlier operations have been
    /// processed by the server when this returns `Ok`.
    pub fn flush(&mut self, timeout: Duration) -> Result<(), Error> {
        let deadline = after(Instant::now(), timeout);
        let id: PingId = self.driver.connection_mut().ping()?;
        let mut result = Err(Error::Timeout);
        self.run_stashing(deadline, |event| match event {
            Event::Pong(p) if *p == id => {
                result = Ok(());
                true
            }
            Event::Disconnected { reason } => {
                result = Err(Error::ConnectFailed(format!("disconnected: {reason}")));
                true
            }
            Event::Closed { reason } => {
                result = Err(reason.clone());
                true
            }
            _ => false,
        })?;
        result
    }

    /// The next message on `sid`, or `Ok(None)` when `timeout` passes first.
    pub fn next_message(&mut self, sid: Sid, timeout: Duration) -> Result<Option<Message>, Error> {
        if let Some(pos) = self
            .stash
            .iter()
            .position(|e| matches!(e, Event::Message { sid: s, .. } if *s == sid))
            && let Some(Event::Message { msg, .. }) = self.stash.remove(pos)
        {
            return Ok(Some(msg));
        }
        let deadline = after(Instant::now(), timeout);
        let event = self.run_stashing(
            deadline,
            |event| matches!(event, Event::Message { sid: s, .. } if *s == sid),
        )?;
        Ok(match event {
            Some(Event::Message { msg, .. }) => Some(msg),
            _ => None,
        })
    }

    /// Sends a request and waits for its reply.
    pub fn request(
        &mut self,
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Message, RequestError> {
        let now = Instant::now();
        let id = self
            .driver
            .connection_mut()
            .request(subject, headers, payload, timeout, now)?;
        self.drive();
        self.wait_response(
            id,
            after(now, timeout.saturating_add(Duration::from_millis(50))),
        )
    }

    /// Waits for the outcome of a request made with `connection_mut().request(..)`.
    pub fn wait_response(
        &mut self,
        id: RequestId,
        deadline: Instant,
    ) -> Result<Message, RequestError> {
        let matches = |e: &Event| matches!(e, Event::Response { id: i, .. } | Event::RequestFailed { id: i, .. } if *i == id);
        let event = match self.stash.iter().position(matches) {
            Some(pos) => self.stash.remove(pos),
            None => self
                .run_stashing(deadline, matches)
                .map_err(RequestError::Send)?,
        };
        match event {
            Some(Event::Response { msg, .. }) => Ok(msg),
            Some(Event::RequestFailed { error, .. }) => Err(error),
            _ => {
                self.driver.connection_mut().cancel_request(id);
                Err(RequestError::Timeout)
            }
        }
    }

    /// Pumps the connection, handing every event to `f` until it returns true (then
    /// `Ok(true)`) or `timeout` passes (`Ok(false)`). Stashed events come first.
    pub fn run_until(
        &mut self,
        timeout: Duration,
        mut f: impl FnMut(&Event) -> bool,
    ) -> Result<bool, Error> {
        let deadline = after(Instant::now(), timeout);
        while let Some(event) = self.stash.pop_front() {
            if f(&event) {
                return Ok(true);
            }
        }
        loop {
            while let Some(event) = self.driver.connection_mut().poll_event() {
                if f(&event) {
                    return Ok(true);
                }
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            self.pump(Some(deadline))?;
        }
    }

    /// Takes every event seen so far (stashed ones first) without waiting.
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut out: Vec<Event> = self.stash.drain(..).collect();
        while let Some(e) = self.driver.connection_mut().poll_event() {
            out.push(e);
        }
        out
    }

    /// Closes the connection after writing what is pending.
    pub fn close(&mut self) {
        let _ = self.flush(Duration::from_secs(1));
        self.driver.connection_mut().close();
        self.drive();
        self.driver.shutdown(self.poll.registry());
    }

    /// Pumps until an event matches; other events are stashed for later calls.
    fn run_stashing(
        &mut self,
        deadline: Instant,
        mut f: impl FnMut(&Event) -> bool,
    ) -> Result<Option<Event>, Error> {
        loop {
            while let Some(event) = self.driver.connection_mut().poll_event() {
                if f(&event) {
                    return Ok(Some(event));
                }
                self.stash_event(event);
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            if let Some(e) = &self.closed {
                return Err(e.clone());
            }
            self.pump(Some(deadline))?;
        }
    }

    fn stash_event(&mut self, event: Event) {
        if let Event::Closed { reason } = &event {
            self.closed = Some(reason.clone());
        }
        if self.stash.len() >= self.stash_limit {
            // Drop the oldest message; control events are few and kept.
            if let Some(pos) = self
                .stash
                .iter()
                .position(|e| matches!(e, Event::Message { .. }))
            {
                self.stash.remove(pos);
            }
        }
        self.stash.push_back(event);
    }

    fn drive(&mut self) {
        let now = Instant::now();
        self.driver.drive(self.poll.registry(), now);
    }

    /// One round: IO that can be done now, then wait for readiness or the next deadline.
    fn pump(&mut self, deadline: Option<Instant>) -> Result<(), Error> {
        self.drive();
        let now = Instant::now();
        let wake = match (deadline, self.driver.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if self.connection().is_closed() && !self.driver.has_socket() && deadline.is_none() {
            return Ok(());
        }
        let timeout = wake.map(|w| w.saturating_duration_since(now));
        match self.poll.poll(&mut self.events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Io(e.to_string())),
        }
        let now = Instant::now();
        let registry = self.poll.registry();
        for event in self.events.iter() {
            self.driver.handle_event(registry, event, now);
        }
        self.driver.drive(registry, now);
        Ok(())
    }
}
