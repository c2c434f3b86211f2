"""The Mamba2 mixer over engine steps (prefill chunks, decodes, requests joining later, each
in its own seat) against transformers' mixers run over each whole sequence: Mamba2's and
Falcon-H1's (norm after the gate, or no norm, and the muP multipliers); the PyTorch path
and the Triton one (the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.core.cache_spec import RecurrentStateSpec, StateTensor
from vllmpy.layers.custom_op import bind_ops
from vllmpy.layers.mamba2 import Mamba2Mixer
from vllmpy.models.weights import load_packed_weights

HIDDEN, HEADS, HEAD_DIM, GROUPS, D_STATE, CONV = 32, 4, 16, 2, 8, 4

# the steps of three requests: {request: (seat, tokens this step)}; request 2 joins later
STEPS = [{0: (2, 10), 1: (0, 3)},
         {0: (2, 1), 1: (0, 6), 2: (1, 1)},
         {0: (2, 1), 1: (0, 1), 2: (1, 4)},
         {0: (2, 1), 1: (0, 1), 2: (1, 1)}]


def _metadata(step: dict[int, tuple[int, int]], done: dict[int, int], pad: int,
              device: str) -> AttentionMetadata:
    qsl, seq_lens = [0], []
    for req, (_, n) in step.items():
        qsl.append(qsl[-1] + n)
        seq_lens.append(done.get(req, 0) + n)
    seats = [seat for seat, _ in step.values()]
    tokens = qsl[-1] + pad
    return AttentionMetadata(
        num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        seq_lens_cpu=seq_lens,
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((len(step), 1), dtype=torch.int32, device=device),
        block_size=16, max_query_len=max(n for _, n in step.values()),
        max_seq_len=max(seq_lens),
        state_indices=torch.tensor(seats, dtype=torch.int32, device=device),
        state_indices_cpu=seats)


def _run_steps(mixer: Mamba2Mixer, inputs: dict[int, torch.Tensor],
               device: str) -> dict[int, torch.Tensor]:
    """Feed each request's rows step by step (two padding rows after the real ones);
    returns each request's outputs, concatenated."""
    spec = mixer.cache_spec()
    mixer.bind_state(spec.allocate(3, torch.float32, torch.float32, device))
    done: dict[int, int] = {}
    outs: dict[int, list[torch.Tensor]] = {r: [] for r in inputs}
    for step in STEPS:
        rows = [inputs[r][done.get(r, 0):done.get(r, 0) + n] for r, (_, n) in step.items()]
        pad = torch.randn(2, HIDDEN)
        meta = _metadata(step, done, 2, device)
        out = mixer(torch.cat(rows + [pad]).to(device), meta).cpu()
        for i, (r, (_, n)) in enumerate(step.items()):
            outs[r].append(out[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]])
            done[r] = done.get(r, 0) + n
    return {r: torch.cat(o) for r, o in outs.items()}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name in ("A_log", "dt_bias"):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0, 0.3)


def _hf_mamba2(limit: tuple[float, float]):
    import transformers as tf
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer

    cfg = tf.Mamba2Config(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM,
                          n_groups=GROUPS, state_size=D_STATE, conv_kernel=CONV, expand=2,
                          time_step_limit=limit, layer_norm_epsilon=1e-5, chunk_size=8)
    hf = HFMixer(cfg, layer_idx=0).eval()
    _randomize(hf, 0)
    ours = Mamba2Mixer(HIDDEN, HEADS, HEAD_DIM, D_STATE, GROUPS, CONV, eps=1e-5,
                       time_step_limit=limit)
    return hf, ours


def _hf_falcon(rms_norm: bool):
    import transformers as tf
    from transformers.models.falcon_h1.modeling_falcon_h1 import (
        FalconH1Mixer,
        compute_mup_vector,
    )

    mults = [0.5, 1.5, 0.8, 1.2, 0.7]
    cfg = tf.FalconH1Config(hidden_size=HIDDEN, mamba_d_ssm=HEADS * HEAD_DIM,
                            mamba_n_heads=HEADS, mamba_d_head=HEAD_DIM,
                            mamba_n_groups=GROUPS, mamba_d_state=D_STATE,
                            mamba_d_conv=CONV, mamba_rms_norm=rms_norm,
                            mamba_norm_before_gate=True, ssm_multipliers=mults,
                            ssm_in_multiplier=0.9, mamba_chunk_size=8,
                            projectors_bias=True, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=1, rms_norm_eps=1e-5)
    hf = FalconH1Mixer(cfg, layer_idx=0).eval()
    hf.register_buffer("mup_vector", compute_mup_vector(cfg), persistent=False)
    _randomize(hf, 1)
    ours = Mamba2Mixer(HIDDEN, HEADS, HEAD_DIM, D_STATE, GROUPS, CONV, eps=1e-5,
                       out_bias=True, rms_norm=rms_norm, norm_before_gate=True,
                       in_multiplier=0.9, proj_multipliers=tuple(mults))
    return hf, ours


CASES = {
    "mamba2": lambda: _hf_mamba2((0.0, float("inf"))),
    "mamba2-dt-limit": lambda: _hf_mamba2((0.3, 1.0)),
    "falcon-norm": lambda: _hf_falcon(True),
    "falcon-no-norm": lambda: _hf_falcon(False),
}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_mixer_over_steps_matches_transformers(case, kernels):
    hf, ours = CASES[case]()
    loaded = load_packed_weights(ours, hf.state_dict().items(), {})
    assert loaded >= {"in_proj.weight", "conv1d.weight", "A_log", "D", "dt_bias"}
    # "triton": the kernels' binding, on CPU tensors when the interpreter runs them
    device = "cuda" if torch.cuda.is_available() and kernels == "triton" else "cpu"
    ours = ours.to(device)
    ours.bind_device(torch.device("cuda" if kernels == "triton" else "cpu"))
    totals = {0: 13, 1: 11, 2: 6}
    torch.manual_seed(5)
    inputs = {r: torch.randn(n, HIDDEN) for r, n in totals.items()}
    got = _run_steps(ours, inputs, device)
    for r, x in inputs.items():
        expected = hf(x[None])[0]
        torch.testing.assert_close(got[r], expected, atol=2e-4, rtol=2e-4,
                                   msg=lambda m, r=r: f"request {r}: {m}")


def test_cache_spec_and_state_binding():
    mixer = Mamba2Mixer(HIDDEN, HEADS, HEAD_DIM, D_STATE, GROUPS, CONV, eps=1e-5)
    conv_dim = HEADS * HEAD_DIM + 2 * GROUPS * D_STATE
    assert mixer.cache_spec() == RecurrentStateSpec("mamba2", (
        StateTensor("conv", (conv_dim, CONV - 1), "model"),
        StateTensor("ssm", (HEADS, HEAD_DIM, D_STATE), "ssm")))
    with pytest.raises(ValueError, match="state 'ssm' has shape"):
        mixer.bind_state({"conv": torch.zeros(3, conv_dim, CONV - 1),
                          "ssm": torch.zeros(3, HEADS, HEAD_DIM, D_STATE + 1)})
    with pytest.raises(ValueError, match="takes state tensors"):
        mixer.bind_state({"conv": torch.zeros(3, conv_dim, CONV - 1)})
    with pytest.raises(ValueError, match="n_groups"):
        Mamba2Mixer(HIDDEN, HEADS, HEAD_DIM, D_STATE, 3, CONV, eps=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_cuda_forward_replays_from_a_cuda_graph():
    """The Triton path reads nothing from the host: a decode step and a mixed step,
    captured in CUDA graphs and replayed from the same seats, give the eager outputs and
    leave the same states."""
    hf, ours = CASES["falcon-norm"]()
    load_packed_weights(ours, hf.state_dict().items(), {})
    ours = ours.cuda()
    bind_ops(ours, torch.device("cuda"))
    g = torch.Generator().manual_seed(9)
    spec = ours.cache_spec()
    initial = {t.name: torch.randn(4, *t.shape, generator=g).cuda() for t in spec.tensors}
    for step in ({0: (2, 1), 1: (0, 1), 2: (1, 1)}, {0: (2, 5), 1: (0, 1), 2: (1, 3)}):
        meta = _metadata(step, {0: 4, 1: 4, 2: 4}, 2, "cuda")
        x = torch.randn(meta.num_actual_tokens + 2, HIDDEN, generator=g).cuda()
        eager_states = {k: v.clone() for k, v in initial.items()}
        ours.bind_state(eager_states)
        eager = ours(x, meta)
        graph_states = {k: v.clone() for k, v in initial.items()}
        ours.bind_state(graph_states)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ours(x, meta)  # warm-up: compiles the kernels
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ours(x, meta)
        for k, v in graph_states.items():
            v.copy_(initial[k])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager)
        for k in initial:
            torch.testing.assert_close(graph_states[k], eager_states[k])
