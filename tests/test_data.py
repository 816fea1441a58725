import pytest

from rollout.data import DataError, extract_final_answer, load_rows, prepare_prompts


@pytest.mark.parametrize("completion, answer", [
    ("She sells 48 / 2 = 24 clips.\n#### 72", "72"),
    ("#### 18 The answer is: 18", "18 The answer is: 18"),
    ("reasoning <answer>42</answer>", "42"),
    ("first 3, then 1,234 apples", "1234"),
    ("no number here", ""),
])
def test_extract_final_answer(completion, answer):
    assert extract_final_answer(completion) == answer


def test_reasoning_gym_set_is_seeded_and_scored():
    rows = load_rows("reasoning_gym:gsm_symbolic", 5, seed=42)
    again = load_rows("reasoning_gym:gsm_symbolic", 5, seed=42)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in again]
    assert [r["id"] for r in rows] == [f"gsm_symbolic-42-{i}" for i in range(5)]
    for row in rows:
        assert row["score"](f"Working...\n#### {row['answer']}") == 1.0
        assert row["score"]("#### -123456789") < 1.0


def test_unknown_reasoning_gym_set():
    with pytest.raises(DataError, match="reasoning-gym has no usable dataset 'no_such_set'"):
        load_rows("reasoning_gym:no_such_set", 2, seed=0)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "folder"])
def test_file_formats_give_the_same_rows(tmp_path, suffix):
    import datasets

    rows = [{"id": f"q{i}", "question": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
    table = datasets.Dataset.from_list(rows)
    path = tmp_path / f"set.{suffix}"
    if suffix == "jsonl":
        table.to_json(str(path))
    elif suffix == "parquet":
        table.to_parquet(str(path))
    else:
        table.save_to_disk(str(path))
    assert load_rows(str(path), None, 0) == rows
    assert load_rows(str(path), 2, 0) == rows[:2]


def test_chat_template_and_field_names(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"qid": "a", "question": "what is 1 plus 1?", "gold": "2"},
            {"qid": "b", "question": [{"role": "user", "content": "hi"}], "gold": "3"}]
    prompts, skipped = prepare_prompts(rows, tokenizer, source="mem", prompt_field="question", id_field="qid",
                              answer_field="gold", system_prompt="Be brief.", apply_chat_template=True,
                              max_prompt_tokens=1000)
    assert skipped == []
    assert [p.prompt_id for p in prompts] == ["a", "b"]
    assert [p.answer for p in prompts] == ["2", "3"]
    assert prompts[0].text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nwhat is 1 plus 1?"
                               "<|im_end|>\n<|im_start|>assistant\n")
    assert prompts[1].text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompts[0].token_ids == tokenizer(prompts[0].text, add_special_tokens=False)["input_ids"]


def test_reasoning_gym_dataset_settings_reach_the_generator():
    rows = load_rows("reasoning_gym:basic_arithmetic", 20, seed=1,
                     dataset_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                     "operators": ["+"]})
    import re

    for row in rows:
        terms = [int(t) for t in re.findall(r"-?\d+", row["prompt"])]
        assert len(terms) == 2 and all(abs(t) < 10 for t in terms) and "+" in row["prompt"]
        assert row["score"](f"#### {row['answer']}") == 1.0
    with pytest.raises(DataError, match="basic_arithmetic"):
        load_rows("reasoning_gym:basic_arithmetic", 2, seed=0, dataset_config={"colour": "red"})


def test_token_id_prompts_need_no_tokenizer(tmp_path):
    from rollout.data import has_tokenizer, load_tokenizer

    (tmp_path / "config.json").write_text("{}")  # a config-only model shape (dummy weights)
    assert not has_tokenizer(str(tmp_path)) and load_tokenizer(str(tmp_path)) is None
    rows = [{"id": "a", "prompt": [5, 6, 7]}, {"id": "b", "prompt": [9]}]
    prompts, _ = prepare_prompts(rows, None, source="ids.jsonl", prompt_field="prompt", id_field="id",
                                 answer_field=None, system_prompt="ignored for token ids", apply_chat_template=True,
                                 max_prompt_tokens=3)
    assert [p.token_ids for p in prompts] == [[5, 6, 7], [9]] and prompts[0].text == ""
    with pytest.raises(DataError, match="row 1: a text prompt needs a tokenizer"):
        prepare_prompts([{"prompt": [1]}, {"prompt": "two"}], None, source="mixed.jsonl", prompt_field="prompt",
                        id_field=None, answer_field=None, system_prompt=None, apply_chat_template=True,
                        max_prompt_tokens=8)
    with pytest.raises(DataError, match="more than the 2"):
        prepare_prompts(rows, None, source="ids.jsonl", prompt_field="prompt", id_field="id", answer_field=None,
                        system_prompt=None, apply_chat_template=True, max_prompt_tokens=2)
    with pytest.raises(DataError, match="negative token id"):
        prepare_prompts([{"prompt": [3, -1]}], None, source="neg.jsonl", prompt_field="prompt", id_field=None,
                        answer_field=None, system_prompt=None, apply_chat_template=True, max_prompt_tokens=8)
