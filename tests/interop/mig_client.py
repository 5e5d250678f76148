"""A MIG client on NATS with the official Python client (nats-py), driven line by line for
tests/mig_nats.rs: each line on stdin is one JSON command, each answer one JSON line on
stdout.

Commands:
  {"cmd":"connect","url",<nats-py credentials: user+password | token | nkeys_seed>,"inbox_prefix"}
  {"cmd":"request","tag","subject","body":<JSON, or "raw" for bytes as is>,"headers":{},
   "timeout":s,"wait":true}  one request; with "wait":false it runs in the background and
                              its answer line comes when it arrives
  {"cmd":"publish","subject","reply"?,"body","headers"?}   a plain publish
  {"cmd":"subscribe","sub","subject"}      collect messages on subject under the name sub
  {"cmd":"collected","sub"}                the messages collected so far
  {"cmd":"sign","seed_file","message"}     base64url Ed25519 signature by an NKey seed
  {"cmd":"exit"}
Every answer is {"tag", ...}: a reply is {"reply": <JSON or text>, "headers": {...}}, a
failure {"error": "..."}.
"""

import asyncio
import base64
import json
import ssl
import sys

try:
    import nats
    import nkeys
except ImportError:
    print("nats-py is missing: pip install nats-py nkeys", file=sys.stderr)
    sys.exit(3)


def out(obj):
    print(json.dumps(obj), flush=True)


def decode(data):
    try:
        return json.loads(data.decode())
    except Exception:
        return data.decode(errors="replace")


async def main():
    nc = None
    collected = {}
    errors = []
    loop = asyncio.get_running_loop()
    background = set()

    async def error_cb(e):
        errors.append(str(e))

    async def request(cmd):
        body = cmd.get("body", {})
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        try:
            msg = await nc.request(cmd["subject"], data, timeout=cmd.get("timeout", 5),
                                   headers=cmd.get("headers") or None)
            out({"tag": cmd.get("tag"), "reply": decode(msg.data), "headers": dict(msg.headers or {})})
        except Exception as e:
            out({"tag": cmd.get("tag"), "error": f"{type(e).__name__}: {e}"})

    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        kind = cmd["cmd"]
        tag = cmd.get("tag")
        if kind == "connect":
            opts = {"servers": [cmd["url"]], "error_cb": error_cb, "allow_reconnect": False,
                    "connect_timeout": 3, "max_reconnect_attempts": 0}
            for key in ("user", "password", "token", "nkeys_seed", "inbox_prefix"):
                if key in cmd:
                    opts[key] = cmd[key]
            if "ca_file" in cmd:
                opts["tls"] = ssl.create_default_context(cafile=cmd["ca_file"])
            try:
                nc = await nats.connect(**opts)
                out({"tag": tag, "ok": True})
            except Exception as e:
                out({"tag": tag, "ok": False, "error": f"{type(e).__name__}: {e}"})
        elif kind == "request":
            if cmd.get("wait", True):
                await request(cmd)
            else:
                t = asyncio.create_task(request(cmd))
                background.add(t)
                t.add_done_callback(background.discard)
        elif kind == "publish":
            body = cmd.get("body", {})
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            await nc.publish(cmd["subject"], data, reply=cmd.get("reply", ""),
                             headers=cmd.get("headers") or None)
            await nc.flush()
            out({"tag": tag, "ok": True})
        elif kind == "subscribe":
            name = cmd["sub"]
            collected[name] = []

            async def cb(msg, name=name):
                collected[name].append({"subject": msg.subject, "body": decode(msg.data),
                                       "headers": dict(msg.headers or {}),
                                       "reply": msg.reply})
            await nc.subscribe(cmd["subject"], cb=cb)
            await nc.flush()
            out({"tag": tag, "ok": True})
        elif kind == "collected":
            await nc.flush()
            out({"tag": tag, "messages": collected.get(cmd["sub"], []), "errors": errors})
        elif kind == "sign":
            with open(cmd["seed_file"], "rb") as f:
                kp = nkeys.from_seed(f.read().strip())
            sig = kp.sign(cmd["message"].encode())
            out({"tag": tag, "sig": base64.urlsafe_b64encode(sig).decode().rstrip("=")})
        elif kind == "exit":
            break
    for t in list(background):
        await t
    if nc is not None:
        await nc.close()


asyncio.run(main())
