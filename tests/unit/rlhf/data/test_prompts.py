import json

import pytest

from rlhf.data.prompts import DatasetError, load_prompts


def _jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    j = _jsonl(tmp_path / "a.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}), "",
                                       json.dumps({"prompt": "2+2=", "answer": 4})])
    pq.write_table(pa.table({"question": ["3+3="], "solution": ["6"]}), tmp_path / "b.parquet")
    s = load_prompts([j], "prompt", "answer")
    assert [(r.prompt, r.answer) for r in s.rows] == [("1+1=", "2"), ("2+2=", "4")]
    assert s.rows[1].source.endswith("a.jsonl:3")
    p = load_prompts([tmp_path / "b.parquet"], "question", "solution")
    assert [(r.prompt, r.answer) for r in p.rows] == [("3+3=", "6")]


@pytest.mark.parametrize("bad, why", [("{not json", "not valid JSON"), ('{"prompt": "1+1="}', "missing field 'answer'"),
                                      ('{"prompt": 5, "answer": "2"}', "non-empty string"), ("[1, 2]", "expected an object")])
def test_malformed_row_names_file_and_line_or_is_skipped(tmp_path, bad, why):
    f = _jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}), bad])
    with pytest.raises(DatasetError, match=rf"p\.jsonl:line 2: .*{why}.*skip_bad_rows"):
        load_prompts([f])
    s = load_prompts([f], skip_bad_rows=True)
    assert len(s) == 1 and s.skipped == 1


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts([tmp_path / "none.jsonl"])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="use .jsonl or .parquet"):
        load_prompts([tmp_path / "x.csv"])


def test_non_utf8_rows_and_unreadable_parquet_are_named(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(json.dumps({"prompt": "1+1=", "answer": "2"}).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(DatasetError, match=r"p\.jsonl:line 2: not UTF-8 text \(byte 0: b'\\xff'\)"):
        load_prompts([f])
    assert load_prompts([f], skip_bad_rows=True).skipped == 1
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match=r"x\.parquet: not a readable parquet file"):
        load_prompts([tmp_path / "x.parquet"])
