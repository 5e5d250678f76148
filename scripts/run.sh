#!/usr/bin/env bash
# Runs the broker: installs nats-server when missing, builds in release mode and starts
# `amp-broker serve` with the arguments given (see README for flags).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-deps.sh
exec cargo run --release --quiet -- serve "$@"
