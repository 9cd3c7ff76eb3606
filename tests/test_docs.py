"""The repository's documents: size limits, no work-diary phrases, no path that does not exist."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 350
RESULTS_MAX_LINES = 300
BENCHMARKS_MAX_FILES = 10
TEXT_SUFFIXES = (".md", ".py", ".sh", ".yaml", ".yml", ".toml")
# Folders a walk skips when the tree is not a git checkout (build outputs, environments).
UNTRACKED_DIRS = {".git", ".venv", "__pycache__", "out", "build", "dist", ".pytest_cache"}

# Diary phrases: an ordinal, or this / that / last / previous / next / same / earlier / later,
# before the word; or the word followed by a number or a range of numbers. The word is spelled
# in two parts so that this file does not match its own patterns.
WORD = "sess" + "ions?"
_ORDINALS = (
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth "
    "thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth "
    "thirtieth fortieth"
).split()
ORDINAL = (
    r"(?:(?:twenty|thirty|forty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
    rf"|{'|'.join(_ORDINALS)}|\d+(?:st|nd|rd|th))"
)
DIARY = re.compile(
    rf"\b(?:{ORDINAL}|this|that|last|previous|next|same|earlier|later)[\s-]+{WORD}\b"
    rf"|\b{WORD}\s+\d+(?:\s*(?:-|\.\.|to|and)\s*\d+)?\b",
    re.IGNORECASE,
)

# Repo-relative paths: under these top-level folders, made of path characters only.
PATH_TOKEN = re.compile(r"(?<![\w./:-])((?:batchgen|kernels|examples|tests|jobs)/[\w./-]*)")
# Written by `batchgen make-model` (make demo, the README's commands, the tests), not tracked.
GENERATED = re.compile(r"^examples/tiny-[\w-]+/?")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BACKTICKED = re.compile(r"`([^`\n]+)`")


def tracked_files() -> list[Path]:
    """The repository's files: git's list, or a walk of the tree outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        names = [name for name in out.decode().split("\0") if name]
        return [ROOT / name for name in names if (ROOT / name).is_file()]
    except (OSError, subprocess.SubprocessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in UNTRACKED_DIRS and not d.startswith(".")]
            files += [Path(dirpath) / f for f in filenames]
        return files


def text_files() -> list[Path]:
    return [p for p in tracked_files() if p.suffix in TEXT_SUFFIXES or p.name == "Makefile"]


def rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()


def diary_lines(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: text' for each line of path holding a diary phrase."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return [
        f"{rel(path, root)}:{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if DIARY.search(line)
    ]


def python_prose(text: str) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings: where it cites files."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                first = node.body[0].lineno
                found += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return found


def markdown_paths(text: str) -> list[tuple[int, str, bool]]:
    """(line, path, is_link) for every link target and every repo path in backticks or code."""
    found = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        for target in MD_LINK.findall(line):
            if not re.match(r"^(?:[a-z]+:|#)", target):
                found.append((n, target.split("#")[0], True))
        spans = [line] if fenced else BACKTICKED.findall(line)
        for span in spans:
            found += [(n, p, False) for p in PATH_TOKEN.findall(span)]
    return found


def missing_paths(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: path' for each repo path (relative to root; a link: to the file's folder)
    that path's text mentions and that does not exist."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".md":
        mentions = markdown_paths(text)
    elif path.suffix == ".py":
        mentions = [(n, p, False) for n, s in python_prose(text) for p in PATH_TOKEN.findall(s)]
    else:  # scripts, Makefile, YAML: every mention counts (they run these paths)
        mentions = [
            (n, p, False)
            for n, line in enumerate(text.splitlines(), 1)
            for p in PATH_TOKEN.findall(line)
        ]
    bad = []
    for n, target, is_link in mentions:
        target = re.sub(r":\d+$", "", target.rstrip(".,;:)"))
        if not target or GENERATED.match(target):
            continue
        base = path.parent if is_link else root
        if not (base / target).exists():
            bad.append(f"{rel(path, root)}:{n}: {target}")
    return bad


def test_readme_and_results_are_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    results = (ROOT / "examples/benchmarks/RESULTS.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines"
    assert len(results) <= RESULTS_MAX_LINES, f"RESULTS.md has {len(results)} lines"


def test_benchmarks_folder_holds_few_files():
    folder = ROOT / "examples" / "benchmarks"
    files = [p for p in tracked_files() if p.parent == folder]
    assert 0 < len(files) <= BENCHMARKS_MAX_FILES, sorted(p.name for p in files)


def test_no_file_reads_like_a_work_diary():
    hits = [hit for path in text_files() for hit in diary_lines(path)]
    assert not hits, "work-diary phrases (cite a commit and date instead):\n" + "\n".join(hits)


def test_every_mentioned_path_exists():
    bad = [hit for path in text_files() for hit in missing_paths(path)]
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "line",
    [
        "Measured in the twelfth " + "session (RESULTS.md).",
        "as before the twenty-seventh " + "session's change",
        "this " + "session: 9,541",
        "see sess" + "ions 7-29",
        "the 3rd " + "session",
    ],
)
def test_diary_phrases_are_caught(tmp_path, line):
    planted = tmp_path / "notes.md"
    planted.write_text(f"# Notes\n\nfine\n{line}\n")
    assert diary_lines(planted, tmp_path) == [f"notes.md:4: {line}"]


@pytest.mark.parametrize(
    "line",
    ["a test " + "session fixture", 'scope="' + "session" + '"', "gpu_" + "session.sh stages"],
)
def test_ordinary_uses_of_the_word_pass(line):
    assert not DIARY.search(line)


def test_missing_paths_are_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "See [the engine](batchgen/engine/README.md) and `examples/benchmarks/gone_probe.py`.\n"
        "```bash\npython tests/no_such_test.py\n```\n"
        "Fine: `batchgen/engine/scheduler.py`, `examples/tiny-llama`, [web](https://x.org).\n"
    )
    py = tmp_path / "mod.py"
    py.write_text('"""Module."""\n\n# measured by examples/benchmarks/gone_probe.py\nX = 1\n')
    (tmp_path / "batchgen/engine").mkdir(parents=True)
    (tmp_path / "batchgen/engine/scheduler.py").write_text("")
    assert missing_paths(doc, tmp_path) == [
        "doc.md:1: batchgen/engine/README.md",
        "doc.md:1: examples/benchmarks/gone_probe.py",
        "doc.md:3: tests/no_such_test.py",
    ]
    assert missing_paths(py, tmp_path) == ["mod.py:3: examples/benchmarks/gone_probe.py"]
