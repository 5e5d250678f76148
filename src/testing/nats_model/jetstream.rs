//! The JetStream side of the model: streams with their consumers, the publishes they
//! capture, acks and flow-control replies, and the clock that drives expiry and
//! redelivery. The `$JS.API` requests are in `api.rs`.

use std::collections::BTreeMap;
use std::time::Instant;

use serde_json::json;

use super::consumer::{AckOp, Consumer, NextRequest, Outbound};
use super::stream::Stream;

#[derive(Debug)]
pub struct StreamEntry {
    pub stream: Stream,
    pub consumers: BTreeMap<String, Consumer>,
}

#[derive(Debug)]
pub struct JetStream {
    pub streams: BTreeMap<String, StreamEntry>,
    pub domain: Option<String>,
    /// State of the generator of ephemeral consumer names (seeded by the options).
    name_state: u64,
    pub api_total: u64,
    pub api_errors: u64,
    /// Statuses for pulls of consumers removed by an API call, sent after its reply.
    pub closing: Vec<Outbound>,
}

/// The outcome of a message the model itself may answer.
#[derive(Debug)]
pub enum Handled {
    /// Nothing in JetStream listens on the subject.
    NotMine,
    /// Taken; these messages go out.
    Out(Vec<Outbound>),
}

fn reply_to(reply: Option<&str>, payload: Vec<u8>) -> Vec<Outbound> {
    reply
        .map(|r| Outbound {
            to: r.to_string(),
            subject: r.to_string(),
            reply: None,
            headers: None,
            payload,
        })
        .into_iter()
        .collect()
}

impl JetStream {
    pub fn new(domain: Option<String>, seed: u64) -> JetStream {
        JetStream {
            streams: BTreeMap::new(),
            domain,
            name_state: seed,
            api_total: 0,
            api_errors: 0,
            closing: Vec::new(),
        }
    }

    /// An ephemeral consumer's name: 8 characters from a seeded splitmix64, so runs repeat.
    pub fn next_name(&mut self) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        self.name_state = self.name_state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.name_state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (0..8)
            .map(|i| char::from(ALPHABET[((z >> (i * 8)) % ALPHABET.len() as u64) as usize]))
            .collect()
    }

    /// A publish on `subject`: stored by the stream that captures it, PubAck to `reply`.
    pub fn capture(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        headers: Option<&[u8]>,
        payload: &[u8],
        now: Instant,
        wall: u64,
    ) -> Handled {
        let Some(entry) = self
            .streams
            .values_mut()
            .find(|e| e.stream.captures(subject))
        else {
            return Handled::NotMine;
        };
        let name = entry.stream.name.clone();
        let body = match entry.stream.store(subject, headers, payload, now, wall) {
            Ok(stored) => {
                let mut ack = json!({"stream": name, "seq": stored.seq});
                if stored.duplicate {
                    ack["duplicate"] = json!(true);
                }
                if let Some(d) = &self.domain {
                    ack["domain"] = json!(d);
                }
                ack
            }
            Err(e) => json!({"error": e.to_json(), "stream": name}),
        };
        Handled::Out(reply_to(reply, body.to_string().into_bytes()))
    }

    /// `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (and the
    /// longer form with domain and account hash).
    pub fn ack(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        payload: &[u8],
        now: Instant,
    ) -> Handled {
        let tokens: Vec<&str> = subject.split('.').collect();
        let rest = match tokens.len() {
            9 => &tokens[2..],
            n if n >= 11 => &tokens[4..],
            _ => return Handled::NotMine,
        };
        let (stream, consumer) = (rest[0], rest[1]);
        let Some(seq) = rest.get(3).and_then(|s| s.parse::<u64>().ok()) else {
            return Handled::NotMine;
        };
        let Some(entry) = self.streams.get_mut(stream) else {
            return Handled::NotMine;
        };
        let Some(c) = entry.consumers.get_mut(consumer) else {
            return Handled::NotMine;
        };
        if let Some(op) = AckOp::parse(payload) {
            let done = c.ack(seq, op, now);
            if entry.stream.is_workqueue() {
                for s in done {
                    entry.stream.remove(s);
                }
            }
        }
        // `+NXT`: the ack is also a pull, answered on its reply subject (no confirmation).
        if let (Some(next), Some(reply)) = (payload.strip_prefix(b"+NXT"), reply) {
            let mut out = Vec::new();
            match NextRequest::parse(next) {
                Ok(req) => c.add_pull(reply, req, now, &mut out),
                Err(_) => out.push(Outbound::status(reply, 400, "Bad Request", &[])),
            }
            return Handled::Out(out);
        }
        Handled::Out(reply_to(reply, Vec::new()))
    }

    /// `$JS.FC.<stream>.<consumer>.<id>`: a push consumer's flow control answered.
    pub fn flow_control(&mut self, subject: &str) -> Handled {
        let tokens: Vec<&str> = subject.split('.').collect();
        if tokens.len() != 5 {
            return Handled::NotMine;
        }
        match self
            .streams
            .get_mut(tokens[2])
            .and_then(|e| e.consumers.get_mut(tokens[3]))
        {
            Some(c) => {
                c.flow_answered(subject);
                Handled::Out(Vec::new())
            }
            None => Handled::NotMine,
        }
    }

    /// Every consumer delivers what it can.
    pub fn pump(&mut self, now: Instant, interest: &dyn Fn(&str) -> bool, out: &mut Vec<Outbound>) {
        for entry in self.streams.values_mut() {
            for c in entry.consumers.values_mut() {
                c.pump(&entry.stream, now, interest, out);
            }
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.streams
            .values()
            .flat_map(|e| {
                e.consumers
                    .values()
                    .map(Consumer::poll_timeout)
                    .chain(std::iter::once(e.stream.next_expiry()))
            })
            .flatten()
            .min()
    }

    pub fn handle_timeout(&mut self, now: Instant, wall: u64, out: &mut Vec<Outbound>) {
        for entry in self.streams.values_mut() {
            entry.stream.expire(now, wall);
            let mut idle = Vec::new();
            for (name, c) in entry.consumers.iter_mut() {
                c.sync(&entry.stream);
                if c.handle_timeout(now, out) {
                    idle.push(name.clone());
                }
            }
            for name in idle {
                if let Some(mut c) = entry.consumers.remove(&name) {
                    c.close(out);
                }
            }
        }
    }
}
