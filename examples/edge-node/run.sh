#!/bin/sh
# A single edge node: the broker starts its own nats-server, reachable only with the
# credential it generates (kept in $DATA/broker.nk), sized for a small device.
DATA=${DATA:-/var/lib/amp}
exec amp-broker serve \
  --config "$(dirname "$0")/config.json" \
  --listen 127.0.0.1:7420 \
  --data-dir "$DATA" \
  --broker-id edge1 \
  --js-max-memory 64MiB \
  --js-max-file 1GiB \
  --nats-mem-limit 256MiB
