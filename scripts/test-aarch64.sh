#!/usr/bin/env bash
# The in-process tests (the unit tests and the model-driven broker tests: everything in
# `cargo test --lib --features testing`) built for aarch64 and run under qemu-aarch64, for
# edge nodes that are not x86_64: the byte scans there take their portable path
# (src/scan.rs, src/proto/parser.rs), and the clippy run checks the target builds clean.
# Not part of scripts/test.sh (a cross build of its own, about ten minutes on two cores);
# it installs what it needs on a Debian machine: the Rust target, a cross C compiler (ring
# builds C) and qemu-user.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target list --installed | grep -qx aarch64-unknown-linux-gnu ||
  rustup target add aarch64-unknown-linux-gnu
if ! command -v aarch64-linux-gnu-gcc > /dev/null || ! command -v qemu-aarch64 > /dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get install -y -q gcc-aarch64-linux-gnu qemu-user
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo clippy --lib --target aarch64-unknown-linux-gnu -- -D warnings
cargo test --release --lib --features testing --target aarch64-unknown-linux-gnu "$@"
