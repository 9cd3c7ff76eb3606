"""cuBLASLt through ctypes: a linear layer's product y[M, N] = x[M, K] @ W[N, K]^T run with a
chosen cuBLASLt algorithm instead of the one cuBLAS's heuristic picks.

cuBLAS picks one kernel per shape from a heuristic, and on the H100 that pick is measurably off
at many of the row counts a decode step runs (2026-11-23, 720e072). cuBLASLt's heuristic
lists several candidate algorithms (tile, stages, split-K, cluster shape) for a shape. This
module is the binding: `LtProduct` (one shape's descriptors, its candidates, the launch) and
`Candidate` (one algorithm). batchgen.layers.gemm_tuning times the candidates and registers the
winners with batchgen.layers.linear. CUDA only: nothing loads the library on the CPU path.

Layouts, in cuBLAS's column-major terms: D[N, M] = op(A)[N, K] @ B[K, M] with
- A = W: as stored, [N, K] row-major is a column-major [K, N] (ld K), op T; stored K-major
  (`kn_weights`: W.t() contiguous) it is a column-major [N, K] (ld N), op N;
- B = x: [M, K] row-major is a column-major [K, M] with ld = x.stride(0), op N;
- D = y: [M, N] row-major is a column-major [N, M] (ld N).
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from dataclasses import dataclass

import torch

# cuBLAS / CUDA enum values (cublasLt.h, library_types.h).
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F = 0
_DTYPES = {torch.bfloat16: 14, torch.float16: 2}  # CUDA_R_16BF, CUDA_R_16F
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoCapAttributes_t: lists of the tile and stages ids an algorithm supports.
_CAP_TILE_IDS, _CAP_STAGES_IDS, _CAP_CUSTOM_OPTION_MAX = 6, 13, 7
# cublasLtMatmulAlgoConfigAttributes_t: read for reports (config), set for variants.
_CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5,
                 "stages": 6, "inner": 7, "cluster": 8}  # fmt: skip
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    # cublasLtMatmulAlgo_t: opaque, 8 x uint64.
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    # cublasLtMatmulHeuristicResult_t.
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    pass


def _find_library() -> str:
    """The libcublasLt torch itself loaded (same version), else the sonames cuBLAS 13 / 12 use."""
    torch.zeros(1, device="cuda") @ torch.zeros(1, device="cuda")  # makes torch load cuBLAS(Lt)
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcublasLt.so"):
                return path
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise CublasLtError("libcublasLt not found: torch has not loaded it and no soname resolves")


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_find_library())
    p, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
    sz = ctypes.c_size_t
    ptr = ctypes.POINTER
    sigs = {
        "cublasLtCreate": [ptr(p)],
        "cublasLtMatmulDescCreate": [ptr(p), i32, i32],
        "cublasLtMatmulDescSetAttribute": [p, i32, p, sz],
        "cublasLtMatrixLayoutCreate": [ptr(p), i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ptr(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i32, p, sz],
        "cublasLtMatmulAlgoGetHeuristic": [p] * 7 + [i32, ptr(_Heuristic), ptr(i32)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ptr(_Algo), i32, p, sz, ptr(sz)],
        "cublasLtMatmulAlgoConfigSetAttribute": [ptr(_Algo), i32, p, sz],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, ptr(_Algo), ptr(_Heuristic)],
        "cublasLtGetVersion": [],
        "cublasLtMatmul": [p] * 12 + [ptr(_Algo), p, sz, p],
        "cublasLtMatmulAlgoCapGetAttribute": [ptr(_Algo), i32, p, sz, ptr(sz)],
        "cublasLtMatmulDescDestroy": [p],
        "cublasLtMatrixLayoutDestroy": [p],
        "cublasLtMatmulPreferenceDestroy": [p],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_size_t if name == "cublasLtGetVersion" else ctypes.c_int
    return lib


def version() -> int:
    """cuBLASLt's version number (an algorithm is only meaningful to the same library)."""
    return int(_lib().cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus {status}")


@functools.cache
def _handle(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")


@dataclass(frozen=True)
class Candidate:
    """One algorithm the heuristic offers for a shape; `index` is its rank in the list."""

    index: int
    algo: _Algo
    workspace: int

    def to_hex(self) -> str:
        """The algorithm's 64 bytes, for a cache file (valid for the same library and GPU)."""
        return bytes(self.algo).hex()

    @classmethod
    def from_hex(cls, text: str, index: int = 0) -> Candidate:
        """A candidate from to_hex's text; LtProduct.check says if it still applies."""
        raw = bytes.fromhex(text)
        if len(raw) != ctypes.sizeof(_Algo):
            raise ValueError(f"an algorithm is {ctypes.sizeof(_Algo)} bytes, got {len(raw)}")
        return cls(index, _Algo.from_buffer_copy(raw), 0)

    def variant(self, index: int, **config: int) -> Candidate | None:
        """A copy with config attributes changed (splitk, reduction, swizzle, stages, cluster,
        tile: cublasLt enum values); None if cuBLASLt refuses one. LtProduct.check says whether
        the variant runs for a shape."""
        algo = _Algo.from_buffer_copy(bytes(self.algo))
        for name, value in config.items():
            attr = _CONFIG_ATTRS[name]
            small = name in ("cluster", "inner")
            buf = ctypes.c_uint16(value) if small else ctypes.c_uint32(value)
            status = _lib().cublasLtMatmulAlgoConfigSetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(buf), ctypes.sizeof(buf)
            )
            if status != 0:
                return None
        return Candidate(index, algo, self.workspace)

    def custom_option_max(self) -> int:
        """The largest custom option (config "custom") this algorithm accepts."""
        value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
        status = _lib().cublasLtMatmulAlgoCapGetAttribute(
            ctypes.byref(self.algo), _CAP_CUSTOM_OPTION_MAX, ctypes.byref(value), 4,
            ctypes.byref(written),
        )  # fmt: skip
        return value.value if status == 0 else 0

    def supported(self, what: str) -> list[int]:
        """The tile ids ("tile") or stages ids ("stages") this algorithm accepts."""
        attr = {"tile": _CAP_TILE_IDS, "stages": _CAP_STAGES_IDS}[what]
        written = ctypes.c_size_t(0)
        lib = _lib()
        status = lib.cublasLtMatmulAlgoCapGetAttribute(
            ctypes.byref(self.algo), attr, None, 0, ctypes.byref(written)
        )
        if status != 0 or written.value == 0:
            return []
        ids = (ctypes.c_uint32 * (written.value // 4))()
        status = lib.cublasLtMatmulAlgoCapGetAttribute(
            ctypes.byref(self.algo), attr, ids, ctypes.sizeof(ids), ctypes.byref(written)
        )
        return list(ids) if status == 0 else []

    def config(self) -> dict[str, int]:
        """The algorithm's tile / split-K / stages / cluster ids (cublasLt enum values)."""
        out = {}
        for name, attr in _CONFIG_ATTRS.items():
            for size in (4, 2, 8):  # the attributes are uint32, uint16 or uint64
                value, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
                status = _lib().cublasLtMatmulAlgoConfigGetAttribute(
                    ctypes.byref(self.algo), attr, ctypes.byref(value), size, ctypes.byref(written)
                )
                if status == 0:
                    out[name] = value.value
                    break
        return out


def _destroy(desc: ctypes.c_void_p, layouts: list[ctypes.c_void_p]) -> None:
    """Free an LtProduct's descriptors (host memory only: no device or stream is needed)."""
    lib = _lib()
    for layout in layouts:
        _check(lib.cublasLtMatrixLayoutDestroy(layout), "cublasLtMatrixLayoutDestroy")
    _check(lib.cublasLtMatmulDescDestroy(desc), "cublasLtMatmulDescDestroy")


class LtProduct:
    """y[M, N] = x[M, K] @ W[N, K]^T for one shape, weight layout and dtype on one device.

    weight_kn: W is stored K-major (its memory is W.t() contiguous, stride (1, N)); otherwise
    row-major [N, K]. x_ld: x's row stride (>= K). accumulate: out += x @ W^T (beta = 1, out
    given) instead of out = x @ W^T. The descriptors live as long as this object (close() frees
    them at once); the launch itself allocates nothing but y when `out` is None, so it can be
    captured in a CUDA graph (a captured launch does not need them afterwards).
    """

    def __init__(
        self,
        m: int,
        n: int,
        k: int,
        dtype: torch.dtype,
        weight_kn: bool,
        x_ld: int,
        device: int,
        accumulate: bool = False,
    ) -> None:
        if dtype not in _DTYPES:
            raise CublasLtError(f"LtProduct: dtype {dtype} is not bf16/fp16")
        self.shape = (m, n, k)
        self.dtype, self.weight_kn, self.x_ld, self.device = dtype, weight_kn, x_ld, device
        self.accumulate = accumulate
        lib, dt = _lib(), _DTYPES[dtype]
        self._desc = ctypes.c_void_p()
        status = lib.cublasLtMatmulDescCreate(
            ctypes.byref(self._desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F
        )
        _check(status, "cublasLtMatmulDescCreate")
        # Freed when this object goes (a tuning run makes thousands, one per shape it looks at)
        # or on close(); layouts join the list as they are made, so a failure midway frees
        # what was made before it.
        self._layouts: list[ctypes.c_void_p] = []
        self._finalizer = weakref.finalize(self, _destroy, self._desc, self._layouts)
        self._finalizer.atexit = False  # at exit the process's memory goes anyway
        for attr, op in ((_DESC_TRANSA, _OP_N if weight_kn else _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(
                lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(value), 4),
                "cublasLtMatmulDescSetAttribute",
            )
        a_rows, a_cols, a_ld = (n, k, n) if weight_kn else (k, n, k)
        self._a = self._layout(dt, a_rows, a_cols, a_ld)
        self._b = self._layout(dt, k, m, x_ld)
        self._d = self._layout(dt, n, m, n)
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(1.0 if accumulate else 0.0)

    def _layout(self, dt: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(
            _lib().cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, rows, cols, ld),
            "cublasLtMatrixLayoutCreate",
        )
        self._layouts.append(layout)
        return layout

    def close(self) -> None:
        """Free the descriptors now; the product cannot run or list candidates after."""
        self._finalizer()

    def _open(self) -> None:
        if not self._finalizer.alive:
            raise CublasLtError(f"LtProduct {self.shape}: used after close()")

    def candidates(self, count: int = 32) -> list[Candidate]:
        """The heuristic's algorithms for this shape, best-guess first (at most `count`)."""
        self._open()
        lib = _lib()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        try:
            return self._heuristic(lib, pref, count)
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)

    def _heuristic(self, lib, pref: ctypes.c_void_p, count: int) -> list[Candidate]:
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(
                pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8
            ),
            "PreferenceSetAttribute",
        )
        results = (_Heuristic * count)()
        returned = ctypes.c_int(0)
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                _handle(self.device),
                self._desc,
                self._a,
                self._b,
                self._d,
                self._d,
                pref,
                count,
                results,
                ctypes.byref(returned),
            ),
            "cublasLtMatmulAlgoGetHeuristic",
        )
        return [
            Candidate(i, results[i].algo, results[i].workspace_size)
            for i in range(returned.value)
            if results[i].state == 0
        ]

    def check(self, cand: Candidate, index: int) -> Candidate | None:
        """cand (found for another shape) as a candidate of this shape, if cuBLASLt accepts it
        here within the workspace; index: its rank in the caller's list."""
        self._open()
        result = _Heuristic()
        status = _lib().cublasLtMatmulAlgoCheck(
            _handle(self.device), self._desc, self._a, self._b, self._d, self._d,
            ctypes.byref(cand.algo), ctypes.byref(result),
        )  # fmt: skip
        if status != 0 or result.workspace_size > WORKSPACE_BYTES:
            return None
        return Candidate(index, cand.algo, result.workspace_size)

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, algo: Candidate, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Launch on the current stream: x [M, K] (row stride x_ld), w [N, K] in the layout
        given at construction; returns out [M, N] (contiguous; required to accumulate)."""
        self._open()
        m, n, _ = self.shape
        if out is None:
            if self.accumulate:
                raise CublasLtError("LtProduct: accumulate needs out")
            out = torch.empty((m, n), dtype=self.dtype, device=x.device)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        _check(
            _lib().cublasLtMatmul(
                _handle(self.device),
                self._desc,
                ctypes.byref(self._alpha),
                w.data_ptr(),
                self._a,
                x.data_ptr(),
                self._b,
                ctypes.byref(self._beta),
                out.data_ptr(),
                self._d,
                out.data_ptr(),
                self._d,  # C = D: beta reads out
                ctypes.byref(algo.algo),
                _workspace(self.device).data_ptr(),
                WORKSPACE_BYTES,
                stream,
            ),
            "cublasLtMatmul",
        )
        return out
