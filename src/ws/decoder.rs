//! A client's frames read (RFC 6455 section 5): bytes in, in whatever pieces the socket
//! gives them; complete text messages and control frames out.
//!
//! Sans-IO and incremental like the request parser: [`Decoder::decode`] takes what it
//! can of the bytes handed in and says how many it used. A payload is unmasked straight
//! into the message it belongs to, so each byte is copied once, no read buffer is kept
//! between frames, and an idle session's decoder holds no allocation at all. This replaced
//! tungstenite's decoder, whose read buffer was allocated again for every read (frames
//! are split off it and keep it alive), which cost more than the rest of reading a
//! frame. tungstenite remains the client of the tests, and `tests/ws_decoding.rs` reads
//! the same generated streams with both and compares the messages and close codes.
//!
//! What the broker does not take is refused at the frame header, before its payload
//! is read: binary messages, frames or messages over the limit, and every protocol
//! violation (reserved bits or opcodes, an unmasked frame, a fragmented or long control
//! frame, a continuation without a message or a new message inside one).

/// Longest frame header: 2 bytes, 8 of extended length, 4 of mask.
const MAX_HEADER: usize = 14;
/// Longest control frame payload.
const MAX_CONTROL: u64 = 125;

const CONTINUATION: u8 = 0x0;
const TEXT: u8 = 0x1;
const BINARY: u8 = 0x2;
const CLOSE: u8 = 0x8;
const PING: u8 = 0x9;
const PONG: u8 = 0xA;

/// What a complete frame gives.
#[derive(Debug, PartialEq, Eq)]
pub enum Item {
    /// A text message, all its fragments joined, checked as UTF-8.
    Text(String),
    /// A data frame that did not end its message.
    Fragment,
    /// A ping, with the payload its pong must echo.
    Ping(Vec<u8>),
    Pong,
    /// A close frame: its status code and reason, `None` when it carried none.
    Close(Option<(u16, String)>),
}

/// Why the session must fail; each has its close code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// 1002.
    Protocol,
    /// 1003: a binary message.
    Binary,
    /// 1007: a text message or close reason that is not UTF-8.
    InvalidUtf8,
    /// 1009: a frame or message over the limit.
    TooBig,
}

/// The frame whose payload is being read.
#[derive(Debug, Clone, Copy)]
struct Frame {
    opcode: u8,
    fin: bool,
    mask: [u8; 4],
    /// Payload bytes still to come.
    remaining: usize,
    /// Payload bytes already read (the phase of the mask).
    done: usize,
}

#[derive(Debug)]
pub struct Decoder {
    max_message: usize,
    head: [u8; MAX_HEADER],
    head_len: u8,
    frame: Option<Frame>,
    /// The text message being read: its bytes so far, unmasked.
    message: Option<Vec<u8>>,
    /// The control frame being read (they may come between fragments of a message).
    control: Vec<u8>,
}

impl Decoder {
    /// A decoder that refuses frames and messages over `max_message` bytes.
    pub fn new(max_message: usize) -> Decoder {
        Decoder {
            max_message,
            head: [0; MAX_HEADER],
            head_len: 0,
            frame: None,
            message: None,
            control: Vec::new(),
        }
    }

    /// Frees the control frame buffer between control frames.
    pub fn compact(&mut self) {
        if self.control.is_empty() {
            self.control = Vec::new();
        }
    }

    /// Reads from `data` until one frame is complete or `data` runs out; how many bytes
    /// it used, and the item when a frame completed. After an error the decoder must not
    /// be used again.
    pub fn decode(&mut self, data: &[u8]) -> (usize, Result<Option<Item>, Error>) {
        let mut used = 0;
        let mut frame = match self.frame {
            Some(frame) => frame,
            None => {
                used = self.read_header(data);
                match self.header() {
                    None => return (used, Ok(None)),
                    Some(Err(e)) => return (used, Err(e)),
                    Some(Ok(frame)) => {
                        self.head_len = 0;
                        if let Err(e) = self.start(&frame) {
                            return (used, Err(e));
                        }
                        frame
                    }
                }
            }
        };
        let rest = data.get(used..).unwrap_or_default();
        let take = rest.len().min(frame.remaining);
        let piece = rest.get(..take).unwrap_or_default();
        let into = if frame.opcode >= CLOSE {
            &mut self.control
        } else {
            self.message.get_or_insert_with(Vec::new)
        };
        unmask_into(into, piece, frame.mask, frame.done);
        used += take;
        frame.remaining -= take;
        frame.done += take;
        if frame.remaining > 0 {
            self.frame = Some(frame);
            return (used, Ok(None));
        }
        self.frame = None;
        (used, self.finish(&frame).map(Some))
    }

    /// Nothing of a frame or message is held: the decoder is as new.
    pub fn between_messages(&self) -> bool {
        self.head_len == 0 && self.frame.is_none() && self.message.is_none()
    }

    /// Bytes of partial frames and messages held.
    pub fn held_bytes(&self) -> usize {
        usize::from(self.head_len) + self.message.as_ref().map_or(0, Vec::len) + self.control.len()
    }

    /// Copies header bytes until the header is complete (its length is known from its
    /// first two bytes); how many it took.
    fn read_header(&mut self, data: &[u8]) -> usize {
        let mut used = 0;
        loop {
            let have = usize::from(self.head_len);
            let want = header_len(self.head.get(..have).unwrap_or_default());
            if have >= want || used == data.len() {
                return used;
            }
            let take = (want - have).min(data.len() - used);
            if let (Some(dst), Some(src)) = (
                self.head.get_mut(have..have + take),
                data.get(used..used + take),
            ) {
                dst.copy_from_slice(src);
            }
            self.head_len += take as u8;
            used += take;
        }
    }

    /// The frame the complete header describes, checked; `None` while it is partial.
    fn header(&self) -> Option<Result<Frame, Error>> {
        let head = self.head.get(..usize::from(self.head_len))?;
        let &[first, second, ..] = head else {
            return None;
        };
        if head.len() < header_len(head) {
            return None;
        }
        let opcode = first & 0x0F;
        let fin = first & 0x80 != 0;
        let masked = second & 0x80 != 0;
        let (len, ext): (u64, usize) = match second & 0x7F {
            126 => (u64::from(be_u16(head.get(2..4)?)), 2),
            127 => (u64::from_be_bytes(head.get(2..10)?.try_into().ok()?), 8),
            n => (u64::from(n), 0),
        };
        let control = opcode >= CLOSE;
        let known = matches!(opcode, CONTINUATION | TEXT | BINARY | CLOSE | PING | PONG);
        if first & 0x70 != 0 || !known || !masked || (control && (!fin || len > MAX_CONTROL)) {
            return Some(Err(Error::Protocol));
        }
        let mask = head.get(2 + ext..6 + ext)?.try_into().ok()?;
        let Ok(remaining) = usize::try_from(len) else {
            return Some(Err(Error::TooBig));
        };
        Some(Ok(Frame {
            opcode,
            fin,
            mask,
            remaining,
            done: 0,
        }))
    }

    /// Checks a data frame against the message it starts or continues.
    fn start(&mut self, frame: &Frame) -> Result<(), Error> {
        match (frame.opcode, &self.message) {
            (CLOSE | PING | PONG, _) => {
                self.control.clear();
                return Ok(());
            }
            (TEXT | BINARY, Some(_)) | (CONTINUATION, None) => return Err(Error::Protocol),
            _ => {}
        }
        let so_far = self.message.as_ref().map_or(0, Vec::len);
        if frame.remaining > self.max_message.saturating_sub(so_far) {
            return Err(Error::TooBig);
        }
        if frame.opcode == BINARY {
            return Err(Error::Binary);
        }
        Ok(())
    }

    fn finish(&mut self, frame: &Frame) -> Result<Item, Error> {
        match frame.opcode {
            PING => Ok(Item::Ping(std::mem::take(&mut self.control))),
            PONG => {
                self.control.clear();
                Ok(Item::Pong)
            }
            CLOSE => {
                let payload = std::mem::take(&mut self.control);
                close_item(&payload)
            }
            _ if !frame.fin => Ok(Item::Fragment),
            _ => {
                let bytes = self.message.take().unwrap_or_default();
                String::from_utf8(bytes)
                    .map(Item::Text)
                    .map_err(|_| Error::InvalidUtf8)
            }
        }
    }
}

/// The header length its first two bytes announce (2 until they are there).
fn header_len(head: &[u8]) -> usize {
    match head.get(1) {
        None => 2,
        Some(second) => {
            let ext = match second & 0x7F {
                126 => 2,
                127 => 8,
                _ => 0,
            };
            2 + ext + if second & 0x80 != 0 { 4 } else { 0 }
        }
    }
}

fn be_u16(b: &[u8]) -> u16 {
    match b {
        &[hi, lo] => u16::from_be_bytes([hi, lo]),
        _ => 0,
    }
}

/// A close frame's payload: empty, or a status code a peer may send and a UTF-8 reason.
fn close_item(payload: &[u8]) -> Result<Item, Error> {
    let Some((code, reason)) = payload.split_first_chunk::<2>() else {
        return if payload.is_empty() {
            Ok(Item::Close(None))
        } else {
            Err(Error::Protocol)
        };
    };
    let code = u16::from_be_bytes(*code);
    // RFC 6455 section 7.4: the defined codes an endpoint may send, and the ranges for
    // libraries and applications. 1005, 1006 and 1015 never go on the wire.
    if !matches!(code, 1000..=1003 | 1007..=1013 | 3000..=4999) {
        return Err(Error::Protocol);
    }
    let reason = std::str::from_utf8(reason).map_err(|_| Error::InvalidUtf8)?;
    Ok(Item::Close(Some((code, reason.to_owned()))))
}

/// Appends `src` unmasked with `mask`, whose phase is `done` bytes into the payload.
fn unmask_into(dst: &mut Vec<u8>, src: &[u8], mask: [u8; 4], done: usize) {
    let start = dst.len();
    dst.extend_from_slice(src);
    let Some(bytes) = dst.get_mut(start..) else {
        return;
    };
    let mut key = mask;
    key.rotate_left(done % 4);
    let word = u64::from_ne_bytes([
        key[0], key[1], key[2], key[3], key[0], key[1], key[2], key[3],
    ]);
    let mut chunks = bytes.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        chunk.copy_from_slice(&(u64::from_ne_bytes(w) ^ word).to_ne_bytes());
    }
    for (b, k) in chunks.into_remainder().iter_mut().zip(key.iter().cycle()) {
        *b ^= k;
    }
}

/// A client frame: `first` byte as given, masked with `mask` (for the tests here and of
/// the connection).
#[cfg(test)]
pub(crate) fn client_frame(first: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
    let mut out = vec![first];
    let len = payload.len();
    if len < 126 {
        out.push(0x80 | len as u8);
    } else if len <= 0xFFFF {
        out.push(0x80 | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
}

#[cfg(test)]
mod tests {
    use super::client_frame as frame;
    use super::*;

    /// Every item of `input` fed in pieces of `step` bytes.
    fn items(input: &[u8], step: usize, max: usize) -> Vec<Result<Item, Error>> {
        let mut d = Decoder::new(max);
        let mut out = Vec::new();
        for piece in input.chunks(step) {
            let mut rest = piece;
            while !rest.is_empty() {
                let (n, r) = d.decode(rest);
                rest = &rest[n..];
                match r {
                    Ok(Some(item)) => out.push(Ok(item)),
                    Ok(None) => assert!(rest.is_empty(), "stopped early without an item"),
                    Err(e) => {
                        out.push(Err(e));
                        return out;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn messages_fragments_and_controls_come_out_the_same_in_any_pieces() {
        let long: String = "xé".repeat(40_000);
        let mut input = frame(0x81, b"hello", [1, 2, 3, 4]);
        input.extend(frame(0x01, b"frag", [9, 8, 7, 6]));
        input.extend(frame(0x89, b"ping!", [5, 5, 5, 5]));
        input.extend(frame(0x80, "ment é".as_bytes(), [0xff, 0, 0x10, 0x3]));
        input.extend(frame(0x8A, b"", [0, 0, 0, 0]));
        input.extend(frame(0x81, long.as_bytes(), [0xde, 0xad, 0xbe, 0xef]));
        input.extend(frame(0x81, &[0u8; 200], [0x11, 0x22, 0x33, 0x44]));
        input.extend(frame(0x88, b"\x03\xe8bye", [7, 7, 7, 7]));
        let want = vec![
            Ok(Item::Text("hello".into())),
            Ok(Item::Fragment),
            Ok(Item::Ping(b"ping!".to_vec())),
            Ok(Item::Text("fragment é".into())),
            Ok(Item::Pong),
            Ok(Item::Text(long.clone())),
            Ok(Item::Text("\0".repeat(200))),
            Ok(Item::Close(Some((1000, "bye".into())))),
        ];
        for step in [1, 2, 3, 7, 13, 64, 1000, input.len()] {
            assert_eq!(items(&input, step, 1 << 20), want, "pieces of {step}");
        }
    }

    #[test]
    fn an_idle_decoder_holds_nothing() {
        let mut d = Decoder::new(1 << 20);
        let input = frame(0x81, &[b'a'; 5000], [1, 2, 3, 4]);
        let (n, r) = d.decode(&input[..3000]);
        assert_eq!((n, r), (3000, Ok(None)));
        assert!(!d.between_messages());
        assert_eq!(d.held_bytes(), 3000 - 8);
        let (n, r) = d.decode(&input[3000..]);
        assert_eq!(n, input.len() - 3000);
        assert!(matches!(r, Ok(Some(Item::Text(t))) if t.len() == 5000));
        assert!(d.between_messages());
        assert_eq!(d.held_bytes(), 0);
        assert!(d.message.is_none() && d.control.capacity() == 0);
    }

    #[test]
    fn what_is_refused_is_refused_at_the_header() {
        let max = 1000;
        let one = |bytes: Vec<u8>| items(&bytes, 1, max).pop();
        let header_only = |first: u8, second: u8, ext: &[u8]| {
            let mut b = vec![first, second];
            b.extend_from_slice(ext);
            b.extend_from_slice(&[1, 2, 3, 4]);
            b
        };
        // Reserved bits, reserved opcodes, unmasked, fragmented or long control frames.
        for first in [0xC1, 0xA1, 0x91, 0x83, 0x87, 0x8B, 0x8F, 0x09, 0x08] {
            assert_eq!(
                one(header_only(first, 0x80, &[])),
                Some(Err(Error::Protocol))
            );
        }
        assert_eq!(one(vec![0x81, 0x00]), Some(Err(Error::Protocol)));
        assert_eq!(
            one(header_only(0x89, 0x80 | 126, &[0, 126])),
            Some(Err(Error::Protocol))
        );
        // A continuation without a message, a new message inside one.
        assert_eq!(one(frame(0x80, b"x", [0; 4])), Some(Err(Error::Protocol)));
        let mut inside = frame(0x01, b"a", [0; 4]);
        inside.extend(frame(0x81, b"b", [0; 4]));
        assert_eq!(one(inside), Some(Err(Error::Protocol)));
        // Over the limit: one frame, a message of fragments, a 64-bit length.
        assert_eq!(
            one(header_only(0x81, 0x80 | 126, &[0x03, 0xE9])),
            Some(Err(Error::TooBig))
        );
        let mut parts = frame(0x01, &[b'a'; 600], [0; 4]);
        parts.extend(header_only(0x80, 0x80 | 126, &[0x01, 0x91]));
        assert_eq!(one(parts), Some(Err(Error::TooBig)));
        assert_eq!(
            one(header_only(0x81, 0xFF, &[0xFF; 8])),
            Some(Err(Error::TooBig))
        );
        assert_eq!(one(header_only(0x82, 0x85, &[])), Some(Err(Error::Binary)));
        // Text and close reasons that are not UTF-8; close codes a peer may not send.
        assert_eq!(
            one(frame(0x81, b"\xff", [0; 4])),
            Some(Err(Error::InvalidUtf8))
        );
        assert_eq!(
            one(frame(0x88, b"\x03\xe8\xff", [0; 4])),
            Some(Err(Error::InvalidUtf8))
        );
        for code in [0u16, 999, 1004, 1005, 1006, 1014, 1015, 2999, 5000] {
            let payload = code.to_be_bytes();
            assert_eq!(
                one(frame(0x88, &payload, [0; 4])),
                Some(Err(Error::Protocol))
            );
        }
        assert_eq!(
            one(frame(0x88, b"\x03", [0; 4])),
            Some(Err(Error::Protocol))
        );
        assert_eq!(one(frame(0x88, b"", [0; 4])), Some(Ok(Item::Close(None))));
        assert_eq!(
            one(frame(0x88, b"\x0f\xa0", [0; 4])),
            Some(Ok(Item::Close(Some((4000, String::new())))))
        );
    }
}
