"""The README's commands run as written: every `batchgen ...` line of its bash blocks on the tiny
model (GPU-only ones parsed and their --help run), and its Python block."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from batchgen import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXPECTED_EXIT = re.compile(r"#\s*exits\s+(\d+)")
# Input rows the workspace keeps: enough for two 50-row shards of jobs/summarize.yaml, few
# enough that every command runs in seconds on a loaded 2-core machine.
KEEP_ROWS = {"docs.jsonl": 60, "docs.parquet": 24, "questions.jsonl": 12}


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def readme_commands() -> list[tuple[list[str], int, str]]:
    """(argv, expected exit status, line) of each command in the README's bash blocks."""
    commands = []
    for block in fenced_blocks(README, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                match = EXPECTED_EXIT.search(line)
                commands.append((words, int(match.group(1)) if match else 0, line.strip()))
    return commands


def needs_gpu(argv: list[str]) -> bool:
    """`batchgen bench` builds its models on the device: a GPU unless `--device cpu`."""
    if argv[1] != "bench":
        return False
    device = argv[argv.index("--device") + 1] if "--device" in argv else "auto"
    return device != "cpu"


BATCHGEN = [c for c in readme_commands() if c[0][0] == "batchgen"]
CPU = [c for c in BATCHGEN if not needs_gpu(c[0])]
GPU = [c for c in BATCHGEN if needs_gpu(c[0])]


class Workspace:
    """A copy of what the README's commands read after `make demo`: jobs/, the example data (its
    first rows), schemas, the trained tiny model and the tiny demo model. Commands run in README
    order; a test runs the ones before its own first, so each test also passes alone."""

    def __init__(self, path: Path, model_dir: str) -> None:
        self.path = path
        shutil.copytree(ROOT / "jobs", path / "jobs")
        for name in ("openai_batch", "schemas", "trained-tiny"):
            shutil.copytree(ROOT / "examples" / name, path / "examples" / name)
        shutil.copy(ROOT / "examples" / "python_api.py", path / "examples" / "python_api.py")
        data = path / "examples" / "data"
        data.mkdir(parents=True)
        for name, rows in KEEP_ROWS.items():
            source = ROOT / "examples" / "data" / name
            if name.endswith(".parquet"):
                import polars as pl  # here, not at the top: `pytest -m gpu` collects without it

                pl.read_parquet(source).head(rows).write_parquet(data / name)
            else:
                lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
                (data / name).write_text("".join(lines[:rows]), encoding="utf-8")
        # The model `make demo` writes (`batchgen make-model --arch llama --preset tiny`, seed 0).
        shutil.copytree(model_dir, path / "examples" / "tiny-llama")
        self.done = 0

    def run_through(self, index: int, monkeypatch) -> object:
        """Run CPU commands up to and including CPU[index]; the result of CPU[index]."""
        monkeypatch.chdir(self.path)
        for key in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"):
            monkeypatch.delenv(key, raising=False)
        result = None
        while self.done <= index:
            argv, expected, line = CPU[self.done]
            result = CliRunner().invoke(cli.main, argv[1:], catch_exceptions=False)
            self.done += 1
            assert result.exit_code == expected, (
                f"{line}\nexit {result.exit_code}:\n{result.output}"
            )
        return result


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir):
    # One thread: torch's default (a thread per core) on a machine shared with other processes
    # makes each tiny-model step wait on oversubscribed cores, seconds instead of milliseconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Workspace(tmp_path_factory.mktemp("readme"), tiny_model_dir("llama"))
    torch.set_num_threads(threads)


def test_readme_shows_the_main_commands():
    subcommands = {argv[1] for argv, _, _ in BATCHGEN}
    assert {"validate", "run", "status", "make-model", "bench"} <= subcommands
    assert GPU and len(CPU) >= 10
    assert any(expected for _, expected, _ in CPU)  # a refusal is shown, and checked


@pytest.mark.parametrize("index", range(len(CPU)), ids=[c[2][:70] for c in CPU])
def test_cpu_command_runs_as_written(workspace, monkeypatch, index):
    argv, expected, line = CPU[index]
    result = workspace.run_through(index, monkeypatch)
    if argv[1] == "run" and expected == 0:
        out_dir = workspace.path / _output_dir(argv)
        assert list(out_dir.glob("part-*")), f"{line}: no shard in {out_dir}"
        if "--shard" not in argv:  # the whole job: every shard committed
            assert (out_dir / "_SUCCESS").exists(), f"{line}: no _SUCCESS in {out_dir}"
    if argv[1] == "status":
        assert "shards:" in result.output, result.output


def _output_dir(argv: list[str]) -> str:
    """The output directory a `batchgen run JOB [--set output.path=...]` writes."""
    for i, word in enumerate(argv):
        if word == "--set" and argv[i + 1].startswith("output.path="):
            return argv[i + 1].split("=", 1)[1]
    job = (ROOT / argv[2]).read_text(encoding="utf-8")
    return re.search(r"^output:\n(?:  .*\n)*?  path: (\S+)", job, flags=re.MULTILINE).group(1)


@pytest.mark.parametrize("argv", [c[0] for c in GPU], ids=[c[2][:70] for c in GPU])
def test_gpu_command_parses_and_has_help(argv):
    command = cli.main.commands[argv[1]]
    help_result = CliRunner().invoke(cli.main, [argv[1], "--help"])
    assert help_result.exit_code == 0, help_result.output
    for word in argv[2:]:
        if word.startswith("--"):
            assert word in help_result.output, f"{word} is not an option of batchgen {argv[1]}"
    # click parses and checks every option (names, types, choices) without running the command.
    command.make_context(argv[1], argv[2:])


def test_python_block_runs(workspace, monkeypatch):
    (code,) = fenced_blocks(README, "python")
    monkeypatch.chdir(workspace.path)
    names: dict = {"__name__": "readme"}
    exec(compile(code, "README.md (python block)", "exec"), names)
    outs, scores, engine = names["outs"], names["scores"], names["engine"]
    assert [o.finish_reason for o in outs] == ["length", "length"]  # 16 tokens, no EOS bias
    assert len(scores) == 1 and len(scores[0]) == 2 and scores[0][0].error is None
    assert not engine.has_unfinished_requests()
