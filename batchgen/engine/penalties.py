"""PenaltyHistory: the token ids of penalised sequences kept on the device, so repetition,
frequency and presence penalties apply without reading any history on the host.

Each penalised sequence owns one row of an [rows, width] int32 buffer holding its ids (prompt,
then outputs). Its known ids are copied in when it first samples; after that every token drawn
for it is written into its row on the device, right after the draw. So a step can penalise with
the tokens of the step still in flight (async scheduling) without waiting for them, and the host
sends a few numbers per row each step (buffer row, history length, prompt length, penalties)
instead of the whole history. Before this, a penalised batch settled the step in flight and
walked every row's history in Python: nano on qwen3-0.6b ran 12x slower with
repetition_penalty=1.1 (2026-11-24, before 76fa873; examples/benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.host_to_device import to_device
from batchgen.kernels import ops
from batchgen.kernels.penalties import new_scratch
from batchgen.sampling_params import SamplingParams

# History positions penalised per pass (rows x the longest history): bounds the torch
# reference's [rows, W] int64 temporaries (the CPU path) at about 32 MB each whatever the batch
# and context length. The CUDA kernel needs no temporaries; its scratch is bounded by rows.
CHUNK_POSITIONS = 1 << 22
_MIN_ROWS, _MIN_WIDTH = 16, 256


@dataclass(frozen=True)
class History:
    """One sampling row's token history, as the sampler reads it.

    Attributes:
        key: the sequence's id (unique among the live sequences of one engine).
        token_ids: the sequence's live token list (prompt + outputs, including placeholders of
            tokens still in flight). Only ids the device does not hold yet are read, and those
            must be known (>= 0).
        num_prompt: leading ids that are the prompt (repetition reads them; frequency and
            presence count only the outputs after them).
        length: the history's length when the step was scheduled, len(token_ids) by default;
            the row's new token goes to this index. Taken at construction because the live list
            may grow before the draw (a structured-output step draws after the next placeholder
            is appended).
    """

    key: int
    token_ids: list[int]
    num_prompt: int
    length: int = -1

    def __post_init__(self) -> None:
        if self.length < 0:
            object.__setattr__(self, "length", len(self.token_ids))


class PenaltyHistory:
    """Device-resident token histories of the penalised sequences, keyed by sequence id.

    Args:
        stage: (values, dtype, device) -> device tensor for the per-step row data (the
            runner's PinnedStager.to_device).
    """

    def __init__(self, stage=to_device) -> None:
        self.stage = stage
        self.ids: torch.Tensor | None = None  # [rows, width] int32
        self.row_of: dict[int, int] = {}  # key -> buffer row
        self.held: dict[int, int] = {}  # key -> ids of it the buffer holds
        self.free: list[int] = []
        self.counts: torch.Tensor | None = None  # the kernel's [C, V] int32 scratch, zero

    def reset(self) -> None:
        """Forget every sequence (a new engine over the same runner numbers its own)."""
        self.row_of.clear()
        self.held.clear()
        self.free = list(range(self.ids.shape[0])) if self.ids is not None else []

    def release(self, keys) -> None:
        """Free the rows of finished sequences (none of their steps still in flight)."""
        for key in keys:
            row = self.row_of.pop(key, None)
            if row is not None:
                del self.held[key]
                self.free.append(row)

    def apply(
        self, logits: torch.Tensor, rows: list[int], histories: list[History],
        params: list[SamplingParams],
    ) -> list[int]:  # fmt: skip
        """Penalise logits [N, V] fp32 in place at the given rows (one History and
        SamplingParams each). Returns their buffer rows, for `record` after the draw.

        Repetition (HF semantics, over prompt + outputs): a seen token's logit is divided by
        the penalty when positive, multiplied when not. Then frequency and presence (OpenAI
        semantics, over outputs only): logit -= frequency x count + presence x (count > 0).
        """
        device = logits.device
        lengths = [h.length for h in histories]
        buf_rows = self._rows(histories, lengths, device)
        step = max(1, CHUNK_POSITIONS // max(lengths))
        for lo in range(0, len(rows), step):
            hi = lo + step
            self._penalise(
                logits, rows[lo:hi], buf_rows[lo:hi], lengths[lo:hi],
                [h.num_prompt for h in histories[lo:hi]], params[lo:hi],
            )  # fmt: skip
        return buf_rows

    def record(
        self, tokens: torch.Tensor, rows: list[int], buf_rows: list[int], histories: list[History]
    ) -> None:
        """Write the drawn tokens (tokens [N] on the device, rows into it) into the buffer at
        each history's next index: no host sync, the next step's penalties read them. Follows
        `apply` on the same histories, which made the buffer wide enough."""
        positions = [h.length for h in histories]
        idx = self.stage([rows, buf_rows, positions], torch.int64, tokens.device)  # [3, P]
        self.ids[idx[1], idx[2]] = tokens[idx[0]].to(torch.int32)
        for h, n in zip(histories, positions):
            self.held[h.key] = n + 1

    def _rows(self, histories: list[History], lengths: list[int], device) -> list[int]:
        """Buffer rows of these histories; a sequence seen for the first time takes a row, and
        ids the buffer lacks (its known history then) are copied in."""
        if self.ids is None:
            self.ids = torch.zeros(_MIN_ROWS, _MIN_WIDTH, dtype=torch.int32, device=device)
            self.free = list(range(_MIN_ROWS))
        self._fit_width(max(lengths) + 1)
        out = []
        for h, n in zip(histories, lengths):
            row = self.row_of.get(h.key)
            if row is None:
                row = self.row_of[h.key] = self._take_row()
                self.held[h.key] = 0
            # A history only shrinks when a sequence stops early; its first n ids still match.
            held = min(self.held[h.key], n)
            if held < n:
                missing = h.token_ids[held:n]
                if min(missing) < 0:
                    raise RuntimeError(
                        f"sequence {h.key}: its history holds a token not drawn yet at index "
                        f"{held + next(i for i, t in enumerate(missing) if t < 0)}, which the "
                        "device never received"
                    )
                self.ids[row, held:n] = self.stage(missing, torch.int32, device)
            self.held[h.key] = n
            out.append(row)
        return out

    def _take_row(self) -> int:
        if not self.free:
            old = self.ids
            self.ids = torch.zeros(
                2 * old.shape[0], old.shape[1], dtype=old.dtype, device=old.device
            )
            self.ids[: old.shape[0]] = old
            self.free = list(range(old.shape[0], self.ids.shape[0]))
        return self.free.pop()

    def _fit_width(self, width: int) -> None:
        if width > self.ids.shape[1]:
            wide = max(width, 2 * self.ids.shape[1])
            old = self.ids
            self.ids = torch.zeros(old.shape[0], wide, dtype=old.dtype, device=old.device)
            self.ids[:, : old.shape[1]] = old

    def _penalise(self, logits, rows, buf_rows, lengths, prompt_lens, params) -> None:
        # Only the logits of ids in the histories are read and written (ops.penalise_logits:
        # a Triton kernel on CUDA, the [P, W] torch reference on CPU); the host sends four
        # ints and three floats a row.
        device = logits.device
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        ints = self.stage([rows, buf_rows, lengths, prompt_lens], torch.int64, device)  # [4, P]
        floats = self.stage([rep, freq, pres], torch.float32, device)  # [3, P]
        ops.penalise_logits(logits, self.ids, ints, floats, self._counts(logits))

    def _counts(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The kernel's zeroed counter scratch for this vocabulary (kept: the kernel leaves
        it zero); None off CUDA, where the reference needs none."""
        if not logits.is_cuda:
            return None
        c = self.counts
        if c is None or c.shape[1] != logits.shape[1] or c.device != logits.device:
            c = self.counts = new_scratch(logits.shape[1], logits.device)
        return c


def apply_penalties_ref(
    logits: torch.Tensor, histories: list[History | None], params: list[SamplingParams]
) -> torch.Tensor:
    """Reference of the penalties from host-side histories, one row at a time (every id of a
    history known); modifies logits [N, V] fp32 in place and returns it."""
    for i, (h, p) in enumerate(zip(histories, params)):
        if h is None or not p.has_penalties:
            continue
        prompt, outputs = h.token_ids[: h.num_prompt], h.token_ids[h.num_prompt :]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(outputs)), device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and outputs:
            out = torch.tensor(outputs, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits
