//! The client side of an AMP session as lean as the project's NATS client, for load
//! generators: frames are queued and written in one go just before the client would wait
//! for input (as the NATS client flushes), and frames read are borrowed from one buffer.
//! The test `Client` (tungstenite, a `serde_json::Value` per frame, a write per frame)
//! cost a benchmark's clients about twice the CPU per message of the baseline's NATS
//! clients on the same cores (benches/RESULTS.md).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::amp::Broker;

pub struct LoadSession {
    stream: TcpStream,
    input: Vec<u8>,
    /// Where the unread part of `input` begins.
    read: usize,
    output: Vec<u8>,
    mask: u32,
    /// How long `next_text` waits for a text frame (pings the broker sends meanwhile
    /// do not extend it).
    wait: Duration,
}

impl LoadSession {
    /// Opens a session and logs in with a token, speaking WebSocket itself from the first
    /// byte (a frame the broker sends right behind the `hello` answer, a message waiting
    /// in the inbox say, must not be left in another client's buffer); `next_text` gives
    /// up after `wait` without a frame.
    pub fn login(broker: &Broker, ns: &str, name: &str, token: &str, wait: Duration) -> Self {
        let stream = TcpStream::connect(broker.addr).expect("connect to the broker");
        stream.set_read_timeout(Some(wait)).expect("read timeout");
        stream.set_nodelay(true).expect("nodelay");
        let mut session = LoadSession {
            stream,
            input: Vec::with_capacity(64 * 1024),
            read: 0,
            output: Vec::with_capacity(16 * 1024),
            mask: 0x9e37_79b9,
            wait,
        };
        let request = format!(
            "GET /amp HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
             Sec-WebSocket-Protocol: amp.v1\r\n\r\n",
            broker.addr
        );
        session.output.extend_from_slice(request.as_bytes());
        session.flush();
        // The response head; what follows it is the first frames.
        let head_end = loop {
            if let Some(i) = session.input.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = session
                .stream
                .read(&mut chunk)
                .expect("the upgrade response");
            assert!(n > 0, "broker closed the connection during the upgrade");
            session.input.extend_from_slice(&chunk[..n]);
        };
        assert!(
            session.input.starts_with(b"HTTP/1.1 101"),
            "upgrade refused: {}",
            String::from_utf8_lossy(&session.input[..head_end])
        );
        session.read = head_end;
        let challenge = session.next_text().expect("a challenge");
        assert!(challenge.starts_with(br#"{"op":"challenge""#));
        let hello = serde_json::json!({"op":"hello","id":"h","ns":ns,"name":name,
                                       "auth":{"type":"token","token":token}});
        session.queue(hello.to_string().as_bytes());
        let ok = session.next_text().expect("the hello answer");
        assert!(
            ok.starts_with(br#"{"op":"ok""#),
            "hello: {}",
            String::from_utf8_lossy(ok)
        );
        session
    }

    /// Queues a masked text frame (RFC 6455 5.3: a client masks what it sends).
    pub fn queue(&mut self, text: &[u8]) {
        self.queue_frame(0x1, text);
    }

    fn queue_frame(&mut self, opcode: u8, payload: &[u8]) {
        let len = payload.len();
        self.output.push(0x80 | opcode);
        if len < 126 {
            self.output.push(0x80 | len as u8);
        } else if len <= 0xffff {
            self.output.push(0x80 | 126);
            self.output.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.output.push(0x80 | 127);
            self.output.extend_from_slice(&(len as u64).to_be_bytes());
        }
        self.mask = self.mask.rotate_left(7).wrapping_add(0x6d2b_79f5);
        let key = self.mask.to_be_bytes();
        self.output.extend_from_slice(&key);
        self.output
            .extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    }

    /// Writes what is queued.
    pub fn flush(&mut self) {
        if !self.output.is_empty() {
            self.stream.write_all(&self.output).expect("write frames");
            self.output.clear();
        }
    }

    /// The next text frame, or `None` when none came within the wait; what was queued
    /// is written first whenever the frame is not already here.
    pub fn next_text(&mut self) -> Option<&[u8]> {
        let deadline = std::time::Instant::now() + self.wait;
        loop {
            if let Some((opcode, start, end)) = self.frame() {
                self.read = end;
                match opcode {
                    0x1 => return Some(&self.input[start..end]),
                    0x8 => panic!("broker closed the session: {:?}", &self.input[start..end]),
                    0x9 => {
                        let payload = self.input[start..end].to_vec();
                        self.queue_frame(0xA, &payload);
                    }
                    _ => {}
                }
                continue;
            }
            self.flush();
            if std::time::Instant::now() >= deadline {
                return None;
            }
            self.input.drain(..self.read);
            self.read = 0;
            let have = self.input.len();
            self.input.resize(have + 64 * 1024, 0);
            let n = match self.stream.read(&mut self.input[have..]) {
                Ok(n) => n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    self.input.truncate(have);
                    return None;
                }
                Err(e) => panic!("read frames: {e}"),
            };
            assert!(n > 0, "broker closed the connection");
            self.input.truncate(have + n);
        }
    }

    /// The opcode and payload bounds of the first whole frame in the unread input (the
    /// broker's frames are unmasked and never fragmented).
    fn frame(&self) -> Option<(u8, usize, usize)> {
        let buf = &self.input[self.read..];
        let (&b0, &b1) = (buf.first()?, buf.get(1)?);
        let (len, header) = match b1 & 0x7f {
            126 => (
                u16::from_be_bytes(buf.get(2..4)?.try_into().ok()?) as usize,
                4,
            ),
            127 => (
                u64::from_be_bytes(buf.get(2..10)?.try_into().ok()?) as usize,
                10,
            ),
            n => (n as usize, 2),
        };
        let start = self.read + header;
        (buf.len() >= header + len).then_some((b0 & 0x0f, start, start + len))
    }
}
