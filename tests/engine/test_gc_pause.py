"""The heap from before a run is frozen against full collections while an engine has unfinished
requests, and handed back when the run ends or the engine is dropped; several holders share
one freeze; GC_FREEZE = 0 leaves the collector alone."""

from __future__ import annotations

import gc

import pytest

from batchgen.config import EngineConfig
from batchgen.engine import gc_pause
from batchgen.engine.gc_pause import HeapFreeze
from batchgen.engine.llm_engine import LLMEngine
from batchgen.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def clean_heap(monkeypatch):
    # These tests read the process-wide freeze: each starts with nothing frozen and no holder
    # (an engine another test left mid-run keeps its hold, restored afterwards) and must
    # leave no holder of its own.
    outside = gc_pause.holders()
    monkeypatch.setattr(gc_pause, "_holders", 0)
    gc.unfreeze()
    yield
    assert gc_pause.holders() == 0
    if outside:
        gc.freeze()


def test_hold_freezes_and_release_unfreezes():
    obj = [object()]  # a tracked container that exists before the hold
    freeze = HeapFreeze()
    freeze.hold()
    assert gc.get_freeze_count() > 0
    frozen = gc.get_freeze_count()
    freeze.hold()  # idempotent: still one holder
    assert gc_pause.holders() == 1
    assert gc.get_freeze_count() == frozen
    freeze.release()
    assert gc.get_freeze_count() == 0
    freeze.release()  # idempotent
    assert gc_pause.holders() == 0
    assert gc.is_tracked(obj)


def test_two_holders_share_one_freeze():
    a, b = HeapFreeze(), HeapFreeze()
    a.hold()
    b.hold()
    assert gc_pause.holders() == 2
    a.release()
    assert gc.get_freeze_count() > 0  # b still runs
    b.release()
    assert gc.get_freeze_count() == 0


def test_switched_off(monkeypatch):
    monkeypatch.setattr(gc_pause, "GC_FREEZE", 0)
    freeze = HeapFreeze()
    freeze.hold()
    assert gc.get_freeze_count() == 0
    assert gc_pause.holders() == 0
    freeze.release()


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


def _engine(model_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_path, dtype="float32", max_model_len=128))


def test_engine_freezes_during_a_run_only(model_path):
    engine = _engine(model_path)
    for i in range(3):
        engine.add_request(f"r{i}", [0, 5 + i, 9], SamplingParams(max_tokens=6, temperature=0.0))
    assert gc.get_freeze_count() == 0  # nothing frozen before the first step
    during, done = [], 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        done += len(outputs)
        if engine.has_unfinished_requests():
            during.append(gc.get_freeze_count())
    assert done == 3
    assert during and all(count > 0 for count in during)
    assert gc.get_freeze_count() == 0
    assert gc_pause.holders() == 0
    # A second run freezes again and ends unfrozen.
    engine.add_request("again", [0, 7], SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()
    assert gc.get_freeze_count() > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert gc.get_freeze_count() == 0


def test_engine_dropped_mid_run_releases(model_path):
    engine = _engine(model_path)
    engine.add_request("r", [0, 5, 9], SamplingParams(max_tokens=20, temperature=0.0))
    engine.step()
    assert gc_pause.holders() == 1
    del engine
    gc.collect()
    assert gc_pause.holders() == 0
    assert gc.get_freeze_count() == 0
