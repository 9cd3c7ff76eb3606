"""A MoE layer's MLP against a dense MLP of the same active size, on the GPU.

    python -m batchgen.bench.moe_layer --preset qwen3-30b-a3b

The sparse block of the preset (router, top-k, fused experts; E experts of intermediate I,
top-K) against a dense SiLU MLP of intermediate K x I, which runs the same parameters per token
(Qwen3-30B-A3B: 8 x 768 = 6144; Mixtral-8x7B: 2 x 14336). Both run as the engine runs them, in
CUDA graphs timed by CUDA events after an L2 flush, at the token counts of decode steps and
prefill chunks. Reported per token count: both times, their ratio, the experts the batch
reached (uniform-ish routing of random weights) and the bandwidth each achieves on the weights
it must read (the touched experts for the MoE, all of it for the dense MLP).
"""

from __future__ import annotations

import argparse
import json

import torch

from batchgen.bench.random_model import preset_config
from batchgen.bench.timing import graph_median_us
from batchgen.kernels import ops
from batchgen.layers.linear import linear
from batchgen.layers.moe import ExpertCounter, SparseMoeBlock
from batchgen.models.config import ModelConfig

TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def build(preset: str):
    """The preset's sparse block and a dense MLP (gate_up [2KI, H], down [H, KI]), random."""
    mc = ModelConfig.from_dict(preset_config(preset))
    moe, h = mc.moe, mc.hidden_size
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = SparseMoeBlock(
            h, moe.num_experts, moe.intermediate_size, moe.top_k, moe.norm_topk_prob,
            moe.round_weights, ExpertCounter("cuda"),
        ).to(torch.bfloat16)  # fmt: skip
        for p in block.parameters():
            p.data.normal_(0.0, 0.02)
        active = moe.top_k * moe.intermediate_size
        gate_up = torch.randn(2 * active, h, dtype=torch.bfloat16) * 0.02
        down = torch.randn(h, active, dtype=torch.bfloat16) * 0.02
    return mc, block, gate_up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", choices=["qwen3-30b-a3b", "mixtral-8x7b"], default="qwen3-30b-a3b"
    )
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    mc, block, gate_up, down = build(opts.preset)
    moe, h = mc.moe, mc.hidden_size
    expert_bytes = 3 * moe.intermediate_size * h * 2
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # past the 50 MB L2
    print(
        f"{opts.preset}: MoE {moe.num_experts} x {moe.intermediate_size} top-{moe.top_k} vs dense "
        f"{moe.top_k * moe.intermediate_size}, hidden {h}, bf16, {torch.cuda.get_device_name()}"
    )
    print(f"{'tokens':>7} {'moe us':>9} {'dense us':>9} {'moe/dense':>9} {'experts':>8} "
          f"{'moe TB/s':>9} {'dense TB/s':>10}")  # fmt: skip
    rows = []
    for T in opts.tokens:
        x = torch.randn(T, h, device="cuda", dtype=torch.bfloat16)
        counter = block.counter
        counter.touched.zero_()
        with torch.no_grad():
            block(x)
        touched = counter.read()  # experts this batch reaches in one layer
        with torch.no_grad():
            moe_us = graph_median_us(lambda x=x: block(x), opts.reps, flush.zero_)
            dense_us = graph_median_us(
                lambda x=x: linear(ops.silu_and_mul(linear(x, gate_up)), down),
                opts.reps,
                flush.zero_,
            )
        row = {
            "tokens": T,
            "moe_us": moe_us,
            "dense_us": dense_us,
            "ratio": moe_us / dense_us,
            "experts_touched": touched,
            "moe_tb_s": (touched * expert_bytes + block.gate.weight.numel() * 2) / moe_us / 1e6,
            "dense_tb_s": (gate_up.numel() + down.numel()) * 2 / dense_us / 1e6,
        }
        rows.append(row)
        print(
            f"{T:>7} {moe_us:>9.1f} {dense_us:>9.1f} {row['ratio']:>9.2f} {touched:>8} "
            f"{row['moe_tb_s']:>9.2f} {row['dense_tb_s']:>10.2f}",
            flush=True,
        )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"preset": opts.preset, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
