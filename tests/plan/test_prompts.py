"""Prompt rendering: {column} templates and chat templates in jinja2's sandbox."""

from __future__ import annotations

import pytest

from batchgen.job import ChatMessage, PromptSpec
from batchgen.job.placeholders import placeholders
from batchgen.plan.prompts import PromptError, PromptRenderer, TemplateLimits

CHAT = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_template_fill_and_placeholders():
    spec = PromptSpec(template="Doc {id}: {text} {{literal}}")
    assert placeholders(spec) == ["id", "text"]
    out = PromptRenderer(spec).render({"id": 7, "text": "hello"})
    assert out.text == "Doc 7: hello {literal}" and out.add_special_tokens


def test_template_row_errors():
    r = PromptRenderer(PromptSpec(template="{text}"))
    with pytest.raises(PromptError) as e:
        r.render({"text": None})
    assert e.value.code == "null_text"
    with pytest.raises(PromptError) as e:
        r.render({})
    assert e.value.code == "missing_column"


def test_chat_template_with_bos_skips_special_tokens():
    spec = PromptSpec(chat=(ChatMessage("system", "Be brief."), ChatMessage("user", "{text}")))
    out = PromptRenderer(spec, CHAT, bos_token="<s>", eos_token="</s>").render({"text": "hi"})
    assert out.text == "<s>[system]Be brief.[user]hi[assistant]"
    assert out.add_special_tokens is False
    no_bos = PromptRenderer(spec, CHAT.replace("{{ bos_token }}", ""), bos_token="<s>")
    assert no_bos.render({"text": "hi"}).add_special_tokens is True


def test_job_chat_template_overrides_model():
    spec = PromptSpec(
        chat=(ChatMessage("user", "{text}"),), chat_template="U:{{ messages[0].content }}"
    )
    assert PromptRenderer(spec, CHAT).render({"text": "x"}).text == "U:x"


@pytest.mark.parametrize(
    "evil",
    [
        "{{ raise_exception.__globals__ }}",
        "{{ raise_exception.__globals__['os'].system('echo pwned') }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% for x in cycler.__init__.__globals__ %}{{ x }}{% endfor %}",
    ],
)
def test_sandbox_refuses_escapes(evil):
    spec = PromptSpec(chat=(ChatMessage("user", "{text}"),), chat_template=evil)
    with pytest.raises(PromptError, match="(unsafe|refused by sandbox|template failed)") as e:
        PromptRenderer(spec).check(needs_chat=True)
    assert e.value.code == "template_error"


def test_raise_exception_helper_and_missing_template():
    spec = PromptSpec(
        chat=(ChatMessage("user", "{text}"),),
        chat_template="{{ raise_exception('only user/assistant roles') }}",
    )
    with pytest.raises(PromptError, match="only user/assistant roles"):
        PromptRenderer(spec).render({"text": "x"})
    with pytest.raises(PromptError, match="the model has none; set prompt.chat_template"):
        PromptRenderer(PromptSpec(chat=(ChatMessage("user", "x"),))).check(needs_chat=True)


def test_immutable_sandbox_blocks_mutation():
    spec = PromptSpec(
        chat=(ChatMessage("user", "x"),),
        chat_template="{% set _ = messages.append(1) %}{{ messages|length }}",
    )
    with pytest.raises(PromptError) as e:
        PromptRenderer(spec).check(needs_chat=True)
    assert e.value.code == "template_error"


@pytest.mark.parametrize(
    "template, why, timeout_s",
    [
        # A loop that touches the data: the sandbox's own deadline check fires first.
        (
            "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% if m.role == 'z' %}x{% endif %}{% endfor %}{% endfor %}{% endfor %}",
            "took over",
            0.3,
        ),
        # The others must be stopped by their own limit: a deadline far off, so a loaded
        # machine's slow render never reaches it first.
        ("{{ 'a' * 300000000 }}", "'*' would build", 60.0),
        ("{{ 10 ** 100000000 }}", "exponent", 60.0),
        ("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}", "output over", 60.0),
    ],
)
def test_chat_template_runs_under_limits(template, why, timeout_s):
    spec = PromptSpec(chat=(ChatMessage("user", "{text}"),))
    limits = TemplateLimits(timeout_s=timeout_s, max_chars=1_000_000)
    with PromptRenderer(spec, template, limits=limits) as renderer:
        with pytest.raises(PromptError, match=why) as e:
            renderer.render({"text": "x" * 100})
        assert e.value.code == "template_error"
    # A renderer of a good template renders a later row (the limits are per render).
    with PromptRenderer(spec, CHAT, limits=limits) as ok:
        assert ok.render({"text": "hi"}).text == "[user]hi[assistant]"


@pytest.mark.parametrize(
    "value, kind",
    [(["a", "b"], "list"), ({"k": "v"}, "dict"), (True, "bool"), (b"raw", "bytes")],
)
def test_non_string_text_values_are_bad_text(value, kind):
    spec = PromptSpec(template="Doc: {text}")
    with pytest.raises(PromptError, match=f"column 'text' holds {kind} .*not text") as e:
        PromptRenderer(spec).render({"text": value})
    assert e.value.code == "bad_text"
    chat = PromptSpec(chat=(ChatMessage("user", "{text}"),))
    with pytest.raises(PromptError) as e:
        PromptRenderer(chat, CHAT).render({"text": value})
    assert e.value.code == "bad_text"


def test_numbers_are_written_as_their_decimal_text():
    r = PromptRenderer(PromptSpec(template="{a} {b} {c}"))
    assert r.render({"a": 7, "b": 2.5, "c": -0.0}).text == "7 2.5 -0.0"
