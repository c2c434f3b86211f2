"""Summarize an engine step log (``VT_ENGINE_STEP_LOG=1``, one ``vllmpy step:`` line per
step on stderr): how steps split by token count, how long each kind took, and how many
requests waited.

    python benchmarks/investigations/step_log_summary.py server.log
"""

from __future__ import annotations

import collections
import re
import sys

LINE = re.compile(r"vllmpy step: t=([\d.]+) tokens=(\d+) new=(\d+) running=(\d+) "
                  r"waiting=(\d+)")


def main(path: str) -> None:
    steps = []
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                steps.append((float(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5])))
    if len(steps) < 2:
        print("no step lines found (run the server with VT_ENGINE_STEP_LOG=1)")
        return
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for (t, tokens, _new, running, _), (t_next, *_) in zip(steps, steps[1:]):
        if tokens <= running:
            kind = "decode only"
        elif tokens <= 512 + running:
            kind = "with prefill, <= 512 new tokens"
        elif tokens <= 2048 + running:
            kind = "with prefill, <= 2048 new tokens"
        else:
            kind = "with prefill, > 2048 new tokens"
        kinds[kind].append((t_next - t) * 1e3)
    span = steps[-1][0] - steps[0][0]
    print(f"{len(steps)} steps over {span:.2f} s")
    for kind, times in sorted(kinds.items()):
        times.sort()
        print(f"  {kind:<34} {len(times):6d} steps  {sum(times) / 1e3:7.2f} s  "
              f"p50 {times[len(times) // 2]:7.2f} ms  max {times[-1]:7.2f} ms")
    waiting = sorted(s[4] for s in steps)
    news = [s[2] for s in steps if s[2]]
    print(f"  waiting requests per step: p50 {waiting[len(waiting) // 2]}, max {waiting[-1]}")
    if news:
        print(f"  steps admitting requests: {len(news)}, requests per such step: "
              f"mean {sum(news) / len(news):.1f}, max {max(news)}")


if __name__ == "__main__":
    main(sys.argv[1])
