import asyncio
import json
import sys

import nats


async def main(url, tenant, name, token, capability):
    # The reply prefix is the participant's own: replies elsewhere are never sent.
    nc = await nats.connect(url, user=f"{tenant}/{name}", password=token,
                            inbox_prefix=f"_INBOX_{tenant}_{name}")
    auth = {"Authorization": f"Bearer {token}"}

    async def call(op, body):
        body = {"header": {"tenant_id": tenant}, **body}
        msg = await nc.request(f"mig.v0_1.{tenant}.{op}", json.dumps(body).encode(),
                               timeout=10, headers=auth)
        reply = json.loads(msg.data)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    hello = await call("hello", {"supported_versions": ["0.1"], "requested_bindings": ["nats"]})
    print("version", hello["selected_version"])
    found = await call("discover", {})
    print("capabilities", " ".join(c["id"] for c in found["capabilities"]))
    result = await call(f"invoke.{capability}", {"payload": {"input": "hello"}})
    print("result", json.dumps(result["payload"]))
    await nc.close()


asyncio.run(main(*sys.argv[1:]))
