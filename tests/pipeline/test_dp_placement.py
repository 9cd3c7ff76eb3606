"""model.data_parallel_size: its values, the GPU groups of the workers, and the errors given
before any input row is read."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from workspace import load, make_job, rows, write_jsonl

from batchgen import cli
from batchgen.job import JobError
from batchgen.pipeline.dp_placement import Placement, place_workers, worker_job

GPUS8 = [str(i) for i in range(8)]


def job_with(tmp_path, **model):
    write_jsonl(tmp_path / "in.jsonl", rows(3))
    return load(make_job(tmp_path, "in.jsonl", model={"path": "model", **model}))


@pytest.mark.parametrize("value", [0, -2, "two", True, 1.5, [2]])
def test_bad_values_name_the_key(tmp_path, value):
    with pytest.raises(JobError, match=r"model\.data_parallel_size: .* neither auto nor an int"):
        job_with(tmp_path, data_parallel_size=value)


def test_values(tmp_path):
    assert job_with(tmp_path).model.data_parallel_size is None  # auto by default
    assert job_with(tmp_path, data_parallel_size="auto").model.data_parallel_size is None
    assert job_with(tmp_path, data_parallel_size=3).model.data_parallel_size == 3


def test_auto_takes_every_whole_gpu_group(tmp_path):
    job = job_with(tmp_path, tensor_parallel_size=2)
    assert place_workers(job, GPUS8) == [
        Placement(0, ("0", "1")),
        Placement(1, ("2", "3")),
        Placement(2, ("4", "5")),
        Placement(3, ("6", "7")),
    ]
    assert place_workers(job_with(tmp_path), ["3", "5", "6"]) == [
        Placement(i, (g,)) for i, g in enumerate(["3", "5", "6"])
    ]
    assert len(place_workers(job_with(tmp_path, tensor_parallel_size=3), GPUS8)) == 2
    assert place_workers(job_with(tmp_path), []) == [Placement(0)]  # no GPU: one engine
    assert place_workers(job_with(tmp_path, device="cpu"), GPUS8) == [Placement(0)]
    assert place_workers(job_with(tmp_path, device="cuda:5"), GPUS8) == [Placement(0)]


def test_explicit_sizes(tmp_path):
    job = job_with(tmp_path, device="cuda:1", data_parallel_size=2, tensor_parallel_size=2)
    assert place_workers(job, ["a", "b", "c", "d", "e"]) == [
        Placement(0, ("b", "c")),
        Placement(1, ("d", "e")),
    ]
    cpu = place_workers(job_with(tmp_path, device="cpu", data_parallel_size=2), GPUS8)
    assert cpu == [Placement(0), Placement(1)] and cpu[1].label == "cpu"
    assert Placement(1, ("2", "3")).label == "GPUs 2,3" and Placement(0, ("7",)).label == "GPU 7"


def test_more_gpus_than_visible_names_both_sizes(tmp_path):
    job = job_with(tmp_path, data_parallel_size=2, tensor_parallel_size=2, device="cuda")
    message = (
        r"model\.data_parallel_size=2 x tensor_parallel_size=2 needs 4 GPUs, but 3 are visible"
    )
    with pytest.raises(JobError, match=message):
        place_workers(job, ["0", "1", "2"])
    offset = job_with(tmp_path, data_parallel_size=4, device="cuda:6")
    with pytest.raises(JobError, match="needs 4 GPUs from cuda:6 on, but 2 are visible"):
        place_workers(offset, GPUS8)


def test_worker_job_runs_one_engine_on_its_group(tmp_path, monkeypatch):
    job = job_with(tmp_path, device="cuda:1", data_parallel_size=2)
    one = worker_job(job, Placement(1, ("2",)), 2)
    assert one.model.engine_config().device == "cuda" and one.model.data_parallel_size == 1
    assert one.model.path == job.model.path and one.output == job.output
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = worker_job(job_with(tmp_path, device="cpu", data_parallel_size=2), Placement(0), 2)
    assert cpu.model.engine_config().cpu_threads >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's setting stays in charge
    cpu = worker_job(job_with(tmp_path, device="cpu", data_parallel_size=2), Placement(0), 2)
    assert cpu.model.engine_config().cpu_threads is None


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("model.data_parallel_size=64", "data_parallel_size=64 x tensor_parallel_size=1 needs 64"),
        ("model.data_parallel_size=0", "model.data_parallel_size: 0 is neither auto"),
    ],
)
def test_cli_refuses_before_reading_any_row(
    tmp_path, monkeypatch, tiny_model_dir, setting, message
):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", rows(3))
    job = make_job(tmp_path, "in.jsonl", model={"path": tiny_model_dir("llama"), "device": "cuda"})
    result = CliRunner().invoke(cli.main, ["run", str(job), "--set", setting])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()  # no claim, no plan: nothing was read
