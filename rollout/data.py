"""Prompt sets: files through `datasets` (JSONL, JSON, parquet, a saved dataset folder) or reasoning-gym
generators, rendered with the tokenizer's chat template and tokenized before the engine starts, so bad input
fails fast with one message naming the file and the line (JSON, JSONL) or row (parquet, dataset folders)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REASONING_GYM_PREFIX = "reasoning_gym:"


# Problems of a prompt set reported in one go; past this many, the count of the rest.
MAX_PROBLEMS = 20


class DataError(ValueError):
    """The prompt set cannot be read or rows are unusable: every problem found in one pass over it, each a line
    that names the file and the line (or row) as a user counts them."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        shown, more = self.problems[:MAX_PROBLEMS], len(self.problems) - MAX_PROBLEMS
        super().__init__("\n".join(shown + ([f"{more} more problems in the prompt set, not shown"] if more > 0
                                             else [])))


@dataclass
class Prompt:
    prompt_id: str
    text: str  # as given to the model, chat template applied
    token_ids: list[int]
    answer: str | None = None
    # Reward in [0, 1] for a completion; None where the set has no scorer.
    score: Callable[[str], float] | None = None


def extract_final_answer(completion: str) -> str:
    """The answer a completion commits to: after the last '####', else in <answer> tags, else its last number."""
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    tagged = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.S)
    if tagged:
        return tagged[-1].strip()
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", completion)
    return numbers[-1].replace(",", "") if numbers else ""


def _reasoning_gym_rows(name: str, size: int, seed: int, settings: dict | None = None) -> list[dict]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **(settings or {}))
    except Exception as exc:  # reasoning-gym raises several types for unknown names
        raise DataError(f"reasoning-gym has no usable dataset {name!r}: {exc}") from exc
    rows = []
    for index, entry in enumerate(dataset):
        rows.append({
            "id": f"{name}-{seed}-{index}", "prompt": entry["question"], "answer": str(entry["answer"]),
            # The scorer compares text to the entry; it runs no code from the data.
            "score": (lambda completion, entry=entry: float(
                dataset.score_answer(extract_final_answer(completion), entry=entry))),
        })
    return rows


NEWLINE = b"\n"


def _parse_json(raw: bytes, line: int):
    """(the value, None) or (None, (line, the problem)) for the JSON text `raw`, which starts on `line`."""
    try:
        return json.loads(raw.decode("utf-8")), None
    except UnicodeDecodeError as exc:
        return None, (line + raw[:exc.start].count(NEWLINE), "not valid UTF-8")
    except json.JSONDecodeError as exc:
        return None, (line + exc.lineno - 1, f"invalid JSON ({exc.msg})")


def _array_item_lines(text: str) -> list[int]:
    """The line each item of a top-level JSON array starts on (text is valid JSON); one line for an object."""
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    start = skip.match(text).end()
    if not text.startswith("[", start):
        return [text.count("\n", 0, start) + 1]
    lines, line, counted, at = [], 1, 0, start + 1
    while True:
        at = skip.match(text, at).end()
        if text.startswith("]", at):
            return lines
        line += text.count("\n", counted, at)
        counted = at
        lines.append(line)
        _, at = decoder.raw_decode(text, at)


def _json_rows(source: Path) -> tuple[list[dict], list[int], list[tuple[int, str]]]:
    """A JSON(L) file's rows (a JSONL file's non-blank lines, a JSON file's array items), the line each starts on,
    and the problems of the lines that are no row, as (line, what is wrong). Read here rather than by `datasets`,
    whose Arrow columns hold one type: a file that gives some prompts as text and others as message lists, as chat
    data does, is valid, and each bad line is named, where datasets names neither line nor cause."""
    data = source.read_bytes()
    rows, lines, problems = [], [], []

    def add(row, number: int) -> None:
        if isinstance(row, dict):
            rows.append(row)
            lines.append(number)
        else:
            problems.append((number, f"expected a JSON object, got {type(row).__name__}"))

    if source.suffix.lower() == ".json":
        value, problem = _parse_json(data, 1)
        if problem:
            return [], [], [problem]
        for number, row in zip(_array_item_lines(data.decode("utf-8")), value if isinstance(value, list)
                               else [value]):
            add(row, number)
        return rows, lines, problems
    for number, raw in enumerate(data.split(NEWLINE), start=1):
        if raw.strip():
            row, problem = _parse_json(raw, number)
            if problem:
                problems.append(problem)
            else:
                add(row, number)
    return rows, lines, problems


def _file_rows(path: str) -> tuple[list[dict], list[str], list[tuple[int, str]]]:
    """The rows of a prompt file or dataset folder, where each is ("line N" of a JSON(L) file, else "row N"), and
    the problems of a JSON(L) file's lines that hold no row, as (line, what is wrong)."""
    source = Path(path)
    if not source.exists():
        raise DataError(f"prompt set {path} does not exist")
    suffix = source.suffix.lower()
    if source.is_file() and suffix in (".jsonl", ".json"):
        if source.stat().st_size == 0:
            raise DataError(f"prompt set {path} is empty")
        rows, lines, problems = _json_rows(source)
        return rows, [f"line {n}" for n in lines], problems
    import datasets

    datasets.disable_progress_bars()
    try:
        if source.is_dir():
            loaded = datasets.load_from_disk(str(source))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[next(iter(loaded))]
        elif suffix == ".parquet":
            loaded = datasets.load_dataset("parquet", data_files=str(source), split="train")
        else:
            raise DataError(f"prompt set {path}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet "
                            "or a saved dataset folder)")
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets and pyarrow raise many types; one message names the file
        cause = exc.__cause__ or exc
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise DataError(f"prompt set {path} cannot be read: {reason}") from exc
    rows = loaded.to_list()
    return rows, [f"row {i + 1}" for i in range(len(rows))], []


def _read_rows(source: str, num_prompts: int | None, seed: int, dataset_config: dict | None
               ) -> tuple[list[dict], list[str], list[tuple[int, str]]]:
    if source.startswith(REASONING_GYM_PREFIX):
        rows = _reasoning_gym_rows(source[len(REASONING_GYM_PREFIX):], num_prompts or 64, seed, dataset_config)
        return rows, [f"row {i + 1}" for i in range(len(rows))], []
    rows, where, problems = _file_rows(source)
    return rows[:num_prompts or None], where[:num_prompts or None], problems


def _report(source: str, problems: list[tuple[int, str]], locations: dict[int, str] | None = None) -> DataError:
    """One DataError for every problem, in the file's order, each naming the source and where it is."""
    return DataError([f"{source} {(locations or {}).get(n, f'line {n}')}: {what}"
                      for n, what in sorted(problems, key=lambda p: p[0])])


def load_rows(source: str, num_prompts: int | None, seed: int,
              dataset_config: dict | None = None) -> tuple[list[dict], list[str]]:
    """The rows of a prompt set and where each is, as a user counts: "line N" of a JSON(L) file (1-based, blank
    lines counted, as an editor shows it), else "row N" (1-based). A JSON(L) file's lines that hold no row raise
    one DataError naming them all."""
    rows, where, problems = _read_rows(source, num_prompts, seed, dataset_config)
    if problems:
        raise _report(source, problems)
    return rows, where


# Where a row without the configured prompt field keeps its prompt: chat data names its message list `messages`
# (OpenAI's files, most chat sets on the hub) or `conversations` (ShareGPT's {from, value} turns).
CHAT_FIELDS = ("messages", "conversations")
# ShareGPT's speaker names as chat templates know them.
SPEAKERS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}


def _as_messages(raw) -> list[dict] | None:
    """A list of chat turns as {role, content} messages ({from, value} turns renamed), or None if it is none."""
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        return None
    messages = []
    for turn in raw:
        role, content = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        messages.append({"role": SPEAKERS.get(role, role), "content": content})
    return messages


def _prompt_field(row: dict, prompt_field: str) -> str | None:
    if row.get(prompt_field) is not None:
        return prompt_field
    return next((name for name in CHAT_FIELDS if row.get(name) is not None), None)


def prepare_prompts(rows: list[dict], tokenizer: Any, *, source: str, prompt_field: str, id_field: str | None,
                    answer_field: str | None, system_prompt: str | None, apply_chat_template: bool,
                    max_prompt_tokens: int, long_prompts: str = "fail", locations: list[str] | None = None,
                    file_problems: list[tuple[int, str]] = ()) -> tuple[list[Prompt], list[dict]]:
    """Render and tokenize every row. Every unusable row, with `file_problems` (the lines that hold no row, as
    (line, what is wrong)), raises one DataError naming each by the source and its location (`locations[i]`, as
    `load_rows` gives them; default "row i+1").

    A row's prompt is its `prompt_field`, else its `messages` or `conversations` (chat data's names for a message
    list); a message list that ends with the assistant's turn is the prompt before that turn, and the turn is the
    row's reference answer where it has no `answer_field`. Prompts longer than max_prompt_tokens fail the set
    (long_prompts="fail") or are left out and returned as the second value (long_prompts="skip").
    """
    if not rows and not file_problems:
        raise DataError(f"prompt set {source} is empty")
    locations = locations or [f"row {i + 1}" for i in range(len(rows))]
    use_template = apply_chat_template and getattr(tokenizer, "chat_template", None)
    prompts, skipped, first_seen = [], [], {}
    problems = list(file_problems)
    where_of = {}
    for index, row in enumerate(rows):
        number = int(locations[index].split()[-1])
        where_of[number] = locations[index]

        def problem(what: str) -> None:
            problems.append((number, what))

        field_name = _prompt_field(row, prompt_field)
        if field_name is None:
            problem(f"missing prompt field {prompt_field!r} (nor {' or '.join(map(repr, CHAT_FIELDS))}; set "
                    "data.prompt_field)")
            continue
        raw = row[field_name]
        prompt_id = str(row[id_field]) if id_field and row.get(id_field) is not None else str(index)
        if prompt_id in first_seen:
            problem(f"duplicate prompt id {prompt_id!r} (first at {first_seen[prompt_id]})")
            continue
        first_seen[prompt_id] = locations[index]
        answer = row.get(answer_field) if answer_field else None
        token_ids, messages = None, _as_messages(raw)
        if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            # Already tokenized (an RL trainer's own prompts, or a model without a tokenizer): used as is.
            if min(raw) < 0:
                problem(f"negative token id in prompt field {field_name!r}")
                continue
            text, token_ids = "", raw
        elif isinstance(raw, str):
            if not raw.strip():
                problem("empty prompt")
                continue
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                [{"role": "user", "content": raw}]
        elif messages is not None:
            if messages[-1]["role"] == "assistant":  # the reference turn of chat data: the model writes its own
                answer = messages[-1]["content"] if answer is None else answer
                messages = messages[:-1]
            if not any(m["role"] == "user" for m in messages):
                problem(f"the messages in {field_name!r} have no user turn to answer")
                continue
        else:
            problem(f"prompt field {field_name!r} must be a string, a list of {{role, content}} messages (or "
                    "{from, value} turns) or a list of token ids")
            continue
        if token_ids is None and tokenizer is None:
            problem(f"a text prompt needs a tokenizer and the model folder has none (give token ids: a list of "
                    f"ints in {field_name!r})")
            continue
        if token_ids is None:
            if use_template:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                text = "\n\n".join(m["content"] for m in messages)
                token_ids = tokenizer(text)["input_ids"]
        if len(token_ids) > max_prompt_tokens:
            if long_prompts == "skip":
                skipped.append({"prompt_id": prompt_id, "location": locations[index], "prompt_tokens": len(token_ids)})
                continue
            problem(f"prompt {prompt_id!r} has {len(token_ids)} tokens, more than the {max_prompt_tokens} the "
                    "model's context leaves (model.max_model_len; data.long_prompts=skip leaves such prompts out)")
            continue
        prompts.append(Prompt(prompt_id=prompt_id, text=text, token_ids=list(token_ids),
                              answer=None if answer is None else str(answer), score=row.get("score")))
    if problems:
        raise _report(source, problems, where_of)
    if not prompts:
        raise DataError(f"prompt set {source}: every prompt is longer than {max_prompt_tokens} tokens")
    return prompts, skipped


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_folder: str) -> bool:
    folder = Path(model_folder)
    return not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_folder: str):
    """The model folder's tokenizer, or None where it has none (dummy-weight shapes take token-id prompts)."""
    if not has_tokenizer(model_folder):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder)


def load_prompts(data, tokenizer: Any, max_prompt_tokens: int) -> tuple[list[Prompt], list[dict]]:
    """The prompt set a `DataConfig` describes, rendered and tokenized, and the prompts skipped as too long. Every
    problem of the set, unreadable lines and unusable rows alike, raises one DataError that names them all."""
    rows, locations, file_problems = _read_rows(data.source, data.num_prompts, data.seed, data.dataset_config)
    return prepare_prompts(
        rows, tokenizer, source=data.source, prompt_field=data.prompt_field, id_field=data.id_field,
        answer_field=data.answer_field, system_prompt=data.system_prompt,
        apply_chat_template=data.apply_chat_template, max_prompt_tokens=max_prompt_tokens,
        long_prompts=data.long_prompts, locations=locations, file_problems=file_problems)
