"""Where an engine start-up's time goes: the load phases, and every Triton kernel variant
compiled in this process with its wall time (a disk-cache hit shows as a few ms).

Starts the engine in-process on Qwen3-8B with dummy weights and the P8 server's settings
(64 sequences, 4,096 blocks), from an empty Triton cache unless ``--warm``:

    python benchmarks/investigations/startup_profile.py --out DIR [--model qwen3-8b] [--warm]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--warm", action="store_true", help="keep the Triton cache as it is")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also profile the engine construction; print its top N functions")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not args.warm:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    os.environ["VT_LOAD_STATS"] = "1"
    t0 = time.perf_counter()

    import triton.compiler

    compiles: list[tuple[str, float, float]] = []  # (kernel, start since t0, seconds)
    original = triton.compiler.compile

    def timed(src, *a, **kw):
        start = time.perf_counter()
        try:
            return original(src, *a, **kw)
        finally:
            name = getattr(getattr(src, "fn", None), "__name__", str(src))
            compiles.append((name, start - t0, time.perf_counter() - start))

    triton.compiler.compile = timed  # JITFunction binds it on its first launch

    from vllmpy.engine.llm import LLM

    t_import = time.perf_counter() - t0
    prof = None
    if args.cprofile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    llm = LLM(model=os.path.join(BENCH_DIR, "configs", args.model), load_format="dummy",
              device="cuda", dtype="bfloat16", max_num_seqs=64, num_blocks=4096)
    t_engine = time.perf_counter() - t0
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)
    del llm

    by_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for name, _, sec in compiles:
        by_kernel[name].append(sec)
    report = {
        "model": args.model, "cold": not args.warm, "import_s": t_import,
        "engine_ready_s": t_engine,
        "compile_s_total": sum(s for _, _, s in compiles),
        "compiles": [{"kernel": n, "at_s": round(at, 3), "s": round(s, 3)}
                     for n, at, s in compiles],
    }
    with open(os.path.join(args.out, f"startup_{args.model}_{'warm' if args.warm else 'cold'}.json"),
              "w") as f:
        json.dump(report, f, indent=1)
    slow = sum(1 for _, _, s in compiles if s > 0.1)
    print(f"{args.model} {'warm' if args.warm else 'cold'}: imports {t_import:.2f} s, engine "
          f"ready at {t_engine:.2f} s; {len(compiles)} first launches of a variant in this "
          f"process ({slow} over 0.1 s, i.e. compiled here), {report['compile_s_total']:.2f} s "
          f"in all")
    for name, secs in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(secs):7.2f} s  {len(secs):3d}x  {name}")


if __name__ == "__main__":
    main()
