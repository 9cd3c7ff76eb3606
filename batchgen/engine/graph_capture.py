"""The runner's CUDA graphs at start-up: GEMM tuning for the rows they run, the tensor-parallel
capture-plan checks, then the decode graphs and the mixed-step graphs, in that order on every
rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.config import EngineConfig
from batchgen.distributed.group import TensorParallel
from batchgen.engine.capture_plan import Agree, CapturePlan, plan_graphs
from batchgen.engine.cuda_graph import DecodeGraphs, bucket_sizes
from batchgen.engine.mixed_graph import MixedGraphs, mixed_bucket_sizes
from batchgen.engine.rank_guard import RankGuard
from batchgen.layers import gemm_tuning


@dataclass
class CapturedGraphs:
    """What start-up captured: decode graphs and mixed-step graphs (None where none), and the
    GEMM tuning report (None where tuning did not run)."""

    graphs: DecodeGraphs | None = None
    mixed_graphs: MixedGraphs | None = None
    tune_report: gemm_tuning.TuneReport | None = None


def capture_graphs(
    model,
    kv_caches,
    config: EngineConfig,
    max_model_len: int,
    num_kv_blocks: int,
    chunk: int,
    stage,
    tp: TensorParallel | None,
    guard: RankGuard,
    agree: Agree,
) -> CapturedGraphs:
    """Capture the graphs (on CUDA, unless enforce_eager) and, with tensor parallel, check that
    every rank planned (before) and issued (after) the same as rank 0.

    Args:
        model, kv_caches: what the graphs run and read.
        config, max_model_len, num_kv_blocks: the engine's settings, as resolved.
        chunk: prompt rows of each mixed graph; 0 captures none.
        stage: the runner's PinnedStager.to_device.
        tp, guard, agree: the rank's group (None without tensor parallel), its RankGuard and
            the runner's start-up agreement.

    Raises:
        TensorParallelError: the ranks' plans or their collectives differ.
    """
    out = CapturedGraphs()
    kv_device = kv_caches[0][0].device
    sizes, mixed = [], []
    if kv_device.type == "cuda" and not config.enforce_eager:
        sizes = bucket_sizes(config.max_num_seqs)
        mixed = mixed_bucket_sizes(config.max_num_seqs) if chunk else []
        if config.tune_gemms:
            rows = sizes + [s + chunk for s in mixed]
            out.tune_report = gemm_tuning.tune_projections(model.projection_groups(), rows)
        agree("tuned", None, lambda vs: None)  # graphs capture collectives: all together
    dtype = next(model.parameters()).dtype
    hidden = model.config.hidden_size
    chunk = chunk if mixed else 0  # no mixed graphs (CPU, eager): no chunk rows
    guard.before_capture(
        agree, plan(hidden, dtype, sizes, mixed, chunk, tp, config, max_model_len, num_kv_blocks)
    )
    if sizes:
        out.graphs = DecodeGraphs(
            model,
            kv_caches,
            config.max_num_seqs,
            max_model_len,
            config.block_size,
            stage,
            on_bucket=lambda bs: guard.enter(f"capture decode graph bs={bs}"),
        )
    if mixed:
        out.mixed_graphs = MixedGraphs(
            model,
            kv_caches,
            mixed,
            chunk,
            max_model_len,
            config.block_size,
            stage,
            out.graphs.pool,
            on_bucket=lambda bs: guard.enter(f"capture mixed graph bs={bs}+{chunk}"),
        )
    guard.leave()
    guard.after_capture(agree)
    return out


def plan(
    hidden_size: int,
    dtype: torch.dtype,
    sizes: list[int],
    mixed: list[int],
    chunk: int,
    tp: TensorParallel | None,
    config: EngineConfig,
    max_model_len: int,
    num_kv_blocks: int,
) -> CapturePlan:
    """What this rank is about to capture (compared across tensor-parallel ranks)."""
    row_bytes = hidden_size * dtype.itemsize
    route = tp.route if tp is not None else (lambda nbytes: "local")
    return CapturePlan(
        graphs=plan_graphs(sizes, mixed, chunk, lambda rows: route(rows * row_bytes)),
        hidden_size=hidden_size,
        dtype=str(dtype),
        num_kv_blocks=num_kv_blocks,
        block_size=config.block_size,
        max_model_len=max_model_len,
        chunk_tokens=chunk,
        one_shot_max_bytes=tp.one_shot_max_bytes if tp is not None else 0,
    )
