"""A participant connecting to nats-server with the official Python client (nats-py), for
tests/policy_callout.rs: the server asks the broker's auth callout, which decides.

Usage: callout_client.py '<json>' where the JSON has
  url, and one credential: user+password | token | nkeys_seed (a file) | creds (a file);
  subscribe: subjects to subscribe to; publish: subjects to publish to; done: a subject
  that ends the run when a message arrives on it.

Prints "READY" once its subscriptions and publishes are flushed, then, after the message on
`done` (or 5 s), one JSON line: {"connected", "error", "errors", "received"}.
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
    for key in ("user", "password", "token", "nkeys_seed", "user_credentials"):
        if key in spec:
            opts[key] = spec[key]
    try:
        nc = await nats.connect(**opts)
    except Exception as e:  # the refusal is the result under test
        print("READY", flush=True)
        print(json.dumps({"connected": False, "error": f"{type(e).__name__}: {e}", "errors": errors, "received": []}), flush=True)
        return

    async def on_msg(msg):
        received.append(msg.subject)

    async def on_done(msg):
        done.set()

    for subject in spec.get("subscribe", []):
        await nc.subscribe(subject, cb=on_msg)
    if spec.get("done"):
        await nc.subscribe(spec["done"], cb=on_done)
    for subject in spec.get("publish", []):
        await nc.publish(subject, b"from python")
    await nc.flush(timeout=3)
    # Permission errors arrive asynchronously after the server processed the protocol
    # lines; a second round trip makes sure they have been read.
    await nc.flush(timeout=3)
    print("READY", flush=True)
    if spec.get("done"):
        try:
            await asyncio.wait_for(done.wait(), timeout=5)
        except asyncio.TimeoutError:
            errors.append("timeout waiting for done")
    await nc.flush(timeout=3)
    print(json.dumps({"connected": True, "error": None, "errors": errors, "received": received}), flush=True)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
