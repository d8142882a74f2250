#!/usr/bin/env bash
# Every test: the Rust workspace's, then the Python package's (scripts/test-python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release --workspace
scripts/test-python.sh
