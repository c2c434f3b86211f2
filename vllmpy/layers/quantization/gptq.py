"""GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format: gptq``, the v1 layout), 4 bits.

Tensors of a layer with K inputs, N outputs and groups of G inputs: ``qweight`` int32
[K / 8, N] (word [r, n] holds inputs 8r .. 8r + 7 of output n in nibbles 0..7),
``qzeros`` int32 [K / G, N / 8] (word [g, j] holds zero - 1 of outputs 8j .. 8j + 7: the
v1 convention), ``scales`` float16 [K / G, N], ``g_idx`` int32 [K] (each input's group).
``w[n, k] = (q - zero[g_idx[k]]) * scale[g_idx[k]]``. With ``desc_act`` the groups are
not in input order: the inputs are permuted once at load so that each group is
contiguous, and the activations are permuted the same way at every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllmpy.layers.quantization.base import LinearMethod, QuantizationConfig, QuantizationError
from vllmpy.layers.quantization.dense import DenseMethod
from vllmpy.layers.quantization.w4a16 import Int4Method, check_group, unpack_nibbles

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear


class GPTQMethod(Int4Method):
    name = "gptq"

    def __init__(self, group: int, symmetric: bool, model_dtype: torch.dtype,
                 desc_act: bool) -> None:
        super().__init__(group, symmetric, model_dtype)
        self.desc_act = desc_act
        self.g_idx_loaded = False

    def layout(self, layer: Linear):
        n, k = layer.output_size, layer.input_size
        g = self.group_size(layer)
        return [("qweight", (k // 8, n), torch.int32, 1, 1, False),
                ("qzeros", (k // g, n // 8), torch.int32, 1, 8, False),
                ("scales", (k // g, n), torch.float16, 1, 1, False),
                ("g_idx", (k,), torch.int32, None, 1, False)]

    def checkpoint_names(self, layer: Linear) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.desc_act else ())

    def optional_names(self, layer: Linear) -> tuple[str, ...]:
        return () if self.desc_act else ("g_idx",)

    def load(self, layer, suffix, loaded, shard_id, name) -> None:
        if suffix != "g_idx":
            super().load(layer, suffix, loaded, shard_id, name)
        elif not self.g_idx_loaded:  # the shards of a packed layer share their inputs
            super().load(layer, suffix, loaded, None, name)
            self.g_idx_loaded = True
        elif not torch.equal(layer.g_idx, loaded.to(layer.g_idx.device, torch.int32)):
            raise QuantizationError(f"weight {name}: the shards of one packed layer order "
                                    "their input groups differently (g_idx)")

    def unpack(self, layer: Linear):
        k = layer.input_size
        g = self.group_size(layer)
        codes = unpack_nibbles(layer.qweight, 0).t().contiguous()  # [N, K]
        zeros = (unpack_nibbles(layer.qzeros, 1).to(torch.int16) + 1).t()  # [N, K / G]
        if self.symmetric:
            zeros = None
        else:
            zeros = zeros.clamp(0, 15).to(torch.uint8).contiguous()
        scales = layer.scales.t().contiguous()
        if self.g_idx_loaded:  # act order, or the trivial order written out
            g_idx = layer.g_idx.long()
            in_order = torch.arange(k, device=g_idx.device) // g
            if not torch.equal(g_idx, in_order):
                perm = torch.argsort(g_idx, stable=True)
                if not torch.equal(g_idx[perm], in_order):
                    raise QuantizationError("g_idx does not give every group "
                                            f"{g} inputs")
                codes = codes[:, perm].contiguous()
                self.perm = perm.to(torch.int64)
        return codes, scales, zeros


class GPTQConfig(QuantizationConfig):
    name = "gptq"
    KEYS = {"quant_method", "bits", "group_size", "desc_act", "sym", "static_groups",
            "lm_head", "checkpoint_format", "damp_percent", "damp_auto_increment",
            "true_sequential", "model_name_or_path", "model_file_base_name", "quant_type",
            "meta", "pack_dtype", "format", "v2", "mse", "modules_in_block_to_quantize",
            "dynamic", "act_group_aware", "hyb_act", "adapter"}

    def __init__(self, group: int, sym: bool, desc_act: bool) -> None:
        super().__init__()
        self.group = group
        self.sym = sym
        self.desc_act = desc_act

    @classmethod
    def from_checkpoint(cls, section: dict, where: str) -> GPTQConfig:
        unknown = sorted(set(section) - cls.KEYS)
        if unknown:
            raise QuantizationError(f"{where}: key {unknown[0]!r} of quant_method 'gptq' is "
                                    "not supported")
        if section.get("bits") != 4:
            raise QuantizationError(f"{where}: bits={section.get('bits')} is not supported "
                                    "(W4A16: 4)")
        fmt = section.get("checkpoint_format", section.get("format", "gptq"))
        if fmt != "gptq":
            raise QuantizationError(f"{where}: checkpoint_format={fmt!r} is not supported; "
                                    "supported: ['gptq'] (the v1 layout)")
        if section.get("lm_head"):
            raise QuantizationError(f"{where}: lm_head=true (a quantized output head) is not "
                                    "supported")
        if section.get("dynamic"):
            raise QuantizationError(f"{where}: dynamic (per-module overrides) is not "
                                    "supported")
        group = int(section.get("group_size", 128))
        check_group(group, "group_size", where)
        return cls(group, bool(section.get("sym", True)), bool(section.get("desc_act")))

    def linear_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        if layer_name.endswith("lm_head"):
            return DenseMethod()
        return GPTQMethod(self.group, self.sym, self.model_dtype, self.desc_act)
