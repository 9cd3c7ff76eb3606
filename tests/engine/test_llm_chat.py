"""LLM.generate's vLLM prompt forms give the same tokens; LLM.chat equals generate on the
conversation as transformers renders it."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
TEXTS = ["the committee measured the river", "a small town", "our team reviewed this report"]


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=128)


def test_three_prompt_forms_give_the_same_tokens(llm):
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    as_text = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    as_dicts = llm.generate([{"prompt": t} for t in TEXTS], GREEDY, use_tqdm=False)
    as_ids = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    mixed = llm.generate([TEXTS[0], {"prompt": TEXTS[1]}, ids[2]], GREEDY, use_tqdm=False)
    expected = [o.token_ids for o in as_text]
    assert all(len(t) == 8 for t in expected)
    assert [o.token_ids for o in as_dicts] == expected
    assert [o.token_ids for o in as_ids] == expected
    assert [o.token_ids for o in mixed] == expected
    assert [o.prompt_token_ids for o in as_dicts] == ids
    single = llm.generate({"prompt": TEXTS[0]}, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in single] == expected[:1]


@pytest.mark.parametrize(
    "prompts, message",
    [
        (
            ["ok", {"prompt": "x", "multi_modal_data": {}}],
            r"prompts\[1\]: unknown key 'multi_modal_data'",
        ),
        ([{"prompt": "x", "prompt_token_ids": [1]}], r"prompts\[0\]: give one of .* not both"),
        ([{}], r"prompts\[0\]: give one of .* not neither"),
        ([{"prompt": 3}], r"prompts\[0\]\['prompt'\]: expected a string"),
        ([{"prompt_token_ids": "abc"}], r"prompts\[0\]\['prompt_token_ids'\]: expected a list"),
        ([1, 2, 3], r"prompts\[0\]: expected a string.*\[\[1, 2, 3\]\]"),
    ],
)
def test_bad_prompts_are_value_errors_naming_the_index(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued


def test_chat_equals_generate_on_the_rendered_conversation(llm, model_path):
    conversations = [[{"role": "user", "content": t}] for t in TEXTS] + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    ]
    hf = transformers.AutoTokenizer.from_pretrained(model_path)
    rendered = [
        hf.apply_chat_template(c, tokenize=True, add_generation_prompt=True) for c in conversations
    ]
    rendered = [
        r["input_ids"] if isinstance(r, dict) or hasattr(r, "keys") else r for r in rendered
    ]
    expected = llm.generate([{"prompt_token_ids": list(r)} for r in rendered], GREEDY, False)
    chats = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in chats] == [list(r) for r in rendered]
    assert [o.token_ids for o in chats] == [o.token_ids for o in expected]
    one = llm.chat(conversations[0], GREEDY, use_tqdm=False)  # a single conversation
    assert len(one) == 1 and one[0].token_ids == expected[0].token_ids


def test_chat_template_override_and_errors(llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}A:"
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template)
    assert out[0].prompt_token_ids == llm.tokenizer.encode("[user] hi\nA:")
    with pytest.raises(ValueError, match="chat template: .*does not compile"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template="{% for %}")
    picky = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    outs = llm.chat(
        [[{"role": "user", "content": "a"}], [{"role": "system", "content": "b"}]],
        GREEDY,
        chat_template=picky,
        use_tqdm=False,
    )
    assert outs[0].error is None and len(outs[0].token_ids) == 8
    assert outs[1].finish_reason == "error" and outs[1].error_code == "template_error"
    assert "no system role" in outs[1].error
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\]: expected a string"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "assistant"}], GREEDY)
