"""``eagle`` / ``eagle3``: a small head (``vllmpy.models.llama_eagle``) proposes the
drafts from the target's own hidden states, greedily, one head forward per draft.

The head's KV (one cache per head layer) lives on the target's block table, like a draft
model's: position p holds what the head computed from the token at p + 1 and the target's
hidden state at p. So the head can only cache positions the target has just computed, and
it runs after every step, while that step's hidden states are at hand (``observe``): for
each request of the step it computes the positions the step computed whose next token is
known (all of a prefill chunk; the accepted ones of a verify step), and for a request that
drafts, its last output gives the first draft; k - 1 one-token forwards, each reading the
head's own last state, give the others (their KV goes to the lookahead slots, rewritten
by the next step). A request served from the prefix cache finds the head's KV of its
cached blocks already there, written by the request that computed them.

EAGLE-3 reads the target's hidden states entering three of its layers: forward hooks on
the target's decoder layers copy them into one buffer per step (a copy a CUDA graph
captures with the layer).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from vllmpy.config import ConfigError, log
from vllmpy.loader.source import ModelSource
from vllmpy.models.llama_eagle import HEAD_ARCHITECTURES, EagleConfig, EagleHead
from vllmpy.spec_decode.config import FLAG, SpeculativeConfig
from vllmpy.spec_decode.draft_model import ModelProposer, draft_source
from vllmpy.worker.input_batch import StepInputs


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's choice of the three target layers an EAGLE-3 head reads when its config
    names none."""
    return (2, num_layers // 2, num_layers - 3)


def _checkpoint_names(source: ModelSource) -> set[str]:
    """The tensor names of a head directory's safetensors (headers only)."""
    from safetensors import safe_open

    from vllmpy.loader.safetensors_loader import safetensors_files

    names: set[str] = set()
    for path in safetensors_files(source.path):
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(n.removeprefix("model.") for n in f.keys())  # noqa: SIM118
    return names


def head_config(config: SpeculativeConfig, source: ModelSource,
                target_text: Any) -> EagleConfig:
    """The head's config, checked against the method and the target."""
    hf = dict(source.hf_config)
    where = f"{FLAG}: EAGLE head {source.model!r}"
    if "speculators_model_type" in hf:
        raise ConfigError(f"{where} is in the speculators format, which is not supported; "
                          f"use a head in EAGLE's own layout (config.json with "
                          f"architectures, fc / midlayer weights)")
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    eagle3 = config.method == "eagle3"
    if arch == "LlamaForCausalLM":  # EAGLE's trainers keep the base model's name
        arch = "Eagle3LlamaForCausalLM" if eagle3 else "EagleLlamaForCausalLM"
    if arch not in HEAD_ARCHITECTURES:
        raise ConfigError(f"{where} has architecture {arch!r}, not an EAGLE head this "
                          f"engine builds ({', '.join(sorted(HEAD_ARCHITECTURES))})")
    if HEAD_ARCHITECTURES[arch] != eagle3:
        other = "eagle3" if HEAD_ARCHITECTURES[arch] else "eagle"
        raise ConfigError(f"{where} is an {other} head ({arch}) but the method is "
                          f"{config.method!r}; use \"method\": \"{other}\"")
    hf["architectures"] = [arch]
    try:
        head = EagleConfig.from_hf(hf, arch)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if source.kind == "hf_dir":
        names = _checkpoint_names(source)
        has_embed, has_lm_head = "embed_tokens.weight" in names, "lm_head.weight" in names
    elif source.kind == "dummy":
        has_embed, has_lm_head = False, head.draft_vocab_size != head.vocab_size
    else:
        raise ConfigError(f"{where}: an EAGLE head loads from a Hugging Face directory "
                          f"(safetensors), not a {source.kind} file")
    if not eagle3:  # EAGLE reads the target's embeddings and LM head (as vLLM does)
        has_embed = has_lm_head = False
    head = dataclasses.replace(head, has_embed_tokens=has_embed, has_lm_head=has_lm_head)
    _check_against_target(head, target_text, where)
    return head


def _check_against_target(head: EagleConfig, target: Any, where: str) -> None:
    if head.vocab_size != target.vocab_size:
        raise ConfigError(f"{where} has a vocabulary of {head.vocab_size} tokens, the "
                          f"target {target.vocab_size}: a head drafts in the target's "
                          f"vocabulary")
    if head.target_hidden_size != target.hidden_size:
        raise ConfigError(f"{where} reads hidden states of width "
                          f"{head.target_hidden_size}, the target's are "
                          f"{target.hidden_size}: the head was trained for another model")
    if not head.has_embed_tokens and head.hidden_size != target.hidden_size:
        raise ConfigError(f"{where} has width {head.hidden_size} and no embeddings of its "
                          f"own; the target's are {target.hidden_size} wide")
    if head.eagle3 and not head.has_lm_head and head.draft_vocab_size != head.vocab_size:
        raise ConfigError(f"{where} drafts over {head.draft_vocab_size} tokens but has no "
                          f"lm_head of its own")
    if head.eagle3 and head.use_aux_hidden_state:
        n = target.num_hidden_layers
        ids = head.aux_layer_ids or default_aux_layers(n)
        if any(not 0 < i < n for i in ids):
            raise ConfigError(f"{where} reads the hidden states entering target layers "
                              f"{list(ids)}; the target has {n} layers (each must be in "
                              f"1..{n - 1}; set eagle_config.eagle_aux_hidden_state_layer_ids)")


def kv_config(config: SpeculativeConfig, target_source_kind: str,
              target_text: Any) -> EagleConfig:
    return head_config(config, draft_source(config, target_source_kind), target_text)


def _decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The target's decoder layers: its first ModuleList of ``num_layers`` modules."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise ConfigError(f"{FLAG}: the target model's decoder layers cannot be found for an "
                      f"EAGLE-3 head to read")


def _layer_output(output: Any) -> torch.Tensor:
    """A decoder layer's output hidden state: ``hidden + residual`` for the layers that
    return the two apart, else the one tensor."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden if residual is None else hidden + residual
    return output


class EagleProposer(ModelProposer):
    every_step = True

    def __init__(self, config: SpeculativeConfig, runner: Any) -> None:
        mc = runner.config.model
        source = draft_source(config, mc.source_kind)
        text = head_config(config, source, mc.text_config)
        seconds = self._load(config, runner, source, text, "EAGLE head", EagleHead)
        head = self.model
        assert isinstance(head, EagleHead)
        if source.kind == "dummy":
            head.d2t.zero_()  # random heads draft in the target's ids
        head.share(runner.model)
        log(f"speculative decoding: {'EAGLE-3' if text.eagle3 else 'EAGLE'} head "
            f"{os.path.basename(source.model.rstrip('/')) or source.model} loaded "
            f"({text.num_hidden_layers} layer(s)) in {seconds:.2f} s")
        # the last target step: (its request ids, its inputs, the hidden states read)
        self._observed: tuple[Sequence[str], StepInputs, torch.Tensor] | None = None
        self._aux: torch.Tensor | None = None
        if text.eagle3 and text.use_aux_hidden_state:
            self._hook_target(mc.text_config)

    def _hook_target(self, target_text: Any) -> None:
        """Copy the hidden states entering the head's three target layers into ``_aux``
        (one [tokens, 3 * hidden] buffer) at every target forward."""
        n, width = target_text.num_hidden_layers, target_text.hidden_size
        ids = self.text.aux_layer_ids or default_aux_layers(n)
        layers = _decoder_layers(self.runner.model, n)
        self._aux = torch.empty(self.buffers.max_tokens, len(ids) * width,
                                dtype=self.runner.config.model.dtype,
                                device=self.runner.device)
        aux = self._aux

        def hook(j: int):
            def copy(module: nn.Module, args: Any, output: Any) -> None:
                out = _layer_output(output)
                aux[:out.shape[0], j * width:(j + 1) * width].copy_(out)
            return copy

        for j, i in enumerate(ids):  # the state entering layer i leaves layer i - 1
            layers[i - 1].register_forward_hook(hook(j))

    def observe(self, req_ids: Sequence[str], step: StepInputs,
                hidden_states: torch.Tensor) -> None:
        self._observed = (list(req_ids), step,
                          hidden_states if self._aux is None else self._aux)

    @torch.inference_mode()
    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: Sequence[int],
                max_drafts: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in rows]
        observed, self._observed = self._observed, None
        if observed is None:
            return drafts
        step_req_ids, step, hidden = observed
        batch = self.runner.input_batch
        qsl = step.query_start_loc.astype(np.int64)
        counts = np.diff(qsl)
        starts = step.seq_lens.astype(np.int64) - counts
        # Per request of the step still running: the positions it computed whose next
        # token is known.
        sel, sel_rows, take = [], [], []
        for i, req_id in enumerate(step_req_ids):
            row = batch.index.get(req_id)
            if row is None:
                continue
            m = min(int(counts[i]), int(num_tokens[row]) - 1 - int(starts[i]))
            if m > 0:
                sel.append(i)
                sel_rows.append(row)
                take.append(m)
        if not sel:
            return drafts
        first = batch.prepare([step_req_ids[i] for i in sel], take, None, starts[sel])
        ids = token_ids[np.repeat(sel_rows, take), first.positions + 1].astype(np.int64)
        src = np.concatenate([np.arange(qsl[i], qsl[i] + m) for i, m in zip(sel, take)])
        states = self.model.combine(hidden[torch.as_tensor(src, device=hidden.device)])
        out, back = self._forward(dataclasses.replace(first, input_ids=ids), states)
        # The requests that draft: their last row's output gives the first draft.
        where = {row: k for k, row in enumerate(sel_rows)}
        last = np.cumsum(take) - 1
        active = [j for j, (row, cap) in enumerate(zip(rows, max_drafts))
                  if cap > 0 and row in where]
        if not active:
            return drafts
        pick = torch.as_tensor(last[[where[rows[j]] for j in active]], device=out.device)
        tokens, state = self.model.draft_ids(out[pick]), back[pick]
        positions = np.array([starts[sel[where[rows[j]]]] + take[where[rows[j]]] - 1
                              for j in active], dtype=np.int64)
        req_ids = [batch.req_ids[rows[j]] for j in active]
        for step_no in range(1, max(max_drafts[j] for j in active) + 1):
            for j, tok in zip(active, tokens.tolist()):
                drafts[j].append(tok)
            keep = [a for a, j in enumerate(active) if max_drafts[j] > step_no]
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.as_tensor(keep, device=out.device)
                tokens, state = tokens[index], state[index]
                active = [active[a] for a in keep]
                positions = positions[keep]
                req_ids = [req_ids[a] for a in keep]
            positions = positions + 1
            one = batch.prepare(req_ids, [1] * len(active), None, positions)
            out, back = self._forward(
                dataclasses.replace(one, input_ids=tokens.cpu().numpy()), state)
            tokens, state = self.model.draft_ids(out), back
        return drafts

    def _forward(self, step: StepInputs, states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager forward of the head over ``step``'s tokens with ``states`` [tokens,
        hidden] -> (the states its LM head reads, the states the next draft reads)."""
        ids, positions, meta = self._inputs(step)
        return self.model(ids, positions, states, meta)


def make(config: SpeculativeConfig, runner: Any) -> EagleProposer:
    return EagleProposer(config, runner)
