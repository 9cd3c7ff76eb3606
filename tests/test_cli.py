"""The batchgen CLI: exit codes, messages, validate, status, --shard, --help."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "pipeline"))

from fake_engine import FakeEngine, FakeTokenizer  # noqa: E402
from workspace import make_job, read_output, rows, write_jsonl  # noqa: E402

from batchgen import cli  # noqa: E402
from batchgen.engine.request_checks import ModelLimits  # noqa: E402
from batchgen.job import JobError, load_job  # noqa: E402
from batchgen.pipeline import engine_factory  # noqa: E402

REAL_MODEL_LIMITS = engine_factory.model_limits  # the fixture below swaps these
REAL_BUILD_ENGINE = engine_factory.build_engine


@pytest.fixture(autouse=True)
def fake_engine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    monkeypatch.setattr(engine_factory, "build_engine", lambda job: FakeEngine(max_model_len=200))
    monkeypatch.setattr(engine_factory, "build_tokenizer", lambda job: FakeTokenizer())
    monkeypatch.setattr(engine_factory, "model_limits", lambda job: ModelLimits(200, 259))


def invoke(*args):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def bad_input(tmp_path):
    data = rows(30)
    lines = [json.dumps(r) for r in data]
    lines[2] = "{not json"
    lines[4] = json.dumps({"id": "long", "text": "y" * 300})
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    return make_job(tmp_path, "in.jsonl", output={"shard_rows": 10})


def test_run_counts_row_errors_and_strict(tmp_path):
    job = bad_input(tmp_path)
    res = invoke("run", str(job))
    assert res.exit_code == 0
    assert "rows: 28 ok, 2 error(s)" in res.output
    assert "2 row(s) ended as error records" in res.output and "_SUCCESS written" in res.output
    assert invoke("run", str(job), "--strict").exit_code == 1


def test_run_bad_jobs_exit_2(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(3))
    job = make_job(tmp_path, "in.jsonl")
    res = invoke("run", str(job), "--set", "sampling.temprature=1")
    assert res.exit_code == 2
    # The key and the file it came from (a cron or Slurm log holds many jobs' errors).
    assert f"error: {job}: sampling.temprature: unknown key (did you mean 'temperature'?)" in (
        res.output
    )
    res = invoke("run", str(job), "--set", "output.path=../x")
    assert res.exit_code == 2 and "escapes the working directory" in res.output
    res = invoke("run", str(job), "--set", "prompt.template=Use {body}")
    assert res.exit_code == 2 and "column(s) 'body' used by the job are not in" in res.output
    res = invoke("run", str(job), "--shard", "3/2")
    assert res.exit_code == 2 and "need 0 <= I < N" in res.output


def test_run_refuses_sandbox_escape_in_chat_template(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(3))
    job = make_job(
        tmp_path,
        "in.jsonl",
        prompt={
            "chat": [{"role": "user", "content": "{text}"}],
            "chat_template": "{{ raise_exception.__globals__['os'] }}",
        },
    )
    res = invoke("run", str(job))
    assert res.exit_code == 2
    assert "chat template refused by sandbox" in res.output and "unsafe" in res.output
    assert not (tmp_path / "out").exists()


def test_run_python_tag_refused(tmp_path):
    job = tmp_path / "evil.yaml"
    job.write_text("model: !!python/object/new:os.system [ls]\n")
    res = invoke("run", str(job))
    assert res.exit_code == 2 and "YAML tags such as '!!python/object/new:os.system'" in res.output


def test_shard_option_and_slurm_env(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", rows(45))
    job = make_job(tmp_path, "in.jsonl", output={"shard_rows": 10})
    assert invoke("run", str(job), "--shard", "1/2").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*")) == [
        "part-00001.parquet",
        "part-00003.parquet",
    ]
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    res = invoke("run", str(job))
    assert "shards committed: 3/3 of task 0/2" in res.output and "_SUCCESS written" in res.output
    assert "job (all tasks): 5/5 shards committed" in res.output
    assert read_output("out").height == 45


def test_sharded_tasks_report_and_strict_on_their_own_rows(tmp_path):
    # 3 shards of 10 rows; both bad rows are in shard 0 (task 0/2 owns shards 0 and 2).
    job = bad_input(tmp_path)
    first = invoke("run", str(job), "--shard", "0/2", "--strict")
    assert first.exit_code == 1
    assert "rows of task 0/2: 18 ok, 2 error(s)" in first.output
    assert "2 row(s) of task 0/2 ended as error records" in first.output
    # Task 1/2 owns shard 1 alone, which is clean: task 0/2's errors neither fail nor show in it,
    # though it completes the job and prints the job's totals.
    last = invoke("run", str(job), "--shard", "1/2", "--strict")
    assert last.exit_code == 0, last.output
    assert "rows of task 1/2: 10 ok, 0 error(s)" in last.output
    assert "ended as error records" not in last.output
    assert "job (all tasks): 3/3 shards committed, rows: 28 ok, 2 error(s)" in last.output
    assert "_SUCCESS written" in last.output
    # A resumed task counts the rows its earlier runs committed.
    again = invoke("run", str(job), "--shard", "0/2", "--strict")
    assert again.exit_code == 1 and "already done: 2" in again.output
    assert "2 row(s) of task 0/2 ended as error records" in again.output


@pytest.mark.parametrize(
    "task, count, first, step, shard",
    [("4", "4", "0", "2", "2/4"), ("7", "3", "3", "2", "2/3"), ("5", "2", "4", None, "1/2")],
)
def test_slurm_array_task_to_shard(monkeypatch, task, count, first, step, shard):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", count)
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", first)
    if step is None:
        monkeypatch.delenv("SLURM_ARRAY_TASK_STEP", raising=False)
    else:
        monkeypatch.setenv("SLURM_ARRAY_TASK_STEP", step)
    assert cli._default_shard() == shard


@pytest.mark.parametrize("task, step", [("x", "1"), ("3", "2"), ("9", "1")])
def test_bad_slurm_array_task_is_a_clear_error(tmp_path, monkeypatch, task, step):
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    job = make_job(tmp_path, "in.jsonl")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_STEP", step)
    res = invoke("run", str(job))
    assert res.exit_code == 2 and "pass --shard I/N" in res.output


def test_unsupported_model_fails_before_anything_runs(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    job = make_job(tmp_path, "in.jsonl")
    monkeypatch.setattr(engine_factory, "model_limits", REAL_MODEL_LIMITS)
    res = invoke("run", str(job))
    assert res.exit_code == 2 and res.output.startswith("error: model.path:")
    assert not (tmp_path / "out").exists()


def test_engine_build_errors_are_job_errors(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    job = load_job(str(make_job(tmp_path, "in.jsonl")))
    with pytest.raises(JobError, match="^model: "):
        REAL_BUILD_ENGINE(job)


def test_changed_job_cli(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    job = make_job(tmp_path, "in.jsonl")
    assert invoke("run", str(job)).exit_code == 0
    res = invoke("run", str(job), "--set", "prompt.template=Other {text}")
    assert res.exit_code == 2 and "different job (changed: prompt)" in res.output
    res = invoke("run", str(job), "--set", "prompt.template=Other {text}", "--overwrite")
    assert res.exit_code == 0


def test_validate_reports_rows(tmp_path):
    job = bad_input(tmp_path)
    res = invoke("validate", str(job))
    assert res.exit_code == 0, res.output
    assert "30 rows: 28 ok, 2 will fail" in res.output
    assert "bad_json: 1" in res.output and "prompt_too_long: 1" in res.output
    assert "estimated tokens:" in res.output and "+ up to 224 generated" in res.output
    assert not (tmp_path / "out").exists()
    assert invoke("validate", str(job), "--set", "input.id_colum=x").exit_code == 2


def test_status(tmp_path):
    job = bad_input(tmp_path)
    invoke("run", str(job))
    res = invoke("status", "out")
    assert res.exit_code == 0
    assert "out: complete" in res.output and "shards: 3/3 committed" in res.output
    assert "rows: 28 ok, 2 error(s)" in res.output and "generated tok/s" in res.output
    assert invoke("status", "nowhere").exit_code == 2


def test_help_everywhere():
    assert "run" in invoke("--help").output
    for cmd in ("run", "validate", "status", "make-model"):
        res = invoke(cmd, "--help")
        assert res.exit_code == 0 and "Usage:" in res.output
    assert "--shard" in invoke("run", "--help").output


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "sampling.max_tokens=10000000",
            "error: job.yaml: sampling.max_tokens=10000000: must be less than max_model_len=200",
        ),
        (
            "sampling.stop_token_ids=[5, 300]",
            "error: job.yaml: sampling.stop_token_ids: 300 is not a token id (vocab size 259)",
        ),
        (
            "model.num_kv_blocks=2",
            "error: job.yaml: model.num_kv_blocks=2: the KV cache holds 32 tokens, fewer than "
            "one max_model_len=200 request",
        ),
        (
            "sampling.n=100000",
            "error: job.yaml: sampling.n=100000: must be an integer in [1, 1024]",
        ),
    ],
)
@pytest.mark.parametrize("command", ["validate", "run"])
def test_job_values_the_model_cannot_take_fail_before_it_loads(
    tmp_path, monkeypatch, command, setting, message
):
    # Limits from config.json (patched: 200 tokens, 259 ids); no row would get through.
    def no_engine(job):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_factory, "build_engine", no_engine)
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    make_job(tmp_path, "in.jsonl")
    res = invoke(command, "job.yaml", "--set", setting)
    assert res.exit_code == 2 and res.output.startswith(message), res.output
    assert not (tmp_path / "out").exists()


def test_validate_counts_rows_the_engine_would_refuse(tmp_path):
    data = rows(6)
    data[1]["params"] = {"max_tokens": 10_000_000}
    data[2]["params"] = {"stop_token_ids": [300]}
    data[3]["params"] = {"n": 100_000}
    data[4]["params"] = {"max_tokens": 190}  # 190 + the prompt's 30-odd tokens > 200
    write_jsonl(tmp_path / "in.jsonl", data)
    job = make_job(tmp_path, "in.jsonl", sampling={"overrides_column": "params"})
    res = invoke("validate", str(job))
    assert res.exit_code == 0, res.output
    assert "6 rows: 2 ok, 4 will fail" in res.output
    assert "bad_params: 3" in res.output and "prompt_too_long: 1" in res.output
    assert "in.jsonl:2: params.max_tokens=10000000: must be less than" in res.output
    assert "in.jsonl:4: params.n=100000: must be an integer in [1, 1024]" in res.output
    assert invoke("run", str(job)).exit_code == 0
    df = read_output("out")
    assert df["error_code"].to_list() == [None] + ["bad_params"] * 3 + ["prompt_too_long", None]
    for message in df["error"].drop_nulls():  # each one validate printed
        assert f"] {message}" in res.output


def _stop_while_starting(monkeypatch, when):
    """Deliver SIGTERM to this process once, at `when` ("job": while the job loads, before the
    runner exists; "runner": as the Runner is built), asserting first that a handler is there
    to catch it: without one the default action would end the test process."""
    import signal

    from batchgen.pipeline import runner as runner_mod

    fired = []

    def deliver():
        if not fired:
            fired.append(True)
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
            signal.raise_signal(signal.SIGTERM)

    if when == "job":
        real_load = cli.load_job

        def load(*args):
            deliver()
            return real_load(*args)

        monkeypatch.setattr(cli, "load_job", load)
    else:
        real_init = runner_mod.Runner.__init__

        def init(self, *args, **kwargs):
            deliver()
            real_init(self, *args, **kwargs)

        monkeypatch.setattr(runner_mod.Runner, "__init__", init)


@pytest.mark.parametrize("when", ["job", "runner"])
def test_stop_signal_while_starting_up_exits_75(tmp_path, monkeypatch, when):
    write_jsonl(tmp_path / "in.jsonl", rows(12))
    job = make_job(tmp_path, "in.jsonl", output={"shard_rows": 5})
    _stop_while_starting(monkeypatch, when)
    res = invoke("run", str(job))
    assert res.exit_code == 75, res.output
    assert "interrupted by SIGTERM" in res.output
    assert not list((tmp_path / "out").glob("part-*"))
    # The rerun (no signal this time) does the whole job.
    res = invoke("run", str(job))
    assert res.exit_code == 0 and "_SUCCESS written" in res.output
    assert len(read_output(tmp_path / "out")) == 12


def test_version_is_the_installed_package_version():
    from importlib.metadata import version

    res = invoke("--version")
    assert res.exit_code == 0 and res.output == f"batchgen {version('batchgen')}\n"
