"""Top-k / top-p / min-p sampling without a sort: one Triton program per row, and the reference.

The filters keep an upper set of each row's tempered logits z = logits / temperature (float32):

- top-k keeps every token whose z is at least the k-th largest z (a tie at the boundary keeps
  the whole tied group, so a row can keep more than k);
- top-p, over the top-k set renormalised, keeps a token while the probability mass strictly
  above its z is below p (tied tokens share that mass, so they stay or go together; the top
  token always stays);
- min-p keeps a token when z - max(z) >= log(min_p), i.e. its probability is at least min_p
  times the top one's.

The token is then the Gumbel-max draw over the kept set with the counter-based noise of
`sampling.py`: argmax over kept i of z_i - log(-log(u(seed, step, i))), lowest index on ties.
With no filter that is `gumbel_argmax`'s draw.

The kernel never sorts. Top-k's threshold starts from a lower bound, the k-th largest of the
lanes' maxima after one pass, and walks up from it a pass a step (`_top_k_threshold`; a radix
select over an order-preserving integer key of z settles what the walk does not). Top-p is
never formed: the kernel draws over the top-k and min-p set, then checks the drawn token
against top-p (one pass summing the mass above it). A rejected token means every token at or
below it is outside the nucleus (the set is an upper one), so the next draw is over the tokens
above it, and so on; each draw is the argmax of the same scores over a smaller set, so the
first accepted one is the argmax over the nucleus. A draw lands in the nucleus with
probability about p, so a row takes about 2/p passes over its logits (the draw, which also
sums the top-k set's mass with an online max, then a check per draw and a redraw per
rejection), plus usually 2-3 with top-k and 1 with min-p (the row max).
"""

from __future__ import annotations

import torch

from .launch import check_launchable, interpreting, tl, triton
from .sampling import _check_rows, _gumbel_scores, _row_keys, check_row_tensor, gumbel_argmax_ref
from .token_bitmask import allowed_bits, check_bitmask, unpack_bitmask_ref

# Elements a program reads per loop step, and its warps. One program per row: with few rows a
# row's latency is the step's, so the program should keep many loads in flight (8192 x 16 warps
# took 22-38% less than 2048 x 8 on the H100, 2026-11-24 at 7d92691).
BLOCK_V = 8192
NUM_WARPS = 16
# Key bits top-k's radix select settles a pass (32 / RADIX_BITS passes).
RADIX_BITS = 4
# Passes top-k's walk up from its lanes' bound may take before the radix select takes over.
TOP_K_WALK = 3
_NARROW = (torch.bfloat16, torch.float16)
_INT32_MIN = -(2**31)


def sortable_keys_ref(z: torch.Tensor) -> torch.Tensor:
    """float32 [..] -> int32 keys in the floats' order (-0.0 and 0.0 share a key; -inf is the
    smallest; NaN is not ordered)."""
    bits = z.contiguous().view(torch.int32)
    bits = torch.where(bits == _INT32_MIN, 0, bits)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _log_min_p(min_p: torch.Tensor) -> torch.Tensor:
    """[B] float32 log(min_p), -inf where min_p <= 0 (off); shared by kernel and reference."""
    return torch.where(min_p > 0, min_p.clamp_min(1e-38).log(), float("-inf"))


def top_k_top_p_mask_ref(
    z: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kept set of each row of tempered logits z [B, V] float32 (the module's rules), built
    with a sort: [B, V] bool. top_k [B] int (<= 0 or >= V: off), top_p [B] (1: off), min_p [B]
    (0: off); None: that filter off for every row."""
    rows, vocab = z.shape
    keys = sortable_keys_ref(z)
    m = z.amax(dim=1, keepdim=True)  # [B, 1]
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None or top_p is not None:  # min-p alone needs no order
        sorted_keys, order = keys.sort(dim=1, descending=True)
    if top_k is not None:
        k = top_k.to(torch.int64)
        kth = sorted_keys.gather(1, (k.clamp(1, vocab) - 1)[:, None])  # [B, 1]
        keep &= (keys >= kth) | ((k <= 0) | (k >= vocab))[:, None]
    if top_p is not None:
        e = torch.exp(z - torch.where(m == float("-inf"), 0.0, m))  # [B, V]
        total = torch.where(keep, e, 0.0).sum(dim=1, keepdim=True)  # the top-k set's mass
        # Mass strictly above each token: the sorted prefix sum before its tied group.
        prefix = e.gather(1, order).cumsum(dim=1)
        pos = torch.arange(vocab, device=z.device).expand(rows, vocab)
        starts = torch.ones_like(sorted_keys, dtype=torch.bool)
        starts[:, 1:] = sorted_keys[:, 1:] != sorted_keys[:, :-1]
        group_start = torch.where(starts, pos, 0).cummax(dim=1).values
        above = torch.where(group_start > 0, prefix.gather(1, (group_start - 1).clamp_min(0)), 0.0)
        above = torch.empty_like(above).scatter_(1, order, above)
        p = top_p.float()[:, None]
        keep &= (above < p * total) | (p >= 1.0)
    if min_p is not None:
        keep &= (z - m) >= _log_min_p(min_p.float())[:, None]
    return keep


def top_k_top_p_sample_ref(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of top_k_top_p_sample (same arguments): the Gumbel-max draw over
    top_k_top_p_mask_ref's set of the tempered logits, disallowed tokens of the packed bitmask
    set to -inf first (so the filters rank and weigh only allowed tokens). [B] int64."""
    z = logits.float() / temperatures.float()[:, None]  # [B, V]
    if bitmask is not None:
        z = z.masked_fill(~unpack_bitmask_ref(bitmask, z.shape[1]), float("-inf"))
    keep = top_k_top_p_mask_ref(z, top_k, top_p, min_p)
    return gumbel_argmax_ref(z.masked_fill(~keep, float("-inf")), seeds, steps)


@triton.jit
def _tempered(base, idx, mask, temp, mbase, HAS_MASK: tl.constexpr):
    # z = logits / temperature in float32, -inf past the row and, with HAS_MASK, where the
    # row's packed bitmask (at mbase) disallows the token: every pass sees the masked row.
    x = tl.load(base + idx, mask=mask, other=float("-inf"))
    z = x.to(tl.float32) / temp
    if HAS_MASK:
        z = tl.where(allowed_bits(mbase, idx, mask), z, float("-inf"))
    return z


@triton.jit
def _keys(z):
    # sortable_keys_ref: int32 keys in z's order, -0.0 keyed as 0.0.
    bits = z.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483647 - 1, 0, bits)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _radix_level(hist, need, prefix, level, BITS: tl.constexpr):
    # One digit of a radix select: hist [2^BITS] counts the keys matching `prefix` (the digits
    # found so far, unsigned order) by their digit at `level` from the top. Returns what is
    # still needed below the digit whose count from the top reaches `need`, and the prefix with
    # that digit set.
    bins = tl.arange(0, 1 << BITS)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    found = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    need = need - tl.sum(tl.where(bins > found, hist, 0), 0)
    return need, prefix | (found.to(tl.uint32) << (32 - BITS * (level + 1)))


@triton.jit
def _digit_hist(u, match, level, BITS: tl.constexpr):
    # Histogram of the digit at `level` (from the top) of unsigned keys u over the matching ones
    # (the others are counted in bin 0, then taken out again).
    shift = 32 - BITS * (level + 1)
    digit = tl.where(match, ((u >> shift) & ((1 << BITS) - 1)).to(tl.int32), 0)
    misses = tl.sum((~match).to(tl.int32), 0)
    return tl.histogram(digit, 1 << BITS) - tl.where(tl.arange(0, 1 << BITS) == 0, misses, 0)


@triton.jit
def _unsigned(keys):
    # int32 keys -> uint32 in the same order (and _signed back).
    return keys.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _signed(u):
    return (u ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def _kth_largest_key(base, V, temp, mbase, k, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
                     BITS: tl.constexpr):  # fmt: skip
    # The k-th largest key of the row's z (1 <= k < V) by radix select over the row in memory:
    # BITS bits a pass from the top, a histogram of the next digit over the keys that match the
    # digits found so far. 32 / BITS passes.
    lanes = tl.arange(0, BLOCK)
    prefix = tl.full([], 0, tl.uint32)  # the key's digits found so far (unsigned order)
    need = k
    for level in tl.static_range(32 // BITS):
        upper = (0xFFFFFFFF << (32 - BITS * level)) & 0xFFFFFFFF  # the digits above this one
        hist = tl.zeros([1 << BITS], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + lanes
            mask = idx < V
            u = _unsigned(_keys(_tempered(base, idx, mask, temp, mbase, HAS_MASK)))
            hist += _digit_hist(u, mask & ((u & upper) == prefix), level, BITS)
        need, prefix = _radix_level(hist, need, prefix, level, BITS)
    return _signed(prefix)


@triton.jit
def _kth_largest_lane_key(lane_keys, k, BITS: tl.constexpr):
    # The same select over a [BLOCK] key vector in registers (k <= BLOCK): no memory passes.
    u = _unsigned(lane_keys)
    prefix = tl.full([], 0, tl.uint32)
    need = k
    for level in tl.static_range(32 // BITS):
        upper = (0xFFFFFFFF << (32 - BITS * level)) & 0xFFFFFFFF
        hist = _digit_hist(u, (u & upper) == prefix, level, BITS)
        need, prefix = _radix_level(hist, need, prefix, level, BITS)
    return _signed(prefix)


@triton.jit
def _top_k_threshold(base, V, temp, mbase, k, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
                     BITS: tl.constexpr, WALK: tl.constexpr):  # fmt: skip
    # The k-th largest key of the row (1 <= k < V). With k <= BLOCK, first a lower bound: the
    # k-th largest of the lanes' maxima (k lanes hold a key at least that large, so at least k
    # keys are), found in registers after one pass. Then walk up from it, a pass a step: count
    # the keys above the bound and take the least of them; while that count is still >= k the
    # least is a better bound, and once it is < k the bound is the answer. The top k keys mostly
    # sit in k different lanes, so the bound is usually the answer or a step or two below it;
    # after WALK steps without an answer, the radix select over the row settles it.
    lanes = tl.arange(0, BLOCK)
    bound = tl.full([], -2147483647 - 1, tl.int32)
    settled = tl.full([], 0, tl.int1)
    if (k <= BLOCK) & (WALK > 0):
        lane_max = tl.full([BLOCK], -2147483647 - 1, tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + lanes
            mask = idx < V
            z = _tempered(base, idx, mask, temp, mbase, HAS_MASK)
            key = tl.where(mask, _keys(z), -2147483647 - 1)
            lane_max = tl.maximum(lane_max, key)
        bound = _kth_largest_lane_key(lane_max, k, BITS)
        steps = 0
        walking = True
        while walking:
            count = tl.zeros([BLOCK], dtype=tl.int32)
            least = tl.full([BLOCK], 2147483647, tl.int32)
            for start in range(0, V, BLOCK):
                idx = start + lanes
                mask = idx < V
                key = _keys(_tempered(base, idx, mask, temp, mbase, HAS_MASK))
                above = mask & (key > bound)
                count += above.to(tl.int32)
                least = tl.minimum(least, tl.where(above, key, 2147483647))
            advance = tl.sum(count, 0) >= k
            bound = tl.where(advance, tl.min(least, 0), bound)
            settled = ~advance
            steps += 1
            walking = advance & (steps < WALK)
    if ~settled:
        bound = _kth_largest_key(base, V, temp, mbase, k, HAS_MASK, BLOCK, BITS)
    return bound


@triton.jit
def _allowed(z, mask, kth, m, lmp, TOP_K: tl.constexpr, MIN_P: tl.constexpr):
    # The hard filters: top-k by key, min-p against the row max.
    ok = mask
    if TOP_K:
        ok = ok & (_keys(z) >= kth)
    if MIN_P:
        ok = ok & ((z - m) >= lmp)
    return ok


@triton.jit
def _draw_above(base, V, temp, mbase, k1, k2, kth, m, lmp, floor, TOP_K: tl.constexpr,
                MIN_P: tl.constexpr, MASS: tl.constexpr, HAS_MASK: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    # Gumbel-max over the allowed tokens with z > floor: (index, its z, score), and with MASS
    # the top-k set's max z (the row max) and sum of exp(z - that max), kept online per lane
    # (so no pass is spent on the max first). Lane-wise running best, then the lowest index
    # among the lanes holding the top score.
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_z = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = lanes
    hi = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + lanes
        mask = idx < V
        z = _tempered(base, idx, mask, temp, mbase, HAS_MASK)
        if MASS:
            zk = tl.where(_allowed(z, mask, kth, m, lmp, TOP_K, False), z, float("-inf"))
            new_hi = tl.maximum(hi, zk)
            ref = tl.where(new_hi == float("-inf"), 0.0, new_hi)
            mass = mass * tl.exp(hi - ref) + tl.exp(zk - ref)
            hi = new_hi
        ok = _allowed(z, mask, kth, m, lmp, TOP_K, MIN_P) & (z > floor)
        score = tl.where(ok, _gumbel_scores(z, idx, k1, k2), float("-inf"))
        take = score > best
        best = tl.where(take, score, best)
        best_z = tl.where(take, z, best_z)
        best_idx = tl.where(take, idx, best_idx)
    top = tl.max(best, 0)
    pick = tl.min(tl.where(best == top, best_idx, V), 0)
    pick_z = tl.max(tl.where(best_idx == pick, best_z, float("-inf")), 0)
    row_max = tl.max(hi, 0)
    ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    return pick, pick_z, top, row_max, tl.sum(mass * tl.exp(hi - ref), 0)


@triton.jit
def _top_k_top_p_kernel(logits_ptr, seeds_ptr, steps_ptr, temps_ptr, top_k_ptr, top_p_ptr,
                        log_min_p_ptr, mask_ptr, out_ptr, stride_row, stride_mask, V,
                        TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
                        TOP_K_WALK: tl.constexpr):  # fmt: skip
    # Grid (B,): one program per row of logits [B, V]; writes the drawn token to out [B].
    # With HAS_MASK every read of the row applies its packed bitmask row (at mbase).
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    mbase = mask_ptr + row * stride_mask
    k1, k2 = _row_keys(seeds_ptr, steps_ptr, row)
    temp = tl.load(temps_ptr + row)
    lanes = tl.arange(0, BLOCK)
    m = float("-inf")
    lmp = float("-inf")
    if MIN_P:
        # Min-p's reference, the row max, before the draw.
        hi = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + lanes
            hi = tl.maximum(hi, _tempered(base, idx, idx < V, temp, mbase, HAS_MASK))
        m = tl.max(hi, 0)
        lmp = tl.load(log_min_p_ptr + row)
    kth = tl.full([], -2147483647 - 1, tl.int32)  # every key: top-k off
    if TOP_K:
        k = tl.load(top_k_ptr + row)
        if (k > 0) & (k < V):
            kth = _top_k_threshold(base, V, temp, mbase, k, HAS_MASK, BLOCK, RADIX_BITS,
                                   TOP_K_WALK)  # fmt: skip
    # The draw over the top-k and min-p set (and, for top-p, the top-k set's mass).
    pick, v, top, row_max, total = _draw_above(base, V, temp, mbase, k1, k2, kth, m, lmp,
                                               float("-inf"), TOP_K, MIN_P, TOP_P, HAS_MASK,
                                               BLOCK)  # fmt: skip
    if TOP_P:
        p = tl.load(top_p_ptr + row)
        limit = p * total
        ref = tl.where(row_max == float("-inf"), 0.0, row_max)
        # Check draws until one is in the nucleus; a rejected one raises the floor to its z.
        searching = (p < 1.0) & (top > float("-inf"))
        while searching:
            above = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + lanes
                z = _tempered(base, idx, idx < V, temp, mbase, HAS_MASK)
                above += tl.where(z > v, tl.exp(z - ref), 0.0)
            searching = tl.sum(above, 0) >= limit
            if searching:
                nxt, nxt_z, nxt_top, _, _ = _draw_above(base, V, temp, mbase, k1, k2, kth, m, lmp,
                                                        v, TOP_K, MIN_P, False, HAS_MASK,
                                                        BLOCK)  # fmt: skip
                # Nothing above the floor happens only with NaN logits: keep the last draw.
                searching = nxt_top > float("-inf")
                pick = tl.where(searching, nxt, pick)
                v = tl.where(searching, nxt_z, v)
    tl.store(out_ptr + row, pick.to(tl.int64))


def top_k_top_p_sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row from the top-k / top-p / min-p filtered distribution, Triton kernel.

    Args:
        logits: [B, V] float32/bf16/fp16, rows contiguous; divided by temperatures in float32.
        seeds, steps: [B] int64, the counter-based noise's keys (as gumbel_argmax).
        temperatures: [B] float32 (> 0).
        top_k: [B] int32, 0 or less (or V and more) off; None: off for every row.
        top_p: [B] float32 in (0, 1], 1 off; None: off for every row.
        min_p: [B] float32 in [0, 1], 0 off; None: off for every row.
        bitmask: optional [B, ceil(V / 32)] int32 packed mask (token_bitmask.py): disallowed
            tokens are -inf before the filters, which then rank and weigh allowed tokens only.

    Returns:
        [B] int64 token ids, what top_k_top_p_sample_ref draws (the two may differ only where a
        token's mass above sits within float32 rounding of p x the total).
    """
    op = "top_k_top_p_sample"
    if not (logits.dim() == 2 and logits.dtype in (torch.float32, *_NARROW)):
        raise ValueError(
            f"{op}: logits must be [B, V] float32/bf16/fp16, got "
            f"{tuple(logits.shape)} {logits.dtype}"
        )
    if logits.stride(1) != 1:
        raise ValueError(f"{op}: logits rows must be contiguous, got strides {logits.stride()}")
    rows, vocab = logits.shape
    _check_rows(op, seeds, steps, rows)
    check_row_tensor(op, "temperatures", temperatures, rows, torch.float32)
    check_row_tensor(op, "top_k", top_k, rows, torch.int32)
    check_row_tensor(op, "top_p", top_p, rows, torch.float32)
    check_row_tensor(op, "min_p", min_p, rows, torch.float32)
    check_bitmask(op, bitmask, rows, vocab)
    given = [t for t in (top_k, top_p, min_p, bitmask) if t is not None]
    check_launchable(op, logits, seeds, steps, temperatures, *given)
    out = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    launch_top_k_top_p(logits, seeds, steps, temperatures, top_k, top_p, min_p, out, bitmask)
    return out


def launch_top_k_top_p(
    logits,
    seeds,
    steps,
    temperatures,
    top_k,
    top_p,
    min_p,
    out,
    bitmask=None,
    block=None,
    num_warps=None,
    radix_bits=None,
    top_k_walk=None,
) -> None:
    """Launch the kernel on checked arguments (top_k_top_p_sample is the entry point); block,
    num_warps, radix_bits and top_k_walk default to BLOCK_V (512 under the interpreter, so small
    test rows span several blocks), NUM_WARPS, RADIX_BITS and TOP_K_WALK (tests and benchmarks
    pass others; top_k_walk 0 goes straight to the radix select)."""
    log_min_p = _log_min_p(min_p) if min_p is not None else None
    _top_k_top_p_kernel[(logits.shape[0],)](
        logits, seeds, steps, temperatures,
        top_k if top_k is not None else seeds, top_p if top_p is not None else temperatures,
        log_min_p if log_min_p is not None else temperatures,
        bitmask if bitmask is not None else seeds, out, logits.stride(0),
        bitmask.stride(0) if bitmask is not None else 0, logits.shape[1],
        TOP_K=top_k is not None, TOP_P=top_p is not None, MIN_P=min_p is not None,
        HAS_MASK=bitmask is not None, BLOCK=block or (512 if interpreting() else BLOCK_V),
        RADIX_BITS=radix_bits or RADIX_BITS,
        TOP_K_WALK=TOP_K_WALK if top_k_walk is None else top_k_walk,
        num_warps=num_warps or NUM_WARPS,
    )  # fmt: skip
