"""BitmaskFiller: a step's packed token masks, computed in parallel across rows on the host."""

from __future__ import annotations

import llguidance
import torch

from batchgen.kernels.token_bitmask import bitmask_words


class BitmaskFiller:
    """Fills [N, ceil(V / 32)] int32 masks: a constrained row gets its matcher's mask for the
    next token, every other row all ones (no constraint).

    The masks come from llguidance's executor, a pool of native threads that computes the rows
    without the Python GIL and with no Python work per row (a Python thread pool releases the
    GIL too, around each row). A row costs from a few microseconds (a state seen before) to
    about a millisecond (a new lexer state at a 150k vocabulary); see the package README.

    Args:
        vocab_size: V, the logits' width.
        num_threads: pool size; None takes llguidance's default (80% of the CPUs, at most 32).
    """

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor(num_threads)

    def fill(self, out: torch.Tensor, rows: list[llguidance.LLMatcher | None]) -> None:
        """Write row i's mask into out[i] ([N, words] int32 on the host, contiguous), from
        rows[i]'s matcher, or all ones where rows[i] is None."""
        if out.shape != (len(rows), self.words) or out.dtype != torch.int32 or out.is_cuda:
            raise ValueError(
                f"bitmask buffer must be [{len(rows)}, {self.words}] int32 on the host, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError("bitmask buffer must be contiguous")
        work = [(m, i) for i, m in enumerate(rows) if m is not None]
        free = [i for i, m in enumerate(rows) if m is None]
        if free:
            if len(free) == len(rows):
                out.fill_(-1)
            else:
                out[torch.tensor(free)] = -1
        if work:
            self._executor.unsafe_compute_mask_ptr(work, out.data_ptr(), self.words * 4, len(rows))
