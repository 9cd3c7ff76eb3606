"""The bench's commit and source-tree labels, in a throwaway git repository."""

import subprocess

from batchgen.bench.report import _git_commit, _source_tree


def _git(repo, *args) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def test_source_tree_is_the_files_as_they_are(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("out/\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    assert _source_tree(repo) == _git(repo, "rev-parse", "HEAD^{tree}")
    assert _git_commit(repo) == _git(repo, "rev-parse", "HEAD")

    # An edit and a new file change the hash; ignored files do not; the repository's own index
    # is untouched (b.py stays untracked).
    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.py").write_text("y = 1\n")
    (repo / "out").mkdir()
    (repo / "out" / "big.bin").write_bytes(b"0" * 1000)
    dirty = _source_tree(repo)
    assert dirty != _git(repo, "rev-parse", "HEAD^{tree}")
    assert "?? b.py" in _git(repo, "status", "--porcelain")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "two")
    assert dirty == _git(repo, "rev-parse", "HEAD^{tree}")


def test_outside_a_repository_is_unknown(tmp_path):
    assert _source_tree(tmp_path) == "unknown"
    assert _git_commit(tmp_path) == "unknown"
