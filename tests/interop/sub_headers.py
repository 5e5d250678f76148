"""Subscribes with nats-py and prints each message as a JSON line (after a READY line)."""
import asyncio, base64, json, sys

try:
    import nats
except ImportError:
    sys.exit("nats-py is not installed: pip install nats-py (or scripts/ensure-deps.sh --test)")


async def main(url, subject, count):
    nc = await nats.connect(url)
    sub = await nc.subscribe(subject)
    await nc.flush()
    print("READY", flush=True)
    for _ in range(count):
        m = await sub.next_msg(timeout=10)
        print(json.dumps({
            "subject": m.subject,
            "headers": m.headers or {},
            "data": base64.b64encode(m.data).decode(),
        }), flush=True)
    await nc.close()


asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
