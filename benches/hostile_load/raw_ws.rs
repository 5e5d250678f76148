//! Just enough client-side WebSocket to misbehave: sockets bound to a chosen source
//! address with a connect timeout, the upgrade request, masked frames built into shared
//! buffers, and an incremental reader of the server's frames that never holds more than
//! a short prefix of a payload. Every function returns errors instead of panicking: the
//! broker closing an attacker is an expected outcome, not a failure of the bench.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::FromRawFd;
use std::time::Duration;

pub const TEXT: u8 = 0x1;
pub const CLOSE: u8 = 0x8;
pub const PING: u8 = 0x9;
pub const PONG: u8 = 0xA;

/// Socket options of an attacking connection.
#[derive(Clone, Copy, Default)]
pub struct SocketOptions {
    /// A tiny receive buffer, so whatever the broker sends piles up on its side.
    pub small_receive_buffer: bool,
    /// Close with a reset (SO_LINGER 0) instead of a FIN.
    pub reset_on_close: bool,
}

fn os_error<T>(ret: libc::c_int, ok: T) -> io::Result<T> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ok)
    }
}

fn set_int_option(fd: libc::c_int, level: libc::c_int, name: libc::c_int, value: libc::c_int) {
    // SAFETY: setsockopt on a socket this module owns, with a pointer to a live c_int.
    unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// A blocking TCP connection from `source` (any free port) to `target`, given up after
/// `timeout`: a broker whose loop is frozen stops accepting, and a plain `connect` would
/// then hang for the kernel's SYN retries.
pub fn connect_from(
    source: Ipv4Addr,
    target: SocketAddr,
    timeout: Duration,
    options: SocketOptions,
) -> io::Result<TcpStream> {
    let SocketAddr::V4(target) = target else {
        return Err(io::Error::other("IPv4 targets only"));
    };
    // SAFETY: a fresh socket; the descriptor is closed by the TcpStream below, or here
    // on every error path.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    let fd = os_error(fd, fd)?;
    // SAFETY: fd is a socket this function just created and owns.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    // Ports are chosen at connect time against the full 4-tuple, so churn does not run
    // out of ports bound to the source address alone.
    set_int_option(fd, libc::IPPROTO_IP, libc::IP_BIND_ADDRESS_NO_PORT, 1);
    if options.small_receive_buffer {
        set_int_option(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, 4096);
    }
    if options.reset_on_close {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt with a pointer to a live struct of the size given.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            );
        }
    }
    let local = sockaddr(SocketAddrV4::new(source, 0));
    let remote = sockaddr(target);
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: bind/connect with pointers to live sockaddr_in values of the length given.
    os_error(
        unsafe { libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) },
        (),
    )?;
    stream.set_nonblocking(true)?;
    // SAFETY: as above.
    let ret = unsafe { libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) };
    if ret < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(err);
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: poll on one live pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        os_error(ready, ())?;
        if ready == 0 {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"));
        }
        if let Some(err) = stream.take_error()? {
            return Err(err);
        }
    }
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Sends the upgrade request for `/amp` with subprotocol `amp.v1` and reads the response
/// head; anything but 101 is an error. Bytes after the head (the challenge, usually) are
/// returned so the frame reader can start with them.
pub fn upgrade(stream: &mut TcpStream, host: SocketAddr) -> io::Result<Vec<u8>> {
    let request = format!(
        "GET /amp HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Protocol: amp.v1\r\n\r\n"
    );
    stream.write_all(request.as_bytes())?;
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            if !head.starts_with(b"HTTP/1.1 101") {
                return Err(io::Error::other("upgrade refused"));
            }
            return Ok(head.split_off(end + 4));
        }
        if head.len() > 8192 {
            return Err(io::Error::other("response head too long"));
        }
    }
}

/// Appends the header of a client frame with mask key 0 (a valid key that leaves the
/// payload as it is, so one buffer serves every connection).
pub fn header(opcode: u8, fin: bool, len: usize, out: &mut Vec<u8>) {
    out.push(if fin { 0x80 } else { 0 } | opcode);
    if len < 126 {
        out.push(0x80 | len as u8);
    } else if len <= u16::MAX as usize {
        out.push(0x80 | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    out.extend_from_slice(&[0; 4]);
}

/// Appends a whole client frame.
pub fn frame(opcode: u8, fin: bool, payload: &[u8], out: &mut Vec<u8>) {
    header(opcode, fin, payload.len(), out);
    out.extend_from_slice(payload);
}

/// A buffer of `count` copies of one text frame.
pub fn repeated_text(text: &str, count: usize) -> Vec<u8> {
    let mut one = Vec::new();
    frame(TEXT, true, text.as_bytes(), &mut one);
    one.repeat(count)
}

/// A server frame as the attackers see it: its opcode and the first bytes of its payload.
pub struct ServerFrame {
    pub opcode: u8,
    pub head: Vec<u8>,
}

impl ServerFrame {
    pub fn text_starts_with(&self, prefix: &str) -> bool {
        self.opcode == TEXT && self.head.starts_with(prefix.as_bytes())
    }
}

/// Incremental parser of server frames (unmasked). Keeps at most `KEEP` payload bytes of
/// a frame, whatever its length, so a reader's memory is fixed.
#[derive(Default)]
pub struct FrameReader {
    header: Vec<u8>,
    opcode: u8,
    remaining: u64,
    head: Vec<u8>,
    in_payload: bool,
}

const KEEP: usize = 256;

impl FrameReader {
    /// Feeds bytes; calls `each` for every frame completed by them.
    pub fn feed(&mut self, mut bytes: &[u8], mut each: impl FnMut(ServerFrame)) {
        while !bytes.is_empty() {
            if !self.in_payload {
                let need = self.header_len().saturating_sub(self.header.len());
                let take = need.min(bytes.len());
                self.header.extend_from_slice(&bytes[..take]);
                bytes = &bytes[take..];
                if self.header.len() < self.header_len() {
                    continue;
                }
                self.opcode = self.header[0] & 0x0F;
                self.remaining = match self.header[1] & 0x7F {
                    126 => u16::from_be_bytes([self.header[2], self.header[3]]) as u64,
                    127 => {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(&self.header[2..10]);
                        u64::from_be_bytes(b)
                    }
                    n => n as u64,
                };
                self.header.clear();
                self.head.clear();
                self.in_payload = true;
            }
            let take = (self.remaining.min(bytes.len() as u64)) as usize;
            let keep = take.min(KEEP.saturating_sub(self.head.len()));
            self.head.extend_from_slice(&bytes[..keep]);
            bytes = &bytes[take..];
            self.remaining -= take as u64;
            if self.remaining == 0 {
                self.in_payload = false;
                each(ServerFrame {
                    opcode: self.opcode,
                    head: std::mem::take(&mut self.head),
                });
            }
        }
    }

    /// Length of the current header once its first two bytes are known.
    fn header_len(&self) -> usize {
        match self.header.get(1).map(|b| b & 0x7F) {
            None => 2,
            Some(126) => 4,
            Some(127) => 10,
            Some(_) => 2,
        }
    }
}

pub fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
