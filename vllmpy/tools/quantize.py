"""Write a quantized copy of a Hugging Face checkpoint in the on-disk layout a publisher uses.

    python -m vllmpy.tools.quantize SRC_DIR DST_DIR --format F [options]

SRC_DIR holds a safetensors model (one file or an index of shards, any float dtype) and its
config.json. DST_DIR receives one ``model.safetensors``, config.json with the format's
``quantization_config`` added, and the tokenizer files, chat template and
generation_config.json when SRC_DIR has them. Every ``nn.Linear`` of the model whose weight
the checkpoint stores is quantized, except the modules named by ``--ignore`` (default
``lm_head``; a name matches a module whose full name equals it or ends in ``.`` + it). All
other tensors (embeddings, norms, biases, an ignored lm_head) keep their name and dtype.
Weights are quantized by round-to-nearest; nothing is searched or calibrated except the
static FP8 activation scales. The tool needs transformers (it builds the model on the meta
device to find the linear layers, and runs it for static calibration).

Notation: a linear layer stores ``weight`` [N, K] (out features, in features); its name
prefix is written ``P`` below (``P.weight``, ``P.weight_scale`` ...). e4m3 is
``float8_e4m3fn`` (largest finite value 448). Every int32 word packs eight 4-bit codes,
the first code in the lowest nibble (bits 0-3).

fp8-tensor (AutoFP8, vLLM's "fp8" serialized per tensor)
    config.json: ``{"quant_method": "fp8", "activation_scheme": "dynamic" | "static",
    "ignored_layers": [ignored modules]}``.
    ``P.weight`` e4m3 [N, K]; ``P.weight_scale`` float32, shape [] (a 0-d scalar, as
    AutoFP8 saves it), equal to amax(|W|) / 448, so ``W ≈ weight * weight_scale``.
    With ``--activation-scheme static`` also ``P.input_scale`` float32 [], the largest
    |input| the layer saw during calibration / 448.

fp8-block (DeepSeek-V3, Qwen3-FP8)
    config.json: ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [B, B]}`` (``B`` = ``--block-size``, default 128), plus
    ``"modules_to_not_convert"`` when modules other than lm_head are ignored.
    ``P.weight`` e4m3 [N, K]; ``P.weight_scale_inv`` float32 [ceil(N/B), ceil(K/B)]: despite
    its name, the dequantization multiplier of each B x B block (edge blocks are partial),
    ``W[n, k] ≈ weight[n, k] * weight_scale_inv[n // B, k // B]``; it is the block's
    amax / 448.

ct-fp8 (compressed-tensors "float-quantized", FP8 dynamic)
    config.json: compressed-tensors' serialized ``QuantizationConfig``: ``quant_method``
    "compressed-tensors", ``format`` "float-quantized", ``quantization_status``
    "compressed", one config group ``group_0`` targeting ``Linear`` with weights
    ``{num_bits 8, type float, strategy channel, symmetric, dynamic false}`` and
    input_activations ``{num_bits 8, type float, strategy token, symmetric, dynamic
    true}``, ``ignore`` the ignored modules, ``kv_cache_scheme`` null, ``sparsity_config``
    and ``transform_config`` {}.
    ``P.weight`` e4m3 [N, K]; ``P.weight_scale`` [N, 1] in the source weight's dtype (bf16,
    fp16 or fp32, as compressed-tensors creates it), each row's amax / 448.

modelopt-fp8 (NVIDIA ModelOpt unified Hugging Face checkpoint, FP8)
    hf_quant_config.json: ``{"producer": {"name": "modelopt", "version": V}, "quantization":
    {"quant_algo": "FP8", "kv_cache_quant_algo": null, "exclude_modules": [ignored]}}``;
    config.json: the form ModelOpt's exporter also writes, ``{"config_groups": {"group_0":
    {"input_activations": {"dynamic": false, "num_bits": 8, "type": "float"}, "weights":
    {"dynamic": false, "num_bits": 8, "type": "float"}, "targets": ["Linear"]}}, "ignore":
    [ignored], "quant_algo": "FP8", "producer": {...}, "quant_method": "modelopt"}``.
    ``P.weight`` e4m3 [N, K]; ``P.weight_scale`` float32 [] and ``P.input_scale`` float32 []
    (activations are always static), defined as for fp8-tensor.

awq (AutoAWQ GEMM)
    config.json: ``{"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true,
    "version": "gemm", "modules_to_not_convert": null | [ignored modules but lm_head]}``
    (AutoAWQ never quantizes lm_head, so it must stay ignored).
    Asymmetric: per group of G input columns of one output row, ``scale = (max - min) / 15``
    and ``zero = round(-min / scale)`` (min and max widened to include 0), codes
    ``q = clamp(round(w / scale) + zero, 0, 15)``, ``W ≈ (q - zero) * scale``.
    ``P.qweight`` int32 [K, N/8]: word ``[k, j]`` holds the codes of output columns
    ``8j + (0, 2, 4, 6, 1, 3, 5, 7)`` in nibbles 0..7 (AWQ's interleave).
    ``P.qzeros`` int32 [K/G, N/8]: the zeros, packed the same way; ``P.scales`` float16
    [K/G, N]. Row ``g`` of qzeros/scales covers inputs ``g*G .. g*G+G-1``.

gptq (AutoGPTQ / GPTQModel, checkpoint_format "gptq", i.e. v1)
    config.json: ``{"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": bool,
    "sym": bool, "static_groups": false, "lm_head": bool, "checkpoint_format": "gptq"}``.
    Symmetric (``--sym``, default): ``scale = amax / 7.5``, zero 8. Asymmetric (``--asym``):
    as for awq, except that a group whose zero would round to 0 takes zero 1 and
    ``scale = max / 14`` (v1 cannot store a zero of 0, see below).
    ``P.qweight`` int32 [K/8, N]: word ``[r, n]`` holds the codes of inputs ``8r .. 8r+7`` of
    output ``n`` in nibbles 0..7. ``P.qzeros`` int32 [K/G, N/8]: word ``[g, j]`` holds
    ``zero - 1`` of outputs ``8j .. 8j+7`` in nibbles 0..7 (the v1 convention: a reader adds
    1 back, so a symmetric checkpoint stores 7 in every nibble, 0x77777777).
    ``P.scales`` float16 [K/G, N]; ``P.g_idx`` int32 [K], the group of each input column,
    ``k // G`` in order. ``--desc-act`` assigns the groups in descending order of each input
    column's squared weight norm instead (standing in for GPTQ's activation order), so
    ``g_idx`` is a permuted, non-monotonic map; ``W[n, k] ≈ (q - zero[g_idx[k], n]) *
    scales[g_idx[k], n]``.

ct-w4a16 (compressed-tensors "pack-quantized")
    config.json: as for ct-fp8 with ``format`` "pack-quantized" and one group whose weights
    are ``{num_bits 4, type int, strategy group, group_size G, symmetric, dynamic false}``
    and no input_activations.
    ``P.weight_packed`` int32 [N, ceil(K/8)]: word ``[n, j]`` holds inputs ``8j .. 8j+7`` of
    row ``n`` in nibbles 0..7, each as the unsigned code ``q`` (compressed-tensors' signed
    value ``q - 8``); ``P.weight_scale`` [N, K/G] in the source weight's dtype;
    ``P.weight_shape`` int64 [2] = ``[N, K]``. Symmetric (default): ``scale = amax / 7.5``,
    ``W ≈ (q - 8) * scale``. Asymmetric (``--asym``): as for awq, plus
    ``P.weight_zero_point`` int32 [ceil(N/8), K/G], packed along the output dimension: word
    ``[j, g]`` holds the zeros of rows ``8j .. 8j+7`` in nibbles 0..7, and
    ``W ≈ (q - zero) * scale``.

Python: ``quantize_checkpoint(src, dst, fmt, **options)`` with the CLI's options as keyword
arguments (``group_size``, ``block_size``, ``activation_scheme``, ``ignore``, ``sym``,
``desc_act``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMATS = ("fp8-tensor", "fp8-block", "ct-fp8", "modelopt-fp8", "awq", "gptq", "ct-w4a16")
INT4_FORMATS = ("awq", "gptq", "ct-w4a16")

FP8_MAX = 448.0
# AutoAWQ's GEMM layout: nibble i of a word holds output column AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SEQUENTIAL_ORDER = tuple(range(8))
# The releases whose serialization the compressed-tensors and ModelOpt layouts follow;
# written where those tools write their own version.
COMPRESSED_TENSORS_VERSION = "0.20.1"
MODELOPT_VERSION = "0.39.0"

# The static-calibration forward pass: this many sequences of this many random tokens.
CALIBRATION_SEQUENCES = 4
CALIBRATION_LENGTH = 32
CALIBRATION_SEED = 0

_COPIED_FILES = ("generation_config.json", "chat_template.jinja", "chat_template.json")
_COPIED_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges")


@dataclass(frozen=True)
class Options:
    """The validated options of one run (see ``quantize_checkpoint``)."""

    fmt: str
    group_size: int
    block_size: int
    activation_scheme: str | None
    ignore: tuple[str, ...]
    sym: bool
    desc_act: bool


def resolve_options(fmt: str, *, group_size: int = 128, block_size: int = 128,
                    activation_scheme: str | None = None,
                    ignore: Iterable[str] = ("lm_head",), sym: bool | None = None,
                    desc_act: bool = False) -> Options:
    """Check the options against the format and fill in its defaults: the activation
    scheme is "dynamic" for fp8-tensor, fp8-block and ct-fp8 and "static" for modelopt-fp8
    (the only ones each allows besides fp8-tensor's "static"); int4 formats take none.
    ``sym`` defaults to True for gptq and ct-w4a16; awq is always asymmetric."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    ignore = tuple(ignore)
    allowed_schemes = {"fp8-tensor": ("dynamic", "static"), "fp8-block": ("dynamic",),
                       "ct-fp8": ("dynamic",), "modelopt-fp8": ("static",)}
    if fmt in INT4_FORMATS:
        if activation_scheme is not None:
            raise ValueError(f"{fmt} quantizes weights only; it takes no activation scheme")
        if group_size < 8 or group_size % 8:
            raise ValueError(f"group size must be a positive multiple of 8, not {group_size}")
    else:
        schemes = allowed_schemes[fmt]
        activation_scheme = activation_scheme or schemes[0]
        if activation_scheme not in schemes:
            raise ValueError(f"{fmt} supports activation scheme {' or '.join(schemes)}, "
                             f"not {activation_scheme!r}")
    if block_size < 1:
        raise ValueError(f"block size must be positive, not {block_size}")
    if fmt == "awq":
        if sym:
            raise ValueError("awq (GEMM, zero_point true) is asymmetric; --sym does not apply")
        if not any(_matches("lm_head", entry) for entry in ignore):
            raise ValueError("awq checkpoints never quantize lm_head; keep it ignored")
        sym = False
    elif fmt in ("gptq", "ct-w4a16"):
        sym = True if sym is None else sym
    elif sym is not None:
        raise ValueError(f"{fmt} is symmetric FP8; --sym/--asym apply to int4 formats")
    if desc_act and fmt != "gptq":
        raise ValueError("--desc-act applies to the gptq format only")
    if fmt == "gptq" and any(not _matches("lm_head", entry) for entry in ignore):
        raise ValueError("a gptq config can only leave lm_head unquantized")
    return Options(fmt, group_size, block_size, activation_scheme, ignore, bool(sym), desc_act)


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, **options) -> Path:
    """Quantize the checkpoint in ``src`` into ``dst`` (created if missing) in format
    ``fmt``; the keyword options are those of ``resolve_options``. Returns ``dst``."""
    opts = resolve_options(fmt, **options)
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src} is already quantized ({config['quantization_config']})")
    tensors = _read_tensors(src)
    linears = _linear_modules(src)
    targets = [name for name in linears
               if f"{name}.weight" in tensors
               and not any(_matches(name, entry) for entry in opts.ignore)]
    if not targets:
        raise ValueError(f"no linear layer of {src} is left to quantize")
    # Linear modules the checkpoint does not store (a tied lm_head) cannot be quantized;
    # formats that list unquantized modules name them too.
    unstored = [name for name in linears if f"{name}.weight" not in tensors
                and not any(_matches(name, entry) for entry in opts.ignore)]
    excluded = list(opts.ignore) + unstored

    input_scales: dict[str, torch.Tensor] = {}
    if opts.activation_scheme == "static":
        input_scales = _calibrate(src, targets, config["vocab_size"])

    writer = _WRITERS[opts.fmt]
    replaced = {f"{prefix}.weight" for prefix in targets}
    out = {name: t for name, t in tensors.items() if name not in replaced}
    for prefix in targets:
        weight = tensors[f"{prefix}.weight"]
        for suffix, tensor in writer(weight, opts).items():
            out[f"{prefix}.{suffix}"] = tensor.contiguous()
        if prefix in input_scales:
            out[f"{prefix}.input_scale"] = input_scales[prefix]

    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    quant_config, side_files = _quantization_config(opts, excluded)
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, content in side_files.items():
        (dst / name).write_text(json.dumps(content, indent=4) + "\n")
    for path in src.iterdir():
        if path.is_file() and (path.name in _COPIED_FILES
                               or path.name.startswith(_COPIED_PREFIXES)):
            shutil.copyfile(path, dst / path.name)
    return dst


# ---- reading the source ---------------------------------------------------------------


def _read_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, from model.safetensors or the shards its index
    names."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{src} has no model.safetensors or safetensors index")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(src / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    return tensors


def _linear_modules(src: Path) -> list[str]:
    """The names of the model's ``nn.Linear`` modules, found by building it (without
    weights) on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)]


def _matches(name: str, entry: str) -> bool:
    return name == entry or name.endswith("." + entry)


def calibration_tokens(vocab_size: int) -> torch.Tensor:
    """The token ids of the static-calibration pass: ``CALIBRATION_SEQUENCES`` rows of
    ``CALIBRATION_LENGTH`` ids drawn uniformly from the vocabulary with a fixed seed."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (CALIBRATION_SEQUENCES, CALIBRATION_LENGTH),
                         generator=generator)


@torch.no_grad()
def _calibrate(src: Path, targets: Sequence[str], vocab_size: int) -> dict[str, torch.Tensor]:
    """Static activation scales: run the source model (float32, in transformers) over
    ``calibration_tokens`` and return, per target layer, the largest |input| it saw / 448
    as a float32 scalar."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.eval()
    amax = {name: torch.zeros((), dtype=torch.float32) for name in targets}
    hooks = []
    for name in targets:
        def record(module, args, name=name):
            amax[name] = torch.maximum(amax[name], args[0].detach().abs().amax().float())
        hooks.append(model.get_submodule(name).register_forward_pre_hook(record))
    for row in calibration_tokens(vocab_size):
        model(row[None])
    for hook in hooks:
        hook.remove()
    return {name: _fp8_scale(value) for name, value in amax.items()}


# ---- FP8 --------------------------------------------------------------------------------


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in float32, kept positive for an all-zero tensor."""
    return (amax.float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def _to_fp8(values: torch.Tensor) -> torch.Tensor:
    """Round float32 values, already divided by their scale, to e4m3 (saturating)."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _write_fp8_tensor(weight: torch.Tensor, opts: Options) -> dict[str, torch.Tensor]:
    w = weight.float()
    scale = _fp8_scale(w.abs().amax())
    return {"weight": _to_fp8(w / scale), "weight_scale": scale}


def _write_fp8_block(weight: torch.Tensor, opts: Options) -> dict[str, torch.Tensor]:
    w = weight.float()
    n, k = w.shape
    b = opts.block_size
    rows, cols = -(-n // b), -(-k // b)
    padded = torch.zeros(rows * b, cols * b, dtype=torch.float32)
    padded[:n, :k] = w.abs()
    amax = padded.view(rows, b, cols, b).amax(dim=(1, 3))
    scale = _fp8_scale(amax)
    per_element = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
    return {"weight": _to_fp8(w / per_element), "weight_scale_inv": scale}


def _write_ct_fp8(weight: torch.Tensor, opts: Options) -> dict[str, torch.Tensor]:
    w = weight.float()
    # Stored in the weight's dtype; the codes are computed with the stored value.
    scale = _fp8_scale(w.abs().amax(dim=1, keepdim=True)).to(_scale_dtype(weight))
    return {"weight": _to_fp8(w / scale.float()), "weight_scale": scale}


def _scale_dtype(weight: torch.Tensor) -> torch.dtype:
    """compressed-tensors keeps scales in the weight's float dtype (fp16 otherwise)."""
    if weight.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return weight.dtype
    return torch.float16


# ---- int4 -------------------------------------------------------------------------------


def _group_index(weight: torch.Tensor, opts: Options) -> torch.Tensor:
    """The group of each input column: ``k // G``, or with ``desc_act`` the columns taken in
    descending order of squared weight norm, G at a time."""
    k = weight.shape[1]
    if k % opts.group_size:
        raise ValueError(f"in-features {k} is not a multiple of the group size "
                         f"{opts.group_size}")
    ranks = torch.arange(k)
    if opts.desc_act:
        order = torch.argsort((weight.float() ** 2).sum(dim=0), descending=True, stable=True)
        ranks = torch.empty_like(order)
        ranks[order] = torch.arange(k)
    return ranks // opts.group_size


def _int4_quantize(weight: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool,
                   scale_dtype: torch.dtype, zero_at_least_one: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes of ``weight`` [N, K] with one (scale, zero) per output
    row and group (``g_idx`` maps each input column to its group). Returns the codes
    [N, K] in 0..15, the scales [N, groups] in ``scale_dtype`` (the codes are computed
    with these stored values) and the zeros [N, groups], all but the scales int64.

    Symmetric: scale = amax / 7.5, zero 8. Asymmetric: min and max widened to include 0,
    scale = (max - min) / 15, zero = round(-min / scale); with ``zero_at_least_one`` a zero
    that rounds to 0 becomes 1 with scale = max / 14. An all-zero group gets scale 1."""
    w = weight.float()
    n = w.shape[0]
    index = g_idx.expand(n, -1)
    low = torch.zeros(n, groups).scatter_reduce(1, index, w, "amin", include_self=True)
    high = torch.zeros(n, groups).scatter_reduce(1, index, w, "amax", include_self=True)
    if sym:
        scale = torch.maximum(-low, high) / 7.5
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.full_like(scale, 8.0)
    else:
        scale = (high - low) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-low / scale).clamp(0, 15)
        if zero_at_least_one:
            lifted = zero == 0
            scale = torch.where(lifted & (high > 0), high / 14, scale)
            zero = torch.where(lifted, torch.ones_like(zero), zero)
    scale = scale.clamp(min=torch.finfo(scale_dtype).tiny).to(scale_dtype)
    per_column_scale = scale.float().gather(1, index)
    per_column_zero = zero.gather(1, index)
    codes = torch.clamp(torch.round(w / per_column_scale) + per_column_zero, 0, 15)
    return codes.to(torch.int64), scale, zero.to(torch.int64)


def _pack_int4(codes: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """Pack 4-bit codes [R, C] into int32 [R, ceil(C/8)] along the last dimension: nibble i
    (bits 4i .. 4i+3) of word j holds column ``8j + order[i]``; a partial last word is
    padded with zeros."""
    rows, cols = codes.shape
    words = -(-cols // 8)
    padded = torch.zeros(rows, words * 8, dtype=torch.int64)
    padded[:, :cols] = codes
    eights = padded.view(rows, words, 8)
    packed = torch.zeros(rows, words, dtype=torch.int64)
    for nibble, column in enumerate(order):
        packed |= eights[:, :, column] << (4 * nibble)
    # The words are unsigned 32-bit patterns; store them as the int32 with the same bits.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def _write_awq(weight: torch.Tensor, opts: Options) -> dict[str, torch.Tensor]:
    n = weight.shape[0]
    if n % 8:
        raise ValueError(f"awq packs 8 output columns per word; out-features {n} is not "
                         "a multiple of 8")
    g_idx = _group_index(weight, opts)
    groups = weight.shape[1] // opts.group_size
    codes, scale, zero = _int4_quantize(weight, g_idx, groups, sym=False,
                                        scale_dtype=torch.float16)
    return {"qweight": _pack_int4(codes.T, AWQ_ORDER),
            "qzeros": _pack_int4(zero.T, AWQ_ORDER),
            "scales": scale.T}


def _write_gptq(weight: torch.Tensor, opts: Options) -> dict[str, torch.Tensor]:
    n = weight.shape[0]
    if n % 8:
        raise ValueError(f"gptq packs 8 zeros per word; out-features {n} is not a "
                         "multiple of 8")
    g_idx = _group_index(weight, opts)
    groups = weight.shape[1] // opts.group_size
    codes, scale, zero = _int4_quantize(weight, g_idx, groups, sym=opts.sym,
                                        scale_dtype=torch.float16, zero_at_least_one=True)
    return {"qweight": _pack_int4(codes, SEQUENTIAL_ORDER).T,
            "qzeros": _pack_int4((zero - 1).T, SEQUENTIAL_ORDER),
            "scales": scale.T,
            "g_idx": g_idx.to(torch.int32)}


def _write_ct_w4a16(weight: torch.Tensor, opts: Options) -> dict[str, torch.Tensor]:
    g_idx = _group_index(weight, opts)
    groups = weight.shape[1] // opts.group_size
    codes, scale, zero = _int4_quantize(weight, g_idx, groups, sym=opts.sym,
                                        scale_dtype=_scale_dtype(weight))
    out = {"weight_packed": _pack_int4(codes, SEQUENTIAL_ORDER),
           "weight_scale": scale,
           "weight_shape": torch.tensor(weight.shape, dtype=torch.int64)}
    if not opts.sym:
        out["weight_zero_point"] = _pack_int4(zero.T, SEQUENTIAL_ORDER).T
    return out


_WRITERS: dict[str, Callable[[torch.Tensor, Options], dict[str, torch.Tensor]]] = {
    "fp8-tensor": _write_fp8_tensor,
    "fp8-block": _write_fp8_block,
    "ct-fp8": _write_ct_fp8,
    "modelopt-fp8": _write_fp8_tensor,
    "awq": _write_awq,
    "gptq": _write_gptq,
    "ct-w4a16": _write_ct_w4a16,
}


# ---- configs ----------------------------------------------------------------------------


def _quantization_config(opts: Options, excluded: list[str]) -> tuple[dict, dict[str, dict]]:
    """The ``quantization_config`` for config.json and any side files (name -> JSON)."""
    others = [name for name in excluded if not _matches("lm_head", name)]
    if opts.fmt == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": opts.activation_scheme,
                "ignored_layers": excluded}, {}
    if opts.fmt == "fp8-block":
        config: dict[str, object] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [opts.block_size, opts.block_size]}
        if others:
            config["modules_to_not_convert"] = excluded
        return config, {}
    if opts.fmt == "ct-fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                   "strategy": "channel", "dynamic": False}
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                       "strategy": "token", "dynamic": True}
        return _compressed_tensors_config("float-quantized", weights, activations, excluded), {}
    if opts.fmt == "ct-w4a16":
        weights = {"num_bits": 4, "type": "int", "symmetric": opts.sym,
                   "group_size": opts.group_size, "strategy": "group", "dynamic": False}
        return _compressed_tensors_config("pack-quantized", weights, None, excluded), {}
    if opts.fmt == "modelopt-fp8":
        producer = {"name": "modelopt", "version": MODELOPT_VERSION}
        hf_quant_config = {"producer": producer,
                           "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                            "exclude_modules": excluded}}
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        config = {"config_groups": {"group_0": {"input_activations": dict(fp8),
                                                "weights": dict(fp8),
                                                "targets": ["Linear"]}},
                  "ignore": excluded, "quant_algo": "FP8", "producer": producer,
                  "quant_method": "modelopt"}
        return config, {"hf_quant_config.json": hf_quant_config}
    if opts.fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": opts.group_size,
                "zero_point": True, "version": "gemm",
                "modules_to_not_convert": others or None}, {}
    return {"quant_method": "gptq", "bits": 4, "group_size": opts.group_size,
            "desc_act": opts.desc_act, "sym": opts.sym, "static_groups": False,
            "lm_head": not any(_matches("lm_head", name) for name in excluded),
            "checkpoint_format": "gptq"}, {}


def _compressed_tensors_config(fmt: str, weights: dict, input_activations: dict | None,
                               ignore: list[str]) -> dict:
    """What compressed-tensors' ``ModelCompressor.update_config`` writes for one config
    group targeting every Linear."""
    return {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": input_activations,
                                      "output_activations": None, "format": None}},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


# ---- command line -----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllmpy.tools.quantize",
        description="Write a quantized copy of a safetensors checkpoint in a published "
                    "layout (see the module documentation for each format).")
    parser.add_argument("src", help="source model directory (config.json + safetensors)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--group-size", type=int, default=128,
                        help="int4 formats: input columns per scale (default 128)")
    parser.add_argument("--block-size", type=int, default=128,
                        help="fp8-block: rows and columns per scale block (default 128)")
    parser.add_argument("--activation-scheme", choices=("dynamic", "static"),
                        help="FP8 formats: static calibrates input_scale tensors")
    parser.add_argument("--ignore", nargs="*", default=["lm_head"],
                        help="modules to leave unquantized (default: lm_head; give the "
                             "flag alone to quantize every linear layer)")
    symmetry = parser.add_mutually_exclusive_group()
    symmetry.add_argument("--sym", dest="sym", action="store_true", default=None,
                          help="gptq / ct-w4a16: symmetric int4 (the default)")
    symmetry.add_argument("--asym", dest="sym", action="store_false",
                          help="gptq / ct-w4a16: asymmetric int4 with zero points")
    parser.add_argument("--desc-act", action="store_true",
                        help="gptq: groups in a permuted column order (a non-monotonic g_idx)")
    args = parser.parse_args(argv)
    try:
        dst = quantize_checkpoint(args.src, args.dst, args.format, group_size=args.group_size,
                                  block_size=args.block_size,
                                  activation_scheme=args.activation_scheme,
                                  ignore=args.ignore, sym=args.sym, desc_act=args.desc_act)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {args.format} checkpoint to {dst}")


if __name__ == "__main__":
    main()
