#!/bin/sh
# A site: the broker's embedded nats-server is a leaf node of the hub, with its own
# JetStream domain `site1` for the site's local namespaces.
DATA=${DATA:-/var/lib/amp-site1}
exec amp-broker serve \
  --config "$(dirname "$0")/site-config.json" \
  --listen 127.0.0.1:7420 \
  --data-dir "$DATA" \
  --broker-id site1 \
  --js-domain site1 \
  --leaf-remote nats-leaf://site:change-me-leaf-password@127.0.0.1:7422
