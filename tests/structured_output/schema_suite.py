"""The JSON-Schema test suite, as shipped inside the jsonschema sdist on PyPI.

Fetched once with pip (as the weights are) and cached beside the weights:

    python tests/structured_output/schema_suite.py     # fetch, print the cached folder
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from vllmpy.loader.pypi_weights import cache_dir

JSONSCHEMA_VERSION = "4.26.0"  # the version pinned in pyproject.toml's test extras
DRAFT = "draft2020-12"


def suite_dir() -> Path:
    """The cached ``json/tests/<DRAFT>`` folder of the jsonschema sdist, fetched if needed."""
    target = cache_dir() / f"jsonschema-{JSONSCHEMA_VERSION}-suite" / DRAFT
    if target.is_dir() and any(target.glob("*.json")):
        return target
    with tempfile.TemporaryDirectory(prefix="vllmpy-jsonschema-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp,
               f"jsonschema=={JSONSCHEMA_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download of the jsonschema sdist failed: "
                               f"{proc.stderr.strip()[-500:]}")
        (sdist,) = Path(tmp).glob("jsonschema-*.tar.gz")
        prefix = f"jsonschema-{JSONSCHEMA_VERSION}/json/tests/{DRAFT}/"
        partial = target.with_name(target.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name
                if name.startswith(prefix) and name.endswith(".json") and "/" not in \
                        name[len(prefix):]:
                    source = tar.extractfile(member)
                    assert source is not None
                    (partial / Path(name).name).write_bytes(source.read())
        if not any(partial.glob("*.json")):
            raise RuntimeError(f"the jsonschema {JSONSCHEMA_VERSION} sdist has no {prefix}")
        partial.replace(target)
    return target


def suite_schemas() -> list[tuple[str, str, Any]]:
    """(file stem, group description, schema) for every test group of the draft, in file
    order, each distinct schema once."""
    seen: set[str] = set()
    out = []
    for path in sorted(suite_dir().glob("*.json")):
        for group in json.loads(path.read_text()):
            key = json.dumps(group["schema"], sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append((path.stem, group["description"], group["schema"]))
    return out


if __name__ == "__main__":
    print(suite_dir())
