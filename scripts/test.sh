#!/usr/bin/env bash
# Every test: the Rust workspace's, then the Python package's (scripts/test-python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# Bounded: a test that hangs fails the run here, long before CI's limit (the whole suite takes
# 10-20 minutes on 2 cores).
timeout 2700 cargo test --release --workspace
scripts/test-python.sh
