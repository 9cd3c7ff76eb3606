"""KVScales: the per-layer K/V scales of an FP8 KV cache — read them, set them, or calibrate them
from max |k| and |v| over a sample of prompts."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchgen.layers.attention import Attention
from batchgen.layers.context import AttentionContext


class KVScales:
    """The model's Attention layers' `kv_scale` buffers, in layer order.

    A scale s stores x as round(x / s) in e4m3 (kernels/fp8.py), so |x| up to 448 s is kept and
    values below 2^-9 s are lost. Calibration runs the prompts through the model's cache-free
    forward (no KV cache, nothing stored), records each layer's max |k| (after q/k-norm and
    rotary, as stored) and max |v|, and sets s = max / 448.
    """

    def __init__(self, model: nn.Module) -> None:
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.layers = sorted(layers, key=lambda a: a.layer_idx)
        self.model = model

    def get(self) -> list[tuple[float, float]]:
        """(k_scale, v_scale) per layer."""
        return [tuple(a.kv_scale.tolist()) for a in self.layers]  # type: ignore[misc]

    def set(self, scales: list[tuple[float, float]] | list[list[float]]) -> None:
        """Set every layer's (k_scale, v_scale); each must be a finite number > 0.

        Raises:
            ValueError: naming the layer at fault, or a count that does not match the model.
        """
        if len(scales) != len(self.layers):
            raise ValueError(
                f"got K/V scales for {len(scales)} layers, the model has {len(self.layers)}"
            )
        for i, pair in enumerate(scales):
            if len(pair) != 2 or not all(
                isinstance(x, (int, float)) and 0 < x < math.inf for x in pair
            ):
                raise ValueError(
                    f"layer {i}: K/V scales must be two finite numbers > 0, got {pair!r}"
                )
        for attn, pair in zip(self.layers, scales):
            attn.kv_scale.copy_(torch.tensor([float(x) for x in pair], dtype=torch.float32))

    @torch.inference_mode()
    def calibrate(
        self, prompts: list[list[int]], max_len: int, max_batch_tokens: int
    ) -> list[tuple[float, float]]:
        """Set the scales from `prompts` (token ids; each cut to its first max_len tokens) run
        in batches of at most max_batch_tokens tokens; returns them. Layers that saw nothing
        above 0 keep scale 1.0."""
        prompts = [p[:max_len] for p in prompts if p]
        if not prompts:
            raise ValueError("KV-scale calibration needs at least one non-empty prompt")
        device = self.layers[0].kv_scale.device
        for attn in self.layers:
            attn.observe_kv_range(True)
        try:
            batch: list[list[int]] = []
            tokens = 0
            for prompt in prompts:
                if batch and tokens + len(prompt) > max_batch_tokens:
                    self._forward(batch, device)
                    batch, tokens = [], 0
                batch.append(prompt)
                tokens += len(prompt)
            self._forward(batch, device)
            scales = [a.scales_from_range() for a in self.layers]
        finally:
            for attn in self.layers:
                attn.observe_kv_range(False)
        self.set([tuple(s.tolist()) for s in scales])
        return self.get()

    def _forward(self, batch: list[list[int]], device: torch.device) -> None:
        lengths = [len(p) for p in batch]
        ids = torch.tensor([t for p in batch for t in p], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        self.model(ids, positions, AttentionContext.for_prompts(lengths, device))
