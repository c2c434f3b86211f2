"""vllm-server's recipe flags: --chat-template, --tokenizer-config on a .gguf,
--max-logprobs, --limit-mm-per-prompt / --language-model-only, --kv-transfer-config,
--offload-config and the CUDA-graph-replay profiler flags. Parsing and the exact one-line
refusals, the engine's config building, the tokenizer they give, and one real server."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from server_utils import COMMON, start_server

from vllmpy import LLM, SamplingParams
from vllmpy.config import EngineArgs
from vllmpy.engine.configure import build_engine_config, model_source
from vllmpy.engine.input_processor import InputProcessor, LogprobsLimitError
from vllmpy.entrypoints.openai.cli_args import parse_server_args
from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.multimodal_limits import (
    MultimodalLimits,
    multimodal_refusal,
    parse_limits,
    request_limits,
)
from vllmpy.entrypoints.openai.protocol import ChatCompletionRequest, parse_request
from vllmpy.loader.source import load_tokenizer
from vllmpy.tokenizer.gguf_tokenizer import load_gguf_tokenizer

VOCAB = 49152  # SmolLM2's vocabulary
NO_IMAGES = ("At most 0 image(s) may be provided in one prompt. Set `--limit-mm-per-prompt` "
             "to increase this limit.")
MISSING_MODEL = "/nonexistent/model.gguf"  # any model I/O would fail on it
IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def one_line_exit(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def own_template(smollm_path) -> str:
    """The SmolLM2 GGUF's own chat template."""
    template = load_gguf_tokenizer(smollm_path).chat_template
    assert template and "You are a helpful AI assistant named SmolLM" in template
    return template


@pytest.fixture(scope="module")
def template_file(own_template, tmp_path_factory) -> tuple[str, str]:
    """(path, text): a copy of SmolLM2's template with its own default system prompt, and a
    tool message rendered through an attribute outside the sandbox."""
    text = own_template.replace("You are a helpful AI assistant named SmolLM, trained by "
                                "Hugging Face", "You answer from a replaced template")
    text = text.replace("{% for message in messages %}",
                        "{% for message in messages %}{% if message['role'] == 'tool' %}"
                        "{{ message['content'].__class__ }}{% endif %}", 1)
    assert text.count("replaced template") == 1 and "__class__" in text
    path = tmp_path_factory.mktemp("templates") / "smollm2-copy.jinja"
    path.write_text(text)
    return str(path), text


# ---- flag parsing (no engine) -------------------------------------------------------------


def test_defaults(monkeypatch):
    a = parse_server_args([])
    assert (a.chat_template, a.max_logprobs, a.kv_transfer_config, a.offload_config) == \
        (None, 20, None, None)
    assert (a.cuda_profile_graph_replays, a.cuda_profile_graph_batch) == (0, None)
    assert a.mm_limits == MultimodalLimits()
    assert [a.mm_limits.limit(m) for m in ("image", "video", "audio", "x")] == [999] * 4


@pytest.mark.parametrize("value, line", [
    ('{"image": 2', "server: --limit-mm-per-prompt: malformed JSON (Expecting ',' delimiter "
                    "at column 12); pass a JSON object such as '{\"image\": 2, \"video\": 0}'"),
    ("[1]", "server: --limit-mm-per-prompt must be a JSON object such as "
            "'{\"image\": 2, \"video\": 0}', got list"),
    ('{"image": -1}', "server: --limit-mm-per-prompt: the 'image' limit must be a count >= 0, "
                      "got -1"),
    ('{"video": {"count": -2}}', "server: --limit-mm-per-prompt: the 'video' limit must be a "
                                 "count >= 0, got -2"),
    ('{"vision_chunk": {"count": -3}}', "server: --limit-mm-per-prompt: the 'vision_chunk' "
                                        "limit must be a count >= 0, got -3"),
    ('{"image": "2"}', "server: --limit-mm-per-prompt: the 'image' entry must be a count (an "
                       "integer >= 0) or an object of options such as {\"count\": 1}, got '2'"),
    ('{"audio": true}', "server: --limit-mm-per-prompt: the 'audio' entry must be a count (an "
                        "integer >= 0) or an object of options such as {\"count\": 1}, got True"),
    ('{"video": {"count": 1, "fps": 2}}', "server: --limit-mm-per-prompt: unknown option "
                                          "'fps' for video; its options are count, "
                                          "num_frames, width, height"),
    ('{"image": {"num_frames": 4}}', "server: --limit-mm-per-prompt: unknown option "
                                     "'num_frames' for image; its options are count, width, "
                                     "height"),
    ('{"audio": {"length": 0}}', "server: --limit-mm-per-prompt: audio.length must be a "
                                 "positive integer or null, got 0"),
])
def test_limit_mm_per_prompt_refusals(value, line, capsys):
    assert one_line_exit(["--limit-mm-per-prompt", value], capsys) == line


def test_limit_mm_per_prompt_forms(capsys):
    a = parse_server_args(["--limit-mm-per-prompt", '{"image": 2, "video": {"count": 1, '
                           '"num_frames": 32, "width": 512, "height": null}, "audio": {}}'])
    assert [a.mm_limits.limit(m) for m in ("image", "video", "audio", "x")] == [2, 1, 999, 999]
    assert capsys.readouterr().err == ""
    # an unknown modality's options are dropped, with a notice; its count is kept
    a = parse_server_args(["--limit-mm-per-prompt", '{"vision_chunk": {"count": 3, "fps": 2}}'])
    assert a.mm_limits.limit("vision_chunk") == 3
    assert capsys.readouterr().err.strip().splitlines() == [
        "server: --limit-mm-per-prompt: dropped vision_chunk.fps: only 'count' is read for a "
        "modality other than image, video and audio, as upstream"]
    a = parse_server_args(["--limit-mm-per-prompt", '{"image": 2}', "--language-model-only"])
    assert [a.mm_limits.limit(m) for m in ("image", "video", "x")] == [0, 0, 0]
    a = parse_server_args(["--language-model-only", "--no-language-model-only"])
    assert a.mm_limits.limit("image") == 999


@pytest.mark.parametrize("argv, line", [
    (["--limit-mm-per-prompt.image", "2"],
     "server: unknown argument '--limit-mm-per-prompt.image'"),
    (["--max-logprobs", "-2"], "server: argument --max-logprobs: expected an integer >= -1, "
                               "got '-2'"),
    (["--max-logprobs", "all"], "server: argument --max-logprobs: expected an integer >= -1, "
                                "got 'all'"),
    (["--cuda-profile-graph-replays", "-1"], "server: argument --cuda-profile-graph-replays: "
                                             "expected an integer >= 0, got '-1'"),
    (["--cuda-profile-graph-batch", "x"], "server: argument --cuda-profile-graph-batch: "
                                          "expected an integer >= 0, got 'x'"),
    (["--cuda-profile-graph-replays", "5", "--device", "cpu"],
     "server: --cuda-profile-graph-replays 5 arms the CUDA-graph-replay profiler, and the cpu "
     "device replays no CUDA graphs; leave it at 0"),
    (["--cuda-profile-graph-replays", "5", "--device", "cuda"],
     "server: --cuda-profile-graph-replays 5 arms the CUDA-graph-replay profiler, and that "
     "trace-only diagnostic is not built into this engine; leave it at 0"),
    (["--cuda-profile-graph-replays", "5", "--max-num-seqs", "8"],
     "server: --cuda-profile-graph-batch 16 (its default when replays are armed) exceeds "
     "--max-num-seqs 8; lower it or raise --max-num-seqs"),
    (["--cuda-profile-graph-batch", "40"], "server: --cuda-profile-graph-batch 40 exceeds "
                                           "--max-num-seqs 32; lower it or raise --max-num-seqs"),
    (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
     "server: --kv-transfer-config names kv_connector 'LMCacheConnectorV1', which is not "
     "supported yet: no KV connector is built; drop the flag (a config without kv_connector "
     "is accepted)"),
    (["--chat-template", "templates/missing.jinja"],
     "server: --chat-template 'templates/missing.jinja' looks like a file path (it has no '{', "
     "'}' or newline), but the file is missing ([Errno 2] No such file or directory: "
     "'templates/missing.jinja'); pass an existing template file or the template text itself"),
    (["--chat-template", "{% for m in messages %}\n{{ m.content }\n{% endfor %}"],
     "server: --chat-template: the chat template does not parse (line 2): unexpected '}'"),
])
def test_refused_while_parsing(argv, line, capsys):
    assert one_line_exit(argv, capsys) == line


def test_a_trace_batch_alone_is_only_checked(capsys):
    a = parse_server_args(["--cuda-profile-graph-batch", "8", "--cuda-profile-graph-replays",
                           "0"])
    assert (a.cuda_profile_graph_batch, a.cuda_profile_graph_replays) == (8, 0)
    assert capsys.readouterr().err == ""


# ---- the engine's checks: before any model I/O ---------------------------------------------


def engine_refusal(**flags) -> str:
    """What building the config refuses for a model that does not exist: the flag's
    refusal, never the missing model's, so it comes before any model I/O."""
    with pytest.raises(ValueError) as e:
        build_engine_config(EngineArgs(model=MISSING_MODEL, device="cpu", **flags))
    assert MISSING_MODEL not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("flags, message", [
    ({"kv_transfer_config": '{"kv_connector": "NixlConnector"'},
     "--kv-transfer-config: malformed JSON (Expecting ',' delimiter at column 33); pass a "
     "JSON object such as '{\"kv_connector\": \"...\", \"kv_role\": \"kv_both\"}'"),
    ({"kv_transfer_config": '{"kv_conector": "NixlConnector"}'},
     "--kv-transfer-config: unknown field 'kv_conector'; the fields are kv_connector, "
     "engine_id, kv_buffer_device, kv_role, kv_port, kv_connector_extra_config, "
     "kv_connector_module_path, enable_permute_local_kv, kv_load_failure_policy"),
    ({"kv_transfer_config": {"kv_connector": "NixlConnector"}},
     "--kv-transfer-config: Please specify kv_role when kv_connector is set, supported roles "
     "are ('kv_producer', 'kv_consumer', 'kv_both')"),
    ({"kv_transfer_config": '{"kv_role": "kv_all"}'},
     "--kv-transfer-config: Unsupported kv_role: kv_all. Supported roles are ('kv_producer', "
     "'kv_consumer', 'kv_both')"),
    ({"kv_transfer_config": '{"kv_port": "14579"}'},
     "--kv-transfer-config: kv_port must be an integer, got '14579'"),
    ({"kv_transfer_config": '{"kv_load_failure_policy": "retry"}'},
     "--kv-transfer-config: kv_load_failure_policy must be one of recompute, fail, got 'retry'"),
    ({"kv_transfer_config": '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'},
     "--kv-transfer-config names kv_connector 'NixlConnector', which is not supported yet: no "
     "KV connector is built; drop the flag (a config without kv_connector is accepted)"),
    ({"offload_config": '"uva"'},
     "--offload-config must be a JSON object such as '{\"offload_backend\": \"uva\", \"uva\": "
     "{\"cpu_offload_gb\": 8}}', got str"),
    ({"offload_config": '{"offload_backend": "nvme"}'},
     "--offload-config: offload_backend must be one of auto, uva, prefetch, got 'nvme'"),
    ({"offload_config": '{"uva": {"cpu_offload_gib": 4}}'},
     "--offload-config: unknown field 'uva.cpu_offload_gib'; the fields of uva are "
     "cpu_offload_gb, cpu_offload_params"),
    ({"offload_config": '{"uva": {"cpu_offload_gb": -1}}'},
     "--offload-config: uva.cpu_offload_gb must be >= 0, got -1"),
    ({"offload_config": '{"prefetch": {"offload_params": ["experts", 2]}}'},
     "--offload-config: prefetch.offload_params must be a list of strings, got ['experts', 2]"),
    ({"offload_config": '{"offload_backend": "prefetch"}'},
     "--offload-config: offload_num_in_group (1) must be <= offload_group_size (0)"),
    ({"offload_config": '{"prefetch": {"offload_group_size": 4, "offload_prefetch_step": 0}}'},
     "--offload-config: offload_prefetch_step (0) must be >= 1 when prefetch offloading is "
     "enabled (offload_group_size > 0)"),
    ({"offload_config": '{"uva": {"cpu_offload_gb": 8}}'},
     "--offload-config enables uva weight offloading, which is not supported yet: no weight "
     "offloader is built, for any architecture; drop the flag or leave offloading disabled"),
    ({"offload_config": '{"prefetch": {"offload_group_size": 8, "offload_num_in_group": 2}}'},
     "--offload-config enables prefetch weight offloading, which is not supported yet: no "
     "weight offloader is built, for any architecture; drop the flag or leave offloading "
     "disabled"),
    ({"cuda_profile_graph_replays": 3},
     "--cuda-profile-graph-replays 3 arms the CUDA-graph-replay profiler, and the cpu device "
     "replays no CUDA graphs; leave it at 0"),
    ({"cuda_profile_graph_batch": -1}, "--cuda-profile-graph-batch must be >= 0, got -1"),
    ({"max_logprobs": -2}, "--max-logprobs must be >= -1 (-1: no limit), got -2"),
    ({"chat_template": "{{ ''.__class__.__mro__ }}"},
     "--chat-template: the chat template reached outside Jinja's sandbox: access to attribute "
     "'__class__' of 'str' object is unsafe; a chat template may not touch Python internals"),
])
def test_engine_refusals_come_before_model_io(flags, message):
    assert engine_refusal(**flags) == message


def test_the_library_takes_and_checks_the_flags():
    with pytest.raises(ValueError, match="--chat-template 'none.jinja' looks like a file path"):
        LLM(MISSING_MODEL, device="cpu", chat_template="none.jinja")
    with pytest.raises(ValueError, match="--kv-transfer-config names kv_connector 'X'"):
        LLM(MISSING_MODEL, device="cpu", kv_transfer_config={"kv_connector": "X",
                                                              "kv_role": "kv_both"})


def test_configs_that_enable_nothing_start_normally(smollm_path, capsys):
    config = build_engine_config(EngineArgs(
        model=smollm_path, device="cpu", num_blocks=8, max_logprobs=7,
        kv_transfer_config='{"kv_role": "kv_both", "kv_port": 15000}',
        offload_config='{"offload_backend": "uva", "prefetch": {"offload_group_size": 4}}',
        cuda_profile_graph_batch=4))
    assert config.model.max_logprobs == 7
    assert "vllmpy: --offload-config: prefetch fields are set but offload_backend='uva'; " \
        "they are ignored" in capsys.readouterr().err.splitlines()


# ---- --max-logprobs in the engine's frontend ----------------------------------------------


@pytest.mark.parametrize("limit, params, message", [
    (20, SamplingParams(logprobs=21),
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    (20, SamplingParams(logprobs=-1),
     f"Requested sample logprobs of {VOCAB}, which is greater than max allowed: 20"),
    (3, SamplingParams(prompt_logprobs=4),
     "Requested prompt logprobs of 4, which is greater than max allowed: 3"),
    (0, SamplingParams(logprobs=1), "Requested sample logprobs of 1, which is greater than "
                                    "max allowed: 0"),
])
def test_max_logprobs_refusals(smollm_path, limit, params, message):
    config = build_engine_config(EngineArgs(model=smollm_path, device="cpu", num_blocks=8,
                                            max_logprobs=limit))
    with pytest.raises(LogprobsLimitError) as e:
        InputProcessor(config.model, None).process("r", [1, 2, 3], params)
    assert str(e.value) == message
    assert e.value.param == ("prompt_logprobs" if params.prompt_logprobs else "logprobs")


def test_max_logprobs_allows(smollm_path):
    for limit, params in ((20, SamplingParams(logprobs=20, prompt_logprobs=0)),
                          (0, SamplingParams(logprobs=0)),
                          (-1, SamplingParams(logprobs=-1, prompt_logprobs=-1)),
                          (-1, SamplingParams(logprobs=VOCAB))):
        config = build_engine_config(EngineArgs(model=smollm_path, device="cpu",
                                                num_blocks=8, max_logprobs=limit))
        request = InputProcessor(config.model, None).process("r", [1, 2, 3], params)
        assert request.sampling_params is params


# ---- chat templates and --tokenizer-config on a .gguf ------------------------------------


def engine_tokenizer(model: str, tokenizer_config: str | None = None, **flags):
    """The tokenizer the engine loads for ``model`` under these flags (as LLM and the
    server load it), without loading any weights."""
    args = EngineArgs(model=model, device="cpu", tokenizer_config=tokenizer_config, **flags)
    return load_tokenizer(model_source(args), args.tokenizer_config)


def test_chat_template_replaces_the_ggufs_own(smollm_path, own_template, template_file):
    path, text = template_file
    assert engine_tokenizer(smollm_path).chat_template == own_template
    tok = engine_tokenizer(smollm_path, chat_template=path)
    assert tok.chat_template == text
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou answer from a replaced template<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    tok = engine_tokenizer(smollm_path, chat_template=inline)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=False) == "[user] Hi\n"


def test_chat_template_replaces_a_model_directorys_own(smollm_path, tmp_path, template_file):
    path, text = template_file
    tok = load_gguf_tokenizer(smollm_path)
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "own"}))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "vocab_size": VOCAB}))
    assert engine_tokenizer(str(tmp_path)).chat_template == "own"
    assert engine_tokenizer(str(tmp_path), chat_template=path).chat_template == text
    other = tmp_path / "other_config.json"
    other.write_text(json.dumps({"chat_template": "from --tokenizer-config"}))
    assert engine_tokenizer(str(tmp_path), str(other)).chat_template == "from --tokenizer-config"
    assert engine_tokenizer(str(tmp_path), str(other), chat_template=path).chat_template == text


def write_config(tmp_path, **entries) -> str:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(entries))
    return str(path)


def test_tokenizer_config_applies_to_a_gguf(smollm_path, tmp_path):
    plain = engine_tokenizer(smollm_path)
    assert (plain.bos_token, plain.encode("")) == ("<|im_start|>", [])  # the GGUF adds none
    config = write_config(tmp_path, bos_token={"content": "<|endoftext|>"}, add_bos_token=True,
                          chat_template=[{"name": "default", "template": "{{ bos_token }}"
                                          "{% for m in messages %}{{ m.content }}{% endfor %}"}],
                          clean_up_tokenization_spaces=False, model_max_length=8192,
                          added_tokens_decoder={"0": {"content": "<|endoftext|>",
                                                      "special": True}})
    tok = engine_tokenizer(smollm_path, config)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token) == ("<|endoftext|>", 0, "<|im_end|>")
    assert tok.encode("Hi") == [0, *plain.encode("Hi")] and len(plain.encode("Hi")) == 1
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|endoftext|>x"


def test_chat_template_wins_over_tokenizer_config(smollm_path, tmp_path, template_file):
    path, text = template_file
    config = write_config(tmp_path, chat_template="from the config")
    assert engine_tokenizer(smollm_path, config).chat_template == "from the config"
    assert engine_tokenizer(smollm_path, config, chat_template=path).chat_template == text
    # a config without a template leaves the GGUF's
    config = write_config(tmp_path, eos_token="<|endoftext|>")
    tok = engine_tokenizer(smollm_path, config)
    assert (tok.eos_token_id, tok.chat_template) == (0, load_gguf_tokenizer(smollm_path)
                                                     .chat_template)


@pytest.mark.parametrize("entries, message", [
    ({"add_prefix_space": True}, "add_prefix_space=True cannot apply to a tokenizer built from "
     "a GGUF file's metadata, whose vocabulary, splitting and decoding come from the file; "
     "remove add_prefix_space or set it to null"),
    ({"tokenizer_file": "tokenizer.json"}, "tokenizer_file='tokenizer.json' cannot apply to a "
     "tokenizer built from a GGUF file's metadata, whose vocabulary, splitting and decoding "
     "come from the file; remove tokenizer_file or set it to null"),
    ({"eos_token": "</s>"}, "eos_token='</s>' is not in the vocabulary"),
    ({"added_tokens_decoder": {"1": {"content": "<s>", "special": True}}},
     "added_tokens_decoder gives id 1 the token '<s>', but the GGUF vocabulary has "
     "'<|im_start|>' there: this config belongs to another vocabulary"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]},
     "chat_template lists templates ['tool_use'] but none named 'default'"),
])
def test_tokenizer_config_refusals_on_a_gguf(smollm_path, tmp_path, entries, message):
    config = write_config(tmp_path, **entries)
    with pytest.raises(ValueError) as e:
        engine_tokenizer(smollm_path, config)
    assert str(e.value) == f"{config}: {message}"


def test_a_tokenizer_config_template_must_compile(smollm_path, tmp_path):
    config = write_config(tmp_path, chat_template="{% for m in messages %}{{ m }")
    with pytest.raises(ValueError) as e:
        engine_tokenizer(smollm_path, config)
    assert str(e.value) == (f"--tokenizer-config {config}: the chat template does not parse "
                            f"(line 1): unexpected '}}'")
    with pytest.raises(ValueError, match="tokenizer config not found: "):
        engine_tokenizer(smollm_path, str(tmp_path / "absent.json"))


# ---- multimodal content parts ---------------------------------------------------------------


def test_multimodal_refusal_messages():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             IMAGE_PART]}]
    only_text = [{"role": "user", "content": [{"type": "text", "text": "x"}]},
                 {"role": "assistant", "content": None}]
    assert multimodal_refusal(parse_limits(None, language_model_only=True), messages) == \
        NO_IMAGES
    assert multimodal_refusal(parse_limits('{"image": 0}'), messages) == NO_IMAGES
    assert multimodal_refusal(parse_limits('{"video": 0}'), messages) == (
        "content part type 'image_url' is not supported: this server takes text only (image "
        "input needs a multimodal model)")
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    assert multimodal_refusal(parse_limits('{"audio": {"count": 0}}'), audio) == (
        "At most 0 audio(s) may be provided in one prompt. Set `--limit-mm-per-prompt` to "
        "increase this limit.")
    assert multimodal_refusal(MultimodalLimits(), [{"role": "user", "content": [
        {"type": "file", "file": {}}]}]) == ("content part type 'file' is not supported: this "
                                            "server takes text parts only")
    assert multimodal_refusal(parse_limits(None, True), only_text) is None


def test_request_validation_reads_the_limits_in_force():
    body = {"messages": [{"role": "user", "content": [IMAGE_PART]}]}
    with request_limits(parse_limits(None, language_model_only=True)), \
            pytest.raises(OpenAIError) as e:
        parse_request(ChatCompletionRequest, body)
    # a validation 400 names the field's path first
    assert (e.value.message, e.value.param) == (f"messages.0.content: {NO_IMAGES}",
                                                "messages.0.content")
    with pytest.raises(OpenAIError) as e:  # outside the block: the default limits
        parse_request(ChatCompletionRequest, body)
    assert e.value.message == ("messages.0.content: content part type 'image_url' is not "
                               "supported: this server takes text only (image input needs a "
                               "multimodal model)")


# ---- one real server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flag_server(smollm_path, template_file):
    s = start_server("--model", smollm_path, *COMMON, "--num-blocks", "16",
                     "--max-model-len", "512", "--language-model-only", "--max-logprobs", "3",
                     "--chat-template", template_file[0],
                     "--kv-transfer-config", '{"kv_role": "kv_both"}',
                     "--offload-config", '{"offload_backend": "auto", "uva": {}}',
                     "--cuda-profile-graph-batch", "8")
    yield s
    s.stop()


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=120)


def bad_request(response: httpx.Response) -> tuple[str, str | None]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    return error["message"], error["param"]


@pytest.mark.slow
def test_the_server_applies_the_flags(flag_server, template_file):
    info = httpx.get(f"{flag_server.url}/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == template_file[1]
    user = [{"role": "user", "content": "Name a color."}]
    ok = post(flag_server, "chat/completions", {"messages": user, "max_tokens": 1,
                                                "logprobs": True, "top_logprobs": 3})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    image = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, IMAGE_PART]}]
    assert bad_request(post(flag_server, "chat/completions", {"messages": image})) == \
        (f"messages.0.content: {NO_IMAGES}", "messages.0.content")
    assert bad_request(post(flag_server, "completions", {"prompt": "Hi", "logprobs": 4})) == \
        ("Requested sample logprobs of 4, which is greater than max allowed: 3", "logprobs")
    assert bad_request(post(flag_server, "completions", {"prompt": "Hi", "max_tokens": 1,
                                                         "prompt_logprobs": -1})) == \
        (f"Requested prompt logprobs of {VOCAB}, which is greater than max allowed: 3",
         "prompt_logprobs")
    assert bad_request(post(flag_server, "chat/completions", {
        "messages": user, "logprobs": True, "top_logprobs": 4}))[0] == \
        "Requested sample logprobs of 4, which is greater than max allowed: 3"
    tool = [*user, {"role": "tool", "content": "blue"}]
    assert bad_request(post(flag_server, "chat/completions", {"messages": tool})) == (
        "chat template: the chat template reached outside Jinja's sandbox: access to "
        "attribute '__class__' of 'str' object is unsafe; a chat template may not touch "
        "Python internals", "messages")


@pytest.mark.slow
def test_a_template_that_does_not_parse_stops_the_server(smollm_path):
    proc = subprocess.run(
        [sys.executable, "-m", "vllmpy.entrypoints.openai.api_server", "--model", smollm_path,
         "--device", "cpu", "--chat-template", "{{ messages }}\n{% if %}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "server: --chat-template: the chat template does not parse (line 2): Expected an "
        "expression, got 'end of statement block'"]
