"""The Mamba2 families through ``LLM`` in float32 and in bf16 against transformers' float32
on the tiny random weights of tests/models/test_mamba2_families.py: per variant the mean
absolute teacher-forced log-prob error of six prompts (the GPU agreement test's first six),
beside transformers' own bf16 error, under the installed transformers release. The engine
in float32 sits at rounding distance from a transformers that computes the same model.

    python benchmarks/hybrid_fp32_check.py [--device cuda] [--variants mamba2,falcon_h1]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from models.test_mamba2_families import VOCAB, _make  # noqa: E402

from vllmpy import LLM, SamplingParams  # noqa: E402


def _prompts() -> list[list[int]]:
    """The first six prompts of test_hybrid_families_gpu (same generator, same draws)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 80, (24,), generator=g)][:6]


@torch.no_grad()
def _hf_logprobs(model, prompt: list[int], device: str) -> torch.Tensor:
    ids = torch.tensor([prompt], device=device)
    lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[:-1]
    return lp.gather(1, ids[0, 1:, None])[:, 0].cpu()  # [len - 1]


def _engine_logprobs(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    return [torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], p[1:])])
            for out, p in zip(llm.generate(prompts, params, use_tqdm=False), prompts)]


def check(variant: str, device: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        hf32 = _make(variant, tmp).to(device)
        hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
        prompts = _prompts()
        ref = [_hf_logprobs(hf32, p, device) for p in prompts]
        hf_err = torch.stack([(_hf_logprobs(hf16, p, device) - r).abs().mean()
                              for p, r in zip(prompts, ref)]).mean()
        errs = {}
        for dtype in ("float32", "bfloat16"):
            llm = LLM(tmp, skip_tokenizer_init=True, device=device, dtype=dtype,
                      block_size=16, num_blocks=256, max_num_seqs=32)
            ours = _engine_logprobs(llm, prompts)
            errs[dtype] = torch.stack([(o - r).abs().mean() for o, r in zip(ours, ref)])
            del llm
    return (f"{variant}: log-prob error against transformers float32: engine float32 "
            f"{errs['float32'].mean():.2e} (max of prompts {errs['float32'].max():.2e}), "
            f"engine bf16 {errs['bfloat16'].mean():.4f}, transformers bf16 {hf_err:.4f}")


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="mamba2,granite_moe_hybrid,nemotron_h,falcon_h1")
    args = ap.parse_args()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"device {args.device}")
    for variant in args.variants.split(","):
        print(check(variant, args.device), flush=True)


if __name__ == "__main__":
    main()
