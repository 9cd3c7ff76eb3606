"""Per-step roofline at the KV capacity a run had: the ideal time of an engine that holds only as
many requests as its KV cache fits, each step bound by the larger of its bytes and its FLOPs.

The decode-bytes and prefill-FLOPs models of roofline.py assume every request resident at once and
add prefill to decode. When the KV cache holds only part of a workload (llama3.1-70b in 4 bits on
one 80 GB GPU: about 90k tokens), the batch a step runs is bounded by it, and a step of a large
batch can be compute-bound. The ideal engine here admits requests in order whenever their whole
length (prompt + max_tokens, in blocks) fits the free cache, never preempts, and runs in each step
the prompts admitted then plus one token of every other resident request:

    step time = max(bytes / copy ceiling, FLOPs / matmul ceiling)
    bytes = weights read by a step (decode_weight_bytes) + the KV of every decoding request
    FLOPs = prompts' forward FLOPs + per decoding request 2 x params + attention at its position

The sum over steps is the ideal wall time at that capacity; its output tok/s is the roofline.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from batchgen.bench.roofline import ModelShape
from batchgen.bench.workloads import Workload


@dataclass(frozen=True)
class StepRoofline:
    """Ideal seconds, steps, bytes and FLOPs; mean decoding batch; the share of the ideal time
    in steps bound by FLOPs rather than bytes."""

    seconds: float
    steps: int
    bytes: float
    flops: float
    mean_batch: float
    flops_bound_share: float

    def metrics(self, wall_s: float, output_tokens: int, kv_tokens: int) -> dict[str, float]:
        return {
            "step_roofline_s": self.seconds,
            "step_roofline_output_tok_s": output_tokens / self.seconds,
            "step_roofline_fraction": self.seconds / wall_s if wall_s > 0 else None,
            "step_roofline_flops_bound_share": self.flops_bound_share,
            "step_roofline_mean_batch": self.mean_batch,
            "step_roofline_kv_tokens": kv_tokens,
            # The ideal steps' bytes over the measured wall time: the bandwidth the run drew.
            "achieved_tb_s": self.bytes / wall_s / 1e12 if wall_s > 0 else None,
        }


def step_roofline(
    shape: ModelShape,
    w: Workload,
    weight_bytes: int,
    kv_tokens: int,
    block_size: int,
    matmul_flops: float,
    copy_bytes_per_s: float,
) -> StepRoofline | None:
    """The ideal run of generation workload `w` with a KV cache of kv_tokens tokens (None for a
    score workload, or when a request can never fit)."""
    if w.is_score or not w.num_requests:
        return None
    capacity = kv_tokens // block_size
    dense_flops = 2.0 * shape.non_embedding_params
    attn = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim  # per token per position
    queue = list(zip(w.prompts, w.max_tokens, w.shared_prefix_lens or [0] * w.num_requests))
    finish: dict[int, list[int]] = defaultdict(list)  # step -> blocks freed after it
    free, step, head = capacity, 0, 0
    batch = ctx_sum = 0  # decoding requests and the sum of their positions
    leaving: dict[int, tuple[int, int]] = defaultdict(lambda: (0, 0))  # step -> (count, ctx)
    seconds = total_bytes = total_flops = batch_steps = flops_time = 0.0
    while head < len(queue) or batch:
        prefill = 0.0
        joining = joining_ctx = 0
        while head < len(queue):
            prompt, m, shared = queue[head]
            need = -(-(len(prompt) + m) // block_size)
            if need > capacity:
                return None
            if need > free:
                break
            free -= need
            head += 1
            prefill += shape.forward_flops(shared, len(prompt) - shared)
            # The prompt step gives the first token; m - 1 decode steps follow from the next.
            end = step + m - 1
            finish[end].append(need)
            if m > 1:
                joining += 1
                joining_ctx += len(prompt)
                count, ctx = leaving[end]
                # its position when it leaves: prompt + (m - 1) - 1 at its last decode step
                leaving[end] = (count + 1, ctx + len(prompt) + m - 2)
        if not batch and not prefill:
            return None  # nothing could run: a request that never fits beside the others
        # Each decoding request reads the KV of its position's prefix and itself.
        nbytes = weight_bytes + shape.kv_bytes_per_token * (ctx_sum + batch)
        flops = prefill + batch * dense_flops + attn * ctx_sum
        t_bytes, t_flops = nbytes / copy_bytes_per_s, flops / matmul_flops
        seconds += max(t_bytes, t_flops)
        flops_time += t_flops if t_flops > t_bytes else 0.0
        total_bytes += nbytes
        total_flops += flops
        batch_steps += batch
        # Decoding requests advance one position; those whose last token this was leave.
        ctx_sum += batch
        count, ctx = leaving.pop(step, (0, 0))
        batch -= count
        ctx_sum -= ctx + count
        free += sum(finish.pop(step, []))
        batch += joining
        ctx_sum += joining_ctx
        step += 1
    return StepRoofline(seconds, step, total_bytes, total_flops, batch_steps / max(step, 1),
                        flops_time / seconds if seconds else 0.0)  # fmt: skip
