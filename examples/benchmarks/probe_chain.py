"""What the decode-chain probes (l2_prefetch_probe.py, l2_sidestream_probe.py, pdl_probe.py)
share: qwen3-0.6b-shaped layer weights, the row kernel body (the small op between two
projections of a decode layer, one row per program) and the L2 prefetch of a weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LAYERS, H, Q, KV, INTER = 28, 1024, 2048, 1024, 3072


def layer_weights(device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Per layer, random bf16 [N, K] weights of the fused qkv, o, gate_up and down projections
    (seeded by the caller's torch.manual_seed)."""
    bf = torch.bfloat16
    return [
        dict(
            qkv=torch.randn(Q + 2 * KV, H, device=device, dtype=bf) * 0.02,
            o=torch.randn(H, Q, device=device, dtype=bf) * 0.02,
            gu=torch.randn(2 * INTER, H, device=device, dtype=bf) * 0.02,
            d=torch.randn(H, INTER, device=device, dtype=bf) * 0.02,
        )
        for _ in range(LAYERS)
    ]


@triton.jit
def row_op_body(x_ptr, out_ptr, stride_x, stride_out, N, MODE: tl.constexpr, BLOCK: tl.constexpr):
    # Row program_id(0) of x -> out: MODE 0 = rms-like scale over N, 1 = copy of N values,
    # 2 = silu(x[:, :N]) * x[:, N:2N].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    if MODE == 2:
        g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + N + cols, mask=m, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
    else:
        y = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if MODE == 0:
            y = y * tl.rsqrt(tl.sum(y * y, 0) / N + 1e-6)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def row_op_body_ref(x, n: int, mode: int):
    """Torch reference of row_op_body, for checking the probes' kernels."""
    if mode == 2:
        g, u = x[:, :n].float(), x[:, n : 2 * n].float()
        return (torch.nn.functional.silu(g) * u).to(x.dtype)
    y = x[:, :n].float()
    if mode == 0:
        y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + 1e-6)
    return y.to(x.dtype)


@triton.jit
def prefetch_l2_share(w_ptr, nbytes, CHUNK: tl.constexpr):
    # Program p of the grid issues `cp.async.bulk.prefetch.L2` over its share of the nbytes at
    # w_ptr (a uint8 pointer), CHUNK bytes an instruction (shares are multiples of 16 bytes).
    n = tl.num_programs(0)
    share = tl.cdiv(tl.cdiv(nbytes, 16), n) * 16
    lo = tl.program_id(0).to(tl.int64) * share
    hi = tl.minimum(lo + share, nbytes)
    for off in range(lo, hi, CHUNK):
        size = tl.minimum(CHUNK, hi - off).to(tl.int32)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;",
            "=r,l,r",
            [w_ptr + off, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
