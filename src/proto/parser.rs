//! Incremental parser for the NATS client protocol, in both directions.
//!
//! The parser keeps no state between calls: hand it the unconsumed bytes and it either
//! returns one operation plus the number of bytes it used, or says it needs more input.
//! Every field of the operation borrows from the input, so nothing is allocated.
//!
//! Behaviour follows nats-server's `server/parser.go` (and nats.go's `parser.go` for the
//! client side); the deliberate differences are listed in the README and pinned in tests.

use memchr::memchr;
use std::fmt;

/// nats-server's `MAX_CONTROL_LINE_SIZE`.
pub const DEFAULT_MAX_CONTROL_LINE: usize = 4096;
/// nats-server's default `max_payload` (1 MiB).
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;
/// nats-server's `parseSize` accepts at most 9 digits (999,999,999).
const MAX_SIZE_DIGITS: usize = 9;

/// Which side's operations the parser accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// We are a client: parse what a server sends (INFO, MSG, HMSG, PING, PONG, +OK, -ERR).
    /// MSG/HMSG fields are split on spaces and tabs only and any other byte (CR, control
    /// bytes, non-UTF-8) is part of the field: nats-server accepts such subjects from any
    /// publisher and delivers them, so refusing them would let one publisher break every
    /// subscriber's connection. The caller validates subjects per message.
    Client,
    /// We are a server: parse what a client sends (CONNECT, PUB, HPUB, SUB, UNSUB, PING,
    /// PONG, and INFO, +OK, -ERR which nats-server also accepts from clients).
    Server,
}

/// One operation, borrowing every field from the input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op<'a> {
    /// Raw JSON of `INFO {...}`.
    Info(&'a [u8]),
    /// Raw JSON of `CONNECT {...}`.
    Connect(&'a [u8]),
    Pub {
        subject: &'a [u8],
        reply: Option<&'a [u8]>,
        payload: &'a [u8],
    },
    Hpub {
        subject: &'a [u8],
        reply: Option<&'a [u8]>,
        /// The whole header block, `NATS/1.0` line and final empty line included.
        headers: &'a [u8],
        payload: &'a [u8],
    },
    Sub {
        subject: &'a [u8],
        queue: Option<&'a [u8]>,
        sid: &'a [u8],
    },
    Unsub {
        sid: &'a [u8],
        /// `None` when absent, zero or not a number: nats-server then removes the
        /// subscription at once, exactly as for a plain `UNSUB sid`.
        max_msgs: Option<u64>,
    },
    Msg {
        subject: &'a [u8],
        sid: &'a [u8],
        reply: Option<&'a [u8]>,
        payload: &'a [u8],
    },
    Hmsg {
        subject: &'a [u8],
        sid: &'a [u8],
        reply: Option<&'a [u8]>,
        /// The whole header block, `NATS/1.0` line and final empty line included.
        headers: &'a [u8],
        payload: &'a [u8],
    },
    Ping,
    Pong,
    Ok,
    /// Text of `-ERR '...'` without the quotes.
    Err(&'a [u8]),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// An operation and the number of input bytes it used (always > 0).
    Complete(Op<'a>, usize),
    /// More input is needed; `needed` is a lower bound of the total input length (counted
    /// from the start of the buffer given to `parse`), known once a control line is read.
    Partial { needed: Option<usize> },
}

/// What exactly was wrong with an operation's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformed {
    /// Too few or too many fields for the operation.
    ArgumentCount,
    /// A size field that is not 1 to 9 decimal digits (negative, overflowing, empty).
    Size,
    /// A header size that is not 1 to 9 decimal digits.
    HeaderSize,
    /// Header size larger than the total size.
    HeaderSizeExceedsTotal,
    /// A MSG/HMSG sid that is not a decimal number (nats.go rejects these).
    Sid,
    /// A carriage return inside a client's control line (only the one before LF is
    /// allowed). A server's MSG/HMSG may carry one in a field: see [`Role::Client`].
    StrayCarriageReturn,
}

/// A protocol violation. `Display` gives nats-server's own wording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    MaxControlLineExceeded,
    MaxPayloadViolation,
    /// An unknown operation name, an operation the role does not accept, or a payload not
    /// followed by CRLF (nats-server reports all of these the same way).
    UnknownOperation,
    /// Malformed arguments, a bad size, ...
    Parser(Malformed),
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            // nats-server 2.15 sends this one in lower case.
            ParseError::MaxControlLineExceeded => "maximum control line exceeded",
            ParseError::MaxPayloadViolation => "Maximum Payload Violation",
            ParseError::UnknownOperation => "Unknown Protocol Operation",
            ParseError::Parser(_) => "Parser Error",
        })
    }
}

impl std::error::Error for ParseError {}

#[derive(Debug, Clone)]
pub struct Parser {
    pub role: Role,
    /// Longest accepted argument part of a control line (after the operation name).
    pub max_control_line: usize,
    /// Largest accepted payload (for HPUB/HMSG: headers plus payload).
    pub max_payload: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Info,
    Connect,
    Pub,
    Hpub,
    Sub,
    Unsub,
    Msg,
    Hmsg,
    Ping,
    Pong,
    Ok,
    Err,
}

type Res<'a> = Result<Parsed<'a>, ParseError>;

const PARTIAL: Parsed<'static> = Parsed::Partial { needed: None };

impl Parser {
    pub fn new(role: Role) -> Self {
        Parser {
            role,
            max_control_line: DEFAULT_MAX_CONTROL_LINE,
            max_payload: DEFAULT_MAX_PAYLOAD,
        }
    }

    /// Parses one operation from the start of `buf`.
    #[inline]
    pub fn parse<'a>(&self, buf: &'a [u8]) -> Res<'a> {
        // The busiest operation of each role, told from four bytes at once: three letters
        // in either case and a blank.
        if let Some(&[a, b, c, blank]) = buf.get(..4)
            && is_ws(blank)
        {
            match ([a | 0x20, b | 0x20, c | 0x20], self.role) {
                (ref n, Role::Client) if n == b"msg" => return self.msg::<false>(buf, 3),
                (ref n, Role::Server) if n == b"pub" => return self.publish::<false>(buf, 3),
                _ => {}
            }
        }
        let (kind, name) = match self.identify(buf)? {
            Some(k) => k,
            None => return Ok(PARTIAL),
        };
        // Match the whole name case-insensitively; only the bytes we have.
        let have = buf.len().min(name.len());
        for (b, n) in buf[..have].iter().zip(name) {
            if !name_byte_eq(*b, *n) {
                return Err(ParseError::UnknownOperation);
            }
        }
        if buf.len() <= name.len() {
            return Ok(PARTIAL);
        }
        let after = name.len();
        match kind {
            Kind::Ping | Kind::Pong | Kind::Ok => self.bare(buf, after, kind),
            Kind::Connect => self.json_line(buf, after, Op::Connect),
            Kind::Info if self.role == Role::Server => self.json_line(buf, after, Op::Info),
            _ => {
                // nats-server and nats.go require a space or tab right after these names.
                if !is_ws(buf[after]) {
                    return Err(ParseError::UnknownOperation);
                }
                match kind {
                    Kind::Info => self.json_line(buf, after, Op::Info),
                    Kind::Err => {
                        let Some((s, e, used)) = self.control_line(buf, after)? else {
                            return Ok(PARTIAL);
                        };
                        Ok(Parsed::Complete(Op::Err(strip_quotes(&buf[s..e])), used))
                    }
                    Kind::Msg => self.msg::<false>(buf, after),
                    Kind::Hmsg => self.msg::<true>(buf, after),
                    Kind::Pub => self.publish::<false>(buf, after),
                    Kind::Hpub => self.publish::<true>(buf, after),
                    Kind::Sub => self.sub(buf, after),
                    _ => self.unsub(buf, after),
                }
            }
        }
    }

    /// Picks the operation from its first one or two bytes (the rest of the name is
    /// checked by the caller). `None`: not enough bytes to tell.
    #[inline]
    fn identify(&self, buf: &[u8]) -> Result<Option<(Kind, &'static [u8])>, ParseError> {
        let Some(&first) = buf.first() else {
            return Ok(None);
        };
        let client = self.role == Role::Client;
        let k = match first {
            b'M' | b'm' if client => (Kind::Msg, &b"msg"[..]),
            b'H' | b'h' if client => (Kind::Hmsg, &b"hmsg"[..]),
            b'H' | b'h' => (Kind::Hpub, &b"hpub"[..]),
            b'I' | b'i' => (Kind::Info, &b"info"[..]),
            b'C' | b'c' if !client => (Kind::Connect, &b"connect"[..]),
            b'S' | b's' if !client => (Kind::Sub, &b"sub"[..]),
            b'U' | b'u' if !client => (Kind::Unsub, &b"unsub"[..]),
            b'+' => (Kind::Ok, &b"+ok"[..]),
            b'-' => (Kind::Err, &b"-err"[..]),
            b'P' | b'p' => {
                let Some(&second) = buf.get(1) else {
                    return Ok(None);
                };
                match second {
                    b'U' | b'u' if !client => (Kind::Pub, &b"pub"[..]),
                    b'I' | b'i' => (Kind::Ping, &b"ping"[..]),
                    b'O' | b'o' => (Kind::Pong, &b"pong"[..]),
                    _ => return Err(ParseError::UnknownOperation),
                }
            }
            _ => return Err(ParseError::UnknownOperation),
        };
        Ok(Some(k))
    }

    /// PING, PONG, +OK: like nats-server, anything up to the LF is ignored.
    fn bare<'a>(&self, buf: &'a [u8], after: usize, kind: Kind) -> Res<'a> {
        // nats-server never bounds this skip; we do, by the control line limit.
        let end = buf.len().min(
            after
                .saturating_add(self.max_control_line)
                .saturating_add(2),
        );
        match memchr(b'\n', &buf[after..end]) {
            Some(p) => {
                let op = match kind {
                    Kind::Ping => Op::Ping,
                    Kind::Pong => Op::Pong,
                    _ => Op::Ok,
                };
                Ok(Parsed::Complete(op, after + p + 1))
            }
            None if end - after >= self.max_control_line.saturating_add(2) => {
                Err(ParseError::MaxControlLineExceeded)
            }
            None => Ok(PARTIAL),
        }
    }

    fn json_line<'a>(&self, buf: &'a [u8], after: usize, make: fn(&'a [u8]) -> Op<'a>) -> Res<'a> {
        match self.control_line(buf, after)? {
            Some((s, e, used)) => Ok(Parsed::Complete(make(&buf[s..e]), used)),
            None => Ok(PARTIAL),
        }
    }

    /// Finds the argument part of a control line starting at `from` (leading spaces/tabs
    /// skipped, trailing CR dropped). Returns `(arg_start, arg_end, used)` where `used`
    /// counts through the LF, or `None` when the LF has not arrived yet.
    #[inline]
    fn control_line(
        &self,
        buf: &[u8],
        from: usize,
    ) -> Result<Option<(usize, usize, usize)>, ParseError> {
        let mcl = self.max_control_line;
        let mut start = from;
        while start < buf.len() && is_ws(buf[start]) {
            start += 1;
        }
        // nats-server lets the run of separators grow without bound; we do not.
        if start - from > mcl {
            return Err(ParseError::MaxControlLineExceeded);
        }
        if start == buf.len() {
            return Ok(None);
        }
        let window_end = buf.len().min(start.saturating_add(mcl).saturating_add(2));
        match memchr(b'\n', &buf[start..window_end]) {
            Some(p) => {
                let lf = start + p;
                let end = if lf > start && buf[lf - 1] == b'\r' {
                    lf - 1
                } else {
                    lf
                };
                if end - start > mcl {
                    return Err(ParseError::MaxControlLineExceeded);
                }
                Ok(Some((start, end, lf + 1)))
            }
            None => {
                // As nats-server at the end of a read: the argument so far, less a
                // trailing CR, must already fit.
                let mut so_far = window_end - start;
                if buf[window_end - 1] == b'\r' {
                    so_far -= 1;
                }
                if so_far > mcl {
                    Err(ParseError::MaxControlLineExceeded)
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// Splits the control line from `after` into `out`: the field count and the bytes
    /// used through the LF, or `None` when the LF has not arrived yet.
    #[inline(always)]
    fn fields<'a, W: scan::Window>(
        &self,
        buf: &'a [u8],
        after: usize,
        out: &mut [&'a [u8]],
    ) -> Result<Option<(usize, usize)>, ParseError> {
        if let Some(fast) = self.fast_fields::<W>(buf, after, out) {
            return Ok(Some(fast));
        }
        let Some((s, e, used)) = self.control_line(buf, after)? else {
            return Ok(None);
        };
        // Only a server's MSG/HMSG come here in the client role.
        let cr_is_data = self.role == Role::Client;
        Ok(Some((split_fields(&buf[s..e], out, cr_is_data)?, used)))
    }

    /// Control line and fields in one pass, for the common case only: the line ends
    /// within the window `W` (64 or 128 bytes) and the limit, fields are separated by spaces, no stray
    /// CR, at most `out.len()` fields. `None` sends the caller to the general path
    /// (`control_line` + `split_fields`), which gives the same answer for everything this
    /// accepts and handles the rest.
    ///
    /// A chunk of bytes per step (16 with SSE2, else 8) into bitmasks of spaces and
    /// line-end candidates, then fields from the edges of the space mask: no branch
    /// depends on where the fields are, so varying subject lengths cost no mispredictions.
    #[inline(always)]
    fn fast_fields<'a, W: scan::Window>(
        &self,
        buf: &'a [u8],
        from: usize,
        out: &mut [&'a [u8]],
    ) -> Option<(usize, usize)> {
        // Blanks plus arguments shorter than the limit: both limits hold.
        let limit = buf.len().min(from.saturating_add(self.max_control_line));
        let line = buf.get(from..limit)?;
        let mut spaces = W::ZERO;
        // Bytes below b' ': CR, LF, and tabs or control bytes, which go the general way.
        let mut stops = W::ZERO;
        let mut base = 0;
        while stops == W::ZERO && base < W::BYTES && base < line.len() {
            let (space, stop) = scan::chunk(line, base);
            spaces = spaces | W::from_chunk(space) << base;
            stops = stops | W::from_chunk(stop) << base;
            base += scan::CHUNK;
        }
        if stops == W::ZERO {
            return None;
        }
        let t = stops.lowest();
        let used = match (line.get(t), line.get(t + 1)) {
            (Some(b'\n'), _) => t + 1,
            (Some(b'\r'), Some(b'\n')) => t + 2,
            _ => return None,
        };
        let text = !spaces & W::below(t);
        let mut starts = text & !(text << 1);
        let mut ends = !text & (text << 1);
        let mut n = 0;
        for field in out.iter_mut() {
            let (s, e) = (starts.lowest(), ends.lowest());
            n += usize::from(starts != W::ZERO);
            starts = starts.clear_lowest();
            ends = ends.clear_lowest();
            *field = line.get(s..e).unwrap_or(&[]);
        }
        // More fields than `out` holds: the general path reports it.
        if starts != W::ZERO {
            return None;
        }
        Some((n, from + used))
    }

    /// Checks the payload that follows a control line ending at `start`.
    #[inline]
    fn payload<'a>(
        &self,
        buf: &'a [u8],
        start: usize,
        size: usize,
    ) -> Result<Option<(&'a [u8], usize)>, ParseError> {
        let end = start + size;
        let total = end + 2;
        // nats-server fails as soon as the byte after the payload is wrong; waiting for
        // the CRLF keeps `needed` exact: before that length, nothing but Partial.
        let (Some(payload), Some(crlf)) = (buf.get(start..end), buf.get(end..total)) else {
            return Ok(None);
        };
        if crlf != b"\r\n" {
            return Err(ParseError::UnknownOperation);
        }
        Ok(Some((payload, total)))
    }

    #[inline(always)]
    fn msg<'a, const HEADERS: bool>(&self, buf: &'a [u8], after: usize) -> Res<'a> {
        let mut f: [&[u8]; 5] = [&[]; 5];
        // JetStream deliveries (HMSG) carry long $JS.ACK reply subjects.
        let fields = if HEADERS {
            self.fields::<u128>(buf, after, &mut f)
        } else {
            self.fields::<u64>(buf, after, &mut f[..4])
        };
        let Some((n, used)) = fields? else {
            return Ok(PARTIAL);
        };
        let (subject, sid, reply, hdr, size) = match (HEADERS, n) {
            (false, 3) => (f[0], f[1], None, None, f[2]),
            (false, 4) => (f[0], f[1], Some(f[2]), None, f[3]),
            (true, 4) => (f[0], f[1], None, Some(f[2]), f[3]),
            (true, 5) => (f[0], f[1], Some(f[2]), Some(f[3]), f[4]),
            _ => return Err(ParseError::Parser(Malformed::ArgumentCount)),
        };
        if !sid.iter().all(u8::is_ascii_digit) {
            return Err(ParseError::Parser(Malformed::Sid));
        }
        let (hdr, size) = self.sizes(hdr, size)?;
        let Some((data, total)) = self.payload(buf, used, size)? else {
            return Ok(Parsed::Partial {
                needed: Some(used + size + 2),
            });
        };
        let op = match hdr {
            None => Op::Msg {
                subject,
                sid,
                reply,
                payload: data,
            },
            Some(h) => {
                let (headers, payload) = data.split_at(h);
                Op::Hmsg {
                    subject,
                    sid,
                    reply,
                    headers,
                    payload,
                }
            }
        };
        Ok(Parsed::Complete(op, total))
    }

    #[inline]
    fn publish<'a, const HEADERS: bool>(&self, buf: &'a [u8], after: usize) -> Res<'a> {
        let mut f: [&[u8]; 4] = [&[]; 4];
        let most = if HEADERS { 4 } else { 3 };
        let Some((n, used)) = self.fields::<u64>(buf, after, &mut f[..most])? else {
            return Ok(PARTIAL);
        };
        let (subject, reply, hdr, size) = match (HEADERS, n) {
            (false, 2) => (f[0], None, None, f[1]),
            (false, 3) => (f[0], Some(f[1]), None, f[2]),
            (true, 3) => (f[0], None, Some(f[1]), f[2]),
            (true, 4) => (f[0], Some(f[1]), Some(f[2]), f[3]),
            _ => return Err(ParseError::Parser(Malformed::ArgumentCount)),
        };
        let (hdr, size) = self.sizes(hdr, size)?;
        let Some((data, total)) = self.payload(buf, used, size)? else {
            return Ok(Parsed::Partial {
                needed: Some(used + size + 2),
            });
        };
        let op = match hdr {
            None => Op::Pub {
                subject,
                reply,
                payload: data,
            },
            Some(h) => {
                let (headers, payload) = data.split_at(h);
                Op::Hpub {
                    subject,
                    reply,
                    headers,
                    payload,
                }
            }
        };
        Ok(Parsed::Complete(op, total))
    }

    /// Validates sizes in nats-server's order: header size, total size, header <= total,
    /// then the payload limit.
    #[inline]
    fn sizes(&self, hdr: Option<&[u8]>, size: &[u8]) -> Result<(Option<usize>, usize), ParseError> {
        let hdr = match hdr {
            Some(h) => Some(parse_size(h).ok_or(ParseError::Parser(Malformed::HeaderSize))?),
            None => None,
        };
        let size = parse_size(size).ok_or(ParseError::Parser(Malformed::Size))?;
        if let Some(h) = hdr
            && h > size
        {
            return Err(ParseError::Parser(Malformed::HeaderSizeExceedsTotal));
        }
        if size > self.max_payload {
            return Err(ParseError::MaxPayloadViolation);
        }
        Ok((hdr, size))
    }

    fn sub<'a>(&self, buf: &'a [u8], after: usize) -> Res<'a> {
        let Some((s, e, used)) = self.control_line(buf, after)? else {
            return Ok(PARTIAL);
        };
        let mut f: [&[u8]; 3] = [&[]; 3];
        let op = match split_fields(&buf[s..e], &mut f, false)? {
            2 => Op::Sub {
                subject: f[0],
                queue: None,
                sid: f[1],
            },
            3 => Op::Sub {
                subject: f[0],
                queue: Some(f[1]),
                sid: f[2],
            },
            _ => return Err(ParseError::Parser(Malformed::ArgumentCount)),
        };
        Ok(Parsed::Complete(op, used))
    }

    fn unsub<'a>(&self, buf: &'a [u8], after: usize) -> Res<'a> {
        let Some((s, e, used)) = self.control_line(buf, after)? else {
            return Ok(PARTIAL);
        };
        let mut f: [&[u8]; 2] = [&[]; 2];
        let op = match split_fields(&buf[s..e], &mut f, false)? {
            1 => Op::Unsub {
                sid: f[0],
                max_msgs: None,
            },
            2 => Op::Unsub {
                sid: f[0],
                max_msgs: parse_size(f[1]).filter(|&m| m > 0).map(|m| m as u64),
            },
            _ => return Err(ParseError::Parser(Malformed::ArgumentCount)),
        };
        Ok(Parsed::Complete(op, used))
    }
}

impl Default for Parser {
    fn default() -> Self {
        Parser::new(Role::Client)
    }
}

#[inline]
fn is_ws(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// Byte classes of a chunk of a control line as bitmasks (bit k for byte `at + k`):
/// spaces, and bytes below b' ' (CR, LF, tab, control bytes). Past the end of the line
/// nothing is flagged.
mod scan {
    use std::ops::{BitAnd, BitOr, Not, Shl};

    /// A bitmask over the first `BYTES` bytes of a control line: u64 for short lines,
    /// u128 for lines with long reply subjects.
    pub trait Window:
        Copy
        + PartialEq
        + BitAnd<Output = Self>
        + BitOr<Output = Self>
        + Not<Output = Self>
        + Shl<usize, Output = Self>
    {
        const ZERO: Self;
        const BYTES: usize;
        fn from_chunk(bits: u64) -> Self;
        /// Bits below `n` (`n` < `BYTES`).
        fn below(n: usize) -> Self;
        /// Index of the lowest set bit, `BYTES` when none.
        fn lowest(self) -> usize;
        fn clear_lowest(self) -> Self;
    }

    macro_rules! window {
        ($t:ty) => {
            impl Window for $t {
                const ZERO: Self = 0;
                const BYTES: usize = <$t>::BITS as usize;
                #[inline(always)]
                fn from_chunk(bits: u64) -> Self {
                    Self::from(bits)
                }
                #[inline(always)]
                fn below(n: usize) -> Self {
                    (1 << n) - 1
                }
                #[inline(always)]
                fn lowest(self) -> usize {
                    self.trailing_zeros() as usize
                }
                #[inline(always)]
                fn clear_lowest(self) -> Self {
                    self & self.wrapping_sub(1)
                }
            }
        };
    }
    window!(u64);
    window!(u128);

    /// Loads `N` bytes of `line` from `at`, padded past its end with a byte never flagged.
    #[inline(always)]
    fn load<const N: usize>(line: &[u8], at: usize) -> [u8; N] {
        if let Some(Ok(w)) = line.get(at..at + N).map(<[u8; N]>::try_from) {
            return w;
        }
        let mut w = [b'A'; N];
        let rest = line.get(at..).unwrap_or(&[]);
        let n = rest.len().min(N);
        w[..n].copy_from_slice(&rest[..n]);
        w
    }

    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    pub const CHUNK: usize = 16;

    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    #[inline(always)]
    pub fn chunk(line: &[u8], at: usize) -> (u64, u64) {
        use std::arch::x86_64::*;
        let b: [u8; 16] = load(line, at);
        let (lo, hi) = b.split_at(8);
        let word = |h: &[u8]| i64::from_le_bytes(h.try_into().unwrap_or([0; 8]));
        // SAFETY: these intrinsics only need SSE2, which this build enables (cfg above);
        // none of them touches memory.
        let (space, low) = unsafe {
            let v = _mm_set_epi64x(word(hi), word(lo));
            let space = _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b' ' as i8)));
            // Unsigned v <= 0x1f: min(v, 0x1f) == v.
            let low = _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(0x1f)), v);
            (space, _mm_movemask_epi8(low))
        };
        (u64::from(space as u16), u64::from(low as u16))
    }

    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    pub const CHUNK: usize = 8;

    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    pub use swar as chunk;

    /// The portable version, eight bytes per step; on x86_64 only its test uses it.
    #[cfg(any(test, not(all(target_arch = "x86_64", target_feature = "sse2"))))]
    #[inline(always)]
    pub fn swar(line: &[u8], at: usize) -> (u64, u64) {
        const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
        const HIGH: u64 = 0x8080_8080_8080_8080;
        let word = u64::from_le_bytes(load(line, at));
        // Exact per byte (no carries between bytes): (b & 0x7f) + 0x60 sets the high bit
        // when (b & 0x7f) >= 0x20; an XOR with spaces turns spaces into zero bytes.
        let low = !(((word & LOW7) + 0x6060_6060_6060_6060) | word) & HIGH;
        let x = word ^ 0x2020_2020_2020_2020;
        let space = !(((x & LOW7) + LOW7) | x) & HIGH;
        // The high bits, one per byte, gathered into the low eight bits.
        let bits = |m: u64| (m >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56;
        (bits(space), bits(low))
    }
}

/// `name` is lower case; letters compare case-insensitively, '+' and '-' exactly.
#[inline]
fn name_byte_eq(b: u8, name: u8) -> bool {
    if name.is_ascii_lowercase() {
        b | 0x20 == name
    } else {
        b == name
    }
}

/// Splits on runs of spaces/tabs into `out`; returns the count, or an error when there
/// are more fields than `out` holds or, unless `cr_is_data`, a CR appears.
#[inline]
fn split_fields<'a>(
    arg: &'a [u8],
    out: &mut [&'a [u8]],
    cr_is_data: bool,
) -> Result<usize, ParseError> {
    let mut n = 0;
    let mut i = 0;
    let len = arg.len();
    while i < len {
        while i < len && is_ws(arg[i]) {
            i += 1;
        }
        if i == len {
            break;
        }
        let start = i;
        while i < len && !is_ws(arg[i]) {
            if arg[i] == b'\r' && !cr_is_data {
                return Err(ParseError::Parser(Malformed::StrayCarriageReturn));
            }
            i += 1;
        }
        let Some(slot) = out.get_mut(n) else {
            return Err(ParseError::Parser(Malformed::ArgumentCount));
        };
        *slot = &arg[start..i];
        n += 1;
    }
    Ok(n)
}

/// nats-server's `parseSize`: 1 to 9 ASCII digits, nothing else.
#[inline]
fn parse_size(d: &[u8]) -> Option<usize> {
    if d.is_empty() || d.len() > MAX_SIZE_DIGITS {
        return None;
    }
    let mut n = 0usize;
    for &c in d {
        if !c.is_ascii_digit() {
            return None;
        }
        n = n * 10 + (c - b'0') as usize;
    }
    Some(n)
}

/// nats.go's `normalizeErr`: trim whitespace, then quotes.
fn strip_quotes(s: &[u8]) -> &[u8] {
    let s = s.trim_ascii();
    let s = match s.iter().position(|&b| b != b'\'') {
        Some(p) => &s[p..],
        None => &[],
    };
    match s.iter().rposition(|&b| b != b'\'') {
        Some(p) => &s[..=p],
        None => &[],
    }
}

#[cfg(test)]
mod tests;
