#!/usr/bin/env bash
# The whole test suite: installs what it needs, then format, lint and every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-deps.sh --test
cargo fmt --check
cargo clippy --all-targets -- -D warnings
cargo test --all-targets
# The same test bodies against the in-process NATS/JetStream model.
scripts/test-model.sh
