"""Trace readers: format detection, field mapping, bad lines with their line numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.errors import TraceError, TraceFormatError, TraceLineError
from loadgen.readers import BadLines, detect_format, read_trace
from loadgen.readers.csv_traces import parse_azure_timestamp
from tests.loadgen.conftest import DATA


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_timestamps_keep_seven_fractional_digits() -> None:
    a = parse_azure_timestamp("2023-11-16 18:17:03.9799600")
    b = parse_azure_timestamp("2023-11-16 18:17:04.0319601")
    assert b - a == pytest.approx(0.0520001, abs=1e-7)
    assert parse_azure_timestamp("2023-11-16 18:17:03") == 1700158623.0


@pytest.mark.parametrize(("name", "fmt", "count"), [
    ("traces/azure_llm_2023_code.csv", "azure", 8819),
    ("traces/mooncake_synthetic.jsonl", "mooncake", 3993),
    ("prompts/spec_bench_questions.jsonl", "specbench", 480),
    ("prompts/gsm8k_train.jsonl", "prompts", 2500),  # the first 2,500 of 7,473 (data/README.md)
])
def test_real_files_detect_and_read_cleanly(name: str, fmt: str, count: int) -> None:
    path = DATA / name
    bad = BadLines("fatal")
    assert detect_format(path) == fmt
    records = list(read_trace(path, "auto", bad))
    assert len(records) == count and bad.num_bad == 0


def test_mooncake_fields_and_millisecond_timestamps() -> None:
    first, second = list(read_trace(DATA / "traces/mooncake_synthetic.jsonl"))[:2]
    assert (first.line, first.timestamp_s, first.prompt_tokens, first.output_tokens) == \
        (1, 0.0, 40160, 6)
    assert first.hash_ids == tuple(range(79)) and second.hash_ids[0] == 79


def test_specbench_categories_map_to_domains() -> None:
    records = list(read_trace(DATA / "prompts/spec_bench_questions.jsonl"))
    domains = {r.domain for r in records}
    assert domains <= {"code", "math", "chat", "qa", "summarization", "translation", "rag",
                       "extraction"}
    assert {"translation", "summarization", "rag", "code"} <= domains
    assert records[0].messages is not None and records[0].messages[0]["role"] == "user"


def test_polyinfer_trace_records(tmp_path: Path) -> None:
    rows = [
        {"ts": 100.5, "request_id": "a", "model": "m", "endpoint": "/v1/completions",
         "stream": True, "domain": "code", "prompt_tokens": 700, "max_tokens": 64,
         "completion_tokens": 40, "worker": "w", "status": "ok", "prefix_hashes": [11, 12]},
        {"ts": 101.0, "request_id": "b", "model": "m", "endpoint": "/v1/chat/completions",
         "stream": True, "domain": "", "prompt_tokens": 9, "max_tokens": 32,
         "completion_tokens": None, "status": "error", "prefix_hashes": [],
         "prompt_text": "hello there"},
    ]
    path = _write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    assert detect_format(path) == "polyinfer"
    a, b = read_trace(path)
    assert (a.timestamp_s, a.prompt_tokens, a.output_tokens, a.hash_ids, a.domain) == \
        (100.5, 700, 40, (11, 12), "code")
    assert b.output_tokens == 32 and b.domain is None and b.prompt is None
    assert b.messages == ({"role": "user", "content": "hello there"},)


def test_burstgpt_and_sharegpt(tmp_path: Path) -> None:
    burst = _write(tmp_path, "b.csv", "Timestamp,Session ID,Elapsed time,Model,Request tokens,"
                   "Response tokens,Total tokens,Log Type\n"
                   "5,1,0.5,ChatGPT,472,18,490,Conversation log\n"
                   "7.25,2,1.0,GPT-4,1024,0,1024,API log\n")
    assert detect_format(burst) == "burstgpt"
    r = list(read_trace(burst))
    assert [(x.line, x.timestamp_s, x.prompt_tokens, x.output_tokens) for x in r] == \
        [(2, 5.0, 472, 18), (3, 7.25, 1024, 0)]
    share = _write(tmp_path, "s.json", json.dumps([
        {"id": "1", "conversations": [{"from": "human", "value": "Q?"},
                                      {"from": "gpt", "value": "A long answer."}]},
        {"id": "2", "conversations": [{"from": "gpt", "value": "orphan"}]},
    ]))
    assert detect_format(share) == "sharegpt"
    bad = BadLines()
    (only,) = read_trace(share, "auto", bad)
    assert only.messages == ({"role": "user", "content": "Q?"},)
    assert only.reference_output == "A long answer."
    assert bad.num_bad == 1 and bad.first[0].endswith(":2: conversations: no human turn")


BROKEN = (
    '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
    '{"timestamp": 5, "input_length": 10\n'  # line 2: cut JSON
    '\n'
    '{"timestamp": "soon", "input_length": 10, "output_length": 2}\n'  # line 4: bad time
    '{"timestamp": 9, "input_length": -3, "output_length": 2}\n'  # line 5: negative
    '[1, 2]\n'  # line 6: not an object
    '{"timestamp": 12, "input_length": 10, "output_length": 3}\n'
)


def test_bad_lines_are_skipped_with_their_numbers(tmp_path: Path) -> None:
    path = _write(tmp_path, "m.jsonl", BROKEN)
    bad = BadLines("skip")
    records = list(read_trace(path, "mooncake", bad))
    assert [r.line for r in records] == [1, 7]
    assert bad.num_bad == 4
    assert [e.split(":")[1] for e in bad.first] == ["2", "4", "5", "6"]


def test_bad_lines_fatal_names_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "m.jsonl", BROKEN)
    with pytest.raises(TraceLineError) as err:
        list(read_trace(path, "mooncake", BadLines("fatal")))
    assert err.value.line == 2 and str(err.value).startswith(f"{path}:2:")


def test_azure_bad_rows(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                  "2023-11-16 18:17:03.9799600,4808,10\n"
                  "2023-11-16 18:17:04,abc,8\n"
                  "2023-11-16 18:17:05.5,1,2,3\n"
                  "yesterday,5,5\n"
                  "2023-11-16 18:17:06.0,100,7\n")
    bad = BadLines()
    records = list(read_trace(path, "auto", bad))
    assert [r.line for r in records] == [2, 6]
    assert [e.split(":")[1] for e in bad.first] == ["3", "4", "5"]


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError):
        detect_format(_write(tmp_path, "x.txt", "just some words\n"))
    with pytest.raises(TraceError):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceFormatError):
        read_trace(_write(tmp_path, "y.jsonl", "{}\n"), "parquet")


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_specbench_category_of_the_wrong_type_is_a_bad_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "q.jsonl", '{"turns": ["a"], "category": "qa"}\n'
                  '{"turns": ["b"], "category": ["qa"]}\n'
                  '{"turns": ["c"], "category": {"x": 1}}\n')
    bad = BadLines()
    assert [r.line for r in read_trace(path, "specbench", bad)] == [1]
    assert [e.split(":")[1] for e in bad.first] == ["2", "3"]


def test_csv_byte_order_mark_is_not_part_of_the_header(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (AZURE_HEADER + "2023-11-16 18:17:03,5,3\n").encode())
    assert detect_format(path) == "azure"
    (r,) = read_trace(path, "auto", BadLines("fatal"))
    assert (r.line, r.prompt_tokens, r.output_tokens) == (2, 5, 3)
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"timestamp": 0, "input_length": 10, "output_length": 2}\n')
    assert detect_format(jsonl) == "mooncake"
    assert [r.line for r in read_trace(jsonl, "auto", BadLines("fatal"))] == [1]


def test_csv_stray_quote_is_a_line_error_at_its_row(tmp_path: Path) -> None:
    # the quote opens a field that swallows the rest of the file, past csv's field limit
    path = _write(tmp_path, "q.csv", AZURE_HEADER + "2023-11-16 18:17:03,5,3\n"
                  '"2023-11-16 18:17:04,5,3\n' + "2023-11-16 18:17:05,5,3\n" * 8000)
    with pytest.raises(TraceLineError) as err:
        list(read_trace(path, "azure", BadLines("skip")))
    assert err.value.line == 3 and str(err.value).startswith(f"{path}:3: CSV row")


def test_huge_and_non_numeric_lengths_are_bad_lines_naming_the_field(tmp_path: Path) -> None:
    csv_path = _write(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:17:03,5,3\n"
                      "2023-11-16 18:17:04,99999999999999999999999,3\n"
                      "2023-11-16 18:17:05,12.5,3\n")
    bad = BadLines()
    assert [r.line for r in read_trace(csv_path, "azure", bad)] == [2]
    assert bad.first[0].endswith(":3: ContextTokens: 99999999999999999999999 tokens is beyond "
                                 "16777216; a corrupt value?")
    assert bad.first[1].endswith(":4: ContextTokens: expected a non-negative integer, got '12.5'")
    mc = _write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": 1e23, "output_length": 2}\n'
                '{"timestamp": 1, "input_length": 10, "output_length": 2}\n')
    bad = BadLines()
    assert [r.line for r in read_trace(mc, "mooncake", bad)] == [2]
    assert "input_length" in bad.first[0] and "beyond" in bad.first[0]


def test_non_utf8_json_line_is_bad_not_silently_altered(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine", "timestamp": 1}\n'
                     b'{"prompt": "caf\xe9 latte", "timestamp": 2}\n')
    bad = BadLines()
    records = list(read_trace(path, "prompts", bad))
    assert [(r.line, r.prompt) for r in records] == [(1, "fine")]
    assert bad.num_bad == 1 and ":2: not JSON" in bad.first[0] and "UTF-8" in bad.first[0]


def test_timestamps_that_are_not_numbers_are_bad_lines(tmp_path: Path) -> None:
    mc = _write(tmp_path, "m.jsonl", '{"timestamp": true, "input_length": 10, "output_length": 2}\n'
                '{"timestamp": 5, "input_length": 10, "output_length": 2}\n')
    bad = BadLines()
    assert [r.line for r in read_trace(mc, "mooncake", bad)] == [2]
    assert bad.first[0].endswith(":1: timestamp: expected a number, got True")
    prompts = _write(tmp_path, "p.jsonl", '{"prompt": "a", "timestamp": 1.5}\n'
                     '{"prompt": "b", "timestamp": "noon"}\n{"prompt": "c"}\n')
    bad = BadLines()
    got = [(r.line, r.timestamp_s) for r in read_trace(prompts, "prompts", bad)]
    assert got == [(1, 1.5), (3, None)]  # was: line 2 kept with its timestamp dropped
    assert bad.first[0].endswith(":2: timestamp: expected a number, got 'noon'")
