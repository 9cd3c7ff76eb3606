"""Sampler: penalties, temperature, top-k/top-p/min-p and per-request keyed random choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.host_to_device import to_device
from batchgen.engine.penalties import History, PenaltyHistory
from batchgen.kernels import ops
from batchgen.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The rows to sample in one step, host-side; `Sampler.prepare` turns it into tensors.

    Attributes:
        params: one SamplingParams per row.
        seeds: per-row random-stream key (request seed mixed with the sample index).
        steps: per-row index of the token being generated (so a resume or a different batch
            gives the same draw).
        histories: per row, its token history (History: the sequence's id and live token
            list); required where the row's params have a penalty, read nowhere else.
        suppress_ids: per-row token ids to forbid this step (EOS/stop ids under min_tokens).
    """

    params: list[SamplingParams]
    seeds: list[int]
    steps: list[int]
    histories: list[History | None]
    suppress_ids: list[list[int]]


class Sampler:
    """Turns logits [N, V] into one token per row, plus optional top-k log-probs.

    Penalised rows read their token histories from `self.penalties`, which keeps them on the
    device and appends each drawn token; `release` frees a finished sequence's.

    Args:
        stage: (values, dtype, device) -> device tensor; the runner passes its PinnedStager's.
    """

    def __init__(self, stage=to_device) -> None:
        self.stage = stage
        self.penalties = PenaltyHistory(stage)

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[list[int], list[dict[int, float]] | None]:
        """logits: [N, V] (modified in place) -> (token per row, {token: logprob} per row or
        None). Waits for the device; the engine uses `sample` and reads the tokens later."""
        tokens, raw_logprobs = self.sample(logits, batch)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, None
        return token_list, gather_logprobs(raw_logprobs, token_list, batch.params)

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits: [N, V] (modified in place) -> (tokens [N] int64 on logits' device, log-softmax
        [N, V] of the raw logits when any row asked for logprobs, else None). Enqueues work
        only: no host sync, so the next step can be scheduled while this one runs.

        bitmask: optional [N, ceil(V / 32)] int32 on the device, the rows' allowed tokens
        (structured output); a disallowed token is never drawn, whatever the settings."""
        if self._direct(batch):
            # Temperature and filters only: the kernels read the model's logits (bf16 on GPU)
            # and divide by each row's temperature in float32 as they read, and the bitmask.
            return self._sample(logits, batch.params, batch.seeds, batch.steps, bitmask), None
        raw_logprobs = None
        if any(p.logprobs is not None for p in batch.params):
            logits = logits.float()
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [N, V], before any processing
        if bitmask is not None:
            # The float32 copy, masked as it is made (no pass of its own); -inf stays -inf
            # through penalties, so the order does not matter.
            logits = ops.apply_token_bitmask(logits, bitmask)
        else:
            logits = logits.float()
        penalised = [i for i, p in enumerate(batch.params) if p.has_penalties]
        if penalised:
            histories = [batch.histories[i] for i in penalised]
            if any(h is None for h in histories):
                row = penalised[next(j for j, h in enumerate(histories) if h is None)]
                raise ValueError(f"sampling row {row} has a penalty but no token history")
            params = [batch.params[i] for i in penalised]
            buf_rows = self.penalties.apply(logits, penalised, histories, params)
        tokens = self._draw(logits, batch)
        if penalised:
            self.penalties.record(tokens, penalised, buf_rows, histories)
        return tokens, raw_logprobs

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Tokens [N] from processed logits [N, V] fp32: suppressed ids, greedy rows, then
        filtered keyed draws for the rest."""
        device = logits.device
        # The engine refuses stop ids past the vocabulary; skipping them here keeps one row's
        # bad id from failing the batch's indexing whatever the caller.
        vocab = logits.shape[1]
        suppress = [
            (row, t) for row, ids in enumerate(batch.suppress_ids) for t in ids if 0 <= t < vocab
        ]
        if suppress:
            idx = self.stage(suppress, torch.int64, device)  # [S, 2] (row, token id)
            logits[idx[:, 0], idx[:, 1]] = float("-inf")
        greedy = [p.greedy for p in batch.params]
        if all(greedy):
            return logits.argmax(dim=-1)
        if not any(greedy):
            return self._sample(logits, batch.params, batch.seeds, batch.steps)
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=device)
        rows = [i for i, g in enumerate(greedy) if g]
        idx = self.stage(rows, torch.int64, device)
        tokens[idx] = logits[idx].argmax(dim=-1)
        rows = [i for i, g in enumerate(greedy) if not g]
        idx = self.stage(rows, torch.int64, device)
        tokens[idx] = self._sample(
            logits[idx],
            [batch.params[i] for i in rows],
            [batch.seeds[i] for i in rows],
            [batch.steps[i] for i in rows],
        )
        return tokens

    @staticmethod
    def _direct(batch: SamplingBatch) -> bool:
        """Every row samples with a temperature and at most top-k/top-p/min-p: no greedy row,
        penalty, suppressed id or logprobs (the common batch-generation case), so the draw
        can read the model's logits as they are."""
        return not any(batch.suppress_ids) and all(
            p.temperature > 0 and p.logprobs is None and not p.has_penalties for p in batch.params
        )

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        steps: list[int],
        bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits: [M, V] (any float dtype, untempered) -> [M] tokens, by Gumbel-max over each
        row's top-k/top-p/min-p set of its logits / temperature (divided in the kernel), over
        the tokens bitmask [M, ceil(V / 32)] allows (read in the kernel) when given."""
        device = logits.device
        temps = self.stage([p.temperature for p in params], torch.float32, device)
        seed_t, step_t = self._keys(seeds, steps, device)
        filters = self._filters(params, logits.shape[1], device)
        if filters is None:
            return ops.sample_gumbel(logits, seed_t, step_t, temps, bitmask)
        return ops.sample_top_k_top_p(logits, seed_t, step_t, temps, *filters, bitmask)

    def _filters(self, params: list[SamplingParams], vocab: int, device):
        """(top_k [M] int32, top_p [M] float32, min_p [M] float32) on the device, each None when
        no row sets it; None when no row sets any. A k past the vocabulary is the vocabulary
        (off)."""
        top_k = [min(p.top_k, vocab) for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        filters = (
            self.stage(top_k, torch.int32, device) if any(k > 0 for k in top_k) else None,
            self.stage(top_p, torch.float32, device) if any(x < 1.0 for x in top_p) else None,
            self.stage(min_p, torch.float32, device) if any(x > 0 for x in min_p) else None,
        )
        return None if all(f is None for f in filters) else filters

    def _keys(
        self, seeds: list[int], steps: list[int], device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row seeds and steps [M] int64 from one transfer; rows padded to an even length
        so both start 16-byte aligned (else Triton builds a kernel variant per parity)."""
        pad = [0] * (len(seeds) % 2)
        keys = self.stage([seeds + pad, steps + pad], torch.int64, device)  # [2, M (+1)]
        return keys[0, : len(seeds)], keys[1, : len(seeds)]


def gather_logprobs(
    logprobs: torch.Tensor, tokens: list[int], params: list[SamplingParams]
) -> list[dict[int, float]]:
    """Per row, {token id: log-prob} of its top `p.logprobs` tokens (at most the vocabulary:
    topk past it would fail the whole step) and of its sampled token; {} where not asked."""
    vocab = logprobs.shape[1]
    out: list[dict[int, float]] = []
    for row, (token, p) in enumerate(zip(tokens, params)):
        if p.logprobs is None:
            out.append({})
            continue
        entry: dict[int, float] = {}
        if p.logprobs > 0:
            values, ids = logprobs[row].topk(min(p.logprobs, vocab))
            entry.update(zip(ids.tolist(), values.tolist()))
        entry[token] = float(logprobs[row, token])
        out.append(entry)
    return out
