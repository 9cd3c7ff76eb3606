"""Parquet footers are read once per file version (the column check and the layout share it)."""

import os

import pytest

from batchgen.io import parquet_schema as mod

# polars reads and writes the Parquet these tests check. The GPU machine has none and runs only
# `pytest -m gpu`: there this module is skipped at collection instead of failing it.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")


def test_schema_read_once_until_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2], "text": ["a", "b"]}).write_parquet(path)
    reads = []
    real = pl.read_parquet_schema
    monkeypatch.setattr(pl, "read_parquet_schema", lambda p: reads.append(p) or real(p))
    mod._read.cache_clear()

    first = mod.parquet_schema(str(path))
    assert first == {"id": pl.Int64, "text": pl.String}
    assert mod.parquet_schema(str(path)) == first
    assert len(reads) == 1

    # A rewritten file (new size and mtime) is read again.
    pl.DataFrame({"id": ["x"], "text": ["a"], "extra": [1.0]}).write_parquet(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert mod.parquet_schema(str(path))["id"] == pl.String
    assert len(reads) == 2


def test_unreadable_file_raises_and_is_not_cached(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet")
    mod._read.cache_clear()
    for _ in range(2):
        with pytest.raises(pl.exceptions.PolarsError):
            mod.parquet_schema(str(path))
    assert mod._read.cache_info().currsize == 0
