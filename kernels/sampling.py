"""Per-request counter-based RNG and fused Gumbel-max sampling: Triton kernels and references.

The noise for token i of a request is a pure function of (seed, step, i), so a request samples
the same tokens whatever else shares its batch, across resumes, and on CPU or GPU. The integer
hash is defined once by the torch reference (int64 tensors masked to 32 bits) and reproduced
bit for bit by the kernel in uint32 arithmetic.

Hash: lowbias32 (Chris Wellons' 32-bit mixer) applied as
    k1 = mix(mix(mix(mix(seed_hi + 0x9E3779B9) ^ seed_lo) ^ step_lo) ^ step_hi)
    k2 = mix(k1 ^ 0x85EBCA6B)
    x  = mix(mix(i ^ k1) ^ k2)
    u  = ((x >> 9) + 0.5) * 2^-23
u takes the top 23 bits with a half-step offset: every value, (0.5 .. 2^23 - 0.5) * 2^-23, is
exact in float32, so u is never 0 nor 1 (with 24 bits the top values would round up to 1.0).
"""

from __future__ import annotations

import torch

from .launch import check_launchable, num_sms, pow2, tl, triton
from .token_bitmask import allowed_bits, check_bitmask, unpack_bitmask_ref

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B
_GOLDEN, _K2 = 0x9E3779B9, 0x85EBCA6B
_BLOCK_V = 2048
_NARROW = (torch.bfloat16, torch.float16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow: split c into 16-bit halves.
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _row_keys_ref(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix_ref((hi + _GOLDEN) & _M32)
    h = _mix_ref(h ^ lo)
    h = _mix_ref(h ^ (steps & _M32))
    k1 = _mix_ref(h ^ ((steps >> 32) & _M32))
    return k1, _mix_ref(k1 ^ _K2)


def uniform_noise_ref(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based uniforms u(seed, step, i) for every token i of every row.

    Args:
        seeds: [B] int64 per-request seeds (any int64 value).
        steps: [B] int64 per-request step counters (>= 0).
        vocab_size: V.

    Returns:
        [B, V] float32 in (0, 1), on seeds' device.
    """
    k1, k2 = _row_keys_ref(seeds.long(), steps.long())
    idx = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)[None, :]
    x = _mix_ref(_mix_ref(idx ^ k1[:, None]) ^ k2[:, None])
    return ((x >> 9).float() + 0.5) * (2.0**-23)


def gumbel_argmax_ref(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of gumbel_argmax: argmax(logits / t - log(-log(u))), [B] int64, the
    division in float32 (t = 1 when temperatures is None); tokens a packed bitmask [B, V / 32]
    int32 disallows are -inf (token_bitmask.py)."""
    u = uniform_noise_ref(seeds, steps, logits.shape[1]).to(logits.device)
    x = logits.float()
    if temperatures is not None:
        x = x / temperatures.float()[:, None]
    if bitmask is not None:
        x = x.masked_fill(~unpack_bitmask_ref(bitmask, x.shape[1]), float("-inf"))
    return torch.argmax(x - torch.log(-torch.log(u)), dim=-1)


@triton.jit
def _mix(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seeds_ptr, steps_ptr, row):
    seed = tl.load(seeds_ptr + row)
    step = tl.load(steps_ptr + row)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = _mix(hi + 0x9E3779B9)
    h = _mix(h ^ lo)
    h = _mix(h ^ (step & 0xFFFFFFFF).to(tl.uint32))
    k1 = _mix(h ^ ((step >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return k1, _mix(k1 ^ 0x85EBCA6B)


@triton.jit
def _uniform(idx, k1, k2):
    x = _mix(_mix(idx.to(tl.uint32) ^ k1) ^ k2)
    return ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23


@triton.jit
def _gumbel_scores(x, idx, k1, k2):
    # The Gumbel-max score of tempered logits x at vocabulary ids idx: x - log(-log(u)), the one
    # formula every sampling kernel draws with (gumbel_argmax_ref's).
    return x - tl.log(-tl.log(_uniform(idx, k1, k2)))


@triton.jit
def _uniform_noise_kernel(seeds_ptr, steps_ptr, out_ptr, V, BLOCK: tl.constexpr):
    # Grid (B, cdiv(V, BLOCK)).
    row = tl.program_id(0).to(tl.int64)
    k1, k2 = _row_keys(seeds_ptr, steps_ptr, row)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + row * V + idx, _uniform(idx, k1, k2), mask=idx < V)


# NUM_CHUNKS follows the row count: unspecialized, or a batch whose count divides by 16 would
# compile another variant mid-run.
@triton.jit(do_not_specialize=["NUM_CHUNKS"])
def _gumbel_argmax_kernel(logits_ptr, seeds_ptr, steps_ptr, temps_ptr, mask_ptr, part_score_ptr,
                          part_idx_ptr, stride_row, stride_mask, V, CHUNK, NUM_CHUNKS,
                          HAS_TEMPS: tl.constexpr, HAS_MASK: tl.constexpr,
                          BLOCK: tl.constexpr):  # fmt: skip
    # Grid (B, NUM_CHUNKS): program (row, c) scans logits[row, c * CHUNK : (c + 1) * CHUNK]
    # (CHUNK a multiple of BLOCK) keeping a running per-lane best (score, index), then writes
    # the chunk's maximum and the lowest index holding it to part_score / part_idx [B, C].
    # Chunks let a few rows still fill the GPU. Logits of any float dtype are widened to
    # float32 and divided by the row's temperature here, sparing the sampler two passes; with
    # HAS_MASK, ids the row's packed bitmask disallows score -inf (read beside the logits).
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    k1, k2 = _row_keys(seeds_ptr, steps_ptr, row)
    if HAS_TEMPS:
        temp = tl.load(temps_ptr + row)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = lo + tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < hi
        x = tl.load(logits_ptr + row * stride_row + idx, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        if HAS_TEMPS:
            x = x / temp
        if HAS_MASK:
            mask = mask & allowed_bits(mask_ptr + row * stride_mask, idx, mask)
        score = tl.where(mask, _gumbel_scores(x, idx, k1, k2), float("-inf"))
        take = score > best
        best = tl.where(take, score, best)
        best_idx = tl.where(take, idx, best_idx)
    top = tl.max(best, 0)
    tl.store(part_score_ptr + row * NUM_CHUNKS + chunk, top)
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, tl.min(tl.where(best == top, best_idx, V), 0))


@triton.jit(do_not_specialize=["NUM_CHUNKS"])
def _argmax_chunks_kernel(part_score_ptr, part_idx_ptr, out_ptr, V, NUM_CHUNKS,
                          BLOCK_C: tl.constexpr):  # fmt: skip
    # One program per row: the best chunk, the lowest index among ties (chunks run in index
    # order and each holds its own lowest tied index): torch.argmax's first-occurrence rule.
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < NUM_CHUNKS
    score = tl.load(part_score_ptr + row * NUM_CHUNKS + c, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * NUM_CHUNKS + c, mask=mask, other=V)
    top = tl.max(score, 0)
    tl.store(out_ptr + row, tl.min(tl.where(mask & (score == top), idx, V), 0).to(tl.int64))


def _max_chunks(vocab: int) -> int:
    """The most chunks a row is split into: each covers at least two BLOCK_V tiles, so the final
    reduce stays small."""
    return triton.cdiv(vocab, 2 * _BLOCK_V)


def _num_chunks(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary chunks per row: enough programs for about four per SM, at most _max_chunks."""
    return max(1, min(-(-4 * num_sms(device) // max(rows, 1)), _max_chunks(vocab)))


def check_row_tensor(op: str, name: str, t: torch.Tensor | None, rows: int, dtype) -> None:
    """A per-row argument of a sampling kernel: [rows] of dtype, contiguous (None passes)."""
    if t is None:
        return
    if not (t.shape == (rows,) and t.dtype == dtype and t.is_contiguous()):
        raise ValueError(
            f"{op}: {name} must be [{rows}] {dtype} and contiguous, got {tuple(t.shape)} {t.dtype}"
        )


def _check_rows(op: str, seeds: torch.Tensor, steps: torch.Tensor, rows: int) -> None:
    check_row_tensor(op, "seeds", seeds, rows, torch.int64)
    check_row_tensor(op, "steps", steps, rows, torch.int64)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Triton version of uniform_noise_ref (bit-identical); materialises [B, V] float32."""
    op = "uniform_noise"
    _check_rows(op, seeds, steps, seeds.shape[0])
    check_launchable(op, seeds, steps)
    out = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32, device=seeds.device)
    if out.numel():
        grid = (seeds.shape[0], triton.cdiv(vocab_size, _BLOCK_V))
        _uniform_noise_kernel[grid](seeds, steps, out, vocab_size, BLOCK=_BLOCK_V, num_warps=8)
    return out


def gumbel_argmax(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token per row by Gumbel-max with counter-based noise, Triton kernel.

    Args:
        logits: [B, V] float32, or (with temperatures) bf16/fp16/fp32; filtered entries are
            -inf; rows contiguous.
        seeds: [B] int64 per-request seeds.
        steps: [B] int64 per-request step counters (the noise of step s is independent of s+1).
        temperatures: optional [B] float32 (> 0); each row's logits are divided by its own, in
            float32, inside the kernel. Without it the logits must already be tempered float32.
        bitmask: optional [B, ceil(V / 32)] int32 packed mask (token_bitmask.py): a token
            whose bit is 0 is never drawn (a row with none allowed returns token 0).

    Returns:
        [B] int64 token ids, the same as gumbel_argmax_ref picks.
    """
    op = "gumbel_argmax"
    allowed = (torch.float32,) if temperatures is None else (torch.float32, *_NARROW)
    if not (logits.dim() == 2 and logits.dtype in allowed):
        raise ValueError(
            f"{op}: logits must be [B, V] of {allowed}, got {tuple(logits.shape)} {logits.dtype}"
        )
    if logits.stride(1) != 1:
        raise ValueError(f"{op}: logits rows must be contiguous, got strides {logits.stride()}")
    _check_rows(op, seeds, steps, logits.shape[0])
    check_row_tensor(op, "temperatures", temperatures, logits.shape[0], torch.float32)
    check_bitmask(op, bitmask, *logits.shape)
    extra = tuple(t for t in (temperatures, bitmask) if t is not None)
    check_launchable(op, logits, seeds, steps, *extra)
    rows, vocab = logits.shape
    out = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = _num_chunks(rows, vocab, logits.device)
    chunk_len = triton.cdiv(triton.cdiv(vocab, chunks), _BLOCK_V) * _BLOCK_V
    chunks = triton.cdiv(vocab, chunk_len)
    part_score = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, chunks)](
        logits, seeds, steps, temperatures if temperatures is not None else seeds,
        bitmask if bitmask is not None else seeds, part_score, part_idx, logits.stride(0),
        bitmask.stride(0) if bitmask is not None else 0, vocab, chunk_len, chunks,
        HAS_TEMPS=temperatures is not None, HAS_MASK=bitmask is not None, BLOCK=_BLOCK_V,
        num_warps=8,
    )  # fmt: skip
    # BLOCK_C from the most chunks this vocabulary can have: one variant per model.
    block_c = max(16, pow2(_max_chunks(vocab)))
    _argmax_chunks_kernel[(rows,)](
        part_score, part_idx, out, vocab, chunks, BLOCK_C=block_c, num_warps=1
    )
    return out
