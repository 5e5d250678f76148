"""Publishes messages with headers from nats-py: a plain one, one with headers, an empty one."""
import asyncio, sys

try:
    import nats
except ImportError:
    sys.exit("nats-py is not installed: pip install nats-py (or scripts/ensure-deps.sh --test)")


async def main(url, subject):
    nc = await nats.connect(url)
    await nc.publish(subject, b"plain from python")
    await nc.publish(subject, b"\x00\x01binary\xff", headers={
        "X-Origin": "nats-py",
        "X-Spaces": "a value: with colon and  spaces",
        "Nats-Msg-Id": "py-1",
    })
    await nc.publish(subject, b"", headers={"X-Empty-Body": "yes"})
    await nc.flush()
    await nc.close()


asyncio.run(main(sys.argv[1], sys.argv[2]))
