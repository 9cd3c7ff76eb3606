"""PenaltyHistory: the token ids of penalised sequences kept on the device, so repetition,
frequency and presence penalties apply without reading any history on the host.

Each penalised sequence owns one row of an [rows, width] int32 buffer holding its ids (prompt,
then outputs). Its known ids are copied in when it first samples; after that every token drawn
for it is written into its row on the device, right after the draw. So a step can penalise with
the tokens of the step still in flight (async scheduling) without waiting for them, and the host
sends a few numbers per row each step (buffer row, history length, prompt length, penalties)
instead of the whole history. Before this, a penalised batch settled the step in flight and
walked every row's history in Python: nano on qwen3-0.6b ran 12x slower with
repetition_penalty=1.1 (RESULTS.md, twenty-third session).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.host_to_device import to_device
from batchgen.sampling_params import SamplingParams

# History positions penalised per pass (rows x the longest history): bounds the [rows, W]
# int64 temporaries at about 32 MB each whatever the batch and context length.
CHUNK_POSITIONS = 1 << 22
_MIN_ROWS, _MIN_WIDTH = 16, 256


@dataclass(frozen=True)
class History:
    """One sampling row's token history, as the sampler reads it.

    Attributes:
        key: the sequence's id (unique among the live sequences of one engine).
        token_ids: the sequence's live token list (prompt + outputs, including placeholders of
            tokens still in flight); the row's new token goes to index len(token_ids). Only
            ids the device does not hold yet are read, and those must be known (>= 0).
        num_prompt: leading ids that are the prompt (repetition reads them; frequency and
            presence count only the outputs after them).
    """

    key: int
    token_ids: list[int]
    num_prompt: int


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
        lengths = [len(h.token_ids) for h in histories]
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
        positions = [len(h.token_ids) for h in histories]
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
        # Only the logits of ids in the histories are read and written: [P, W] work (W the
        # longest history), no pass over the [P, V] logits. Every id of a history is seen, so
        # each gets the one value rep(logit) - (frequency x count + presence x (count > 0)),
        # count its occurrences among the outputs (0 for an id only in the prompt); a repeated
        # id computes and writes that same value again.
        device, vocab = logits.device, logits.shape[1]
        width = max(lengths)
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        ints = self.stage([rows, buf_rows, lengths, prompt_lens], torch.int64, device)  # [4, P]
        floats = self.stage([rep, freq, pres], torch.float32, device)  # [3, P]
        pos = torch.arange(width, device=device).unsqueeze(0)  # [1, W]
        valid = pos < ints[2].unsqueeze(1)  # [P, W]
        hist = self.ids[ints[1], :width].long()  # [P, W]
        # Positions past a history's end stand for its first id (prompts are never empty).
        hist = torch.where(valid, hist, hist[:, :1])
        flat = ints[0].unsqueeze(1) * vocab + hist  # [P, W] into logits.view(-1)
        values = logits.view(-1)[flat]  # the logits before any write
        if any(r != 1.0 for r in rep):
            r = floats[0].unsqueeze(1)
            values = torch.where(values > 0, values / r, values * r)
        if any(freq) or any(pres):
            # Each position's id counted among the outputs: the outputs sorted per row (other
            # positions as vocab, past every id), then two binary searches.
            outputs = valid & (pos >= ints[3].unsqueeze(1))
            ranked = torch.where(outputs, hist, vocab).sort(dim=1).values
            count = torch.searchsorted(ranked, hist, right=True) - torch.searchsorted(ranked, hist)
            count = count.float()
            values = values - (
                floats[1].unsqueeze(1) * count + floats[2].unsqueeze(1) * (count > 0)
            )
        logits.view(-1)[flat] = values


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
