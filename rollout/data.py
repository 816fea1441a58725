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


class DataError(ValueError):
    """The prompt set cannot be read or a row is unusable."""


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


def _parse_json(raw: bytes, source: Path, line: int):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        bad_line = line + raw[:exc.start].count(NEWLINE)
        raise DataError(f"{source} line {bad_line}: not valid UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{source} line {line + exc.lineno - 1}: invalid JSON ({exc.msg})") from exc


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


def _check_json_file(source: Path) -> list[int]:
    """Name the first bad line of a JSON(L) file (datasets' own errors give neither line nor cause), and return
    the line each row starts on: datasets reads a JSONL file's non-blank lines, a JSON file's array items."""
    data = source.read_bytes()
    if source.suffix.lower() == ".json":
        rows = _parse_json(data, source, 1)
        lines = _array_item_lines(data.decode("utf-8"))
        for number, row in zip(lines, rows if isinstance(rows, list) else [rows]):
            if not isinstance(row, dict):
                raise DataError(f"{source} line {number}: expected a JSON object, got {type(row).__name__}")
        return lines
    lines = []
    for number, raw in enumerate(data.split(NEWLINE), start=1):
        if raw.strip():
            if not isinstance(row := _parse_json(raw, source, number), dict):
                raise DataError(f"{source} line {number}: expected a JSON object, got {type(row).__name__}")
            lines.append(number)
    return lines


def _file_rows(path: str) -> tuple[list[dict], list[int] | None]:
    """The rows of a prompt file or dataset folder, and for a JSON(L) file the line each row starts on."""
    import datasets

    source = Path(path)
    if not source.exists():
        raise DataError(f"prompt set {path} does not exist")
    datasets.disable_progress_bars()
    lines = None
    try:
        if source.is_dir():
            loaded = datasets.load_from_disk(str(source))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[next(iter(loaded))]
        else:
            suffix = source.suffix.lower()
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
            if builder is None:
                raise DataError(f"prompt set {path}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet "
                                "or a saved dataset folder)")
            if builder == "json":
                lines = _check_json_file(source)
            if source.stat().st_size == 0:
                raise DataError(f"prompt set {path} is empty")
            loaded = datasets.load_dataset(builder, data_files=str(source), split="train")
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets and pyarrow raise many types; one message names the file
        cause = exc.__cause__ or exc
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise DataError(f"prompt set {path} cannot be read: {reason}") from exc
    rows = loaded.to_list()
    return rows, lines if lines is not None and len(lines) == len(rows) else None


def load_rows(source: str, num_prompts: int | None, seed: int,
              dataset_config: dict | None = None) -> tuple[list[dict], list[str]]:
    """The rows of a prompt set and where each is, as a user counts: "line N" of a JSON(L) file (1-based, blank
    lines counted, as an editor shows it), else "row N" (1-based)."""
    if source.startswith(REASONING_GYM_PREFIX):
        rows = _reasoning_gym_rows(source[len(REASONING_GYM_PREFIX):], num_prompts or 64, seed, dataset_config)
        lines = None
    else:
        rows, lines = _file_rows(source)
        rows = rows[:num_prompts] if num_prompts else rows
    where = [f"line {n}" for n in lines[:len(rows)]] if lines else [f"row {i + 1}" for i in range(len(rows))]
    return rows, where


def prepare_prompts(rows: list[dict], tokenizer: Any, *, source: str, prompt_field: str, id_field: str | None,
                    answer_field: str | None, system_prompt: str | None, apply_chat_template: bool,
                    max_prompt_tokens: int, long_prompts: str = "fail",
                    locations: list[str] | None = None) -> tuple[list[Prompt], list[dict]]:
    """Render and tokenize every row; the first unusable one raises a DataError naming the source and the row's
    location (`locations[i]`, as `load_rows` gives them; default "row i+1").

    Prompts longer than max_prompt_tokens fail the set (long_prompts="fail") or are left out and returned
    as the second value (long_prompts="skip").
    """
    if not rows:
        raise DataError(f"prompt set {source} is empty")
    locations = locations or [f"row {i + 1}" for i in range(len(rows))]
    use_template = apply_chat_template and getattr(tokenizer, "chat_template", None)
    prompts, skipped, first_seen = [], [], {}
    for index, row in enumerate(rows):
        where = f"{source} {locations[index]}"
        if prompt_field not in row or row[prompt_field] is None:
            raise DataError(f"{where}: missing prompt field {prompt_field!r} (set data.prompt_field)")
        raw = row[prompt_field]
        prompt_id = str(row[id_field]) if id_field and row.get(id_field) is not None else str(index)
        if prompt_id in first_seen:
            raise DataError(f"{where}: duplicate prompt id {prompt_id!r} (first at {first_seen[prompt_id]})")
        first_seen[prompt_id] = locations[index]
        token_ids = None
        if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            # Already tokenized (an RL trainer's own prompts, or a model without a tokenizer): used as is.
            if min(raw) < 0:
                raise DataError(f"{where}: negative token id in prompt field {prompt_field!r}")
            text, token_ids = "", raw
        elif tokenizer is None:
            raise DataError(f"{where}: a text prompt needs a tokenizer and the model folder has none "
                            f"(give token ids: a list of ints in {prompt_field!r})")
        elif isinstance(raw, str):
            if not raw.strip():
                raise DataError(f"{where}: empty prompt")
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                [{"role": "user", "content": raw}]
        elif isinstance(raw, list) and raw and all(isinstance(m, dict) and "role" in m and "content" in m
                                                    for m in raw):
            messages = raw
        else:
            raise DataError(f"{where}: prompt field {prompt_field!r} must be a string, a list of "
                            "{role, content} messages or a list of token ids")
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
            raise DataError(f"{where}: prompt {prompt_id!r} has {len(token_ids)} tokens, more than the "
                            f"{max_prompt_tokens} the model's context leaves (model.max_model_len; "
                            "data.long_prompts=skip leaves such prompts out)")
        answer = row.get(answer_field) if answer_field else None
        prompts.append(Prompt(prompt_id=prompt_id, text=text, token_ids=list(token_ids),
                              answer=None if answer is None else str(answer), score=row.get("score")))
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
    """The prompt set a `DataConfig` describes, rendered and tokenized, and the prompts skipped as too long."""
    rows, locations = load_rows(data.source, data.num_prompts, data.seed, data.dataset_config)
    return prepare_prompts(
        rows, tokenizer, source=data.source, prompt_field=data.prompt_field, id_field=data.id_field,
        answer_field=data.answer_field, system_prompt=data.system_prompt,
        apply_chat_template=data.apply_chat_template, max_prompt_tokens=max_prompt_tokens,
        long_prompts=data.long_prompts, locations=locations)
