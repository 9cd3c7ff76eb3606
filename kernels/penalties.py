"""Repetition, frequency and presence penalties over device-resident token histories: a Triton
kernel and its torch reference.

Each penalised row p of a step names its logits row, its history (a row of an [R, W] int32 id
buffer, of which the first `length` ids are valid and the first `prompt` of those are the
prompt) and its three penalties. Every id in the history gets the one value

    rep(x) - (frequency * n + presence * (n > 0)),  rep(x) = x / r if x > 0 else x * r

where x is its logit before the pass and n its count among the outputs (0 for an id only in
the prompt). Neutral penalties (r = 1, 0, 0) leave a logit bit for bit as it was.

The reference does [P, W] work: gather, sort the outputs, two binary searches, scatter (about
15 torch launches a pass). The kernel runs one program a row in two phases over its history,
with an int32 counter per vocabulary id in a zeroed scratch row:
1. each output position adds 1 to its id's counter; each prompt position ORs in _IN_PROMPT;
2. each position swaps its id's counter for 0: the one that finds it non-zero owns the id,
   reads its logit and writes the penalised value. So an id is written once, from the value
   before the pass, and the scratch row is zero again for the next launch.
Integer counts keep the result deterministic (no float atomics).
"""

from __future__ import annotations

import torch

from .launch import check_launchable, tl, triton

# Counter bit: the id occurs in the prompt (output counts stay far below it).
_IN_PROMPT = 1 << 30
_BLOCK = 1024
# Scratch budget of one launch: rows per launch = this // (4 x V), so the counters take at most
# 32 MB whatever the batch (a [P, V] scratch at 256 rows of a 152k vocabulary would be 155 MB).
SCRATCH_BYTES = 32 << 20


@triton.jit(do_not_specialize=["first", "P"])
def _penalise_kernel(
    logits_ptr, ids_ptr, counts_ptr, ints_ptr, floats_ptr, first, P,
    stride_logits, stride_ids, stride_counts, V,
    IN_PROMPT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Program p: penalised row i = first + p, counters in scratch row p. ints [4, P] int64:
    # logits row, history row, history length, prompt length; floats [3, P] fp32: repetition,
    # frequency, presence.
    pid = tl.program_id(0)
    i = first + pid
    row = tl.load(ints_ptr + i)
    hist = ids_ptr + tl.load(ints_ptr + P + i) * stride_ids
    n = tl.load(ints_ptr + 2 * P + i).to(tl.int32)
    n_prompt = tl.load(ints_ptr + 3 * P + i).to(tl.int32)
    counts = counts_ptr + pid.to(tl.int64) * stride_counts
    for lo in range(0, n, BLOCK):
        pos = lo + tl.arange(0, BLOCK)
        tok = tl.load(hist + pos, mask=pos < n, other=-1)
        ok = (tok >= 0) & (tok < V)  # an id past the vocabulary is never written
        tl.atomic_add(counts + tok, 1, mask=ok & (pos >= n_prompt))
        tl.atomic_or(counts + tok, IN_PROMPT, mask=ok & (pos < n_prompt))
    tl.debug_barrier()  # every count in before any is read
    r = tl.load(floats_ptr + i)
    freq = tl.load(floats_ptr + P + i)
    pres = tl.load(floats_ptr + 2 * P + i)
    out_row = logits_ptr + row * stride_logits
    for lo in range(0, n, BLOCK):
        pos = lo + tl.arange(0, BLOCK)
        tok = tl.load(hist + pos, mask=pos < n, other=-1)
        ok = (tok >= 0) & (tok < V)
        c = tl.atomic_xchg(counts + tok, 0, mask=ok)
        mine = ok & (c != 0)  # the first position of its id to get here
        x = tl.load(out_row + tok, mask=mine, other=0.0)
        x = tl.where(x > 0, x / r, x * r)
        k = c & (IN_PROMPT - 1)
        x = x - (freq * k.to(tl.float32) + pres * (k > 0).to(tl.float32))
        tl.store(out_row + tok, x, mask=mine)


def _check_args(op, logits, ids, ints, floats) -> None:
    if not (logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1):
        raise ValueError(
            f"{op}: logits must be [N, V] float32 with contiguous rows, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    if not (ids.dim() == 2 and ids.dtype == torch.int32 and ids.stride(1) == 1):
        raise ValueError(
            f"{op}: ids must be [R, W] int32 with contiguous rows, got {tuple(ids.shape)} "
            f"{ids.dtype}"
        )
    P = ints.shape[-1]
    if not (ints.shape == (4, P) and ints.dtype == torch.int64 and ints.is_contiguous()):
        raise ValueError(f"{op}: ints must be [4, P] int64, contiguous, got {tuple(ints.shape)}")
    if not (floats.shape == (3, P) and floats.dtype == torch.float32 and floats.is_contiguous()):
        raise ValueError(
            f"{op}: floats must be [3, P] float32, contiguous, got {tuple(floats.shape)} "
            f"{floats.dtype}"
        )


def scratch_rows(vocab: int) -> int:
    """Rows of counters one launch uses: SCRATCH_BYTES of int32 [rows, vocab], at least 1."""
    return max(1, SCRATCH_BYTES // (4 * vocab))


def new_scratch(vocab: int, device: torch.device) -> torch.Tensor:
    """The kernel's zeroed int32 counters [scratch_rows(vocab), vocab] (keep it: each launch
    leaves it zero)."""
    return torch.zeros(scratch_rows(vocab), vocab, dtype=torch.int32, device=device)


def penalise_logits(
    logits: torch.Tensor,
    ids: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Apply each penalised row's penalties to logits in place, Triton kernel.

    Args:
        logits: [N, V] float32, rows contiguous; modified in place.
        ids: [R, W] int32 token histories (a row's first `length` entries valid).
        ints: [4, P] int64: per penalised row its logits row, ids row, history length (<= W)
            and prompt length. No two penalised rows share a logits row.
        floats: [3, P] float32: repetition, frequency and presence penalty.
        counts: [C, >= V] int32 scratch, all zero; the kernel leaves it zero. P rows run in
            launches of C (scratch_rows(V) keeps it at SCRATCH_BYTES).

    Returns:
        logits.
    """
    op = "penalise_logits"
    _check_args(op, logits, ids, ints, floats)
    V = logits.shape[1]
    if not (counts.dim() == 2 and counts.dtype == torch.int32 and counts.shape[1] >= V
            and counts.stride(1) == 1):  # fmt: skip
        raise ValueError(
            f"{op}: counts must be [C, >= {V}] int32, got {tuple(counts.shape)} {counts.dtype}"
        )
    check_launchable(op, logits, ids, ints, floats, counts)
    P, C = ints.shape[1], counts.shape[0]
    for first in range(0, P, C):
        _penalise_kernel[(min(C, P - first),)](
            logits, ids, counts, ints, floats, first, P,
            logits.stride(0), ids.stride(0), counts.stride(0), V,
            IN_PROMPT=_IN_PROMPT, BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip
    return logits


def penalise_logits_ref(
    logits: torch.Tensor, ids: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor
) -> torch.Tensor:
    """Torch reference of penalise_logits (same arguments, no scratch): modifies logits in
    place and returns it. [P, W] temporaries, W the longest history."""
    _check_args("penalise_logits", logits, ids, ints, floats)
    P = ints.shape[1]
    if P == 0:
        return logits
    device, vocab = logits.device, logits.shape[1]
    rows, buf_rows, lengths, prompt_lens = ints
    width = int(lengths.max())
    pos = torch.arange(width, device=device).unsqueeze(0)  # [1, W]
    valid = pos < lengths.unsqueeze(1)  # [P, W]
    hist = ids[buf_rows, :width].long()  # [P, W]
    # Positions past a history's end stand for its first id (prompts are never empty).
    hist = torch.where(valid, hist, hist[:, :1])
    flat = rows.unsqueeze(1) * vocab + hist  # [P, W] into logits.view(-1)
    values = logits.view(-1)[flat]  # the logits before any write
    # Neutral penalties are exact identities, so skipping them changes no value.
    if bool((floats[0] != 1).any()):
        r = floats[0].unsqueeze(1)
        values = torch.where(values > 0, values / r, values * r)
    if bool((floats[1:] != 0).any()):
        # Each position's id counted among the outputs: the outputs sorted per row (other
        # positions as vocab, past every id), then two binary searches.
        outputs = valid & (pos >= prompt_lens.unsqueeze(1))
        ranked = torch.where(outputs, hist, vocab).sort(dim=1).values
        count = torch.searchsorted(ranked, hist, right=True) - torch.searchsorted(ranked, hist)
        count = count.float()
        values = values - (floats[1].unsqueeze(1) * count + floats[2].unsqueeze(1) * (count > 0))
    logits.view(-1)[flat] = values
    return logits
