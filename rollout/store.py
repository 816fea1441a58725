"""The output folder of a run, made so that no work is lost: a manifest that fingerprints what is being
generated, samples appended to samples.jsonl as they finish (flushed in batches, fsynced in the background),
and, once every sample exists, the final files (samples.jsonl sorted, samples.parquet) replaced atomically.

A run killed at any moment and started again with the same command finds the manifest, keeps every complete
line, drops a torn last line, and generates only what is missing. A changed configuration or prompt set is
refused unless forced.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path

MANIFEST_FILE = "manifest.json"
SAMPLES_FILE = "samples.jsonl"
PARQUET_FILE = "samples.parquet"
SUMMARY_FILE = "summary.json"
MANIFEST_VERSION = 1


class StoreError(RuntimeError):
    """The output folder cannot be used as asked."""


def fingerprint(settings: dict, prompts: list) -> dict:
    """What decides the outputs: the generation settings and every prompt's id and tokens."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(json.dumps([prompt.prompt_id, prompt.token_ids]).encode())
    return {"settings": json.loads(json.dumps(settings, sort_keys=True, default=str)),
            "prompts_sha256": digest.hexdigest(), "num_prompts": len(prompts)}


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


# Characters that JSON leaves raw (with ensure_ascii=False) and that some line splitters break lines at:
# str.splitlines (U+0085, U+2028, U+2029), JavaScript (U+2028, U+2029). Escaped on writing, so that the file has
# one record per "\n" for every reader; a record's text keeps every other character as it is.
_LINE_BREAKING = re.compile("[\u0085\u2028\u2029]")


def json_line(record: dict) -> str:
    """One JSON-lines record, "\n"-terminated, with no character inside that any reader takes for a line end."""
    return _LINE_BREAKING.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(record, ensure_ascii=False)) + "\n"


def _listed(changes: list[str]) -> str:
    return "; ".join(changes[:3]) + ("; ..." if len(changes) > 3 else "")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """write(tmp_path) then rename over `path`: readers see the old file or the new one, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class SampleStore:
    def __init__(self, out_dir: str | os.PathLike, expected: dict, *, overwrite: bool = False,
                 force: bool = False) -> None:
        self.dir = Path(out_dir)
        self.expected = expected
        self.overwrite = overwrite
        self.force = force
        self.samples_path = self.dir / SAMPLES_FILE
        self.done: dict[tuple[str, int], dict] = {}
        self._log = None
        self._dirty = threading.Event()
        self._syncer: threading.Thread | None = None

    def _changes(self) -> list[str]:
        """How the folder's run differs from the one asked for (empty: the same settings and prompts)."""
        manifest = json.loads((self.dir / MANIFEST_FILE).read_text())
        return _differences(manifest.get("fingerprint", {}), self.expected)

    def completed(self) -> dict | None:
        """The summary of the run in the folder where it is complete and is the run asked for: there is nothing
        to generate. None where there is work to do (no run, a partial one, or output.overwrite)."""
        if self.overwrite or not (self.dir / SUMMARY_FILE).exists() or not (self.dir / MANIFEST_FILE).exists():
            return None
        changed = self._changes()
        if changed:
            raise StoreError(f"{self.dir} holds a complete run with other settings or prompts ({_listed(changed)}); "
                             "pass output.overwrite=true to replace it")
        return json.loads((self.dir / SUMMARY_FILE).read_text())

    def open(self) -> dict[tuple[str, int], dict]:
        """Prepare the folder; returns the samples already durable, keyed by (prompt id, sample index)."""
        manifest_path = self.dir / MANIFEST_FILE
        if self.overwrite:
            for name in (SAMPLES_FILE, PARQUET_FILE, SUMMARY_FILE, MANIFEST_FILE):
                (self.dir / name).unlink(missing_ok=True)
        present = [name for name in (SAMPLES_FILE, PARQUET_FILE, SUMMARY_FILE) if (self.dir / name).exists()]
        if manifest_path.exists():
            changed = self._changes()
            if (self.dir / SUMMARY_FILE).exists():  # complete: completed() tells the caller there is nothing to do
                other = f" with other settings or prompts ({_listed(changed)})" if changed else ""
                raise StoreError(f"{self.dir} holds a complete run{other}; pass output.overwrite=true to replace it")
            if changed and not self.force:
                raise StoreError(f"{self.dir} holds a run with other settings or prompts ({_listed(changed)}); pass "
                                 "output.force=true to resume it anyway or output.overwrite=true to start over")
            self.done = self._read_durable()
        elif present:
            raise StoreError(f"{self.dir} already holds {', '.join(present)}; pass output.overwrite=true to "
                             "replace them")
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(manifest_path, lambda p: p.write_text(json.dumps(
            {"version": MANIFEST_VERSION, "fingerprint": self.expected}, indent=1)))
        self._log = self.samples_path.open("a", encoding="utf-8")
        self._syncer = threading.Thread(target=self._sync_loop, args=(self._log,), daemon=True,
                                        name="samples-fsync")
        self._syncer.start()
        return dict(self.done)

    def _sync_loop(self, log) -> None:
        # fsync can stall for seconds on a busy disk; the generation loop must not wait for it.
        while True:
            self._dirty.wait()
            self._dirty.clear()
            if log.closed:
                return
            try:
                os.fsync(log.fileno())
            except (OSError, ValueError):  # closed under us: close() syncs itself
                return

    def _read_durable(self) -> dict[tuple[str, int], dict]:
        if not self.samples_path.exists():
            return {}
        data = self.samples_path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a line torn by the crash: it was never acknowledged as durable
            with self.samples_path.open("rb+") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        done = {}
        # Lines end at "\n" alone: a record another writer made may hold a raw U+2028 or the like, which
        # str.splitlines would take for a line end.
        for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
            try:
                record = json.loads(line)
                key = (record["prompt_id"], record["sample_index"])
            except (ValueError, KeyError, TypeError) as exc:  # ValueError: bad JSON or UTF-8
                raise StoreError(f"{self.samples_path} line {number} is not a sample record ({exc}); "
                                 "pass output.overwrite=true to start over") from exc
            done[key] = record  # a sample written twice (a crash between write and acknowledgement) counts once
        return done

    def append(self, records: list[dict]) -> None:
        """Make a batch of finished samples durable: written and flushed here (safe from a killed process), and
        fsynced by a background thread (safe from a machine crash moments later; always before finalize)."""
        if not records:
            return
        self._log.write("".join(json_line(r) for r in records))
        self._log.flush()
        self._dirty.set()
        for r in records:
            self.done[(r["prompt_id"], r["sample_index"])] = r

    def finalize(self, order: list[tuple[str, int]], formats: list[str]) -> dict[str, str]:
        """Every expected sample exactly once, in prompt then sample order, in the final files."""
        missing = [key for key in order if key not in self.done]
        if missing:
            raise StoreError(f"{len(missing)} samples are missing, e.g. {missing[0]}")
        records = [self.done[key] for key in order]
        self.close()
        paths = {}
        atomic_write(self.samples_path, lambda p: p.write_text(
            "".join(json_line(r) for r in records), encoding="utf-8"))
        if "jsonl" in formats:
            paths["jsonl"] = str(self.samples_path)
        if "parquet" in formats:
            import datasets

            datasets.disable_progress_bars()  # the console keeps to the run's own lines
            table = datasets.Dataset.from_list(records)
            atomic_write(self.dir / PARQUET_FILE, lambda p: table.to_parquet(str(p)))
            paths["parquet"] = str(self.dir / PARQUET_FILE)
        return paths

    def write_summary(self, summary: dict) -> Path:
        """Written last: its presence marks the run complete."""
        path = self.dir / SUMMARY_FILE
        atomic_write(path, lambda p: p.write_text(json.dumps(summary, indent=1, default=str)))
        return path

    def close(self) -> None:
        if self._log is not None:
            log, self._log = self._log, None
            log.flush()
            os.fsync(log.fileno())
            log.close()
            self._dirty.set()  # wakes the syncer, which sees the closed file and ends
            if self._syncer is not None:
                self._syncer.join(timeout=5)
