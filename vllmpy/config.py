"""Engine configuration: one ``EngineArgs`` shared by the CLI, server, bench and ``LLM``,
resolved into one frozen dataclass per concern."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from vllmpy.core.scheduler import SCHEDULING_POLICIES

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "float16", "fp8_e5m2")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")


class ConfigError(ValueError):
    """A configuration the engine refuses; the message names the flag and the fix."""


@dataclass(frozen=True)
class TextModelConfig:
    """What the engine outside the model reads of every architecture's config: the KV
    geometry, the vocabulary and the serving limits. Each architecture's converter
    (``vllmpy.models.<family>``) builds its own subclass, with the fields its model reads;
    ``vllmpy.models.registry.text_config`` picks the converter by architecture."""

    architectures: list[str]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    # each layer's sliding attention window (None: the layer attends to every token)
    layer_windows: tuple[int | None, ...]
    # An encoder-only model (BERT and kin): bidirectional attention over each step's whole
    # prompts, no KV cache; it serves pooling requests only. Set by the family's config.
    ENCODER_ONLY: ClassVar[bool] = False

    @property
    def sliding_window(self) -> int | None:
        """The widest window when every layer has one; None when any layer sees all."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    def layer_cache_specs(self) -> tuple[Any, ...]:
        """What each caching layer keeps between steps, in model order
        (``vllmpy.core.cache_spec``): paged K/V per layer here; hybrid and latent-attention
        families override it (recurrent states, MLA latents)."""
        from vllmpy.core.cache_spec import PagedKVSpec

        if self.ENCODER_ONLY:  # attention over each step's whole prompts: nothing cached
            return ()
        return tuple(PagedKVSpec(self.num_key_value_heads, self.head_dim, window)
                     for window in self.layer_windows)


RUNNERS = ("auto", "generate", "pooling")
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")
CONVERTS = ("auto", "none", "embed")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user named: a directory, a .gguf file or a hub repo id
    source_kind: str  # "hf_dir" | "gguf" | "dummy"
    path: str  # the local directory or file the weights come from
    hf_config: dict[str, Any]
    text_config: TextModelConfig
    dtype: Any  # torch.dtype of the weights and activations
    max_model_len: int  # longest sequence served (prompt + output)
    max_model_len_fitted: bool  # True when chosen by the engine (no --max-model-len)
    eos_token_ids: frozenset[int]  # config.json plus generation_config.json
    tokenizer_config: str | None  # override for tokenizer_config.json
    seed: int
    # most logprobs / prompt_logprobs a request may ask for (-1: the whole vocabulary)
    max_logprobs: int = 20
    # the checkpoint's weight quantization (a layers.quantization.QuantizationConfig)
    quantization: Any = None
    runner: str = "generate"  # "generate" or "pooling"
    # the pooling runner's pooling (a pooling.config.PoolingSpec); None for generate
    pooling: Any = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int  # tokens per KV block
    num_blocks: int  # blocks per layer
    kv_cache_dtype: Any  # torch.dtype of the stored keys and values
    kv_cache_dtype_requested: str  # the --kv-cache-dtype value as given
    bytes_per_block: int  # one block across every layer, keys and values
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared by prompts
    # CUDA without --num-blocks / --kv-cache-memory: num_blocks is 0 until the engine has
    # profiled memory, then this fraction of the device's memory bounds the whole engine.
    gpu_memory_utilization: float = 0.9
    # Hybrid models (``vllmpy.core.cache_spec``): the recurrent-state seats the pool holds
    # beside the blocks (one per running sequence; 0 without recurrent layers), what one
    # seat takes across the recurrent layers, and the SSM / delta state's dtype.
    num_seats: int = 0
    bytes_per_seat: int = 0
    ssm_cache_dtype: Any = None
    layout: Any = None  # the model's CacheLayout (None: every layer paged K/V)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # most requests running in one step
    max_num_batched_tokens: int  # token budget of one step (prefill chunks + decodes)
    policy: str = "fcfs"  # admission order of waiting requests: one of SCHEDULING_POLICIES


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str  # "cpu" or "cuda"
    enforce_eager: bool = False  # CUDA: never capture or replay CUDA graphs
    # Schedule and launch step N+1 while step N runs (the default on CUDA)
    async_scheduling: bool = False
    # Structured output: append the text a grammar forces without a forward pass per token
    enable_jump_forward: bool = False
    # Speculative decoding (a spec_decode.config.SpeculativeConfig), None when off
    speculative: Any = None


@dataclass
class EngineArgs:
    """Every engine flag, with vLLM's names. ``None`` means "let the engine decide"."""

    model: str | None = None  # None serves the embedded default model
    tokenizer_config: str | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts only, no text out
    revision: str | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 32
    num_blocks: int | None = None  # default 256 when kv_cache_memory is not given
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    # hybrid models: the SSM / delta state's dtype (auto: the model's, as vLLM)
    mamba_ssm_cache_dtype: str = "auto"
    quantization: str | None = None  # None: what the checkpoint declares
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # default 8192 on CUDA, 2048 on the CPU
    enforce_eager: bool = False  # CUDA: run every step eagerly (no CUDA graphs)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use
    async_scheduling: bool | None = None  # None: on for CUDA, off for the CPU
    enable_prefix_caching: bool = True  # automatic prefix caching (SGLang: radix attention)
    scheduling_policy: str = "fcfs"  # fcfs | priority | lpm
    enable_jump_forward: bool = False  # structured output: append forced text, no forward
    chat_template: str | None = None  # a template file or its text; replaces the model's
    max_logprobs: int = 20  # most logprobs a request may ask for; -1: no limit
    kv_transfer_config: str | dict[str, Any] | None = None  # vLLM's JSON; refused if it enables
    offload_config: str | dict[str, Any] | None = None  # vLLM's OffloadConfig JSON; likewise
    cuda_profile_graph_replays: int = 0  # > 0 arms the CUDA-graph-replay profiler (not built)
    cuda_profile_graph_batch: int | None = None  # its traced batch; 16 when replays are armed
    speculative_config: str | dict[str, Any] | None = None  # vLLM's JSON; None: off
    # generate | pooling | auto (pooling for encoder-only architectures, else generate)
    runner: str = "auto"
    # pooling runner over a generative checkpoint: embed (last-token vectors) | auto | none
    convert: str = "auto"
    pooler_config: str | dict[str, Any] | None = None  # vLLM's PoolerConfig JSON
    # keys merged into the checkpoint's config.json before it is read (vLLM's JSON)
    hf_overrides: str | dict[str, Any] | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="model directory, .gguf file or "
                       "Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct)")
        g.add_argument("--tokenizer-config", default=None, help="override tokenizer_config.json")
        g.add_argument("--skip-tokenizer-init", action="store_true",
                       help="load no tokenizer: prompts must be token ids, outputs carry ids")
        g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
        g.add_argument("--download-dir", default=None, help="hub download directory")
        g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                       help="'dummy' initialises random weights from config.json")
        g.add_argument("--dtype", default="auto", choices=DTYPES)
        g.add_argument("--device", default="auto", choices=DEVICES)
        g.add_argument("--max-model-len", type=positive_int, default=None)
        g.add_argument("--block-size", type=positive_int, default=32)
        g.add_argument("--num-blocks", type=positive_int, default=None,
                       help="KV blocks per layer (default 256)")
        g.add_argument("--kv-cache-memory", type=_byte_size, default=None,
                       help="byte budget for the whole KV pool, every layer included "
                            "(suffixes K, M, G, Ki, Mi, Gi accepted)")
        g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV page storage: auto (what the checkpoint declares, else the "
                            "model dtype), bfloat16, float32, fp8 = fp8_e4m3 (1 byte, "
                            "per-layer scales); float16 and fp8_e5m2 are refused")
        g.add_argument("--mamba-ssm-cache-dtype", default="auto",
                       choices=MAMBA_SSM_CACHE_DTYPES,
                       help="hybrid models (Mamba2, Gated DeltaNet layers): the dtype of each "
                            "sequence's recurrent state (auto: the model dtype)")
        g.add_argument("--quantization", "-q", default=None,
                       help="weight quantization: by default what the checkpoint declares "
                            "(config.json quantization_config, hf_quant_config.json, GGUF "
                            "block types); fp8 on an unquantized checkpoint quantizes its "
                            "linear weights to fp8 at load")
        g.add_argument("--max-num-seqs", type=positive_int, default=32)
        g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                       help="token budget of one step (default 8192 on CUDA, 2048 on the CPU)")
        g.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run every step eagerly, without CUDA graphs")
        g.add_argument("--async-scheduling", dest="async_scheduling", action="store_true",
                       default=None,
                       help="schedule and launch each step while the previous one runs, "
                            "reading its sampled ids a step later (default: on for CUDA)")
        g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                       help="run the steps one after another")
        g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                       help="CUDA: fraction of the device's memory the engine may use "
                            "(weights, activations, CUDA graphs and the KV pool); the pool "
                            "gets what is left, unless --num-blocks or --kv-cache-memory "
                            "sizes it (default 0.9)")
        g.add_argument("--enable-prefix-caching", "--enable-radix-attention",
                       dest="enable_prefix_caching", action="store_true", default=True,
                       help="reuse the KV cache of prompt prefixes shared between requests "
                            "(default on; --enable-radix-attention is SGLang's name)")
        g.add_argument("--no-enable-prefix-caching", "--disable-radix-attention",
                       dest="enable_prefix_caching", action="store_false",
                       help="turn automatic prefix caching off")
        g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                       help="order of waiting requests: fcfs (arrival), priority (the "
                            "request's priority, lower first, then arrival) or lpm (longest "
                            "cached-prefix match first, SGLang's cache-aware policy)")
        g.add_argument("--enable-jump-forward", action="store_true",
                       help="structured output: where the grammar allows exactly one "
                            "continuation, append its tokens without sampling them one "
                            "forward pass at a time")
        g.add_argument("--chat-template", default=None, help="a chat template file, or "
                       "the template text, replacing the model's own")
        g.add_argument("--max-logprobs", type=_int_at_least(-1), default=20, help="most "
                       "(prompt_/top_)logprobs a request may ask for; -1: no limit (20)")
        g.add_argument("--kv-transfer-config", default=None, help="vLLM's JSON; refused "
                       "when it names a kv_connector (none is built)")
        g.add_argument("--offload-config", default=None, help="vLLM's OffloadConfig JSON; "
                       "refused when it enables offloading (no offloader is built)")
        g.add_argument("--cuda-profile-graph-replays", type=_int_at_least(0), default=0,
                       help="arm a CUDA-graph-replay profiler (not built: N > 0 is refused)")
        g.add_argument("--cuda-profile-graph-batch", type=_int_at_least(0), default=None,
                       help="its traced batch (16 when armed); at most --max-num-seqs")
        g.add_argument("--speculative-config", default=None,
                       help="speculative decoding, vLLM's JSON: "
                            "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or "
                            "'{\"method\": \"draft_model\", \"model\": \"draft.gguf\", "
                            "\"num_speculative_tokens\": 4}'")
        g.add_argument("--hf-overrides", default=None,
                       help="JSON merged into the checkpoint's config.json before it is "
                            "read, e.g. '{\"architectures\": "
                            "[\"Qwen3ForSequenceClassification\"], "
                            "\"classifier_from_token\": [\"no\", \"yes\"], "
                            "\"is_original_qwen3_reranker\": true}'")
        g.add_argument("--runner", default="auto", choices=RUNNERS,
                       help="generate (sampling) or pooling (embeddings, classification, "
                            "scores); auto: pooling for encoder-only models (BERT and kin)")
        g.add_argument("--convert", default="auto", choices=CONVERTS,
                       help="with --runner pooling over a generative checkpoint: embed "
                            "(the last token's state, normalized, as Qwen3-Embedding); "
                            "auto: embed")
        g.add_argument("--pooler-config", default=None,
                       help="vLLM's PoolerConfig JSON: '{\"pooling_type\": \"MEAN\", "
                            "\"normalize\": true}' (pooling_type CLS, MEAN, LAST, ALL or "
                            "STEP; step_tag_id)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_engine_config(self) -> EngineConfig:
        from vllmpy.engine.configure import build_engine_config

        return build_engine_config(self)


def _int_at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_byte_size(text: str) -> int:
    """'1073741824', '512M', '2GiB', '1.5G' -> bytes."""
    raw = str(text).strip().upper().removesuffix("B")
    number = raw.rstrip("KMGTI")
    suffix = raw[len(number):]
    try:
        value = float(number) * _SUFFIXES[suffix]
    except (KeyError, ValueError):
        raise ValueError(f"expected a byte count like 1073741824, 512M or 2GiB, got {text!r}")\
            from None
    if value < 1:
        raise ValueError(f"expected a positive byte count, got {text!r}")
    return int(value)


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def log(message: str) -> None:
    """Engine start-up and status lines go to stderr, never stdout."""
    print(f"vllmpy: {message}", file=sys.stderr, flush=True)


