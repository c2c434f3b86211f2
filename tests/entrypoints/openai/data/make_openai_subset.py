"""Write openai-subset.json: the operations of OpenAI's published OpenAPI spec that this
server implements, with every component they refer to (examples dropped).

    python tests/entrypoints/openai/data/make_openai_subset.py <openai-openapi.json>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OPERATIONS = {"/completions": "post", "/chat/completions": "post", "/models": "get"}


def subset(spec: dict) -> dict:
    paths = {path: {method: spec["paths"][path][method]} for path, method in OPERATIONS.items()}
    wanted: dict[str, dict[str, object]] = {}

    def walk(node: object) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/"):
                _, _, kind, name = ref.split("/", 3)
                if name not in wanted.setdefault(kind, {}):
                    wanted[kind][name] = spec["components"][kind][name]
                    walk(wanted[kind][name])
            for key, value in node.items():
                if key != "x-oaiMeta":
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(paths)
    for operations in paths.values():
        for operation in operations.values():
            operation.pop("x-oaiMeta", None)
    components = {kind: dict(sorted(items.items())) for kind, items in sorted(wanted.items())}
    components["securitySchemes"] = spec["components"].get("securitySchemes", {})
    return {"openapi": spec["openapi"], "info": spec["info"], "servers": spec["servers"],
            "security": spec.get("security", []), "paths": paths, "components": components}


if __name__ == "__main__":
    source = json.loads(Path(sys.argv[1]).read_text())
    out = Path(__file__).with_name("openai-subset.json")
    out.write_text(json.dumps(subset(source), indent=1, ensure_ascii=False) + "\n")
    print(out)
