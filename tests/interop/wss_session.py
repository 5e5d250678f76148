"""The README's session example over wss://: alice sends to bob, bob acks. Trusts the CA
file given; prints one line per answer and `done` at the end.

usage: wss_session.py wss://127.0.0.1:PORT/amp CA_FILE NAMESPACE
"""
import asyncio
import json
import ssl
import sys

try:
    import websockets
except ImportError:
    print("python3 needs websockets: python3 -m pip install websockets "
          "(or scripts/ensure-deps.sh --test)", file=sys.stderr)
    sys.exit(2)

URL, CA, NS = sys.argv[1], sys.argv[2], sys.argv[3]


async def main():
    tls = ssl.create_default_context(cafile=CA)
    async with websockets.connect(URL, subprotocols=["amp.v1"], ssl=tls) as a, \
            websockets.connect(URL, subprotocols=["amp.v1"], ssl=tls) as b:
        for ws, name in ((a, "alice"), (b, "bob")):
            print(json.loads(await ws.recv())["op"], flush=True)        # challenge
            await ws.send(json.dumps({"op": "hello", "id": "h", "ns": NS, "name": name,
                                      "auth": {"type": "token", "token": name + "-token"}}))
            print(json.loads(await ws.recv())["op"], flush=True)        # ok
        await a.send(json.dumps({"op": "send", "id": "s1", "to": "bob", "body": {"hi": 1}}))
        print(json.loads(await a.recv())["op"], flush=True)             # ok
        msg = json.loads(await b.recv())
        print(msg["op"], msg["from"], json.dumps(msg["body"]), flush=True)
        await b.send(json.dumps({"op": "ack", "id": "a1", "seq": msg["seq"]}))
        print(json.loads(await b.recv())["op"], flush=True)             # ok
    print("done", flush=True)


asyncio.run(main())
