"""A participant on NATS with the official Python client (nats-py), probing what its scoped
JWT lets it do, for tests/access_matrix.rs and tests/policy_callout.rs. The server asks the
broker's auth callout.

Usage: access_probe.py '<json>' where the JSON has
  url; one credential: user+password | token | nkeys_seed (a file) | user_credentials (a
  .creds file); inbox_prefix (nats-py `inbox_prefix`, optional); timeout (requests, s);
  subscribe: subjects to subscribe to (everything received is reported);
  publish: [subject, payload] pairs to publish;
  publish_reply: [subject, reply, payload] triples, published with that reply subject;
  pull: [subject, payload] JetStream pull requests (MSG.NEXT) made with `request`; each
        message that comes back is reported and acknowledged with +ACK on its reply subject;
  request: [subject, payload] plain requests (answers reported);
  fetch: [stream, consumer] pairs: one message fetched from a durable pull consumer with
         nats-py's JetStream API (its deliveries come under the connection's inbox prefix),
         reported and acknowledged;
  done: a subject that ends the run when a message arrives on it.

Prints "READY" once every step is flushed, then, after the message on `done` (or 10 s), one
JSON line: {"connected", "error", "errors", "received", "pulled", "answers"}.
"""

import asyncio
import json
import sys

try:
    import nats
except ImportError:
    print("nats-py is missing: pip install nats-py nkeys", file=sys.stderr)
    sys.exit(3)


async def main(spec):
    errors = []
    received = []
    pulled = []
    answers = []
    done = asyncio.Event()

    async def error_cb(e):
        errors.append(str(e))

    opts = {
        "servers": [spec["url"]],
        "error_cb": error_cb,
        "allow_reconnect": False,
        "connect_timeout": 3,
        "max_reconnect_attempts": 0,
    }
    for key in ("user", "password", "token", "nkeys_seed", "user_credentials", "inbox_prefix"):
        if key in spec:
            opts[key] = spec[key]
    try:
        nc = await nats.connect(**opts)
    except Exception as e:  # the refusal is the result under test
        print("READY", flush=True)
        print(json.dumps({"connected": False, "error": f"{type(e).__name__}: {e}", "errors": errors,
                          "received": [], "pulled": [], "answers": []}), flush=True)
        return

    async def on_msg(msg):
        received.append({"subject": msg.subject, "data": msg.data.decode(errors="replace")})

    async def on_done(msg):
        done.set()

    for subject in spec.get("subscribe", []):
        await nc.subscribe(subject, cb=on_msg)
    if spec.get("done"):
        await nc.subscribe(spec["done"], cb=on_done)
    for subject, payload in spec.get("publish", []):
        await nc.publish(subject, payload.encode())
    for subject, reply, payload in spec.get("publish_reply", []):
        await nc.publish(subject, payload.encode(), reply=reply)
    await nc.flush(timeout=3)
    for subject, payload in spec.get("pull", []):
        try:
            msg = await nc.request(subject, payload.encode(), timeout=spec.get("timeout", 2))
        except Exception as e:
            pulled.append({"subject": subject, "error": type(e).__name__})
            continue
        status = msg.headers.get("Status") if msg.headers else None
        pulled.append({"subject": subject, "status": status, "reply": msg.reply or "",
                       "data": msg.data.decode(errors="replace")})
        if msg.reply:
            await nc.publish(msg.reply, b"+ACK")
    js = nc.jetstream()
    for stream, consumer in spec.get("fetch", []):
        try:
            psub = await js.pull_subscribe_bind(consumer, stream=stream)
            for msg in await psub.fetch(1, timeout=spec.get("timeout", 2)):
                pulled.append({"subject": msg.subject, "reply": msg.reply or "",
                               "data": msg.data.decode(errors="replace")})
                await msg.ack()
        except Exception as e:
            pulled.append({"consumer": consumer, "error": type(e).__name__})
    for subject, payload in spec.get("request", []):
        try:
            msg = await nc.request(subject, payload.encode(), timeout=spec.get("timeout", 2))
            answers.append({"subject": subject, "data": msg.data.decode(errors="replace")})
        except Exception as e:
            answers.append({"subject": subject, "error": type(e).__name__})
    try:
        await nc.flush(timeout=3)
        # Permission errors arrive asynchronously after the server processed the protocol
        # lines; a second round trip makes sure they have been read.
        await nc.flush(timeout=3)
    except Exception as e:
        errors.append(f"flush: {type(e).__name__}: {e}")
    print("READY", flush=True)
    if spec.get("done"):
        try:
            await asyncio.wait_for(done.wait(), timeout=10)
        except asyncio.TimeoutError:
            errors.append("timeout waiting for done")
    if not nc.is_closed:
        await nc.flush(timeout=3)
    print(json.dumps({"connected": True, "error": None, "errors": errors, "received": received,
                      "pulled": pulled, "answers": answers}), flush=True)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
