"""Which kernel and tiles run a 4-bit projection on CUDA: per row-count class and weight shape, the
fastest of a few candidate GemmConfigs of the fused kernel and, for large steps, the dequantize +
cuBLAS path (DEQUANT), timed on the GPU the first time the class meets the shape.

Why timed: the fused kernel's best tiles and split-K depend on the rows, the weight's shape and the
GPU (a decode step of one row streams the weight with K split across programs to fill 132 SMs; a
prefill step of thousands of rows is compute-bound and wants large tiles, or cuBLAS on a
dequantized copy). A heuristic (`default_config`) is used where timing is off (TUNE = False),
where a CUDA graph is being captured (the engine warms every captured size up before capturing,
so those are tuned already), and by the interpreter.

How: candidates run in a CUDA graph over the weights of registered layers of the same shape
(Int4Linear.set_packed registers them; SCREEN_BYTES of them), so a decode-sized product streams
from HBM as in a step instead of from L2; the median of TUNE_REPLAYS replays decides. Results
live for the process and in int4_tuning.json under the user's cache directory (as
gemm_tuning.json: BATCHGEN_CACHE_DIR, else ~/.cache/batchgen), keyed by GPU, Triton version, the
candidate list (a changed list times again), activation dtype, row class and weight shape, so a
later process on the machine skips the timing (minutes for a 70B model's row classes).
"""

from __future__ import annotations

import hashlib
import os
import warnings
import weakref
from dataclasses import asdict, replace

import torch

from batchgen.bench.timing import graph_median_us
from batchgen.cache_dir import user_cache_dir
from batchgen.kernels.int4_dequant import dequantize_int4
from batchgen.kernels.int4_gemm import MAGIC, GemmConfig, int4_gemm
from batchgen.kernels.launch import interpreting, num_sms, triton
from batchgen.layers.tuning_cache import read_records, write_records

DEQUANT = "dequant"  # the dequantize + cuBLAS path
# Timing on (the first use of each row class and shape times the candidates); off: heuristic.
TUNE = True
TUNE_REPLAYS = 5
# Weights each timing cycles through: past the H100's 50 MB L2, so they stream from HBM.
SCREEN_BYTES = 256 << 20
# Row counts from here on also time the dequantize + cuBLAS path.
DEQUANT_MIN_ROWS = 1024
# Row classes: powers of two up to this, then multiples of it.
_CLASS_CAP = 4096

CACHE_NAME = "int4_tuning.json"
CACHE_VERSION = 1
_CACHE_WHAT = "4-bit GEMM tuning cache"

_choices: dict[tuple, GemmConfig | str] = {}
_layers: dict[tuple, weakref.WeakSet] = {}
_disk: dict[str, dict] | None = None  # the cache file's records, read at the first timing


def row_class(m: int) -> int:
    """The row count a product of m rows is tuned at: the next power of two (up to 4096)."""
    if m <= _CLASS_CAP:
        return 1 << max(m - 1, 0).bit_length()
    return -(-m // _CLASS_CAP) * _CLASS_CAP


def _shape_key(layer) -> tuple:
    return (layer.out_features, layer.in_features, layer.group_size, layer.perm is not None)


def register(layer) -> None:
    """Remember `layer` (an Int4Linear) among the layers of its shape, timed together."""
    _layers.setdefault(_shape_key(layer), weakref.WeakSet()).add(layer)


def forget() -> None:
    """Drop every choice made so far (tests, or after changing TUNE or the candidates); the
    cache file is read again at the next timing."""
    global _disk
    _choices.clear()
    _disk = None


def cache_path() -> str:
    return os.path.join(user_cache_dir(), CACHE_NAME)


def _valid_record(record) -> bool:
    return isinstance(record, dict) and (
        record.get("choice") == DEQUANT or isinstance(record.get("choice"), dict)
    )


def disk_key(m: int, layer, dtype: torch.dtype, options: list) -> str:
    """The cache file's key of m rows (a row class) through `layer`'s shape among `options`."""
    n, k, group, perm = _shape_key(layer)
    search = hashlib.sha1(repr(options).encode()).hexdigest()[:12]
    gpu = torch.cuda.get_device_name(layer.weight.device)
    return (
        f"{gpu}|triton{triton.__version__}|{search}|r{TUNE_REPLAYS}s{SCREEN_BYTES >> 20}|"
        f"{str(dtype).removeprefix('torch.')}|m{m}n{n}k{k}g{group}|{'perm' if perm else 'inorder'}"
    )


def cached_choice(key: str, options: list) -> GemmConfig | str | None:
    """The choice the cache file holds under `key` if it is one of `options`, else None."""
    global _disk
    if _disk is None:
        _disk = read_records(cache_path(), CACHE_VERSION, _valid_record, _CACHE_WHAT)
    record = _disk.get(key)
    if record is None:
        return None
    if record["choice"] == DEQUANT:
        return DEQUANT if DEQUANT in options else None
    try:
        choice = GemmConfig(**record["choice"])
    except TypeError:  # fields of another version of GemmConfig
        return None
    return choice if choice in options else None


def store_choice(key: str, choice: GemmConfig | str) -> None:
    """Add `key`'s choice to the cache file (merged with what other processes wrote)."""
    global _disk
    record = {"choice": DEQUANT if choice == DEQUANT else asdict(choice)}
    _disk = {**(_disk or {}), key: record}
    write_records(cache_path(), CACHE_VERSION, {key: record}, _valid_record, _CACHE_WHAT)


def _split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """Split-K so that about two programs run per SM, each over at least 2 K blocks."""
    split = 1
    while tiles * split * 2 <= 2 * sms and k // (block_k * split * 2) >= 2 and split < 16:
        split *= 2
    return split


def _block_k(group: int, want: int) -> int:
    bk = want
    while group % bk:
        bk //= 2
    return bk


def default_config(m: int, n: int, k: int, group: int, sms: int = 132) -> GemmConfig:
    """The heuristic tiles for m rows of an n x k weight in groups of `group`."""
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 128, _block_k(group, 128), 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = row_class(m), 128, _block_k(group, 128), 4, 4
    elif m <= 256:
        bm, bn, bk, warps, stages = 64, 128, _block_k(group, 64), 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 256, _block_k(group, 64), 8, 3
    tiles = -(-n // bn) * -(-m // bm)
    return GemmConfig(bm, bn, bk, _split(tiles, k, bk, sms), warps, stages)


def candidates(m: int, n: int, k: int, group: int, sms: int) -> list[GemmConfig | str]:
    """What is timed for m rows (a row class): tiles around the heuristic's, those of 16-32 rows
    also as split8, each also with magic weights (16-bit activations; the same as plain for
    fp32), and DEQUANT from DEQUANT_MIN_ROWS rows."""
    out: list[GemmConfig | str] = [default_config(m, n, k, group, sms)]

    def add(bm: int, bn: int, bk: int, warps: int, stages: int, split: int | None = None):
        bk = _block_k(group, bk)
        tiles = -(-n // bn) * -(-m // bm)
        s = _split(tiles, k, bk, sms) if split is None else split
        cfg = GemmConfig(bm, bn, bk, s, warps, stages)
        if cfg not in out:
            out.append(cfg)

    if m <= 2:
        add(1, 64, 128, 4, 4)  # CUDA-core dot products: one row, no 16-row padding
        add(1, 128, 64, 4, 4)
        add(1, 32, 256, 4, 4, split=1)  # narrow columns instead of split-K: no second kernel
    if m <= 64:
        bm = max(16, m)
        for bn in (64, 128, 256):
            add(bm, bn, 128, 4, 4)
        add(bm, 128, 256, 8, 3)
        add(bm, 128, 128, 4, 5)
        add(bm, 64, 128, 4, 4, split=1)
        add(bm, 32, 256, 4, 4, split=1)
    elif m <= 512:
        for bm, bn, warps in ((64, 128, 4), (64, 256, 8), (128, 128, 8), (128, 256, 8)):
            for stages in (3, 4):
                add(bm, bn, 64, warps, stages, split=1)
    else:
        for bn in (128, 256):
            for stages in (3, 4):
                add(128, bn, 64, 8, stages, split=1)
        add(256, 128, 64, 8, 3, split=1)
    # The tl.dot tiles of 16-32 rows again as eight per-nibble products (GemmConfig.split8): no
    # reshape staged through shared memory (the wgmma tiles of 64 rows or more stage B anyway).
    out += [replace(c, split8=True) for c in out if 16 <= c.block_m <= 32 and c.block_k >= 128]
    # Each again with the weights made 16-bit floats by bit operations (GemmConfig.magic).
    out += [replace(c, magic=True) for c in out]
    if m >= DEQUANT_MIN_ROWS and group % 32 == 0:
        out.append(DEQUANT)
    return out


def choose(m: int, layer, dtype: torch.dtype) -> GemmConfig | str:
    """The path for m rows through `layer` (an Int4Linear on CUDA): a GemmConfig or DEQUANT."""
    device = layer.weight.device
    key = (row_class(m), *_shape_key(layer), dtype, device.index)
    choice = _choices.get(key)
    if choice is not None:
        return choice
    n, k, group = layer.out_features, layer.in_features, layer.group_size
    sms = num_sms(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not TUNE or capturing or interpreting() or device.type != "cuda":
        return default_config(m, n, k, group, sms)
    layers = list(_layers.get(_shape_key(layer), ())) or [layer]
    # Enough layers' weights to pass the L2 (SCREEN_BYTES), not all 80 of a 70B model's.
    layers = layers[: max(1, -(-SCREEN_BYTES // max(1, layer.packed_bytes())))]
    options = candidates(row_class(m), n, k, group, sms)
    if dtype not in MAGIC:  # magic tiles are the plain ones for fp32 activations
        options = [o for o in options if o == DEQUANT or not o.magic]
    stored = disk_key(row_class(m), layer, dtype, options)
    choice = cached_choice(stored, options)
    if choice is None:
        choice = fastest(options, row_class(m), layers, dtype)
        store_choice(stored, choice)
    _choices[key] = choice
    return choice


def fastest(options: list, m: int, layers: list, dtype: torch.dtype) -> GemmConfig | str:
    """The option with the lowest median graph-replay time over all `layers` for m rows."""
    device = layers[0].weight.device
    x = torch.randn(m, layers[0].in_features, device=device, dtype=dtype)
    best, best_us = options[0], float("inf")
    for i, option in enumerate(options):
        fn = _runner(option, x, [layer.packed() for layer in layers])
        try:
            fn()  # compiles outside the capture
            us = graph_median_us(fn, TUNE_REPLAYS)
        except Exception as e:
            # A tile this GPU cannot run (shared memory) is no candidate; the heuristic's
            # (the first) must run.
            if i == 0:
                raise
            if "out of resource" not in str(e).lower():
                why = f"{type(e).__name__}: {e}"
                warnings.warn(f"4-bit GEMM candidate {option} skipped: {why}", stacklevel=2)
            continue
        if us < best_us:
            best, best_us = option, us
    return best


def _runner(option, x: torch.Tensor, packs: list):
    def run() -> None:
        for p in packs:
            if option == DEQUANT:
                torch.mm(x, dequantize_int4(p.qweight, p.scales, p.zeros, p.group_size,
                                            x.dtype, p.perm))  # fmt: skip
            else:
                int4_gemm(x, p.qweight, p.scales, p.zeros, p.group_size, option, p.perm)

    return run
