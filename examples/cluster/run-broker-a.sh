#!/bin/sh
# Broker a: all three nodes (it learns further ones from the servers' connect_urls), R3
# streams so any one node may die without losing an acknowledged message.
exec amp-broker serve \
  --config "$(dirname "$0")/config.json" \
  --listen 127.0.0.1:7420 \
  --nats nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224 \
  --replicas 3 \
  --broker-id a
