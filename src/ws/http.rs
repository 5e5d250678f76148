//! The small HTTP/1.1 surface: request heads parsed with `httparse` under a header-count
//! and size bound, routing, the WebSocket upgrade check (RFC 6455 section 4.2) and plain
//! responses. Nothing here does IO.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use sha1::{Digest, Sha1};

/// The only subprotocol the broker speaks.
pub const SUBPROTOCOL: &str = "amp.v1";

/// RFC 6455 section 1.3: the GUID appended to the client's key.
const WS_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// Most headers a request head may carry; one more answers 431.
pub const MAX_HEADERS: usize = 32;

/// What a complete request head asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// `/healthz` and `/readyz`: NATS up, JetStream answering, no stream found gone.
    Health,
    /// `/livez`: the event loop turns on time, whatever NATS does.
    Live,
    Metrics,
    Schema,
    /// A valid WebSocket upgrade on `/amp`.
    Upgrade(Upgrade),
    /// A response decided by the head alone (404, 400, 426).
    Reject(Status, &'static str),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upgrade {
    /// `Sec-WebSocket-Accept` value for the response.
    pub accept: String,
    /// `Some(SUBPROTOCOL)` when the client offered it.
    pub subprotocol: Option<&'static str>,
    /// The `Origin` header (browsers send it; other clients usually do not).
    pub origin: Option<String>,
    /// The `Host` header, for the same-host origin check.
    pub host: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    BadRequest,
    Forbidden,
    NotFound,
    UpgradeRequired,
    HeadersTooLarge,
    Unavailable,
}

impl Status {
    pub const fn code(self) -> u16 {
        match self {
            Status::Ok => 200,
            Status::BadRequest => 400,
            Status::Forbidden => 403,
            Status::NotFound => 404,
            Status::UpgradeRequired => 426,
            Status::HeadersTooLarge => 431,
            Status::Unavailable => 503,
        }
    }

    const fn reason(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::BadRequest => "Bad Request",
            Status::Forbidden => "Forbidden",
            Status::NotFound => "Not Found",
            Status::UpgradeRequired => "Upgrade Required",
            Status::HeadersTooLarge => "Request Header Fields Too Large",
            Status::Unavailable => "Service Unavailable",
        }
    }
}

/// Outcome of parsing the bytes received so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// The head is not complete yet.
    Partial,
    /// The head is complete and `len` bytes long; what follows it belongs to the next layer.
    Complete { request: Request, len: usize },
    /// The head cannot be served; answer this status, then close.
    Error(Status),
}

/// Parses a request head from `buf`, which holds at most `max_bytes` (the caller stops
/// buffering there, so a head still partial at the bound is too large).
pub fn parse_request(buf: &[u8], max_bytes: usize) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => Parsed::Complete {
            request: route(&req),
            len,
        },
        Ok(httparse::Status::Partial) if buf.len() >= max_bytes => {
            Parsed::Error(Status::HeadersTooLarge)
        }
        Ok(httparse::Status::Partial) => Parsed::Partial,
        Err(httparse::Error::TooManyHeaders) => Parsed::Error(Status::HeadersTooLarge),
        Err(_) => Parsed::Error(Status::BadRequest),
    }
}

fn route(req: &httparse::Request<'_, '_>) -> Request {
    let path = req.path.unwrap_or("");
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    if req.method != Some("GET") {
        return Request::Reject(Status::NotFound, "not found\n");
    }
    match path {
        "/healthz" | "/readyz" => Request::Health,
        "/livez" => Request::Live,
        "/metrics" => Request::Metrics,
        "/amp/schema" => Request::Schema,
        "/amp" => upgrade(req),
        _ => Request::Reject(Status::NotFound, "not found\n"),
    }
}

fn upgrade(req: &httparse::Request<'_, '_>) -> Request {
    if req.version != Some(1) {
        return Request::Reject(Status::BadRequest, "WebSocket needs HTTP/1.1\n");
    }
    let mut upgrade_websocket = false;
    let mut connection_upgrade = false;
    let mut version: Option<&[u8]> = None;
    let mut key: Option<&[u8]> = None;
    let mut offered_any = false;
    let mut offered_amp = false;
    let mut origin: Option<&[u8]> = None;
    let mut host: Option<&[u8]> = None;
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("origin") {
            if origin.is_some() {
                return Request::Reject(Status::BadRequest, "repeated Origin\n");
            }
            origin = Some(h.value);
        } else if name.eq_ignore_ascii_case("host") {
            host = Some(h.value);
        } else if name.eq_ignore_ascii_case("upgrade") {
            upgrade_websocket |= has_token(h.value, "websocket");
        } else if name.eq_ignore_ascii_case("connection") {
            connection_upgrade |= has_token(h.value, "upgrade");
        } else if name.eq_ignore_ascii_case("sec-websocket-version") {
            if version.is_some() {
                return Request::Reject(Status::BadRequest, "repeated Sec-WebSocket-Version\n");
            }
            version = Some(h.value);
        } else if name.eq_ignore_ascii_case("sec-websocket-key") {
            if key.is_some() {
                return Request::Reject(Status::BadRequest, "repeated Sec-WebSocket-Key\n");
            }
            key = Some(h.value);
        } else if name.eq_ignore_ascii_case("sec-websocket-protocol") {
            for token in tokens(h.value) {
                offered_any = true;
                offered_amp |= token == SUBPROTOCOL.as_bytes();
            }
        }
    }
    if !upgrade_websocket || !connection_upgrade {
        return Request::Reject(Status::BadRequest, "expected a WebSocket upgrade\n");
    }
    if version.map(trim) != Some(b"13".as_slice()) {
        return Request::Reject(
            Status::UpgradeRequired,
            "Sec-WebSocket-Version must be 13\n",
        );
    }
    let Some(key) = key.map(trim) else {
        return Request::Reject(Status::BadRequest, "missing Sec-WebSocket-Key\n");
    };
    match STANDARD.decode(key) {
        Ok(raw) if raw.len() == 16 => {}
        _ => return Request::Reject(Status::BadRequest, "invalid Sec-WebSocket-Key\n"),
    }
    if offered_any && !offered_amp {
        return Request::Reject(Status::BadRequest, "subprotocol amp.v1 required\n");
    }
    Request::Upgrade(Upgrade {
        accept: accept_key(key),
        subprotocol: offered_amp.then_some(SUBPROTOCOL),
        origin: origin.map(|o| String::from_utf8_lossy(trim(o)).into_owned()),
        host: host.map(|h| String::from_utf8_lossy(trim(h)).into_owned()),
    })
}

/// `Sec-WebSocket-Accept` for a client key: base64(SHA-1(key + GUID)).
pub fn accept_key(key: &[u8]) -> String {
    let mut sha = Sha1::new();
    sha.update(key);
    sha.update(WS_GUID.as_bytes());
    STANDARD.encode(sha.finalize())
}

/// The comma-separated tokens of a header value, trimmed, empty ones skipped.
fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(trim)
        .filter(|t| !t.is_empty())
}

fn has_token(value: &[u8], token: &str) -> bool {
    tokens(value).any(|t| t.eq_ignore_ascii_case(token.as_bytes()))
}

fn trim(v: &[u8]) -> &[u8] {
    v.trim_ascii()
}

/// A complete response that closes the connection after it.
pub fn response(out: &mut Vec<u8>, status: Status, content_type: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n{}Connection: close\r\n\r\n",
        status.code(),
        status.reason(),
        content_type,
        body.len(),
        if status == Status::UpgradeRequired {
            "Sec-WebSocket-Version: 13\r\n"
        } else {
            ""
        },
    );
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(body);
}

/// The `101 Switching Protocols` response of an accepted upgrade.
pub fn switching_protocols(out: &mut Vec<u8>, upgrade: &Upgrade) {
    out.extend_from_slice(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: ",
    );
    out.extend_from_slice(upgrade.accept.as_bytes());
    if let Some(protocol) = upgrade.subprotocol {
        out.extend_from_slice(b"\r\nSec-WebSocket-Protocol: ");
        out.extend_from_slice(protocol.as_bytes());
    }
    out.extend_from_slice(b"\r\n\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

    fn upgrade_request(extra: &str) -> String {
        format!(
            "GET /amp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {KEY}\r\n{extra}\r\n"
        )
    }

    fn parse(s: &str) -> Parsed {
        parse_request(s.as_bytes(), 8192)
    }

    fn request(s: &str) -> Request {
        match parse(s) {
            Parsed::Complete { request, len } => {
                assert_eq!(len, s.len());
                request
            }
            other => panic!("{s:?}: {other:?}"),
        }
    }

    #[test]
    fn accept_key_is_the_rfc_6455_example() {
        assert_eq!(accept_key(KEY.as_bytes()), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn routes_the_plain_endpoints_and_404s_the_rest() {
        assert_eq!(request("GET /healthz HTTP/1.1\r\n\r\n"), Request::Health);
        assert_eq!(request("GET /readyz HTTP/1.1\r\n\r\n"), Request::Health);
        assert_eq!(request("GET /livez HTTP/1.1\r\n\r\n"), Request::Live);
        assert_eq!(
            request("GET /metrics?x=1 HTTP/1.1\r\n\r\n"),
            Request::Metrics
        );
        assert_eq!(request("GET /amp/schema HTTP/1.0\r\n\r\n"), Request::Schema);
        assert!(matches!(
            request("GET / HTTP/1.1\r\n\r\n"),
            Request::Reject(Status::NotFound, _)
        ));
        assert!(matches!(
            request("POST /healthz HTTP/1.1\r\n\r\n"),
            Request::Reject(Status::NotFound, _)
        ));
    }

    #[test]
    fn upgrade_selects_amp_v1_when_offered_among_others() {
        let Request::Upgrade(u) =
            request(&upgrade_request("Sec-WebSocket-Protocol: chat, amp.v1\r\n"))
        else {
            panic!("not an upgrade")
        };
        assert_eq!(u.subprotocol, Some("amp.v1"));
        assert_eq!(u.accept, "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
        let mut out = Vec::new();
        switching_protocols(&mut out, &u);
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(text.starts_with("HTTP/1.1 101 "));
        assert!(text.contains("\r\nSec-WebSocket-Protocol: amp.v1\r\n"));
    }

    #[test]
    fn upgrade_without_subprotocol_is_accepted_without_protocol_header() {
        let Request::Upgrade(u) = request(&upgrade_request("")) else {
            panic!("not an upgrade")
        };
        assert_eq!(u.subprotocol, None);
        let mut out = Vec::new();
        switching_protocols(&mut out, &u);
        assert!(!String::from_utf8_lossy(&out).contains("Sec-WebSocket-Protocol"));
    }

    #[test]
    fn upgrade_offering_only_other_subprotocols_is_400() {
        assert!(matches!(
            request(&upgrade_request(
                "Sec-WebSocket-Protocol: chat\r\nSec-WebSocket-Protocol: amp.v2\r\n"
            )),
            Request::Reject(Status::BadRequest, _)
        ));
    }

    #[test]
    fn upgrade_checks_key_version_and_headers() {
        let bad_key = upgrade_request("").replace(KEY, "c2hvcnQ=");
        assert!(matches!(
            request(&bad_key),
            Request::Reject(Status::BadRequest, _)
        ));
        let no_key = upgrade_request("").replace(&format!("Sec-WebSocket-Key: {KEY}\r\n"), "");
        assert!(matches!(
            request(&no_key),
            Request::Reject(Status::BadRequest, _)
        ));
        let v8 = upgrade_request("").replace("Version: 13", "Version: 8");
        assert!(matches!(
            request(&v8),
            Request::Reject(Status::UpgradeRequired, _)
        ));
        let no_upgrade = upgrade_request("").replace("Upgrade: websocket\r\n", "");
        assert!(matches!(
            request(&no_upgrade),
            Request::Reject(Status::BadRequest, _)
        ));
        let no_conn = upgrade_request("").replace("keep-alive, Upgrade", "keep-alive");
        assert!(matches!(
            request(&no_conn),
            Request::Reject(Status::BadRequest, _)
        ));
        let http10 = upgrade_request("").replace("HTTP/1.1", "HTTP/1.0");
        assert!(matches!(
            request(&http10),
            Request::Reject(Status::BadRequest, _)
        ));
    }

    #[test]
    fn heads_over_the_bounds_are_431_and_garbage_is_400() {
        let many: String = (0..=MAX_HEADERS).map(|i| format!("X-{i}: v\r\n")).collect();
        assert_eq!(
            parse(&format!("GET / HTTP/1.1\r\n{many}\r\n")),
            Parsed::Error(Status::HeadersTooLarge)
        );
        let big = format!("GET / HTTP/1.1\r\nX: {}", "a".repeat(100));
        assert_eq!(
            parse_request(big.as_bytes(), 64),
            Parsed::Error(Status::HeadersTooLarge)
        );
        assert_eq!(parse("GET / HTTP/1.1\r\nX: 1"), Parsed::Partial);
        assert_eq!(
            parse("\x16\x03\x01 hello\r\n\r\n"),
            Parsed::Error(Status::BadRequest)
        );
        assert_eq!(
            parse("GET / HTTP/1.1\r\nBad Header\r\n\r\n"),
            Parsed::Error(Status::BadRequest)
        );
    }
}
