#!/bin/sh
# The hub's broker, next to the hub nats-server (nats-server -c hub-nats.conf).
exec amp-broker serve \
  --config "$(dirname "$0")/hub-config.json" \
  --listen 127.0.0.1:7430 \
  --nats nats://127.0.0.1:4222 \
  --broker-id hub
