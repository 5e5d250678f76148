"""KV through nats-py.

  kv.py URL read BUCKET KEY...   prints one JSON object: key -> {"value": b64, "revision"} | "not_found"
                                 and whether nats-py's create() of the first key conflicts
  kv.py URL write BUCKET         creates BUCKET (history 5) and writes a few keys
"""
import asyncio, base64, json, sys

try:
    import nats
    from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, BadRequestError
except ImportError:
    sys.exit("nats-py is not installed: pip install nats-py (or scripts/ensure-deps.sh --test)")


async def read(js, bucket, keys):
    kv = await js.key_value(bucket)
    out = {}
    for key in keys:
        try:
            e = await kv.get(key)
            out[key] = {"value": base64.b64encode(e.value or b"").decode(), "revision": e.revision}
        except KeyNotFoundError:
            out[key] = "not_found"
    try:
        await kv.create(keys[0], b"from python")
        out["_create_first"] = "created"
    except (KeyWrongLastSequenceError, BadRequestError) as e:
        out["_create_first"] = "conflict"
    return out


async def write(js, bucket):
    kv = await js.create_key_value(bucket=bucket, history=5)
    r1 = await kv.put("a", b"from python")
    await kv.update("a", b"from python v2", last=r1)
    await kv.put("d", b"to delete")
    await kv.delete("d")
    await kv.put("p", b"to purge")
    await kv.purge("p")
    await kv.create("c", b"created by python")
    return {"ok": True}


async def main():
    url, mode, bucket, keys = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    nc = await nats.connect(url)
    js = nc.jetstream()
    out = await (read(js, bucket, keys) if mode == "read" else write(js, bucket))
    print(json.dumps(out), flush=True)
    await nc.close()


asyncio.run(main())
