"""W4A16 GEMM: y = x @ W^T with W held as 4-bit integers packed eight to an int32 along K, group
scales and zero points per K-group, dequantized in registers: Triton kernel, launcher, reference.

The layout (batchgen's one int4 layout, into which every checkpoint format is converted at load):
    qweight [K / 8, N] int32: bits 4j .. 4j + 3 of qweight[i, n] hold q[8i + j, n], 0 .. 15;
    scales [K / G, N] and zeros [K / G, N] (float, the scales' dtype; zeros are integers 0 .. 16;
    None for symmetric weights, whose zero point is 8 everywhere: nothing to read);
    W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n];
    perm [K] int64 or None: the layout's column k holds input channel perm[k], so the product
    reads x[:, perm] (act-order checkpoints, sorted into group order at load).

Each program computes a [BLOCK_M, BLOCK_N] tile of y over a range of K (split-K: SPLIT_K programs
share a tile and write fp32 partial sums that a second kernel adds up in a fixed order, so results
do not depend on timing; both kernels take programmatic dependent launch, launch.py). A
[BLOCK_K, BLOCK_N] weight tile is read once as [BLOCK_K / 8, BLOCK_N]
int32, expanded to nibbles in registers, and the integers q - zero (exact in the activations'
dtype) go through tl.dot with fp32 accumulation; the group scale multiplies the tile's partial
product (BLOCK_K divides G, so a tile lies in one group). BLOCK_M < 16 (a handful of rows)
multiplies and sums in fp32 on the CUDA cores instead of tl.dot. With `magic` (16-bit activations)
each nibble becomes a 16-bit float by bit operations alone (module constant MAGIC), the offset
and the zero points coming off through x's row sums after the product. With `split8` the tile is
not reshaped to [BLOCK_K, BLOCK_N]: nibble j of the [BLOCK_K / 8, BLOCK_N] words is the weight of
layout rows 8i + j, multiplied by x's columns k0 + 8i + j, eight products of BLOCK_K / 8 rows
each. The words then reach the MMA's operand layout straight from their load; the reshape stages
a 16-bit [BLOCK_K, BLOCK_N] tile through shared memory (sm_90 PTX of a 16 x 128 x 128 tile: 153
shared stores a thread an iteration against 18).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .launch import check_dtype, check_launchable, pdl_prologue, tl, triton, use_pdl

PACK = 8  # 4-bit values per int32
_REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class GemmConfig:
    """Tiles and launch options of one int4_gemm launch (block_k divides the group size)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    magic: bool = False  # 16-bit activations: weights as float bits (MAGIC), no int -> float
    split8: bool = False  # eight products of K / 8 rows, one per nibble, instead of a reshape


# The 16-bit float whose bit pattern ORed with q (0 .. 15) is that float plus q, exactly: 128 in
# bfloat16 (7 mantissa bits, spacing 1 from 128 to 256) and 1024 in float16 (10 bits).
MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@triton.jit
def _tile_product(
    a, q, z, BLOCK_M: tl.constexpr, F32: tl.constexpr, MAGIC_BITS: tl.constexpr
):  # fmt: skip
    # a [BM, KK] x (q - z) [KK, BN] in fp32 for nibbles q (0 .. 15) and zero points z [BN]. With
    # MAGIC_BITS the weights enter as MAGIC_VALUE + q (a 16-bit float made by ORing the bits, no
    # int -> float conversion) and the caller takes (MAGIC_VALUE + z) * (x's row sums) off.
    if MAGIC_BITS != 0:
        b = (q | MAGIC_BITS).to(tl.int16).to(a.dtype, bitcast=True)  # [KK, BN]
        if BLOCK_M >= 16:
            part = tl.dot(a, b)
        else:
            part = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    else:
        b = q.to(tl.float32) - z[None, :]  # [KK, BN] integers -16 .. 15
        if BLOCK_M >= 16:
            if F32:
                part = tl.dot(a, b, input_precision="ieee")
            else:
                part = tl.dot(a, b.to(a.dtype))  # exact: small integers
        else:
            part = tl.sum(a.to(tl.float32)[:, :, None] * b[None, :, :], axis=1)
    return part


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, res_ptr, bias_ptr,
    M, N, K, stride_xm, stride_qk, stride_sg, stride_om, stride_rm, stride_os, k_per_split,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, HAS_PERM: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr, ADD_RES: tl.constexpr, F32: tl.constexpr,
    MAGIC_BITS: tl.constexpr, MAGIC_VALUE: tl.constexpr, SPLIT8: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # Grid (N tiles, M tiles, splits). Program (pn, pm, ps): rows [pm*BM, +BM), columns
    # [pn*BN, +BN), K range [ps*k_per_split, +k_per_split) (a multiple of BLOCK_K).
    pdl_prologue(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_k = tl.arange(0, BLOCK_K)
    rows_p = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        packed = tl.load(
            qw_ptr + (k0 // 8 + rows_p)[:, None] * stride_qk + offs_n[None, :],
            mask=mask_n[None, :],
            other=0,
        )  # [BK / 8, BN] int32
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        if SPLIT8:
            # Nibble j of packed row i is layout row 8i + j: eight [BK / 8]-row products.
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            row_sums = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for j in tl.static_range(8):
                cols = k0 + rows_p * 8 + j  # [BK / 8] positions in the layout's K order
                if HAS_PERM:
                    cols = tl.load(perm_ptr + cols)  # the input channels they hold
                a = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=mask_m[:, None],
                    other=0.0,
                )
                part += _tile_product(a, (packed >> (4 * j)) & 0xF, z, BLOCK_M, F32, MAGIC_BITS)
                if MAGIC_BITS != 0:
                    row_sums += tl.sum(a.to(tl.float32), axis=1)
        else:
            cols = k0 + rows_k  # [BK] positions in the layout's K order
            if HAS_PERM:
                cols = tl.load(perm_ptr + cols)
            a = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None], other=0.0
            )
            # Nibble j of packed row i is layout row 8i + j: [BK / 8, 8, BN] -> [BK, BN].
            q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            part = _tile_product(a, q, z, BLOCK_M, F32, MAGIC_BITS)
            row_sums = tl.sum(a.to(tl.float32), axis=1)  # [BM]
        if MAGIC_BITS != 0:
            # sum_k x (q - z) = x @ (MAGIC_VALUE + q) - (MAGIC_VALUE + z) * sum_k x.
            part = part - row_sums[:, None] * (z + MAGIC_VALUE)[None, :]
        acc += part * s[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if PARTIAL:
        tl.store(
            out_ptr + pid_s * stride_os + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask
        )
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if ADD_RES:
            res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask)
            acc += res.to(tl.float32)
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr, out_ptr, res_ptr, bias_ptr, M, N, stride_om, stride_rm,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_RES: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # out[m, n] = (residual[m, n]) + sum_s ws[s, m, n] (+ bias[n]), splits added in order.
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if ADD_RES:
        acc += tl.load(res_ptr + m * stride_rm + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_layout(
    op: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Check the packed layout's tensors against each other; returns (K, N)."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"{op}: qweight must be [K/8, N] int32, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")  # fmt: skip
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{op}: group_size {group_size} must divide K={k}")
    groups = k // group_size
    zshape = tuple(zeros.shape) if zeros is not None else (groups, n)
    if scales.shape != (groups, n) or zshape != (groups, n):
        raise ValueError(
            f"{op}: scales and zeros must be [K/G, N] = [{groups}, {n}], got "
            f"{tuple(scales.shape)} and {zshape}"
        )
    zdtype = zeros.dtype if zeros is not None else scales.dtype
    if not scales.is_floating_point() or zdtype != scales.dtype:
        raise ValueError(f"{op}: scales and zeros must share one float dtype, got "
                         f"{scales.dtype} and {zdtype}")  # fmt: skip
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int64):
        raise ValueError(f"{op}: perm must be [K] = [{k}] int64, got {perm.dtype} "
                         f"{tuple(perm.shape)}")  # fmt: skip
    return k, n


def check_config(op: str, config: GemmConfig, k: int, group_size: int) -> None:
    """block_k: a multiple of 16 (tl.dot) dividing the group size, and >= 128 for split8 tiles of
    16 rows or more; the rest powers of two."""
    bk = config.block_k
    if bk % 16 or group_size % bk or k % bk:
        raise ValueError(f"{op}: block_k={bk} must be a multiple of 16 dividing the group size "
                         f"{group_size} and K={k}")  # fmt: skip
    for name in ("block_m", "block_n"):
        v = getattr(config, name)
        if v < 1 or v & (v - 1) or (name == "block_n" and v < 16):
            raise ValueError(f"{op}: {name}={v} must be a power of two (block_n >= 16)")
    if config.split8 and config.block_m >= 16 and bk < 128:
        raise ValueError(f"{op}: split8 with block_m >= 16 needs block_k >= 128 (tl.dot takes "
                         f"K / 8 >= 16 rows), got block_k={bk}")  # fmt: skip
    if config.split_k < 1:
        raise ValueError(f"{op}: split_k={config.split_k} must be >= 1")


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    config: GemmConfig,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, Triton kernel (module docstring: the layout).

    Args:
        x: [M, K] bf16 / fp16 / fp32, rows contiguous.
        qweight, scales, zeros, group_size, perm: the packed weight (contiguous tensors; zeros
            None: symmetric, zero point 8).
        config: tiles, split-K and launch options (batchgen.layers.int4_tuning picks them).
        bias: [N] or None, added in fp32 before the one rounding.
        residual: [M, N] of x's dtype with contiguous rows, or None: when given, the result is
            added into it in place (residual += x @ W^T, one rounding) and it is returned.
        out: [M, N] of x's dtype with contiguous rows, or None: written instead of a new tensor
            (its old values are not read); not with residual.
    """
    op = "int4_gemm"
    k, n = check_layout(op, qweight, scales, zeros, group_size, perm)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{op}: x must be [M, {k}] with contiguous rows, got "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    check_dtype(op, "x", x)
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    check_config(op, config, k, group_size)
    m = x.shape[0]
    if residual is not None:
        if residual.shape != (m, n) or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"{op}: residual must be [{m}, {n}] {x.dtype} with contiguous "
                             f"rows, got {tuple(residual.shape)} {residual.dtype}")  # fmt: skip
    if out is not None and (
        residual is not None or out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1
    ):
        raise ValueError(f"{op}: out must be [{m}, {n}] {x.dtype} with contiguous rows (and no "
                         f"residual), got {tuple(out.shape)} {out.dtype}")  # fmt: skip
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{op}: bias must be [{n}], got {tuple(bias.shape)}")
    extra = [t for t in (zeros, perm, bias, residual, out) if t is not None]
    check_launchable(op, x, qweight, scales, *extra)
    if residual is not None:
        out = residual
    elif out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bk = config.block_k
    k_blocks = k // bk
    split = min(config.split_k, k_blocks)
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(k, k_per_split)  # no empty split
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    partial = split > 1
    magic = MAGIC.get(x.dtype, (0, 0.0)) if config.magic else (0, 0.0)
    pdl = use_pdl(x.device)  # programmatic dependent launch (launch.py), as the layer's kernels
    target = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales,
        perm if perm is not None else qweight, target,
        residual if residual is not None else out, bias if bias is not None else scales,
        m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, m * n, k_per_split,
        GROUP=group_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=bk,
        PARTIAL=partial, HAS_PERM=perm is not None, HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        ADD_RES=residual is not None, F32=x.dtype == torch.float32,
        MAGIC_BITS=magic[0], MAGIC_VALUE=magic[1], SPLIT8=config.split8, USE_PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    if partial:
        _split_k_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            target, out, residual if residual is not None else out,
            bias if bias is not None else scales, m, n, out.stride(0),
            residual.stride(0) if residual is not None else 0,
            SPLIT_K=split, HAS_BIAS=bias is not None, ADD_RES=residual is not None,
            BLOCK=_REDUCE_BLOCK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    return out


def unpack_int4_ref(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [K/8, N] int32 -> q [K, N] int32 in 0 .. 15 (nibble j of row i is row 8i + j)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return q.reshape(-1, qweight.shape[1])


def pack_int4_ref(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers 0 .. 15 (K a multiple of 8) -> qweight [K/8, N] int32."""
    if q.shape[0] % PACK:
        raise ValueError(f"pack_int4_ref: K={q.shape[0]} must be a multiple of {PACK}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("pack_int4_ref: values must lie in 0 .. 15")
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (q.to(torch.int64).reshape(-1, PACK, q.shape[1]) << shifts[None, :, None]).sum(1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the unsigned word as an int32


def dequantize_int4_ref(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """The weight in the layout's K order, [K, N] float32: (q - zero) * scale per group (zero 8
    where zeros is None)."""
    check_layout("dequantize_int4_ref", qweight, scales, zeros, group_size)
    q = unpack_int4_ref(qweight).float()
    g = torch.arange(q.shape[0], device=q.device) // group_size
    z = zeros.float()[g] if zeros is not None else 8.0
    return (q - z) * scales.float()[g]


def int4_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of int4_gemm: fp32 x[:, perm] @ dequantized W (+ bias, + residual),
    rounded once to x's dtype (a new tensor: residual is not changed)."""
    w = dequantize_int4_ref(qweight, scales, zeros, group_size)  # [K, N]
    xs = x.float() if perm is None else x.float()[:, perm]
    y = xs @ w
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
