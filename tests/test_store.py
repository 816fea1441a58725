"""The output folder without an engine: what a resumed run reads back, and when a run has nothing left to do."""

import json

import pytest

from rollout.store import SUMMARY_FILE, SampleStore, StoreError, json_line

# Every character str.splitlines takes for a line end besides "\n" and "\r"; JSON escapes the control characters
# among them itself, and leaves U+0085, U+2028 and U+2029 raw unless told to escape everything.
LINE_BREAKING = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
EXPECTED = {"settings": {"n": 2}, "prompts_sha256": "x", "num_prompts": 2}


def records(count: int) -> list[dict]:
    return [{"prompt_id": f"p{i // 2}", "sample_index": i % 2, "prompt": f"a{LINE_BREAKING}b",
             "completion": f"{LINE_BREAKING}é 中 {i}{LINE_BREAKING}"} for i in range(count)]


def test_samples_holding_line_breaking_characters_are_read_back_whole(tmp_path):
    """A file with those characters raw inside its records (what json.dumps(..., ensure_ascii=False) writes, as
    another writer may): each "\\n"-terminated line is one record, and a torn last line is dropped."""
    written = records(3)
    SampleStore(tmp_path, EXPECTED).open()  # a partial run's manifest
    (tmp_path / "samples.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in written) + '{"prompt_id": "p1", "samp',
        encoding="utf-8")
    store = SampleStore(tmp_path, EXPECTED)
    assert store.open() == {(r["prompt_id"], r["sample_index"]): r for r in written}
    store.close()


def test_written_lines_break_only_at_their_ends(tmp_path):
    """What the store writes has one line per record for any line splitter, and keeps the text as it is."""
    assert all(json_line(r).splitlines() == [json_line(r)[:-1]] for r in records(2))
    store = SampleStore(tmp_path, EXPECTED)
    store.open()
    store.append(records(4)[:3])
    store.close()
    text = (tmp_path / "samples.jsonl").read_text(encoding="utf-8")
    assert [json.loads(line) for line in text.splitlines()] == records(3)
    again = SampleStore(tmp_path, EXPECTED)
    assert len(again.open()) == 3
    again.append(records(4)[3:])
    again.finalize([(f"p{i // 2}", i % 2) for i in range(4)], ["jsonl"])
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == records(4)


def complete_run(folder, expected=EXPECTED):
    store = SampleStore(folder, expected)
    store.open()
    store.append(records(4))
    store.finalize([(f"p{i // 2}", i % 2) for i in range(4)], ["jsonl"])
    store.write_summary({"num_samples": 4})


def test_a_complete_run_of_the_same_settings_has_nothing_to_do(tmp_path):
    assert SampleStore(tmp_path / "new", EXPECTED).completed() is None
    partial = SampleStore(tmp_path / "partial", EXPECTED)
    partial.open()
    partial.close()
    assert SampleStore(tmp_path / "partial", EXPECTED).completed() is None
    complete_run(tmp_path / "done")
    assert SampleStore(tmp_path / "done", EXPECTED).completed() == {"num_samples": 4}
    assert SampleStore(tmp_path / "done", EXPECTED, overwrite=True).completed() is None
    with pytest.raises(StoreError, match=r"holds a complete run with other settings or prompts \(settings.n: 2 -> "
                                         r"3\); pass output.overwrite=true"):
        SampleStore(tmp_path / "done", {**EXPECTED, "settings": {"n": 3}}).completed()
    assert (tmp_path / "done" / SUMMARY_FILE).exists()
