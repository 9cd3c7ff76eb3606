"""Job fingerprints by content: a changed model or input is a changed job, even at equal sizes."""

from __future__ import annotations

import os
import threading

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from workspace import load, make_job, read_output, rows, write_jsonl

from batchgen.job import JobError
from batchgen.pipeline import file_digest as fd
from batchgen.pipeline.fingerprint import model_fingerprint
from batchgen.pipeline.runner import Runner


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))


def run(job, **kw):
    kw.setdefault("engine_factory", lambda j: FakeEngine(max_model_len=256, max_num_seqs=8))
    kw.setdefault("tokenizer_factory", lambda j: FakeTokenizer())
    return Runner(job, **kw).run()


def same_size_rewrite(path, old: bytes, new: bytes) -> None:
    """Replace bytes in place, keeping the file's size and its mtime (as `touch -r` would)."""
    st = os.stat(path)
    data = open(path, "rb").read()
    assert len(old) == len(new) and old in data
    with open(path, "r+b") as f:
        f.write(data.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_retrained_weights_of_the_same_size_are_a_changed_model(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(120))
    job = load(make_job(tmp_path, "in.jsonl"))
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + b"A" * 4096)
    assert run(job).complete
    same_size_rewrite(weights, b"A" * 16, b"B" * 16)  # "retrained": same names and sizes
    with pytest.raises(JobError, match=r"different job \(changed: model\)"):
        run(job)
    assert run(job, overwrite=True).complete


def test_changed_quantization_config_is_a_changed_model(tmp_path):
    # A 4-bit checkpoint's format is read from config.json's quantization_config: the same
    # tensors with sym true (zero points 8) or false (qzeros read) dequantize to other weights.
    write_jsonl(tmp_path / "in.jsonl", rows(120))
    job = load(make_job(tmp_path, "in.jsonl"))
    config = tmp_path / "model" / "config.json"
    config.write_text(
        '{"model_type": "fake", "quantization_config": {"quant_method": "gptq", "bits": 4, '
        '"group_size": 128, "sym": true }}'
    )
    assert run(job).complete
    same_size_rewrite(config, b'"sym": true ', b'"sym": false')
    with pytest.raises(JobError, match=r"different job \(changed: model\)"):
        run(job)


def test_input_edited_in_place_with_same_size_and_mtime_is_a_changed_input(tmp_path):
    data = rows(120)
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(make_job(tmp_path, "in.jsonl"))
    assert run(job).complete
    same_size_rewrite(tmp_path / "in.jsonl", b"document 7 ", b"DOCUMENT 7 ")
    with pytest.raises(JobError, match=r"different job \(changed: input\)"):
        run(job)
    assert run(job, overwrite=True).complete
    assert len(read_output("out")) == 120


def test_digest_is_of_every_byte_and_cached_by_identity(tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "RACY_S", -1e9)  # files written just now count as settled
    monkeypatch.setattr(fd, "READ_BLOCK", 1000)  # several reads per file
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 40)
    import xxhash

    expected = xxhash.xxh3_128_hexdigest(path.read_bytes())
    assert fd.cached_digest(str(path)) is None
    assert fd.file_digest(str(path)) == expected
    assert fd.cached_digest(str(path)) == expected
    # A resume reads the cache, not the file.
    monkeypatch.setattr(fd, "_hash_stream", lambda f: pytest.fail("file read again"))
    assert fd.file_digest(str(path)) == expected
    monkeypatch.undo()
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fd, "RACY_S", -1e9)
    # The last byte changed, size and mtime restored: the ctime moved, so the cache misses.
    same_size_rewrite(path, bytes(range(200, 256)), bytes(range(199, 255)))
    assert fd.cached_digest(str(path)) is None
    assert fd.file_digest(str(path)) == xxhash.xxh3_128_hexdigest(path.read_bytes()) != expected


def test_a_file_changed_just_now_is_not_cached(tmp_path):
    path = tmp_path / "fresh.bin"
    path.write_bytes(b"x" * 100)
    assert fd.file_digest(str(path))
    assert fd.cached_digest(str(path)) is None  # within RACY_S of its last change


def test_damaged_or_foreign_cache_entries_are_misses(tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "RACY_S", -1e9)
    path = tmp_path / "w.bin"
    path.write_bytes(b"weights" * 100)
    digest = fd.file_digest(str(path))
    entry = os.path.join(fd.digest_cache_dir(), fd.FileIdentity.of(os.stat(path)).cache_name())
    for bad in ("{", "[]", '{"algorithm": "xxh3_128", "identity": [1], "digest": "0"}'):
        with open(entry, "w") as f:
            f.write(bad)
        assert fd.cached_digest(str(path)) is None
        assert fd.file_digest(str(path)) == digest  # rehashed and written back
        assert fd.cached_digest(str(path)) == digest


def test_unwritable_cache_costs_only_the_rehash(tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "RACY_S", -1e9)
    (tmp_path / "cache-file").write_text("a file where the cache directory should be")
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache-file"))
    path = tmp_path / "w.bin"
    path.write_bytes(b"w" * 10)
    assert fd.file_digest(str(path)) == fd.file_digest(str(path), use_cache=False)
    assert fd.cached_digest(str(path)) is None


def test_concurrent_writers_never_leave_a_torn_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "RACY_S", -1e9)
    path = tmp_path / "w.bin"
    path.write_bytes(b"z" * 5000)
    digest = fd.file_digest(str(path), use_cache=False)
    identity = fd.FileIdentity.of(os.stat(path))
    seen, stop = [], threading.Event()

    def write() -> None:
        while not stop.is_set():
            fd._store(identity, digest)

    writers = [threading.Thread(target=write) for _ in range(3)]
    for t in writers:
        t.start()
    try:
        for _ in range(300):
            seen.append(fd.cached_digest(str(path)))
    finally:
        stop.set()
        for t in writers:
            t.join()
    assert set(seen) <= {None, digest} and digest in seen
    leftovers = [n for n in os.listdir(fd.digest_cache_dir()) if n.startswith(".")]
    assert leftovers == []


def test_model_fingerprint_covers_config_tokenizer_and_every_weight_shard(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        (model / name).write_text(name)
    (model / "model-00001-of-00002.safetensors").write_bytes(b"a" * 64)
    (model / "model-00002-of-00002.safetensors").write_bytes(b"b" * 64)
    before = model_fingerprint(str(model))
    for name in ("chat_template.jinja", "model-00002-of-00002.safetensors", "config.json"):
        path = model / name
        original = path.read_bytes()
        path.write_bytes(original[:-1] + b"!")
        assert model_fingerprint(str(model)) != before, name
        path.write_bytes(original)
        assert model_fingerprint(str(model)) == before
