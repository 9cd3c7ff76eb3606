"""StepHandle: a launched step whose results are still on the device (and StepForward, its
model pass before the draw)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from batchgen.engine.host_to_device import PinnedStager
from batchgen.engine.sampler import gather_logprobs
from batchgen.engine.step_inputs import StepInputs
from batchgen.sampling_params import SamplingParams


class StepForward(NamedTuple):
    """A step's model pass, enqueued, before its draw (ModelRunner.forward -> sample).

    Attributes:
        step: the step's inputs.
        hidden: [T', H] hidden states on the device (T' may include graph padding rows).
        logits: [N, V] logits of the N sampling rows, or None when nothing samples.
        sample_ids: seq_id of each sampling row, in batch order.
    """

    step: StepInputs
    hidden: torch.Tensor
    logits: torch.Tensor | None
    sample_ids: list[int]


class StepHandle:
    """What one launched step will produce; `result()` waits for the device and reads it.

    On CUDA the sampled tokens and scores start copying into pinned host memory as soon as
    they are enqueued, behind the step's kernels, and an event marks the end; the host meanwhile
    schedules and launches the next step.

    Args:
        stager: the runner's PinnedStager (the results are read back through it).
        tokens: [N] int64 sampled tokens on the device (None when nothing sampled), in batch
            order of the sampling sequences; the next step may read them as inputs.
        raw_logprobs: [N, V] log-softmax of the raw logits, when any row asked for logprobs.
        params: the N rows' sampling params (how many top logprobs each wants).
        sample_index: seq_id -> row of `tokens`.
        score_owner: batch row owning each scored position (host list).
        score_logprobs / score_matches: [n] float32 / bool per scored position, or None.
        check: called once the step is done, before its results are read (tensor parallel:
            raises if another rank died, whose step results cannot be trusted).
    """

    def __init__(
        self,
        stager: PinnedStager,
        tokens: torch.Tensor | None,
        raw_logprobs: torch.Tensor | None,
        params: list[SamplingParams],
        sample_index: dict[int, int],
        score_owner: list[int],
        score_logprobs: torch.Tensor | None,
        score_matches: torch.Tensor | None,
        check: Callable[[], None] | None = None,
    ) -> None:
        self.tokens = tokens
        self.raw_logprobs = raw_logprobs
        self.params = params
        self.sample_index = sample_index
        self.score_owner = score_owner
        self._check = check
        self._host = [stager.to_host(t) for t in (tokens, score_logprobs, score_matches)]
        self._event = None
        device = next((t.device for t in (tokens, score_logprobs) if t is not None), None)
        if device is not None and device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def result(
        self,
    ) -> tuple[list[int], list[dict[int, float]] | None, list[tuple[int, float, bool]]]:
        """Wait for the step. Returns:
        tokens: one sampled token per sampling sequence (batch order).
        logprobs: per sampling sequence {token: logprob} when any asked, else None.
        scores: (batch row, log-prob of the candidate token, whether it was the argmax) for
            every scored position, in order.
        """
        try:
            if self._event is not None:
                self._event.synchronize()
        except Exception:
            if self._check is not None:
                self._check()  # a rank died under the step: say so rather than the CUDA error
            raise
        if self._check is not None:
            self._check()
        tokens, lps, matches = (t.tolist() if t is not None else [] for t in self._host)
        logprobs = None
        if self.raw_logprobs is not None:
            logprobs = gather_logprobs(self.raw_logprobs, tokens, self.params)
        return tokens, logprobs, list(zip(self.score_owner, lps, matches))
