import json

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
    rows, where = load_rows("reasoning_gym:gsm_symbolic", 5, seed=42)
    again, _ = load_rows("reasoning_gym:gsm_symbolic", 5, seed=42)
    assert where == [f"row {i}" for i in range(1, 6)]
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
    assert load_rows(str(path), None, 0)[0] == rows
    assert load_rows(str(path), 2, 0)[0] == rows[:2]


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
    rows, _ = load_rows("reasoning_gym:basic_arithmetic", 20, seed=1,
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
    with pytest.raises(DataError, match="mixed.jsonl row 2: a text prompt needs a tokenizer"):
        prepare_prompts([{"prompt": [1]}, {"prompt": "two"}], None, source="mixed.jsonl", prompt_field="prompt",
                        id_field=None, answer_field=None, system_prompt=None, apply_chat_template=True,
                        max_prompt_tokens=8)
    with pytest.raises(DataError, match="more than the 2"):
        prepare_prompts(rows, None, source="ids.jsonl", prompt_field="prompt", id_field="id", answer_field=None,
                        system_prompt=None, apply_chat_template=True, max_prompt_tokens=2)
    with pytest.raises(DataError, match="negative token id"):
        prepare_prompts([{"prompt": [3, -1]}], None, source="neg.jsonl", prompt_field="prompt", id_field=None,
                        answer_field=None, system_prompt=None, apply_chat_template=True, max_prompt_tokens=8)


def test_rows_are_located_as_an_editor_shows_the_file(tmp_path):
    """JSONL: 1-based file lines, blank lines counted; JSON: the line each array item starts on."""
    jsonl = tmp_path / "set.jsonl"
    jsonl.write_text('{"id": "a", "prompt": "x"}\n\n   \n{"id": "b", "prompt": "y"}\n{"id": "c", "prompt": "z"}\n\n')
    assert load_rows(str(jsonl), None, 0) == ([{"id": i, "prompt": p} for i, p in zip("abc", "xyz")],
                                              ["line 1", "line 4", "line 5"])
    assert load_rows(str(jsonl), 2, 0)[1] == ["line 1", "line 4"]
    array = tmp_path / "set.json"
    array.write_text('[\n  {"id": "a", "prompt": "x"},\n\n  {"id": "b",\n'
                     '   "prompt": "[y]\\n"}, {"id": "c", "prompt": "z"}\n]\n')  # an escaped newline is no line
    assert load_rows(str(array), None, 0)[1] == ["line 2", "line 4", "line 5"]


@pytest.mark.parametrize("kind", ["parquet", "folder"])
def test_rows_of_tables_are_counted_from_one(tmp_path, kind):
    import datasets

    table = datasets.Dataset.from_list([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    path = tmp_path / ("set.parquet" if kind == "parquet" else "set")
    table.to_parquet(str(path)) if kind == "parquet" else table.save_to_disk(str(path))
    assert load_rows(str(path), None, 0)[1] == ["row 1", "row 2"]


def prompts_of(path, **settings):
    from rollout.data import load_prompts
    from rollout.config import DataConfig

    return load_prompts(DataConfig(source=str(path), **settings), None, max_prompt_tokens=4)


@pytest.mark.parametrize("name, content, message", [
    ("dupe.jsonl", '{"id": 1, "prompt": [1]}\n\n{"id": 2, "prompt": [2]}\n\n{"id": 1, "prompt": [3]}\n',
     "dupe.jsonl line 5: duplicate prompt id '1' (first at line 1)"),
    ("long.jsonl", '\n{"id": "w", "prompt": [1]}\n{"id": "x", "prompt": [1, 2, 3, 4, 5]}\n',
     "long.jsonl line 3: prompt 'x' has 5 tokens, more than the 4"),
    ("nofield.jsonl", '{"id": 1, "prompt": [1]}\n\n{"id": 2, "text": "a"}\n',
     "nofield.jsonl line 3: missing prompt field 'prompt'"),
    ("negative.jsonl", '\n\n{"prompt": [3, -1]}\n', "negative.jsonl line 3: negative token id"),
    ("dupe.json", '[\n {"id": 1, "prompt": [1]},\n\n {"id": 1,\n  "prompt": [2]}\n]',
     "dupe.json line 4: duplicate prompt id '1' (first at line 2)"),
    ("text.json", '[{"id": 1, "prompt": [1]},\n {"id": 2, "prompt": "words"}]',
     "text.json line 2: a text prompt needs a tokenizer"),
    ("notobject.json", '[{"prompt": [1]},\n\n 3]', "notobject.json line 3: expected a JSON object, got int"),
    ("notobject.jsonl", '{"prompt": [1]}\n\n[1, 2]\n', "notobject.jsonl line 3: expected a JSON object, got list"),
    ("broken.jsonl", '{"prompt": [1]}\n\n{"prompt": \n', "broken.jsonl line 3: invalid JSON"),
])
def test_problems_are_reported_by_file_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as info:
        prompts_of(path)
    assert str(path.parent / message) in str(info.value)


def test_problems_in_tables_are_reported_by_row(tmp_path):
    import datasets

    path = tmp_path / "set.parquet"
    datasets.Dataset.from_list([{"id": "a", "prompt": [1]}, {"id": "b", "prompt": [2]},
                                {"id": "a", "prompt": [3]}]).to_parquet(str(path))
    with pytest.raises(DataError, match=r"set.parquet row 3: duplicate prompt id 'a' \(first at row 1\)"):
        prompts_of(path)
    datasets.Dataset.from_list([{"id": "a", "prompt": [1]}, {"id": "b", "prompt": [1, 2, 3, 4, 5]}]).to_parquet(
        str(path))
    _, skipped = prompts_of(path, long_prompts="skip")
    assert skipped == [{"prompt_id": "b", "location": "row 2", "prompt_tokens": 5}]


def test_text_and_message_prompts_mix_in_one_file_with_blank_lines(tmp_path, tiny_model):
    """A column that holds text in some rows and message lists in others is valid chat data (Arrow, which
    `datasets` reads JSON into, holds one type a column)."""
    from transformers import AutoTokenizer

    from rollout.config import DataConfig
    from rollout.data import load_prompts

    path = tmp_path / "mixed.jsonl"
    path.write_text('{"id": "t", "prompt": "what is 1 plus 1?"}\n\n'
                    '{"id": "m", "prompt": [{"role": "user", "content": "hi"}]}\n')
    prompts, _ = load_prompts(DataConfig(source=str(path)), AutoTokenizer.from_pretrained(tiny_model), 1000)
    assert [p.prompt_id for p in prompts] == ["t", "m"]
    assert prompts[1].text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_rows_need_no_prompt_field(tmp_path, tiny_model):
    """`messages` (OpenAI-style files) and `conversations` ({from, value} turns) rows, mixed with the configured
    field's in one file: the assistant's closing turn is the reference answer, not part of the prompt."""
    from transformers import AutoTokenizer

    from rollout.config import DataConfig
    from rollout.data import load_prompts

    path = tmp_path / "chat.jsonl"
    rows = [{"id": "q", "question": "what is 2 plus 2?", "answer": "4"},
            {"id": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "hey"}, {"from": "gpt", "value": "yo"}],
             "answer": "kept"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, _ = load_prompts(DataConfig(source=str(path), prompt_field="question"),
                              AutoTokenizer.from_pretrained(tiny_model), 1000)
    assert [p.prompt_id for p in prompts] == ["q", "m", "c"]
    assert prompts[1].text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert prompts[2].text == "<|im_start|>user\nhey<|im_end|>\n<|im_start|>assistant\n"
    assert [p.answer for p in prompts] == ["4", "hello", "kept"]


def test_every_problem_of_a_file_is_reported_at_once(tmp_path):
    """One pass names each bad line, in the file's order: unreadable lines and unusable rows together."""
    path = tmp_path / "messy.jsonl"
    path.write_text('{"id": "a", "prompt": [1]}\n{"prompt": \n\n[3]\n{"id": "a", "prompt": [2]}\n'
                    '{"id": "b", "text": "x"}\n{"id": "c", "messages": [{"role": "assistant", "content": "x"}]}\n'
                    '{"id": "d", "prompt": [1, 2, 3, 4, 5]}\n{"id": "e", "prompt": [4]}\n')
    with pytest.raises(DataError) as info:
        prompts_of(path)
    assert str(info.value).split("\n") == [
        f"{path} line 2: invalid JSON (Expecting value)",
        f"{path} line 4: expected a JSON object, got list",
        f"{path} line 5: duplicate prompt id 'a' (first at line 1)",
        f"{path} line 6: missing prompt field 'prompt' (nor 'messages' or 'conversations'; set data.prompt_field)",
        f"{path} line 7: the messages in 'messages' have no user turn to answer",
        f"{path} line 8: prompt 'd' has 5 tokens, more than the 4 the model's context leaves (model.max_model_len; "
        "data.long_prompts=skip leaves such prompts out)"]


def test_problems_past_the_limit_are_counted():
    from rollout.data import MAX_PROBLEMS

    rows = [{"id": "x", "prompt": [1]}] * (MAX_PROBLEMS + 6)
    with pytest.raises(DataError) as info:
        prepare_prompts(rows, None, source="dupes.jsonl", prompt_field="prompt", id_field="id", answer_field=None,
                        system_prompt=None, apply_chat_template=True, max_prompt_tokens=8)
    lines = str(info.value).split("\n")
    assert len(lines) == MAX_PROBLEMS + 1 and lines[0].startswith("dupes.jsonl row 2: duplicate prompt id 'x'")
    assert lines[-1] == "5 more problems in the prompt set, not shown"
