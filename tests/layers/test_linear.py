"""The projections' torch path (layers.linear), the GEMM tuning cache (layers.gemm_tuning) and
what feeds it, on CPU: the registry is CUDA-only, so CPU tensors always run torch."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from batchgen.kernels.cublaslt import Candidate, CublasLtError, _Algo

from batchgen.layers import gemm_tuning, linear
from batchgen.models.loader import load_model


@pytest.fixture
def clean_registry():
    """An empty linear._TUNED for the test; whatever was registered before comes back after."""
    saved = dict(linear._TUNED)
    linear._TUNED.clear()
    try:
        yield linear._TUNED
    finally:
        linear._TUNED.clear()
        linear._TUNED.update(saved)


@pytest.fixture
def fresh_cache(monkeypatch):
    """gemm_tuning's module state (results, file read) fresh for the test, restored after."""
    monkeypatch.setattr(gemm_tuning, "_results", {})
    monkeypatch.setattr(gemm_tuning, "_loaded_from", None)


class FakeProduct:
    """Stands in for a kernels.cublaslt.LtProduct: records its calls, returns a marker."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, w, algo, out=None):
        self.calls.append((x, w, algo, out))
        return torch.full((x.shape[0], w.shape[0]), 12345.0)


def weights(n: int = 24, k: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    return {"row_major": w, "k_major": w.t().contiguous().t()}


@pytest.mark.parametrize("layout", ["row_major", "k_major"])
def test_linear_equals_f_linear(clean_registry, layout):
    w = weights()[layout]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=g)
    bias = torch.randn(24, generator=g)
    torch.testing.assert_close(linear.linear(x, w), F.linear(x, w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        linear.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(linear.linear(x, w), x @ weights()["row_major"].t())
    assert linear.linear(x, w).shape == (5, 24)


@pytest.mark.parametrize("layout", ["row_major", "k_major"])
def test_add_linear_adds_in_place(clean_registry, layout):
    w = weights()[layout]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, generator=g)
    residual = torch.randn(5, 24, generator=g)
    expected = residual + x @ weights()["row_major"].t()
    ptr = residual.data_ptr()
    out = linear.add_linear_(residual, x, w)
    assert out is residual and residual.data_ptr() == ptr
    torch.testing.assert_close(residual, expected, rtol=1e-6, atol=1e-6)


def test_weight_kn_layouts():
    w = weights()
    assert linear.weight_kn(w["k_major"]) is True
    assert linear.weight_kn(w["row_major"]) is False
    assert linear.weight_kn(w["row_major"][:, ::2]) is None
    assert linear.weight_kn(w["k_major"][::2, :]) is None


def test_cpu_tensors_never_use_the_registry(clean_registry):
    w = weights()["row_major"]
    x = torch.randn(5, 16)
    residual = torch.randn(5, 24)
    fake = FakeProduct()
    linear.register(5, w, False, fake, "algo")
    linear.register(5, w, True, fake, "algo")
    # The exact keys linear / add_linear_ would look up for these tensors are registered: only
    # the CUDA check keeps the fake out.
    assert linear._key(x.shape[0], x.stride(0), w, False) in clean_registry
    assert linear._key(x.shape[0], x.stride(0), w, True) in clean_registry
    assert linear._tuned(x, w, False) is None and linear._tuned(x, w, True) is None
    torch.testing.assert_close(linear.linear(x, w), F.linear(x, w), rtol=1e-6, atol=1e-6)
    expected = residual + x @ w.t()
    assert linear.add_linear_(residual, x, w) is residual
    torch.testing.assert_close(residual, expected, rtol=1e-6, atol=1e-6)
    assert fake.calls == []
    linear.clear_tuning()
    assert linear._TUNED == {}


def test_cache_path_precedence(monkeypatch, tmp_path):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "bg"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gemm_tuning.cache_path() == str(tmp_path / "bg" / "gemm_tuning.json")
    monkeypatch.delenv("BATCHGEN_CACHE_DIR")
    assert gemm_tuning.cache_path() == str(tmp_path / "xdg" / "batchgen" / "gemm_tuning.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert gemm_tuning.cache_path() == str(home / ".cache" / "batchgen" / "gemm_tuning.json")
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", "")  # empty: as if unset
    assert gemm_tuning.cache_path() == str(home / ".cache" / "batchgen" / "gemm_tuning.json")


def test_cache_round_trip(fresh_cache, tmp_path):
    path = str(tmp_path / "sub" / "gemm_tuning.json")  # the directory is made on save
    record = {"algo": "ab" * 64, "us": 40.5, "cublas_us": 50.25}
    gemm_tuning._results["H100|lt1|m8n16k32|nk|out"] = record
    gemm_tuning._save_cache(path)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    assert data["version"] == gemm_tuning.CACHE_VERSION
    gemm_tuning._results.clear()
    gemm_tuning._loaded_from = None
    gemm_tuning._load_cache(path)
    assert gemm_tuning._results == {"H100|lt1|m8n16k32|nk|out": record}
    assert gemm_tuning._loaded_from == path


def test_save_keeps_records_another_process_wrote(fresh_cache, tmp_path):
    # Tensor-parallel ranks tune at once and each saves: none may drop the other's shapes.
    path = tmp_path / "gemm_tuning.json"
    theirs = {"algo": None, "us": 9.0, "cublas_us": 9.0}
    ours = {"algo": "cd" * 64, "us": 30.0, "cublas_us": 35.0}
    mine_before = {"algo": None, "us": 1.0, "cublas_us": 1.0}
    records = {"rank1|acc": theirs, "shared": mine_before}
    path.write_text(json.dumps({"version": gemm_tuning.CACHE_VERSION, "results": records}))
    gemm_tuning._results.update({"rank0|out": ours, "shared": ours})
    gemm_tuning._save_cache(str(path))
    saved = json.loads(path.read_text())["results"]
    assert saved == {"rank1|acc": theirs, "rank0|out": ours, "shared": ours}


def test_corrupt_cache_warns_and_loads_nothing(fresh_cache, tmp_path):
    path = tmp_path / "gemm_tuning.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="GEMM tuning cache"):
        gemm_tuning._load_cache(str(path))
    assert gemm_tuning._results == {}


def test_cache_of_another_version_loads_nothing(fresh_cache, tmp_path):
    path = tmp_path / "gemm_tuning.json"
    results = {"key": {"algo": None, "us": 1.0, "cublas_us": 1.0}}
    path.write_text(json.dumps({"version": gemm_tuning.CACHE_VERSION + 1, "results": results}))
    gemm_tuning._load_cache(str(path))
    assert gemm_tuning._results == {}
    # The same file with the current version does load (the version is what kept it out).
    path.write_text(json.dumps({"version": gemm_tuning.CACHE_VERSION, "results": results}))
    gemm_tuning._loaded_from = None
    gemm_tuning._load_cache(str(path))
    assert gemm_tuning._results == results


def test_candidate_hex_round_trip():
    algo = _Algo()
    algo.data[0] = 123
    algo.data[3] = 0xDEADBEEF
    algo.data[7] = 2**64 - 1
    text = Candidate(0, algo, 0).to_hex()
    assert len(text) == 128
    back = Candidate.from_hex(text, index=3)
    assert bytes(back.algo) == bytes(algo)
    assert list(back.algo.data) == [123, 0, 0, 0xDEADBEEF, 0, 0, 0, 2**64 - 1]
    assert back.index == 3 and back.workspace == 0


def test_candidate_from_bad_hex_raises():
    with pytest.raises(ValueError):
        Candidate.from_hex("00" * 63)  # too short
    with pytest.raises(ValueError):
        Candidate.from_hex("abc")  # odd length
    with pytest.raises(ValueError):
        Candidate.from_hex("zz" * 64)  # not hex


def test_candidate_from_too_long_hex_raises():
    with pytest.raises(ValueError):
        Candidate.from_hex("00" * 65)


def test_tune_projections_skips_cpu_weights(clean_registry, fresh_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    w = weights()
    groups = [
        ([w["row_major"], w["row_major"].clone()], False),
        ([w["k_major"].to(torch.bfloat16)], True),
    ]
    report = gemm_tuning.tune_projections(groups, [1, 8, 64], use_cache=False)
    assert isinstance(report, gemm_tuning.TuneReport)
    assert (report.shapes, report.timed, report.tuned) == (0, 0, 0)
    assert clean_registry == {}
    assert gemm_tuning._results == {} and gemm_tuning._loaded_from is None
    assert not os.path.exists(tmp_path / "cache")


def test_projection_groups_of_tiny_llama(tiny_model_dir):
    model, _ = load_model(tiny_model_dir("llama"), "float32", "cpu")
    layers = model.model.layers
    num_layers = model.config.num_hidden_layers
    assert len(layers) == num_layers

    def expected():
        return [
            [layer.self_attn.qkv_proj.weight for layer in layers],
            [layer.self_attn.o_proj.weight for layer in layers],
            [layer.mlp.gate_up_proj.weight for layer in layers],
            [layer.mlp.down_proj.weight for layer in layers],
        ]

    groups = model.projection_groups()
    assert len(groups) == 4
    for (ws, accumulate), want in zip(groups, expected()):
        assert len(ws) == num_layers
        assert all(a is b for a, b in zip(ws, want))
        assert accumulate is False
    assert model.fold_norms_() is True
    folded = model.projection_groups()
    assert [acc for _, acc in folded] == [False, True, False, True]
    for (ws, _), want in zip(folded, expected()):
        assert len(ws) == num_layers and all(a is b for a, b in zip(ws, want))


def test_projection_groups_leave_out_biased_projections(tiny_model_dir):
    # Qwen2's qkv carries a bias: torch runs it, the other three are tuned (norms not folded).
    model, _ = load_model(tiny_model_dir("qwen2"), "float32", "cpu")
    groups = model.projection_groups()
    layers = model.model.layers
    assert len(groups) == 3
    assert groups[0][0][0] is layers[0].self_attn.o_proj.weight
    assert [acc for _, acc in groups] == [False, False, False]


def test_malformed_cache_records_are_dropped(fresh_cache, tmp_path):
    path = tmp_path / "gemm_tuning.json"
    good = {"algo": None, "us": 10.0, "cublas_us": 10.0}
    bad = [[1, 2], {"algo": 5, "us": 1.0, "cublas_us": 1.0}, {"algo": None, "us": "x"}]
    results = {"good": good, **{f"bad{i}": r for i, r in enumerate(bad)}}
    path.write_text(json.dumps({"version": gemm_tuning.CACHE_VERSION, "results": results}))
    gemm_tuning._load_cache(str(path))
    assert gemm_tuning._results == {"good": good}


class TimedCandidate:
    """Stands in for a cublaslt.Candidate in _time_shape: a time, or a refusal at run time."""

    def __init__(self, index: int, us: float | None):
        self.index, self.us = index, us  # us None: cuBLASLt refuses it when it runs
        self.algo = bytes([index])

    def variant(self, index, **config):
        return None  # no cluster / tile variants: only the listed candidates are timed

    def to_hex(self) -> str:
        return f"cand{self.index}"


class RefusingProduct:
    """An LtProduct stand-in whose candidates either run (and say which ran) or raise."""

    accumulate = False
    last = None

    def __call__(self, x, w, cand, out=None):
        if cand.us is None:
            raise CublasLtError("cublasLtMatmul failed with cublasStatus 13")
        self.last = cand
        return out


@pytest.mark.parametrize("refused", [[1], [0, 1, 2]], ids=["one", "all"])
def test_time_shape_leaves_out_only_refused_candidates(monkeypatch, refused):
    # Candidate 1 is refused at run time; 2 is the fastest. One refusal must not throw away the
    # others' timings (it used to: the shape then stayed on cuBLAS).
    product = RefusingProduct()
    times = [90.0, 70.0, 80.0]
    cands = [TimedCandidate(i, None if i in refused else us) for i, us in enumerate(times)]

    def graph_us(call, ws, replays=3):
        product.last = None
        for w in ws:
            call(w)
        return 100.0 if product.last is None else product.last.us  # None ran: cuBLAS

    monkeypatch.setattr(gemm_tuning, "_graph_us", graph_us)
    monkeypatch.setattr(gemm_tuning, "candidates", lambda product, count, widen: cands)
    w = [torch.randn(24, 16) for _ in range(2)]
    record = gemm_tuning._time_shape(w, False, 8, product)
    assert record["cublas_us"] == 100.0
    if len(refused) == 1:
        assert record == {"algo": "cand2", "us": 80.0, "cublas_us": 100.0}
    else:
        assert record == {"algo": None, "us": 100.0, "cublas_us": 100.0}
