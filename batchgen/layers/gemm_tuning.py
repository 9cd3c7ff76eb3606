"""Tuning of the decoder projections' GEMMs on CUDA: per projection and row count, cuBLAS's own
pick against the algorithms cuBLASLt's heuristic offers; winners are registered with
batchgen.layers.linear and remembered in a cache file.

Why: cuBLAS picks one kernel per shape from a heuristic, and on the H100 that pick is off at
many of the row counts a decode step runs (llama3.1-8b's down projection at 192 rows: 76.8 us
against 50.8 for another of cuBLASLt's kernels; measured 2026-11-23 at 720e072).

How: the runner calls tune_projections before it captures the CUDA graphs, with the graphs' row
counts. Candidates: the algorithms cuBLASLt's heuristic lists for the shape (at most 8), those
it lists for neighbouring row counts that cuBLASLt accepts for this one (TUNE_WIDEN), the
fastest few again with other thread-block cluster shapes (TUNE_REFINE), and from
TUNE_TILES_MIN_ROWS rows up (the mixed steps) every tile id cuBLASLt runs for the algorithm,
the best tiles then with every custom option and cluster shape. Each is screened on the first
layers' weights (SCREEN_BYTES, past L2, so they stream from HBM as in a step) in CUDA-graph
replays; the fastest TUNE_CONFIRM and cuBLAS are then timed over every layer's weight, and a
candidate replaces cuBLAS when it is TUNE_MIN_GAIN faster there.

Cache: results (winner or "cuBLAS") go to gemm_tuning.json under BATCHGEN_CACHE_DIR, else
$XDG_CACHE_HOME/batchgen, else ~/.cache/batchgen, keyed by GPU, cuBLASLt version, search and
shape; a later run reads them instead of timing again, and re-checks every algorithm it loads
with cuBLASLt. A cache that cannot be read or written is skipped with a warning.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.bench.timing import graph_median_us
from batchgen.cache_dir import user_cache_dir
from batchgen.layers import linear
from batchgen.layers.tuning_cache import read_records, write_records

# A candidate must beat cuBLAS's pick by this fraction to replace it (below it, timing noise).
TUNE_MIN_GAIN = 0.02
# Candidates asked of cuBLASLt's heuristic per shape (it returns at most 8).
TUNE_CANDIDATES = 8
# 1: also time the candidates the heuristic lists for neighbouring row counts (`candidates`).
TUNE_WIDEN = 1
# Then time the TUNE_REFINE fastest again with each of these thread-block cluster shapes
# (cublasLtClusterShape_t: 1x1, 2x1, 4x1, 1x2, 2x2, 1x4): the heuristic's cluster is often not
# the fastest (llama3.1-8b down at 192 rows: 44.2 us against 50.9; 2026-11-23, 720e072).
TUNE_REFINE = 3
TUNE_CLUSTERS = (2, 3, 4, 5, 6, 8)
# From this many rows up (the mixed steps: a decode bucket plus the prompt chunk), also search
# the tile ids cuBLASLt lists for the algorithm (over a hundred run for each shape; the
# heuristic names a handful): each base's every tile, then its TUNE_TILE_TOP fastest with every
# custom option and cluster shape. The bases are the fastest candidate so far, the heuristic's
# first and its first with split-K. llama3.1-8b's down at 256 rows: 49.0 us against 56.2
# (2026-11-23, 0ff3c56; examples/benchmarks/RESULTS.md). 0 turns the search off.
TUNE_TILES_MIN_ROWS = 129
TUNE_TILE_TOP = 4
# Candidates are screened on the first layers' weights, at least SCREEN_BYTES of them (past
# the 50 MB L2, so they stream from HBM like a step's), 3 replays each; the TUNE_CONFIRM
# fastest and cuBLAS are then timed over every layer's weight, CONFIRM_REPLAYS replays, and the
# winner is chosen from those (the fastest of hundreds of short timings is biased low).
SCREEN_BYTES = 256 << 20
TUNE_CONFIRM = 3
CONFIRM_REPLAYS = 9
CACHE_NAME = "gemm_tuning.json"
CACHE_VERSION = 1

_results: dict[str, dict] = {}  # cache key -> {"algo": hex or None, "us": ..., "cublas_us": ...}
_loaded_from: str | None = None


@dataclass
class TuneReport:
    """What tune_projections did: shapes considered, shapes timed now (the rest came from the
    cache), shapes where a cuBLASLt algorithm runs, the summed us of one call of those shapes by
    cuBLAS and by the algorithm, and the wall seconds spent."""

    shapes: int = 0
    timed: int = 0
    tuned: int = 0
    cublas_us: float = 0.0
    tuned_us: float = 0.0
    seconds: float = 0.0


def cache_path() -> str:
    return os.path.join(user_cache_dir(), CACHE_NAME)


def _load_cache(path: str) -> None:
    global _loaded_from
    if _loaded_from == path:
        return
    _loaded_from = path
    _results.update(read_records(path, CACHE_VERSION, _valid_record, "GEMM tuning cache"))


def _valid_record(record) -> bool:
    """A cache record as _time_shape writes it; anything else is timed again."""
    return (
        isinstance(record, dict)
        and (record.get("algo") is None or isinstance(record.get("algo"), str))
        and all(isinstance(record.get(f), (int, float)) for f in ("us", "cublas_us"))
    )


def _save_cache(path: str) -> None:
    # Records another process wrote since this one read the file are kept (tuning_cache.py).
    write_records(path, CACHE_VERSION, _results, _valid_record, "GEMM tuning cache")


def _cache_key(m: int, weight: torch.Tensor, accumulate: bool, lt_version: int) -> str:
    n, k = weight.shape
    gpu = torch.cuda.get_device_name(weight.device)
    search = (
        f"c{TUNE_CANDIDATES}w{TUNE_WIDEN}r{TUNE_REFINE}g{TUNE_MIN_GAIN}"
        f"t{TUNE_TILES_MIN_ROWS}x{TUNE_TILE_TOP}s{SCREEN_BYTES >> 20}f{TUNE_CONFIRM}"
    )
    layout = "kn" if linear.weight_kn(weight) else "nk"
    return (
        f"{gpu}|lt{lt_version}|{search}|{str(weight.dtype).removeprefix('torch.')}|"
        f"m{m}n{n}k{k}|{layout}|{'acc' if accumulate else 'out'}"
    )


def candidates(product, count: int = TUNE_CANDIDATES, widen: bool = True) -> list:
    """cuBLASLt's heuristic candidates for the product's shape; with widen, then those it lists
    for other row counts (a quarter, half, double, four times; 16, 32 and 64 fewer and more
    rows) that cuBLASLt accepts for this shape, without repeats."""
    from batchgen.kernels.cublaslt import LtProduct

    own = product.candidates(count)
    if not widen:
        return own
    m, n, k = product.shape
    seen = {bytes(c.algo) for c in own}
    out = list(own)
    for other in sorted({max(1, m // 4), max(1, m // 2), max(1, m - 64), max(1, m - 32),
                         max(1, m - 16), m + 16, m + 32, m + 64, 2 * m, 4 * m}):  # fmt: skip
        if other == m:
            continue
        lister = LtProduct(other, n, k, product.dtype, product.weight_kn, k, product.device)
        for cand in lister.candidates(count):
            if bytes(cand.algo) in seen:
                continue
            seen.add(bytes(cand.algo))
            checked = product.check(cand, len(out))
            if checked is not None:
                out.append(checked)
    return out


def _graph_us(call, weights: list[torch.Tensor], replays: int = 3) -> float:
    """us per product of call(w), made once for each w in weights: the median of `replays`
    CUDA-graph replays of all of them."""

    def run():
        for w in weights:
            call(w)

    return graph_median_us(run, replays) / len(weights)


def _time_each(cands: list, time_us) -> list:
    """(us, index, candidate) for each candidate timed with time_us(candidate); one that
    cuBLASLt refuses when it runs (CublasLtError) is left out, and the others still count."""
    from batchgen.kernels.cublaslt import CublasLtError

    timed = []
    for cand in cands:
        try:
            timed.append((time_us(cand), cand.index, cand))
        except CublasLtError:
            continue
    return timed


def _refine(product, timed: list, time_us) -> list:
    """The TUNE_REFINE fastest of timed ((us, index, candidate)) with each of TUNE_CLUSTERS,
    where cuBLASLt accepts them for the product's shape, timed with time_us(candidate)."""
    seen = {bytes(c.algo) for _, _, c in timed}
    extra = []
    for _, _, cand in sorted(timed, key=lambda t: t[:2])[:TUNE_REFINE]:
        for cluster in TUNE_CLUSTERS:
            var = cand.variant(len(timed) + len(extra), cluster=cluster)
            if var is None or bytes(var.algo) in seen:
                continue
            seen.add(bytes(var.algo))
            var = product.check(var, var.index)
            if var is not None:
                extra += _time_each([var], time_us)
    return extra


def _tile_search(product, timed: list, time_us) -> list:
    """Candidates with other tile ids (TUNE_TILES_MIN_ROWS above), as (us, index, candidate):
    for each base (the fastest of timed, the heuristic's first, its first with split-K), every
    tile cuBLASLt lists and accepts for the shape, then the TUNE_TILE_TOP fastest of those with
    every custom option and cluster shape (cluster 0: cuBLASLt's choice)."""
    seen = {bytes(c.algo) for _, _, c in timed}
    extra = []

    def run(base, **config) -> float | None:
        var = base.variant(len(timed) + len(extra), **config)
        if var is None or bytes(var.algo) in seen:
            return None
        seen.add(bytes(var.algo))
        var = product.check(var, var.index)
        got = _time_each([var], time_us) if var is not None else []
        extra.extend(got)
        return got[0][0] if got else None

    ranked = [c for _, _, c in sorted(timed, key=lambda t: t[:2])]
    own = [c for _, _, c in timed if c.index < TUNE_CANDIDATES]
    split = [c for c in own if c.config().get("splitk", 1) > 1]
    bases = {bytes(c.algo): c for c in ranked[:1] + own[:1] + split[:1]}
    for base in bases.values():
        by_tile = []
        for tile in base.supported("tile"):
            us = run(base, tile=tile)
            if us is not None:
                by_tile.append((us, tile))
        for _, tile in sorted(by_tile)[:TUNE_TILE_TOP]:
            for custom in range(base.custom_option_max() + 1):
                for cluster in (0, *TUNE_CLUSTERS):
                    run(base, tile=tile, custom=custom, cluster=cluster)
    return extra


def screened(weights: list[torch.Tensor], m: int, product, x, out) -> list:
    """The screening of product's candidates at m rows (x [m, K], out [m, N]) on the first
    layers' weights: (us, index, candidate), fastest first."""
    w0 = weights[0]
    screen = weights[: max(2, -(-SCREEN_BYTES // (w0.numel() * w0.element_size())))]

    def time_us(cand) -> float:
        return _graph_us(lambda w: product(x, w, cand, out=out), screen, 3)

    timed = _time_each(candidates(product, TUNE_CANDIDATES, bool(TUNE_WIDEN)), time_us)
    timed += _refine(product, timed, time_us)
    if timed and TUNE_TILES_MIN_ROWS and m >= TUNE_TILES_MIN_ROWS:
        timed += _tile_search(product, timed, time_us)
    return sorted(timed, key=lambda t: t[:2])


def _time_shape(weights: list[torch.Tensor], accumulate: bool, m: int, product) -> dict:
    """Time cuBLAS and the candidates at m rows over weights: the cache record."""
    w0 = weights[0]
    n, k = w0.shape
    x = torch.randn(m, k, device=w0.device, dtype=w0.dtype)
    out = torch.zeros(m, n, device=w0.device, dtype=w0.dtype)
    finalists = [c for _, _, c in screened(weights, m, product, x, out)[: max(1, TUNE_CONFIRM)]]
    if accumulate:
        base = _graph_us(lambda w: out.addmm_(x, w.t()), weights, CONFIRM_REPLAYS)
    else:
        base = _graph_us(lambda w: F.linear(x, w), weights, CONFIRM_REPLAYS)

    def confirm_us(cand) -> float:
        return _graph_us(lambda w: product(x, w, cand, out=out), weights, CONFIRM_REPLAYS)

    confirmed = _time_each(finalists, confirm_us)
    record = {"algo": None, "us": base, "cublas_us": base}
    if confirmed:
        best_us, _, best = min(confirmed, key=lambda t: t[:2])
        if best_us < base * (1 - TUNE_MIN_GAIN):
            record.update(algo=best.to_hex(), us=best_us)
    return record


def _record_algo(product, record: dict):
    """The record's cuBLASLt algorithm as a candidate of product's shape; None where the record
    says cuBLAS, or its algorithm does not parse or no longer applies (another library)."""
    from batchgen.kernels.cublaslt import Candidate

    if not record["algo"]:
        return None
    try:
        return product.check(Candidate.from_hex(record["algo"]), 0)
    except ValueError:
        return None


@torch.inference_mode()
def tune_projections(
    groups: list[tuple[list[torch.Tensor], bool]], rows: list[int], use_cache: bool = True
) -> TuneReport:
    """Register, for each projection group at each row count, the cuBLASLt algorithm that beats
    cuBLAS there (CUDA, bf16/fp16 weights, row-major or K-major; others are left to torch).

    groups: (the weights of one projection in every layer, all one shape and layout;
    accumulate) -- accumulate for the projections the model adds into its residual stream
    (linear.add_linear_). rows: the row counts to tune (the CUDA graphs' sizes). use_cache:
    read and write the cache file (cache_path()).
    """
    from batchgen.kernels.cublaslt import CublasLtError, LtProduct, version

    report = TuneReport()
    t0 = time.perf_counter()
    path = cache_path()
    if use_cache:
        _load_cache(path)
    lt_version = None
    for weights, accumulate in groups:
        w0 = weights[0]
        kn = linear.weight_kn(w0)
        if not w0.is_cuda or w0.dtype not in (torch.bfloat16, torch.float16) or kn is None:
            continue
        lt_version = lt_version or version()
        n, k = w0.shape
        timed_before = report.timed
        for m in sorted(set(rows)):
            report.shapes += 1
            try:
                product = LtProduct(m, n, k, w0.dtype, kn, k, w0.device.index, accumulate)
            except CublasLtError:
                continue
            key = _cache_key(m, w0, accumulate, lt_version)
            record = _results.get(key) if use_cache else None
            algo = _record_algo(product, record) if record is not None else None
            # Not cached, or its algorithm no longer applies here: time the shape.
            if record is None or (record["algo"] and algo is None):
                record = _time_shape(weights, accumulate, m, product)
                report.timed += 1
                _results[key] = record
                algo = _record_algo(product, record)
            if algo is not None:
                linear.register(m, w0, accumulate, product, algo)
                report.tuned += 1
                report.cublas_us += record["cublas_us"]
                report.tuned_us += record["us"]
        # Saved per projection, so a run stopped while tuning keeps the shapes it timed.
        if use_cache and report.timed > timed_before:
            _save_cache(path)
    if report.shapes:
        torch.cuda.synchronize()
    report.seconds = time.perf_counter() - t0
    return report
