"""BitmaskUploader: a step's structured-output token masks from host to device, beside the model
pass (a side stream into two alternating device buffers)."""

from __future__ import annotations

import torch

from batchgen.engine.host_to_device import PinnedStager


class BitmaskUploader:
    """Uploads a step's [N, W] int32 token masks (W = ceil(V / 32)).

    On CUDA the copy runs on a side stream into one of two device buffers (the stager's sets'
    turn), so it overlaps the model pass already enqueued instead of queueing behind it; the
    draw, enqueued next on the main stream, waits for it. Buffer k was last read by the draw
    of step N - 2, which the engine has waited for. On the CPU the host tensor is used as is.

    Args:
        stager: the runner's PinnedStager (whose turn picks the buffer).
        device: the runner's device.
        max_rows: rows a step may sample (max_num_seqs): buffers are sized for it once.
    """

    def __init__(self, stager: PinnedStager, device: torch.device, max_rows: int) -> None:
        self.stager = stager
        self.device = device
        self.max_rows = max_rows
        self._stream: torch.cuda.Stream | None = None  # created on first use
        self._buffers: list[torch.Tensor | None] = [None, None]

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """host: [N, W] int32 (pinned on CUDA) -> the same masks on the device."""
        if self.device.type != "cuda":
            return host
        main = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        turn = self.stager.turn
        need = max(self.max_rows * host.shape[1], host.numel())
        buf = self._buffers[turn]
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=torch.int32, device=self.device)
            self._buffers[turn] = buf
            # Fresh memory may be a block the main stream freed with kernels still pending.
            self._stream.wait_stream(main)
        dev = buf[: host.numel()].view(host.shape)
        with torch.cuda.stream(self._stream):
            dev.copy_(host, non_blocking=True)
        main.wait_stream(self._stream)
        return dev
