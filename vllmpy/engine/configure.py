"""EngineArgs -> EngineConfig: resolve the model, dtypes, KV pool size and serving length."""

from __future__ import annotations

import torch

from vllmpy.config import (
    CacheConfig,
    ConfigError,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    TextModelConfig,
    log,
)
from vllmpy.loader.source import ModelSource, resolve_model_source

DEFAULT_NUM_BLOCKS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is available "
                          "(this torch build or machine has none); use --device cpu")
    return device


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    if requested == "auto":
        return model_dtype
    if requested in ("float16", "fp8_e5m2"):
        raise ConfigError(f"--kv-cache-dtype {requested} is not supported; "
                          "use auto, bfloat16 or float32")
    if requested in ("fp8", "fp8_e4m3"):
        raise ConfigError(f"--kv-cache-dtype {requested} is not implemented yet; "
                          "use auto, bfloat16 or float32")
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[requested]


def _bytes_per_block(text: TextModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return (2 * text.num_hidden_layers * block_size * text.num_key_value_heads
            * text.head_dim * elem)


def _resolve_num_blocks(args: EngineArgs, bytes_per_block: int) -> int:
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        raise ConfigError("--num-blocks and --kv-cache-memory both size the KV pool; give one")
    if args.kv_cache_memory is None:
        return args.num_blocks or DEFAULT_NUM_BLOCKS
    num_blocks = args.kv_cache_memory // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"--kv-cache-memory {args.kv_cache_memory} bytes holds no KV block: one block "
            f"of {args.block_size} tokens needs {bytes_per_block} bytes across all layers")
    return num_blocks


def _resolve_max_model_len(args: EngineArgs, text: TextModelConfig, cache: CacheConfig) -> int:
    limit = text.max_position_embeddings
    pool = cache.num_tokens
    if args.max_model_len is None:
        fitted = min(limit, pool)
        why = ("the model's max_position_embeddings" if limit <= pool else
               f"the KV pool ({cache.num_blocks} blocks x {cache.block_size} tokens)")
        log(f"max_model_len not set: fitted to {why}: {fitted} tokens")
        return fitted
    if args.max_model_len > limit:
        raise ConfigError(f"--max-model-len {args.max_model_len} exceeds the model's "
                          f"max_position_embeddings ({limit})")
    if args.max_model_len > pool:
        need = -(-args.max_model_len // cache.block_size)
        raise ConfigError(
            f"--max-model-len {args.max_model_len} needs {need} KV blocks of "
            f"{cache.block_size} tokens, but the pool has {cache.num_blocks} blocks "
            f"({pool} tokens, {cache.num_blocks * cache.bytes_per_block} bytes); raise "
            f"--num-blocks to {need} or --kv-cache-memory to "
            f"{need * cache.bytes_per_block}, or lower --max-model-len to {pool}")
    return args.max_model_len


def build_engine_config(args: EngineArgs, source: ModelSource | None = None) -> EngineConfig:
    from vllmpy.loader.hf_config import resolve_torch_dtype

    if args.block_size <= 0 or args.max_num_seqs <= 0:
        raise ConfigError("--block-size and --max-num-seqs must be positive")
    device = resolve_device(args.device)
    if source is None:
        source = resolve_model_source(args.model, load_format=args.load_format,
                                      revision=args.revision, download_dir=args.download_dir)
    text = TextModelConfig.from_hf_config(source.hf_config)
    dtype = resolve_torch_dtype(source.hf_config, args.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    per_block = _bytes_per_block(text, args.block_size, kv_dtype)
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=_resolve_num_blocks(args, per_block),
        kv_cache_dtype=kv_dtype,
        kv_cache_dtype_requested=args.kv_cache_dtype,
        bytes_per_block=per_block,
    )
    max_model_len = _resolve_max_model_len(args, text, cache)
    if text.sliding_window is not None and max_model_len > text.sliding_window:
        raise ConfigError(
            f"the model attends within a sliding window of {text.sliding_window} tokens, "
            f"which is not implemented; serve at most that many with --max-model-len "
            f"{text.sliding_window} (the resolved length is {max_model_len})")
    log(f"KV cache: {cache.num_blocks} blocks x {cache.block_size} tokens = "
        f"{cache.num_tokens} tokens, {cache.num_blocks * per_block} bytes "
        f"({str(kv_dtype).removeprefix('torch.')})")
    model = ModelConfig(
        model=source.model,
        source_kind=source.kind,
        path=source.path,
        hf_config=source.hf_config,
        text_config=text,
        dtype=dtype,
        max_model_len=max_model_len,
        max_model_len_fitted=args.max_model_len is None,
        eos_token_ids=frozenset(source.eos_token_ids),
        tokenizer_config=args.tokenizer_config,
        seed=args.seed,
    )
    budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    return EngineConfig(model=model, cache=cache,
                        scheduler=SchedulerConfig(args.max_num_seqs, budget), device=device,
                        enforce_eager=args.enforce_eager)
