"""Prompt datasets from jsonl or parquet files: rows with a prompt and a reference answer.

A malformed row (not UTF-8, bad JSON, missing or non-string field) raises with the file and line (row
for parquet), unless `skip_bad_rows` is set, in which case it is skipped and counted; so does a prompt
that leaves no room for the answer in the model's context (`fit_context`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence


class DatasetError(ValueError):
    """A prompt file or row that cannot be used; the message names file and line."""


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    answer: str
    source: str  # "file:line", to trace a sample back to its row


@dataclass(frozen=True)
class PromptSet:
    rows: tuple[PromptRow, ...]
    skipped: int  # malformed rows skipped (only with skip_bad_rows)

    def __len__(self) -> int:
        return len(self.rows)


def _records(path: Path) -> Iterator[tuple[int, object]]:
    """(line or row number from 1, decoded record or the exception that decoding raised)."""
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            for i, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield i, DatasetError(f"not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})")
                    continue
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, DatasetError(f"not valid JSON ({e})")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(f"{path}: not a readable parquet file ({e}); write it again or use .jsonl") from None
        for i, rec in enumerate(table.to_pylist(), 1):
            yield i, rec
    else:
        raise DatasetError(f"{path}: unsupported prompt file type {path.suffix!r}; use .jsonl or .parquet")


def _row(rec: object, prompt_key: str, answer_key: str) -> tuple[str, str]:
    if isinstance(rec, DatasetError):
        raise rec
    if not isinstance(rec, dict):
        raise DatasetError(f"expected an object with '{prompt_key}' and '{answer_key}', got {type(rec).__name__}")
    for key in (prompt_key, answer_key):
        if key not in rec:
            raise DatasetError(f"missing field '{key}' (fields: {sorted(rec)}); set data.prompt_key/answer_key")
    prompt, answer = rec[prompt_key], rec[answer_key]
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"field '{prompt_key}' must be a non-empty string, got {prompt!r}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DatasetError(f"field '{answer_key}' must be a string or number, got {answer!r}")
    return prompt, answer


def load_prompts(
    files: Sequence[str | Path], prompt_key: str = "prompt", answer_key: str = "answer", skip_bad_rows: bool = False
) -> PromptSet:
    if not files:
        raise DatasetError("no prompt files given; set data.train_files")
    rows, skipped = [], 0
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise DatasetError(f"prompt file {path} does not exist")
        unit = "row" if path.suffix == ".parquet" else "line"
        for i, rec in _records(path):
            try:
                prompt, answer = _row(rec, prompt_key, answer_key)
            except DatasetError as e:
                if skip_bad_rows:
                    skipped += 1
                    continue
                raise DatasetError(f"{path}:{unit} {i}: {e}; fix the row or set data.skip_bad_rows=true") from None
            rows.append(PromptRow(prompt, answer, f"{path}:{i}"))
    if not rows:
        raise DatasetError(f"no usable rows in {[str(f) for f in files]} ({skipped} skipped)")
    return PromptSet(tuple(rows), skipped)


def fit_context(prompts: PromptSet, count: Callable[[str], int], limit: int, why: str, skip_bad_rows: bool) -> PromptSet:
    """The rows whose prompt is at most `limit` tokens (`count` gives a prompt's tokens; `why` says where the
    limit comes from). A longer one raises naming its row and what to change, or with `skip_bad_rows` is
    skipped and counted: never cut short, which would change the question."""
    kept, skipped = [], prompts.skipped
    for row in prompts.rows:
        n = count(row.prompt)
        if n <= limit:
            kept.append(row)
        elif skip_bad_rows:
            skipped += 1
        else:
            raise DatasetError(f"{row.source}: the prompt is {n} tokens, more than {limit} ({why}); shorten it, "
                               "raise that limit, or set data.skip_bad_rows=true to skip such rows")
    if not kept:
        raise DatasetError(f"no prompt fits in {limit} tokens ({why}); {skipped} rows skipped")
    return PromptSet(tuple(kept), skipped)


def valid_answers(prompts: PromptSet, check: Callable[[str], None], what: str, skip_bad_rows: bool) -> PromptSet:
    """The rows whose answer `check` accepts (it raises ValueError saying what is wrong; `what` names the
    verifier). A refused one raises naming its row, or with `skip_bad_rows` is skipped and counted."""
    kept, skipped = [], prompts.skipped
    for row in prompts.rows:
        try:
            check(row.answer)
            kept.append(row)
        except ValueError as e:
            if not skip_bad_rows:
                raise DatasetError(f"{row.source}: the answer is not {what}: {e}; fix the row, or set "
                                   "data.skip_bad_rows=true to skip such rows") from None
            skipped += 1
    if not kept:
        raise DatasetError(f"no row's answer is {what}; {skipped} rows skipped")
    return PromptSet(tuple(kept), skipped)
