#!/usr/bin/env bash
# The Python package's tests: build and install hcomm (the PyO3 extension and python/hcomm)
# into a virtualenv under target/, then run pytest with a deadline.
#
# The virtualenv sees the system's site-packages, so a torch installed system-wide is reused;
# what is missing is installed into the system Python with pip: numpy, pytest, pytest-timeout,
# maturin, ml_dtypes, scikit-learn, and torch only when it cannot be imported (its PyPI wheel is large).
# torch tests are required here (HCOMM_REQUIRE_TORCH=1): they fail, never skip, without torch.
#
# Environment: PYTHON (default python3), PYTEST_ARGS (extra pytest arguments, e.g. "-k ddp").
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
export CARGO_TARGET_DIR="$PWD/target"   # share the workspace's build (crates/hcomm-py is its own workspace)

have() { "$PY" -c "import $1" >/dev/null 2>&1; }
missing=()
have numpy || missing+=(numpy)
have pytest || missing+=(pytest)
have pytest_timeout || missing+=(pytest-timeout)
have maturin || missing+=("maturin>=1.9.4,<2")
have ml_dtypes || missing+=(ml_dtypes)
have sklearn || missing+=(scikit-learn)   # the convergence test's data set (load_digits ships with it)
if ((${#missing[@]})); then
    echo "installing ${missing[*]}"
    "$PY" -m pip install --quiet --disable-pip-version-check "${missing[@]}"
fi
if ! have torch; then
    echo "installing torch (once; the wheel is large)"
    "$PY" -m pip install --quiet --disable-pip-version-check torch
fi

echo "== build the hcomm command (the tests launch jobs with it too)"
cargo build --release -p hcomm-cli

echo "== build and install the Python package into target/python-venv"
VENV=target/python-venv
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation .

echo "== pytest"
# The installed package is what is tested: python/hcomm (the sources) is not importable as
# `hcomm` from the repository root. Each test has a deadline (pyproject.toml), the run too.
# shellcheck disable=SC2086
HCOMM_REQUIRE_TORCH=1 HCOMM_BIN="$CARGO_TARGET_DIR/release/hcomm" timeout 3600 \
    "$VENV/bin/python" -m pytest tests/python -q -ra --durations=8 -p no:cacheprovider ${PYTEST_ARGS:-}
