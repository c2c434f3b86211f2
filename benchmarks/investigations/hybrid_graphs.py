"""Do the recurrent layers run under CUDA graphs? For each tiny hybrid family (the model
tests' random configs), float32 on CUDA: greedy continuations of a batch of mixed-length
prompts with the engine eager, then with CUDA graphs captured (decode and mixed graphs),
side by side. Prints per family whether capture succeeded, how many of the continuations
are identical, and the decode rate of each (one request, tiny model: launch-bound, so the
ratio is what graphs save on the host).

    PYTHONPATH=.:tests python benchmarks/investigations/hybrid_graphs.py [--variants a,b]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback

import torch

VARIANTS = ["qwen3_next", "qwen3_5", "mamba2", "nemotron_h", "granite_moe_hybrid",
            "falcon_h1"]


def build(variant: str, path: str) -> int:
    """Write the family's tiny model to ``path``; returns its vocabulary size."""
    if variant.startswith("qwen3"):
        from models.test_qwen3_next import VOCAB, _make
    else:
        from models.test_mamba2_families import VOCAB, _make
    _make(variant, path)
    return VOCAB


def run(path: str, prompts: list[list[int]], graphs: bool) -> tuple[list[list[int]], float]:
    """(greedy continuations, one request's decode tok/s)."""
    from vllmpy import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="float32",
              max_model_len=256, max_num_seqs=16,
              enforce_eager=not graphs)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    long = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], long)  # warm
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts[0]}], long)
    rate = 128 / (time.perf_counter() - start)
    del llm
    torch.cuda.empty_cache()
    return outs, rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    rows = []
    for variant in args.variants.split(","):
        path = tempfile.mkdtemp(prefix=f"{variant}-")
        vocab = build(variant, path)
        g = torch.Generator().manual_seed(0)
        lens = torch.randint(1, 60, (12,), generator=g).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
        eager, eager_rate = run(path, prompts, graphs=False)
        try:
            graphed, graph_rate = run(path, prompts, graphs=True)
        except Exception as e:  # the finding this script exists for
            traceback.print_exc()
            rows.append((variant, f"failed: {type(e).__name__}: {str(e)[:120]}", "-",
                         f"{eager_rate:.1f}", "-"))
            continue
        same = sum(a == b for a, b in zip(eager, graphed))
        rows.append((variant, "captured", f"{same}/{len(prompts)}", f"{eager_rate:.1f}",
                     f"{graph_rate:.1f}"))
    print("| family | CUDA graphs | identical to eager | eager tok/s | graphs tok/s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
