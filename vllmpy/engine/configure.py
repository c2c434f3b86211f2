"""EngineArgs -> EngineConfig: resolve the model, dtypes, KV pool size and serving length."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllmpy.config import (
    MAMBA_SSM_CACHE_DTYPES,
    CacheConfig,
    ConfigError,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    TextModelConfig,
    log,
)
from vllmpy.core.cache_spec import CacheLayout
from vllmpy.core.scheduler import SCHEDULING_POLICIES
from vllmpy.loader.source import ModelSource, resolve_model_source
from vllmpy.startup_flags import check_startup_flags

DEFAULT_NUM_BLOCKS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# On CUDA, vLLM's serving default: prefill chunks large enough to keep a GPU busy.
DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA = 8192


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is available "
                          "(this torch build or machine has none); use --device cpu")
    return device


# --kv-cache-dtype values that select a storage dtype ("auto" is resolved from the model)
KV_CACHE_STORAGE: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# values that parse (vLLM accepts them) but that this engine refuses by name
KV_CACHE_REFUSED = ("float16", "fp8_e5m2")
# a checkpoint's kv_cache_quant_algo (lower-cased) -> the --kv-cache-dtype it means
CHECKPOINT_KV_ALGOS = {"fp8": "fp8_e4m3"}
# fp8 e4m3 loads and conversions in Triton need compute capability 8.9 (Ada, Hopper) or newer
FP8_MIN_CAPABILITY = (8, 9)


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """How logs and reports name a KV storage dtype: ``fp8_e4m3`` for the 1-byte e4m3
    pages (vLLM's name), the torch name otherwise."""
    if dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    return str(dtype).removeprefix("torch.")


def _kv_choices() -> str:
    return ", ".join(("auto", *KV_CACHE_STORAGE))


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype,
                           source: ModelSource | None = None) -> torch.dtype:
    """``--kv-cache-dtype`` -> the dtype the KV pages are stored in.

    An explicit value always wins. ``auto`` takes the checkpoint's own declaration
    (config.json ``quantization_config.kv_cache_quant_algo``, else ``hf_quant_config.json``)
    and logs it; with none it is the model dtype. ``float16`` and ``fp8_e5m2`` are refused
    by name; so is a declared algorithm other than FP8.
    """
    if requested in KV_CACHE_REFUSED:
        raise ConfigError(f"--kv-cache-dtype {requested} is not supported; use one of "
                          f"{_kv_choices()} (fp8 is e4m3 with per-layer scales)")
    if requested != "auto" and requested not in KV_CACHE_STORAGE:
        raise ConfigError(f"unknown --kv-cache-dtype {requested!r}; choose one of "
                          f"{_kv_choices()}")
    if requested != "auto":
        try:
            declared = _declared_kv_algo(source)
        except ConfigError:  # the flag decides: an unreadable declaration is moot
            declared = None
        if declared is not None:
            log(f"KV cache dtype: --kv-cache-dtype {requested} overrides the checkpoint's "
                f"{declared[1]} {declared[0]!r}")
        return KV_CACHE_STORAGE[requested]
    declared = _declared_kv_algo(source)
    if declared is None:
        return model_dtype
    algo, where = declared
    value = CHECKPOINT_KV_ALGOS.get(algo.lower())
    if value is None:
        raise ConfigError(
            f"the checkpoint's {where} is {algo!r}, a KV-cache quantization this engine does "
            f"not implement (it implements 'FP8', stored as fp8_e4m3); pass --kv-cache-dtype "
            f"bfloat16 or float32 to serve with an unquantized KV cache")
    log(f"KV cache dtype: {value} (1-byte pages, per-layer k_scale/v_scale), as the "
        f"checkpoint's {where} {algo!r} declares; --kv-cache-dtype overrides it")
    return KV_CACHE_STORAGE[value]


def _declared_kv_algo(source: ModelSource | None) -> tuple[str, str] | None:
    from vllmpy.loader.hf_config import declared_kv_cache_quant_algo

    if source is None:
        return None
    # hf_quant_config.json sits next to config.json; a GGUF file carries neither
    model_dir = source.path if source.kind in ("hf_dir", "dummy") else None
    try:
        return declared_kv_cache_quant_algo(source.hf_config, model_dir)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_kv_dtype_on_device(kv_dtype: torch.dtype, device: str) -> None:
    if kv_dtype != torch.float8_e4m3fn or device != "cuda":
        return
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(
            f"--kv-cache-dtype fp8 needs a GPU of compute capability "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer for its fp8 e4m3 "
            f"loads; this one is {capability[0]}.{capability[1]}: use --kv-cache-dtype "
            f"bfloat16 (or auto)")


def _bytes_per_block(text: TextModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """One block across every paged layer (K/V or MLA latents), at the KV storage dtype."""
    return CacheLayout(text.layer_cache_specs()).bytes_per_block(block_size, kv_dtype)


def _ssm_cache_dtype(args: EngineArgs, dtype: torch.dtype) -> torch.dtype:
    """--mamba-ssm-cache-dtype: auto is the model's dtype (vLLM's default)."""
    choice = args.mamba_ssm_cache_dtype
    if choice == "auto":
        return dtype
    if choice not in MAMBA_SSM_CACHE_DTYPES:
        raise ConfigError(f"--mamba-ssm-cache-dtype {choice!r}: choose one of "
                          f"{', '.join(MAMBA_SSM_CACHE_DTYPES)}")
    return getattr(torch, choice)


def _split_pool(budget: int, per_block: int, per_seat: int, wanted: int, max_len: int,
                block_size: int, flag: str, fitted: bool) -> tuple[int, int]:
    """A hybrid model's byte budget as (KV blocks, recurrent seats): seats first, up to
    ``wanted`` (one per sequence --max-num-seqs allows), leaving the blocks one sequence of
    ``max_len`` tokens needs; the rest are blocks. With the serving length auto-fitted
    (``fitted``) a budget too small for that keeps one seat and fits the length to what is
    left. Refuses a budget that holds no seat, with the arithmetic."""
    need = -(-max_len // block_size)
    if per_block == 0:  # every layer recurrent: blocks are only bookkeeping
        seats = min(wanted, budget // per_seat)
        if seats < 1:
            raise ConfigError(
                f"{flag} {budget} bytes holds no sequence's recurrent state: one takes "
                f"{per_seat} bytes across the model's recurrent layers; raise {flag} to at "
                f"least {per_seat}")
        return seats * need, seats
    seats = min(wanted, max(0, budget - need * per_block) // per_seat)
    if seats < 1 and fitted and budget >= per_seat + per_block:
        seats = 1
    if seats < 1:
        raise ConfigError(
            f"{flag} {budget} bytes cannot serve one sequence: its recurrent state takes "
            f"{per_seat} bytes and its {need} KV blocks of {block_size} tokens (max_model_len "
            f"{max_len}) take {need * per_block} bytes ({per_block} per block), "
            f"{per_seat + need * per_block} bytes in all; raise {flag} or lower --max-model-len")
    return (budget - seats * per_seat) // per_block, seats


def _seat_line(wanted: int, seats: int, num_blocks: int, budget: int, per_seat: int,
               layout: CacheLayout, flag: str) -> str | None:
    """The stderr line of a reduced --max-num-seqs (None when every seat fits)."""
    if seats >= wanted:
        return None
    return (f"recurrent-state budget: reduced max_num_seqs from {wanted} to {seats}. The KV "
            f"pool ({budget} bytes, {flag}) holds {seats} recurrent states of {per_seat} "
            f"bytes ({layout.describe()} layers) beside {num_blocks} KV blocks, and each "
            f"sequence owns one. Raise {flag} for more concurrent sequences "
            f"({wanted * per_seat} bytes of states serve {wanted}).")


def _resolve_num_blocks(args: EngineArgs, bytes_per_block: int, device: str) -> int:
    """Blocks per layer; 0 on CUDA when no flag sizes the pool: the engine then sizes it
    from the memory left under --gpu-memory-utilization once the model is loaded."""
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        raise ConfigError("--num-blocks and --kv-cache-memory both size the KV pool; give one")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got "
                          f"{args.gpu_memory_utilization}")
    if args.kv_cache_memory is None:
        if args.num_blocks is None and device == "cuda":
            return 0
        return args.num_blocks or DEFAULT_NUM_BLOCKS
    num_blocks = args.kv_cache_memory // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"--kv-cache-memory {args.kv_cache_memory} bytes holds no KV block: one block "
            f"of {args.block_size} tokens needs {bytes_per_block} bytes across all layers")
    return num_blocks


def _resolve_max_model_len(args: EngineArgs, text: TextModelConfig,
                           cache: CacheConfig) -> tuple[int, str]:
    """(serving length, how it was chosen) -- fitted to the pool without --max-model-len
    (vLLM's _auto_fit_max_model_len), checked against it with (_check_enough_kv_cache_memory)."""
    limit = text.max_position_embeddings
    pool = cache.num_tokens
    if args.max_model_len is None:
        fitted = min(limit, pool)
        why = ("the model's max_position_embeddings" if limit <= pool else "the KV pool")
        return fitted, f"auto-fitted to {why}; --max-model-len sets it"
    if args.max_model_len > limit:
        raise ConfigError(f"--max-model-len {args.max_model_len} exceeds the model's "
                          f"max_position_embeddings ({limit})")
    if args.max_model_len > pool:
        raise ConfigError(_pool_too_small(args, text, cache))
    return args.max_model_len, "--max-model-len"


def _pool_too_small(args: EngineArgs, text: TextModelConfig, cache: CacheConfig) -> str:
    """The refusal of a --max-model-len the pool cannot hold: the arithmetic and every flag
    that closes the gap."""
    assert args.max_model_len is not None
    need = -(-args.max_model_len // cache.block_size)
    dtype = kv_cache_dtype_name(cache.kv_cache_dtype)
    fixes = [f"raise --num-blocks to {need}",
             f"--kv-cache-memory to {need * cache.bytes_per_block}"]
    fp8_block = _bytes_per_block(text, cache.block_size, torch.float8_e4m3fn)
    if (args.kv_cache_memory is not None and cache.kv_cache_dtype != torch.float8_e4m3fn
            and args.kv_cache_memory // fp8_block >= need):
        fixes.append(f"use --kv-cache-dtype fp8 (1-byte pages: the same --kv-cache-memory "
                     f"holds {args.kv_cache_memory // fp8_block * cache.block_size} tokens)")
    fixes.append(f"lower --max-model-len to {cache.num_tokens}")
    return (f"--max-model-len {args.max_model_len} needs {need} KV blocks of "
            f"{cache.block_size} tokens ({need * cache.bytes_per_block} bytes at {dtype}, "
            f"{cache.bytes_per_block} bytes per block across all {text.num_hidden_layers} "
            f"layers), but the pool has {cache.num_blocks} blocks ({cache.num_tokens} tokens, "
            f"{cache.num_blocks * cache.bytes_per_block} bytes); "
            + ", ".join(fixes[:-1]) + f", or {fixes[-1]}")


def _startup_line(args: EngineArgs, cache: CacheConfig, max_model_len: int, how: str) -> str:
    elem = cache.kv_cache_dtype.itemsize
    sized = (f", sized by --kv-cache-memory {args.kv_cache_memory}"
             if args.kv_cache_memory is not None else "")
    if cache.num_seats and not cache.bytes_per_block:  # every layer recurrent
        return (f"KV cache: no paged layers{sized}{_seats_part(cache)}; max_model_len "
                f"{max_model_len} ({how})")
    return (f"KV cache: {cache.num_blocks} blocks x {cache.block_size} tokens = "
            f"{cache.num_tokens} tokens, {cache.num_blocks * cache.bytes_per_block} bytes "
            f"({kv_cache_dtype_name(cache.kv_cache_dtype)}, {elem}-byte values{sized})"
            f"{_seats_part(cache)}; max_model_len {max_model_len} ({how})")


def _seats_part(cache: CacheConfig) -> str:
    """The recurrent-state half of the start-up line ('' without recurrent layers)."""
    if not cache.num_seats:
        return ""
    return (f"; recurrent state: {cache.num_seats} seats x {cache.bytes_per_seat} bytes = "
            f"{cache.num_seats * cache.bytes_per_seat} bytes ({cache.layout.describe()} "
            f"layers, state dtype {str(cache.ssm_cache_dtype).removeprefix('torch.')})")


def model_source(args: EngineArgs) -> ModelSource:
    """Where the arguments' model comes from (``--model``, ``--load-format``,
    ``--revision``, ``--download-dir``), with ``--chat-template``'s text; fetches it on
    first use, once ``check_startup_flags`` has passed."""
    check_startup_flags(args, resolve_device(args.device))
    source = resolve_model_source(args.model, load_format=args.load_format,
                                  revision=args.revision, download_dir=args.download_dir)
    if args.hf_overrides is not None:
        source = _apply_hf_overrides(source, args)
    if args.chat_template is not None:
        from vllmpy.tokenizer.chat_template import load_chat_template_arg

        source = dataclasses.replace(source,
                                     chat_template=load_chat_template_arg(args.chat_template))
    return source


def _apply_hf_overrides(source: ModelSource, args: EngineArgs) -> ModelSource:
    """--hf-overrides merged into the checkpoint's config; ``classifier_from_token`` (a
    classification head made of LM-head rows) gets its tokens' ids from the tokenizer."""
    import json

    value = args.hf_overrides
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--hf-overrides: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--hf-overrides must be a JSON object, got {type(value).__name__}")
    cfg = {**source.hf_config, **value}
    tokens = cfg.get("classifier_from_token")
    if tokens is not None:
        from vllmpy.loader.source import load_tokenizer

        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ConfigError(f"--hf-overrides: classifier_from_token must be a list of "
                              f"token texts, got {tokens!r}")
        tokenizer = load_tokenizer(source, args.tokenizer_config)
        if tokenizer is None:
            raise ConfigError("--hf-overrides: classifier_from_token needs the model's "
                              "tokenizer")
        ids = []
        for text in tokens:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ConfigError(f"--hf-overrides: classifier_from_token {text!r} is "
                                  f"{len(encoded)} tokens, not one")
            ids.append(encoded[0])
        cfg["classifier_token_ids"] = ids
    log(f"--hf-overrides: {', '.join(sorted(value))} set")
    return dataclasses.replace(source, hf_config=cfg)


def build_engine_config(args: EngineArgs, source: ModelSource | None = None) -> EngineConfig:
    from vllmpy.loader.hf_config import resolve_torch_dtype

    if args.block_size <= 0 or args.max_num_seqs <= 0:
        raise ConfigError("--block-size and --max-num-seqs must be positive")
    _check_scheduling_policy(args)
    device = resolve_device(args.device)
    if source is None:
        source = model_source(args)
    else:  # most often model_source's, which checked and logged them
        check_startup_flags(args, device, notify=False)
    from vllmpy.models.registry import text_config

    text = text_config(source.hf_config)  # the architecture's own converter
    dtype = resolve_torch_dtype(source.hf_config, args.dtype, device)
    quant = _quantization(args, source, device, dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, source)
    _check_kv_dtype_on_device(kv_dtype, device)
    speculative, async_scheduling = _speculative(args, device)
    runner, pooling = _runner(args, source, text)
    if runner == "pooling":
        if speculative is not None:
            raise ConfigError("--speculative-config: a pooling model samples no tokens, so "
                              "there is nothing to speculate")
        async_scheduling = False  # each request ends with its one step
    layout = CacheLayout(text.layer_cache_specs())
    per_block = layout.bytes_per_block(args.block_size, kv_dtype)
    budget = args.max_num_batched_tokens or (
        DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA if device == "cuda"
        else DEFAULT_MAX_NUM_BATCHED_TOKENS)
    if text.ENCODER_ONLY:
        return _encoder_engine_config(args, source, text, dtype, quant, kv_dtype, device,
                                      budget, pooling)
    if speculative is not None:
        # a draft model's (or head's) pool shares the target's blocks: a block holds both
        from vllmpy.spec_decode import draft_kv_config

        draft = draft_kv_config(speculative, source.kind, text)
        if draft is not None:
            per_block += _bytes_per_block(draft, args.block_size, kv_dtype)
    max_num_seqs = args.max_num_seqs
    if layout.is_hybrid:
        cache, max_num_seqs = _hybrid_cache(args, text, layout, per_block, dtype, kv_dtype,
                                            device, speculative)
    else:
        cache = CacheConfig(
            block_size=args.block_size,
            num_blocks=_resolve_num_blocks(args, per_block, device),
            kv_cache_dtype=kv_dtype,
            kv_cache_dtype_requested=args.kv_cache_dtype,
            bytes_per_block=per_block,
            enable_prefix_caching=bool(args.enable_prefix_caching),
            gpu_memory_utilization=args.gpu_memory_utilization,
            layout=layout,
        )
    enforce_eager = args.enforce_eager
    if cache.num_blocks == 0:  # sized after the memory profile (finish_profiled_pool)
        max_model_len = args.max_model_len or text.max_position_embeddings
        if max_model_len > text.max_position_embeddings:
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's "
                              f"max_position_embeddings ({text.max_position_embeddings})")
        how = "--max-model-len" if args.max_model_len else "the model's max_position_embeddings"
    else:
        max_model_len, how = _resolve_max_model_len(args, text, cache)
    if cache.num_blocks:
        log(_startup_line(args, cache, max_model_len, how))
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
        max_logprobs=args.max_logprobs,
        quantization=quant,
        runner=runner,
        pooling=pooling,
    )
    if runner == "pooling":  # a prompt is computed in one step
        budget = max(budget, max_model_len)
    return EngineConfig(model=model, cache=cache,
                        scheduler=SchedulerConfig(max_num_seqs, budget,
                                                  args.scheduling_policy),
                        device=device, enforce_eager=enforce_eager,
                        async_scheduling=async_scheduling,
                        enable_jump_forward=args.enable_jump_forward,
                        speculative=speculative)


def _runner(args: EngineArgs, source: ModelSource, text: TextModelConfig
            ) -> tuple[str, Any]:
    """The runner (generate or pooling) and, for pooling, how it pools."""
    from vllmpy.models.registry import resolve_model_class
    from vllmpy.pooling.config import parse_pooler_config, pooling_spec

    arch = text.architectures[0]
    model_cls = resolve_model_class(text.architectures)
    classifier = callable(getattr(model_cls, "classify", None))
    runner = args.runner
    if runner == "auto":
        runner = "pooling" if text.ENCODER_ONLY or classifier else "generate"
    if runner == "generate":
        if text.ENCODER_ONLY or classifier:
            raise ConfigError(f"{arch} is a pooling model: it embeds, classifies or "
                              f"scores, and generates no text (serve it with --runner "
                              f"pooling, or leave --runner at auto)")
        if args.pooler_config is not None:
            raise ConfigError("--pooler-config applies to a pooling model (--runner pooling)")
        return runner, None
    overrides = parse_pooler_config(args.pooler_config)
    if text.ENCODER_ONLY or classifier:
        if args.convert not in ("auto", "none"):
            raise ConfigError(f"--convert {args.convert}: {arch} is a pooling model already")
        default = getattr(model_cls, "default_pooling_type", "CLS")
        gguf_pooling = source.hf_config.get("gguf_pooling_type")
    else:
        if args.convert == "none":
            raise ConfigError(f"--runner pooling over the generative {arch} needs "
                              f"--convert embed (its last token's state as the embedding)")
        default = "LAST"  # vLLM's for a converted decoder (Qwen3-Embedding)
        gguf_pooling = None
    model_dir = source.path if source.kind == "hf_dir" else None
    spec = pooling_spec(model_dir, gguf_pooling or default, True, overrides)
    if gguf_pooling and "pooling_type" not in overrides:
        spec = dataclasses.replace(spec, source="the GGUF's pooling_type")
    log(f"pooling model: {arch}, {spec.pooling_type} pooling ({spec.source})"
        f"{', normalized' if spec.normalize else ''}"
        f"{f', {len(spec.dense)} Dense layers' if spec.dense else ''}")
    return runner, spec


def _hybrid_cache(args: EngineArgs, text: TextModelConfig, layout: CacheLayout,
                  per_block: int, dtype: torch.dtype, kv_dtype: torch.dtype, device: str,
                  speculative: Any) -> tuple[CacheConfig, int]:
    """The pool of a model with recurrent layers: KV blocks for its paged layers and one
    recurrent-state seat per concurrent sequence (``vllmpy.core.cache_spec``); the
    --max-num-seqs it can serve. A byte budget (--kv-cache-memory) pays for both, seats
    first; --num-blocks names the blocks and the seats come on top."""
    if speculative is not None:
        raise ConfigError(
            f"--speculative-config: {text.architectures[0]} keeps recurrent states "
            f"({layout.describe()} layers), which a rejected draft would have to roll back; "
            f"speculative decoding is not supported on this model")
    enable_caching = bool(args.enable_prefix_caching)
    if enable_caching:
        log(f"prefix caching: off for {text.architectures[0]}: its recurrent layers keep one "
            f"state per sequence, not per block, so a cached prefix has no state to resume "
            f"from (--no-enable-prefix-caching says so)")
        enable_caching = False
    ssm_dtype = _ssm_cache_dtype(args, dtype)
    per_seat = layout.bytes_per_seat(dtype, ssm_dtype)
    wanted = args.max_num_seqs
    max_len = args.max_model_len or text.max_position_embeddings
    num_blocks = _resolve_num_blocks(args, max(per_block, 1), device)
    seats = wanted
    if args.kv_cache_memory is not None:
        num_blocks, seats = _split_pool(args.kv_cache_memory, per_block, per_seat, wanted,
                                        max_len, args.block_size, "--kv-cache-memory",
                                        args.max_model_len is None)
        line = _seat_line(wanted, seats, num_blocks, args.kv_cache_memory, per_seat, layout,
                          "--kv-cache-memory")
        if line:
            log(line)
    elif per_block == 0 and num_blocks:  # every layer recurrent: blocks only count tokens
        num_blocks = wanted * -(-max_len // args.block_size)
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=num_blocks,
        kv_cache_dtype=kv_dtype,
        kv_cache_dtype_requested=args.kv_cache_dtype,
        bytes_per_block=per_block,
        enable_prefix_caching=enable_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_seats=seats,
        bytes_per_seat=per_seat,
        ssm_cache_dtype=ssm_dtype,
        layout=layout,
    )
    return cache, seats


def _encoder_engine_config(args: EngineArgs, source: ModelSource, text: TextModelConfig,
                           dtype: Any, quant: Any, kv_dtype: Any, device: str, budget: int,
                           pooling: Any) -> EngineConfig:
    """An encoder-only model keeps no KV: its attention runs over each step's whole
    prompts. The block table stays (the scheduler counts seats and tokens in blocks) with
    no memory behind it: enough blocks for one full step."""
    limit = text.max_position_embeddings
    if pooling.max_seq_length:
        limit = min(limit, int(pooling.max_seq_length))
    if args.max_model_len is not None and args.max_model_len > text.max_position_embeddings:
        raise ConfigError(f"--max-model-len {args.max_model_len} exceeds the model's "
                          f"max_position_embeddings ({text.max_position_embeddings})")
    max_model_len = args.max_model_len or limit
    budget = max(budget, max_model_len)
    num_blocks = -(-budget // args.block_size) + args.max_num_seqs
    cache = CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                        kv_cache_dtype=kv_dtype, kv_cache_dtype_requested=args.kv_cache_dtype,
                        bytes_per_block=0, enable_prefix_caching=False,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    how = ("--max-model-len" if args.max_model_len else
           "sentence-transformers' max_seq_length" if limit < text.max_position_embeddings
           else "the model's max_position_embeddings")
    log(f"KV cache: none (encoder-only {text.architectures[0]}: bidirectional attention "
        f"over each step's whole prompts); max_model_len {max_model_len} ({how})")
    model = ModelConfig(
        model=source.model, source_kind=source.kind, path=source.path,
        hf_config=source.hf_config, text_config=text, dtype=dtype,
        max_model_len=max_model_len, max_model_len_fitted=False,
        eos_token_ids=frozenset(source.eos_token_ids), tokenizer_config=args.tokenizer_config,
        seed=args.seed, max_logprobs=args.max_logprobs, quantization=quant,
        runner="pooling", pooling=pooling)
    return EngineConfig(model=model, cache=cache,
                        scheduler=SchedulerConfig(args.max_num_seqs, budget,
                                                  args.scheduling_policy),
                        device=device, enforce_eager=args.enforce_eager,
                        async_scheduling=False, enable_jump_forward=args.enable_jump_forward,
                        speculative=None)


def _speculative(args: EngineArgs, device: str) -> tuple[Any, bool]:
    """The speculative config (None when off) and whether steps are scheduled ahead:
    speculative steps never are (the drafts of step N + 1 come from step N's tokens)."""
    async_scheduling = device == "cuda" if args.async_scheduling is None \
        else bool(args.async_scheduling)
    if args.speculative_config is None:
        return None, async_scheduling
    from vllmpy.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_json(args.speculative_config)
    log(spec.describe())
    if async_scheduling:
        log("speculative decoding: async scheduling is off (each step's drafts are "
            "proposed from the tokens the previous step emitted)")
    return spec, False


def _quantization(args: EngineArgs, source: ModelSource, device: str, dtype: torch.dtype):
    """The checkpoint's weight quantization, checked against ``--quantization`` and the
    device, before any weight is read."""
    from vllmpy.layers.quantization import QuantizationError, quantization_config

    model_dir = source.path if source.kind in ("hf_dir", "dummy") else None
    try:
        quant = quantization_config(source.kind, source.hf_config, model_dir,
                                    args.quantization)
        if quant is not None:
            quant.bind_target(torch.device(device), dtype)
    except QuantizationError as e:
        raise ConfigError(str(e)) from None
    return quant


def _check_scheduling_policy(args: EngineArgs) -> None:
    if args.scheduling_policy not in SCHEDULING_POLICIES:
        raise ConfigError(f"--scheduling-policy {args.scheduling_policy!r} is not a policy; "
                          f"choose one of {', '.join(SCHEDULING_POLICIES)}")
    if args.scheduling_policy == "lpm" and not args.enable_prefix_caching:
        log("--scheduling-policy lpm orders by cached-prefix match, and prefix caching is "
            "off: waiting requests are admitted in arrival order")


def finish_profiled_pool(config: EngineConfig, kv_bytes: int, breakdown: str) -> EngineConfig:
    """The config with the KV pool sized from ``kv_bytes`` (what the memory profile left
    under --gpu-memory-utilization); refuses start-up when one sequence of max_model_len
    does not fit, with the arithmetic and the flags that close the gap."""
    cache, model = config.cache, config.model
    if cache.num_seats:
        return _finish_profiled_hybrid(config, kv_bytes, breakdown)
    num_blocks = max(0, kv_bytes) // cache.bytes_per_block
    need = -(-model.max_model_len // cache.block_size)
    if num_blocks < need:
        raise ConfigError(
            f"--gpu-memory-utilization {cache.gpu_memory_utilization} leaves "
            f"{max(0, kv_bytes)} bytes for the KV cache ({breakdown}): {num_blocks} blocks "
            f"of {cache.block_size} tokens, fewer than the {need} one sequence of "
            f"max_model_len {model.max_model_len} needs ({cache.bytes_per_block} bytes per "
            f"block); raise --gpu-memory-utilization, lower --max-model-len, use "
            f"--kv-cache-dtype fp8, or size the pool with --num-blocks / --kv-cache-memory")
    cache = dataclasses.replace(cache, num_blocks=num_blocks)
    how = ("the model's max_position_embeddings; --max-model-len sets it"
           if model.max_model_len_fitted else "--max-model-len")
    log(f"KV cache: {num_blocks} blocks x {cache.block_size} tokens = {cache.num_tokens} "
        f"tokens, {num_blocks * cache.bytes_per_block} bytes "
        f"({kv_cache_dtype_name(cache.kv_cache_dtype)}, "
        f"{cache.kv_cache_dtype.itemsize}-byte values, sized by --gpu-memory-utilization "
        f"{cache.gpu_memory_utilization}: {breakdown}); max_model_len {model.max_model_len} "
        f"({how})")
    return dataclasses.replace(config, cache=cache)


def _finish_profiled_hybrid(config: EngineConfig, kv_bytes: int, breakdown: str
                            ) -> EngineConfig:
    """``finish_profiled_pool`` for a model with recurrent layers: the bytes pay for the
    seats first, then the blocks (``_split_pool``); a reduced --max-num-seqs is said."""
    cache, model = config.cache, config.model
    budget = max(0, kv_bytes)
    flag = f"--gpu-memory-utilization {cache.gpu_memory_utilization}"
    wanted = config.scheduler.max_num_seqs
    num_blocks, seats = _split_pool(budget, cache.bytes_per_block, cache.bytes_per_seat,
                                    wanted, model.max_model_len, cache.block_size, flag,
                                    fitted=False)
    if (line := _seat_line(wanted, seats, num_blocks, budget, cache.bytes_per_seat,
                           cache.layout, flag)):
        log(line)
    cache = dataclasses.replace(cache, num_blocks=num_blocks, num_seats=seats)
    how = ("the model's max_position_embeddings; --max-model-len sets it"
           if model.max_model_len_fitted else "--max-model-len")
    log(f"KV cache: {num_blocks} blocks x {cache.block_size} tokens = {cache.num_tokens} "
        f"tokens, {num_blocks * cache.bytes_per_block} bytes "
        f"({kv_cache_dtype_name(cache.kv_cache_dtype)}, sized by {flag}: {breakdown})"
        f"{_seats_part(cache)}; max_model_len {model.max_model_len} ({how})")
    scheduler = dataclasses.replace(config.scheduler, max_num_seqs=seats)
    return dataclasses.replace(config, cache=cache, scheduler=scheduler)
