"""Int4Linear and its dispatch (layers.linear), fused packing, and int4_tuning's choices."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.int4_gemm import check_config, dequantize_int4_ref, pack_int4_ref

from batchgen.layers import int4_tuning, linear
from batchgen.layers.int4_linear import Int4Linear, PackedInt4, concat_outputs, weight_count


def packed(k: int, n: int, group: int, seed: int = 0, perm: bool = False) -> PackedInt4:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = torch.rand(k // group, n, generator=g) * 0.05
    zeros = torch.randint(0, 17, (k // group, n), generator=g).float()
    order = torch.randperm(k, generator=g) if perm else None
    return PackedInt4(pack_int4_ref(q), scales, zeros, group, order)


def dense(p: PackedInt4) -> torch.Tensor:
    """W [N, K] in input-channel order, from the reference dequantization."""
    w = dequantize_int4_ref(p.qweight, p.scales, p.zeros, p.group_size)  # [K, N] layout order
    if p.perm is not None:
        out = torch.empty_like(w)
        out[p.perm] = w
        w = out
    return w.t()


@pytest.mark.parametrize("with_perm", [False, True])
def test_int4_linear_forward_equals_dense(with_perm):
    p = packed(64, 48, 32, perm=with_perm)
    layer = Int4Linear(64, 48, bias=True, dtype=torch.float32)
    layer.set_packed(p)
    layer.bias.data = torch.randn(48)
    x = torch.randn(2, 3, 64)
    want = torch.nn.functional.linear(x.double(), dense(p).double(), layer.bias.double())
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    # layers.linear finds the layer through its packed weight, as the models call it.
    got = linear.linear(x.reshape(6, 64), layer.weight, layer.bias)
    torch.testing.assert_close(got.double(), want.reshape(6, 48), rtol=1e-5, atol=1e-5)
    residual = torch.randn(6, 48)
    expected = residual.double() + want.reshape(6, 48) - layer.bias.double()
    out = linear.add_linear_(residual, x.reshape(6, 64), layer.weight)
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_concat_outputs_is_the_fused_projection():
    parts = [packed(64, n, 32, seed=i) for i, n in enumerate((32, 16, 16))]
    fused = concat_outputs(parts, "qkv")
    torch.testing.assert_close(dense(fused), torch.cat([dense(p) for p in parts]))


def test_concat_outputs_refuses_mismatched_parts():
    a, b = packed(64, 16, 32, perm=True), packed(64, 16, 32, seed=1, perm=True)
    with pytest.raises(ValueError, match="different act orders"):
        concat_outputs([a, b], "gate_up")
    with pytest.raises(ValueError, match="one group size"):
        concat_outputs([packed(64, 16, 32), packed(64, 16, 64)], "gate_up")


def test_set_packed_checks_the_shape():
    layer = Int4Linear(64, 32, bias=False)
    with pytest.raises(ValueError, match="packed weight is 64 -> 48"):
        layer.set_packed(packed(64, 48, 32))
    layer.set_packed(packed(64, 32, 32))
    assert layer.packed_bytes() == 64 * 32 // 2 + 2 * 2 * 32 * 4


def test_row_classes():
    assert [int4_tuning.row_class(m) for m in (1, 2, 3, 16, 17, 48, 4096)] == [
        1, 2, 4, 16, 32, 64, 4096,
    ]  # fmt: skip
    assert int4_tuning.row_class(4097) == 8192


# Llama-3.1-8B and 70B projections (N, K) and the group sizes checkpoints use (K: per channel).
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (10240, 8192),
          (8192, 8192), (57344, 8192), (8192, 28672)]  # fmt: skip


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_every_candidate_is_a_valid_launch(n, k, group):
    g = k if group == -1 else group
    for m in (1, 2, 8, 16, 48, 128, 512, 2048, 8192):
        options = int4_tuning.candidates(int4_tuning.row_class(m), n, k, g, 132)
        assert options[0] == int4_tuning.default_config(int4_tuning.row_class(m), n, k, g, 132)
        for option in options:
            if option != int4_tuning.DEQUANT:
                check_config("candidate", option, k, g)  # raises on an invalid one
        assert (int4_tuning.DEQUANT in options) == (m >= int4_tuning.DEQUANT_MIN_ROWS)
        # Classes of up to 32 rows also time per-nibble (split8) tl.dot tiles, plain and magic,
        # where a 128-row K tile fits in a group.
        split8 = {o.magic for o in options if o != int4_tuning.DEQUANT and o.split8}
        assert split8 == ({False, True} if m <= 32 and g % 128 == 0 else set())


@pytest.fixture
def int4_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    int4_tuning.forget()
    yield tmp_path / "int4_tuning.json"
    int4_tuning.forget()


def test_tuning_cache_round_trip(int4_cache):
    options = int4_tuning.candidates(2048, 4096, 4096, 128, 132)
    tile = options[3]
    int4_tuning.store_choice("a", tile)
    int4_tuning.store_choice("b", int4_tuning.DEQUANT)
    int4_tuning.forget()  # a new process: only the file remains
    assert int4_tuning.cached_choice("a", options) == tile
    assert int4_tuning.cached_choice("b", options) is int4_tuning.DEQUANT  # identity: dispatch
    assert int4_tuning.cached_choice("c", options) is None
    # A stored choice that is not among today's candidates is timed again.
    assert int4_tuning.cached_choice("a", options[:3]) is None
    assert int4_tuning.cached_choice("b", options[:3]) is None


def test_tuning_cache_keeps_other_processes_records_and_skips_bad_ones(int4_cache):
    import json

    theirs = {"choice": {"block_m": 16, "block_n": 64, "block_k": 128, "bogus": 1}}
    int4_cache.write_text(json.dumps({"version": int4_tuning.CACHE_VERSION, "results": {
        "theirs": theirs, "broken": {"choice": 7}}}))  # fmt: skip
    int4_tuning.store_choice("ours", int4_tuning.default_config(1, 64, 256, 128))
    saved = json.loads(int4_cache.read_text())["results"]
    assert set(saved) == {"theirs", "ours"} and saved["theirs"] == theirs
    int4_tuning.forget()
    options = int4_tuning.candidates(1, 64, 256, 128, 132)
    assert int4_tuning.cached_choice("theirs", options) is None  # fields GemmConfig lacks
    assert int4_tuning.cached_choice("ours", options) == options[0]
    int4_cache.write_text("{not json")
    int4_tuning.forget()
    with pytest.warns(UserWarning, match="4-bit GEMM tuning cache"):
        assert int4_tuning.cached_choice("ours", options) is None


def test_tuning_cache_key_names_gpu_candidates_dtype_rows_and_shape(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU-X")
    lin = Int4Linear(256, 64, bias=False)
    lin.set_packed(packed(256, 64, 128))
    options = int4_tuning.candidates(16, 64, 256, 128, 132)
    key = int4_tuning.disk_key(16, lin, torch.bfloat16, options)
    assert key.startswith("GPU-X|triton") and key.endswith("|bfloat16|m16n64k256g128|inorder")
    others = [
        int4_tuning.disk_key(32, lin, torch.bfloat16, options),
        int4_tuning.disk_key(16, lin, torch.float16, options),
        int4_tuning.disk_key(16, lin, torch.bfloat16, options[:-1]),
    ]
    assert len({key, *others}) == 4


def test_decode_heuristic_fills_the_gpu():
    # One row through a 4096 x 4096 weight: K is split so about two programs run per SM.
    cfg = int4_tuning.default_config(1, 4096, 4096, 128, 132)
    programs = -(-4096 // cfg.block_n) * cfg.split_k
    assert 132 <= programs <= 4 * 132


def test_choose_off_cuda_is_the_heuristic():
    layer = Int4Linear(256, 64, bias=False)
    layer.set_packed(packed(256, 64, 128))
    assert int4_tuning.choose(5, layer, torch.float32) == int4_tuning.default_config(
        5, 64, 256, 128
    )


def test_weight_count_counts_4_bit_layers_in_full():
    # The engine sizes its prompt chunks by parameter count: a 4-bit model counts as its
    # 16-bit twin (projections' in x out), not as its packed buffers.
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), Int4Linear(64, 32, bias=True))
    model[1].set_packed(packed(64, 32, 32))
    assert weight_count(model) == (64 * 32 + 32) + (64 * 32 + 32)


@pytest.mark.parametrize("tune", [False, True])
def test_engine_tune_gemms_switches_4_bit_tile_timing(tiny_model_dir, monkeypatch, tune):
    from batchgen import LLM

    monkeypatch.setattr(int4_tuning, "TUNE", not tune)
    LLM(
        tiny_model_dir("llama"),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        tune_gemms=tune,
    )
    assert int4_tuning.TUNE is tune
