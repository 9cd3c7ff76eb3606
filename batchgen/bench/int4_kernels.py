"""`python -m batchgen.bench.int4_kernels`: the 4-bit projections of a preset, timed on the GPU at
several row counts: every fused-kernel candidate int4_tuning would time, the dequantize + cuBLAS
path, and the 16-bit GEMM (cuBLAS) of the same shape; one table, the fastest of each first.

Each product is timed in CUDA-graph replays over enough copies of the weight to pass the 50 MB L2
(as a step streams each layer's weight from HBM). Columns: microseconds per product, the weight
bandwidth it reaches (packed bytes / time; the decode-size figure of merit, against the copy
ceiling of about 3.0 TB/s) and TFLOP/s (the prefill-size one, against about 775 for bf16).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from batchgen.bench.random_int4 import random_gptq
from batchgen.bench.random_model import preset_config
from batchgen.bench.timing import graph_median_us
from batchgen.kernels.int4_dequant import dequantize_int4
from batchgen.kernels.int4_gemm import int4_gemm
from batchgen.kernels.launch import num_sms
from batchgen.layers import int4_tuning
from batchgen.models.int4 import gptq

SCREEN_BYTES = 256 << 20  # weights cycled per timing: past the L2


def projection_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the decoder's fused projections."""
    c = preset_config(preset)
    h, inter = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def _copies(nbytes: int) -> int:
    return max(2, -(-SCREEN_BYTES // nbytes))


def time_shape(n: int, k: int, rows: list[int], group: int, act_order: bool, reps: int):
    """Rows of the table for one (N, K): per row count, every option's microseconds."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    packs = []
    probe = gptq.to_packed(random_gptq(n, k, group, act_order, gen, device), group, True, "w")
    for _ in range(_copies(n * k // 2)):
        packs.append(gptq.to_packed(random_gptq(n, k, group, act_order, gen, device), group,
                                    True, "w"))  # fmt: skip
    dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
             for _ in range(_copies(n * k * 2))]  # fmt: skip
    g = k if group == -1 else group
    out = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        results: dict[str, float] = {}
        bf16_us = graph_median_us(lambda: [F.linear(x, w) for w in dense], reps)  # noqa: B023
        results["bf16 cuBLAS"] = bf16_us / len(dense)
        options = int4_tuning.candidates(int4_tuning.row_class(m), n, k, g, num_sms(device))
        if int4_tuning.DEQUANT not in options:
            options.append(int4_tuning.DEQUANT)
        for option in options:
            label = "dequant + cuBLAS" if option == int4_tuning.DEQUANT else _label(option)
            try:
                run = _runner(option, x, packs)
                run()
                results[label] = graph_median_us(run, reps) / len(packs)
            except Exception as e:  # a tile the GPU cannot run: reported, not fatal
                results[label] = float("nan")
                print(f"  {n}x{k} m={m} {label}: {type(e).__name__}: {e}", file=sys.stderr)
        default = _label(int4_tuning.default_config(m, n, k, g, num_sms(device)))
        nbytes = probe.qweight.numel() * 4 + probe.scales.numel() * 2
        out.append({"m": m, "n": n, "k": k, "us": results, "default": default,
                    "int4_bytes": nbytes})  # fmt: skip
    return out


def _label(cfg) -> str:
    flags = "".join(f" {f}" for f in ("magic", "split8") if getattr(cfg, f))
    return (f"bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} s{cfg.split_k} "
            f"w{cfg.num_warps} st{cfg.num_stages}{flags}")  # fmt: skip


def _runner(option, x, packs):
    def run() -> None:
        for p in packs:
            if option == int4_tuning.DEQUANT:
                w = dequantize_int4(p.qweight, p.scales, p.zeros, p.group_size, x.dtype, p.perm)
                torch.mm(x, w)
            else:
                int4_gemm(x, p.qweight, p.scales, p.zeros, p.group_size, option, p.perm)

    return run


def format_rows(name: str, rows: list[dict], verbose: bool) -> list[str]:
    lines = []
    for r in rows:
        m, n, k = r["m"], r["n"], r["k"]
        us = r["us"]
        bf16 = us["bf16 cuBLAS"]
        fused = {key: v for key, v in us.items() if key.startswith("bm") and v == v}
        best_key = min(fused, key=fused.get) if fused else None
        best = fused.get(best_key, float("nan"))
        deq = us.get("dequant + cuBLAS", float("nan"))
        flops = 2.0 * m * n * k
        tb_s = r["int4_bytes"] / best / 1e6
        heuristic = us.get(r["default"], float("nan"))
        lines.append(
            f"{name:8} {m:>6} {n:>6}x{k:<6} fused {best:9.1f} us {tb_s:6.2f} TB/s "
            f"{flops / best / 1e6:7.1f} TFLOP/s [{best_key}] | dequant+cuBLAS {deq:9.1f} us "
            f"| bf16 {bf16:9.1f} us {n * k * 2 / bf16 / 1e6:5.2f} TB/s {flops / bf16 / 1e6:7.1f} "
            f"TFLOP/s | heuristic {heuristic:9.1f} us"
        )
        if verbose:
            for key, v in sorted(us.items(), key=lambda kv: kv[1]):
                lines.append(f"{'':17}{key:40} {v:9.1f} us")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3.1-8b")
    ap.add_argument("--rows", default="1,2,8,16,32,64,128,256,512,1024,2048,4096,8192")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated projections (qkv,o,gate_up,down)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--verbose", action="store_true", help="every option's time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("int4_kernels times CUDA kernels: no CUDA device is visible")
    rows = [int(r) for r in args.rows.split(",")]
    shapes = projection_shapes(args.preset)
    if args.only:
        shapes = {k: v for k, v in shapes.items() if k in args.only.split(",")}
    print(f"{args.preset} group {args.group_size}{' act order' if args.act_order else ''} on "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    report = {}
    for name, (n, k) in shapes.items():
        report[name] = time_shape(n, k, rows, args.group_size, args.act_order, args.reps)
        print("\n".join(format_rows(name, report[name], args.verbose)), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
