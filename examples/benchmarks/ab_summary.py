"""One line per `batchgen bench --json` file: workload, preset, the median output tok/s (or
MFU) and every run's wall, so A/B calls print a short table last.

Usage: python examples/benchmarks/ab_summary.py OUT/*.json
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as f:
            report = json.load(f)
        result = report.get("result") or {}
        walls = ", ".join(f"{r.get('wall_s', 0):.2f}" for r in report.get("runs", []))
        mfu = result.get("mfu")
        extra = f" mfu {mfu:.1%}" if isinstance(mfu, float) else ""
        print(f"{path.rsplit('/', 1)[-1]:<28} {result.get('output_tok_s', 0):>9,.0f} tok/s"
              f"{extra}  walls [{walls}]")  # fmt: skip


if __name__ == "__main__":
    main()
