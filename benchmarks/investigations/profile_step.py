"""Where a decode step's time goes on the GPU: the graph replay alone (the device floor)
against the whole engine step, with a cProfile of the host side.

    python benchmarks/investigations/profile_step.py --out DIR [--model qwen3-0.6b] [--batch 1]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import numpy as np
    import torch

    from vllmpy.engine.llm import LLM
    from vllmpy.sampling_params import SamplingParams

    blocks = max(512, args.batch * (args.input_len + args.output_len) // 32 + 64)
    llm = LLM(model=os.path.join(BENCH_DIR, "configs", args.model), load_format="dummy",
              device="cuda", dtype="bfloat16", num_blocks=blocks,
              max_num_seqs=max(args.batch, 1), max_num_batched_tokens=8192)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 10000, args.input_len).tolist()}
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up

    runner = llm.engine.engine_core.model_runner
    graphs = getattr(runner, "graphs", None)
    replay_ms = float("nan")
    if graphs is not None:
        size = next(s for s in graphs.sizes if s >= args.batch)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            graphs.graphs[size].replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t) / 50 * 1e3

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(45)
    with open(os.path.join(args.out, f"profile_{args.model}_b{args.batch}.txt"), "w") as f:
        f.write(s.getvalue())
    steps = args.output_len
    print(f"model={args.model} batch={args.batch} wall={wall:.3f}s out_tok={n_out} "
          f"tok/s={n_out / wall:.1f} ms/step~{wall / steps * 1e3:.3f} "
          f"graph_replay_ms={replay_ms:.3f}")


if __name__ == "__main__":
    main()
