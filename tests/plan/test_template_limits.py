"""Chat templates under hard limits: a worker process with a wall clock and a memory cap.

The templates are the ones that got past the in-process sandbox's checks: a loop that touches
nothing, a filter that builds 1.5 GB in one call (folded while compiling), and values grown
with `~` and list `+`. Each must end as that row's template_error, quickly, with the worker's
memory bounded and the parent's untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from batchgen.job import ChatMessage, PromptSpec
from batchgen.plan.prompts import PromptError, PromptRenderer, RenderStopped, TemplateLimits
from batchgen.plan.template_process import TemplateProcess

GOOD = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
NESTED_LOOP = '{% set s = "x" * 100000 %}{% for i in s %}{% for j in s %}{% endfor %}{% endfor %}'
GROW_CONCAT = (
    '{% set ns = namespace(s="x" * 1000) %}{% for i in range(40) %}'
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
)
GROW_LIST = (
    "{% set ns = namespace(s=[1] * 1000) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}"
)
# Hangs on rows, but renders the one-message probe that check() sends.
HANG_ON_ROWS = "{% if messages[0].content != 'probe' %}" + NESTED_LOOP + "{% endif %}" + GOOD
LIMITS = TemplateLimits(timeout_s=1.0, memory_bytes=256 << 20)
SPEC = PromptSpec(chat=(ChatMessage("user", "{text}"),))


# Renders one row in a fresh interpreter and reports the peak memory of that interpreter
# (the parent) and of its children (the template worker), apart from anything this test
# session started before.
_PROBE = """
import json, resource, sys
from batchgen.job import ChatMessage, PromptSpec
from batchgen.plan.prompts import PromptRenderer, TemplateLimits
spec = PromptSpec(chat=(ChatMessage("user", "{text}"),))
limits = TemplateLimits(timeout_s=1.0, memory_bytes=256 << 20)
with PromptRenderer(spec, sys.argv[1], limits=limits) as renderer:
    result = renderer.render_rows([{"text": "a"}])[0]
# VmHWM, not RUSAGE_SELF: the latter keeps the forking test process's own peak across exec.
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"code": getattr(result, "code", None), "error": str(result),
                  "parent_mib": hwm // 1024,
                  "worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024}))
"""


@pytest.mark.parametrize(
    "template",
    [NESTED_LOOP, '{{ "x"|center(1500000000) }}', GROW_CONCAT, GROW_LIST],
    ids=["nested-loop", "center", "grow-concat", "grow-list"],
)
def test_hostile_template_row_fails_quickly_with_bounded_memory(template):
    start = time.monotonic()
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, template], capture_output=True, text=True, timeout=60
    )
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    assert got["code"] == "template_error", got
    assert time.monotonic() - start < 30  # two interpreter starts and the 1 s limit, loaded
    # The worker is capped at its start size (~30 MiB) + 256 MiB; the parent builds nothing.
    assert got["worker_mib"] < 256 + 100, got
    assert got["parent_mib"] < 100, got


def test_filter_folded_while_compiling_is_bounded():
    # jinja2 tries filters on constants while compiling: 1.5 GB before any render.
    template = '{{ "x"|center(1500000000) }}'
    with PromptRenderer(SPEC, template, limits=LIMITS) as renderer:
        with pytest.raises(PromptError, match="memory limit") as e:
            renderer.check(needs_chat=True)
        assert e.value.code == "template_error"
        results = renderer.render_rows([{"text": "a"}, {"text": "b"}])
    assert [r.code for r in results] == ["template_error"] * 2


def test_a_killed_row_fails_alone_and_the_rest_of_the_batch_renders():
    template = "{% if messages[0].content == 'hang' %}" + NESTED_LOOP + "{% endif %}" + GOOD
    # 2 s: the good rows' renders take milliseconds, with room for a loaded machine.
    process = TemplateProcess(template, limits=TemplateLimits(timeout_s=2.0))
    try:
        rows = [[{"role": "user", "content": c}] for c in ("a", "hang", "b", "hang", "c")]
        results = process.render(rows)
    finally:
        process.close()
    assert [r.text for r in results] == ["[user]a", None, "[user]b", None, "[user]c"]
    assert all("took over 2 s" in r.error for r in results if r.text is None)
    assert process.starts == 3  # one worker, then one after each killed row


def test_stop_kills_a_hung_render_at_once():
    stop_at = time.monotonic() + 2.0
    limits = TemplateLimits(timeout_s=60.0)
    renderer = PromptRenderer(
        SPEC, HANG_ON_ROWS, limits=limits, should_stop=lambda: time.monotonic() > stop_at
    )
    try:
        renderer.check(needs_chat=True)
        with pytest.raises(RenderStopped):
            renderer.render_rows([{"text": "a"}])
        assert time.monotonic() - stop_at < 5  # not the 60 s limit
    finally:
        renderer.close()


def test_rows_go_in_batches_and_render_in_order():
    process = TemplateProcess(GOOD, limits=LIMITS)
    try:
        rows = [[{"role": "user", "content": f"row {i} " + "y" * 2000}] for i in range(3000)]
        results = process.render(rows)  # about 6 MB: one batch, one worker
    finally:
        process.close()
    assert [r.text for r in results] == [f"[user]row {i} " + "y" * 2000 for i in range(3000)]
    assert process.starts == 1


def test_a_lone_surrogate_fails_its_row_only():
    process = TemplateProcess(GOOD, limits=LIMITS)
    try:
        rows = [[{"role": "user", "content": "\ud800"}], [{"role": "user", "content": "fine"}]]
        results = process.render(rows)
    finally:
        process.close()
    assert results[0].text is None and "lone surrogate" in results[0].error
    assert results[1].text == "[user]fine"
