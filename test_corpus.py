"""Your text at a real size: tokenized once into a memory map (the ids of each document whole, however
long), reused until its files or tokenizer change; the layouts users have (a Hub snapshot's splits, a
DatasetDict, another text field); shuffled epochs; a resume into changed files refused. Bad files:
test_documents.py's one-line inputs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import tokens
from harness import DpMesh, make_documents, make_tokenizer

CFG = {"training": {"seed": 42, "seq_len": 64, "local_batch_size": 2, "global_batch_size": -1},
       "parallelism": {"dp_shard": 1}}


def data_keys(tmp_path: Path, path, tokenizer, **keys) -> dict:
    return {"path": str(path), "split": "train", "text_field": "text", "tokenizer": str(tokenizer),
            "cache_folder": str(tmp_path / "cache"), "max_bytes": 1_000_000, **keys}


def documents_of(docs: "data.Documents") -> list[np.ndarray]:
    starts = np.asarray(docs.tokens.starts)
    return [np.asarray(docs.tokens.ids[starts[d] : starts[d + 1]]) for d in docs.docs]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


PROSE = "".join(f"Paragraph {i} says a few words.\nIt goes on a line.\n\n\nThen a new one starts.\n\n" for i in range(200))


def test_a_long_document_is_read_and_tokenized_in_pieces_with_the_ids_of_the_whole(tmp_path, monkeypatch):
    """A .txt read in blocks of 1,000 bytes (characters cut by a block's end), tokenized in pieces of about 300
    characters, gives the whole text's ids, BOS once and an EOS, with a GPT-2-style tokenizer that merges
    "\n\n": a cut after it, before a word, would change the ids, and the probe (cuts_cleanly) catches that
    cut. A SentencePiece-style tokenizer (Metaspace marks a text's start), whose pieces would differ, is whole."""
    import re

    import documents
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(make_tokenizer(tmp_path / "gpt2", 600, PROSE))
    tokens_of = lambda text: tokenizer.backend_tokenizer.encode(text).tokens  # noqa: E731
    assert tokens_of("x.\n\n")[-1] == "ĊĊ" != tokens_of("x.\n\nThen")[-2]
    monkeypatch.setattr(documents, "BLOCK", 1000)
    monkeypatch.setattr(tokens, "PIECE", 300)
    monkeypatch.setattr(tokens, "BATCH", 1000)  # several tokenizer calls, a document across them
    text = Path(json.__file__).read_text() + "Caf\u00e9 \u00fcber na\u00efve, \u20ac5\n" * 300 + PROSE  # 46 KB
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "empty.txt").write_text("")
    assert len(list(tokens.pieces([text], tokens.PIECE))) > 50 and tokens.cuts_cleanly(tokenizer)
    long = tokens.tokenized(sorted(tmp_path.glob("*.txt")), "text", tokenizer, str(tmp_path / "cache"))
    [ids] = documents_of(data.Documents(long, np.arange(1)))
    assert ids.tolist() == tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert long.skipped == 1 and ids.dtype == np.uint16
    monkeypatch.setattr(tokens, "CUT", re.compile(r"\n(?=\S)"))  # a cut at any line end before a non-space
    assert not tokens.cuts_cleanly(tokenizer)

    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    metaspace.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    metaspace = PreTrainedTokenizerFast(tokenizer_object=metaspace, bos_token="<s>", eos_token="</s>")
    assert not tokens.cuts_cleanly(metaspace)
    [ids] = documents_of(data.Documents(tokens.tokenized([tmp_path / "long.txt"], "text", metaspace,
                                                         str(tmp_path / "cache")), np.arange(1)))
    assert ids.tolist() == metaspace(text)["input_ids"] + [metaspace.eos_token_id]


def test_the_tokenized_copy_is_read_again_and_rebuilt_when_the_files_or_tokenizer_change(tmp_path, tokenizer_folder):
    docs = make_documents(tmp_path / "docs.jsonl", count=30)
    first = data.prepare(data_keys(tmp_path, docs, tokenizer_folder), "", 1000, 2, 64)
    again = data.prepare(data_keys(tmp_path, docs, tokenizer_folder), "", 1000, 2, 64)
    assert first.train.tokens.built is not None and again.train.tokens.built is None
    assert first.train.tokens.key == again.train.tokens.key
    assert [d.tolist() for d in documents_of(first.train)] == [d.tolist() for d in documents_of(again.train)]
    other_tokenizer = data.prepare(data_keys(tmp_path, docs, "bytes"), "", 1000, 2, 64)
    docs.write_text(docs.read_text() + json.dumps({"text": "one more document"}) + "\n")
    changed = data.prepare(data_keys(tmp_path, docs, tokenizer_folder), "", 1000, 2, 64)
    assert len({first.train.tokens.key, other_tokenizer.train.tokens.key, changed.train.tokens.key}) == 3
    assert changed.train.tokens.built is not None and len(changed.train) + len(changed.held_out) == 31


def test_a_snapshot_folder_trains_on_train_validates_on_validation_and_never_reads_test(tmp_path):
    """Hub file names give the splits; the test split is a file pyarrow cannot read, so reading it fails."""
    import datasets

    snapshot = tmp_path / "snapshot" / "data"
    snapshot.mkdir(parents=True)
    texts = {split: [f"{split} document {i} " * (i + 3) for i in range(n)] for split, n in (("train", 30), ("validation", 4))}
    for split, rows in texts.items():
        datasets.Dataset.from_dict({"content": rows}).to_parquet(str(snapshot / f"{split}-00000-of-00001.parquet"))
    (snapshot / "test-00000-of-00001.parquet").write_bytes(b"not parquet")
    got = data.prepare(data_keys(tmp_path, snapshot.parent, "bytes", text_field="content"), "", 256, 2, 64)
    assert [bytes(d.astype(np.uint8)).decode() for d in documents_of(got.train)] == texts["train"]
    assert [bytes(d.astype(np.uint8)).decode() for d in documents_of(got.held_out)] == texts["validation"]
    assert got.held_out_from == "its validation split"
    windows, _ = data.training_batches(got, CFG)
    x, y, positions = next(windows)
    assert x.shape == y.shape == positions.shape == (2, 64)

    saved = tmp_path / "saved"  # load_dataset(...).save_to_disk(...): a DatasetDict folder
    datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": rows, "id": list(range(len(rows)))})
                          for split, rows in texts.items()}).save_to_disk(str(saved))
    got = data.prepare(data_keys(tmp_path, saved, "bytes"), "", 256, 2, 64)
    assert [bytes(d.astype(np.uint8)).decode() for d in documents_of(got.train)] == texts["train"]
    assert len(got.held_out) == 4 and next(data.training_batches(got, CFG)[0])[0].shape == (2, 64)


def test_one_document_trains_and_a_validation_path_holds_out(tmp_path):
    """A corpus of under 10 documents holds none out (validation.path would); one document is enough.
    The data line counts the empty and null documents skipped."""
    import report

    (tmp_path / "book.txt").write_text("a line of a book\n" * 200)
    (tmp_path / "blank.txt").write_text("")
    (tmp_path / "held.jsonl").write_text(json.dumps({"text": "held out " * 50}) + "\n" + json.dumps({"text": None}) + "\n")
    keys = data_keys(tmp_path, tmp_path / "*.txt", "bytes")
    alone = data.prepare(keys, "", 256, 2, 64)
    assert len(alone.train) == 1 and alone.held_out is None
    line = report.data_line({"data": keys, **CFG}, alone, data.training_batches(alone, CFG)[1])
    assert "data: 1 documents, 3,400 tokens (100.0% targets) of " in line and "(train; 1 empty or null skipped)" in line, line
    assert "held out: none (every 10th document of 1: set validation.path)" in line, line
    held = data.prepare(data_keys(tmp_path, tmp_path / "book.txt", "bytes"), str(tmp_path / "held.jsonl"), 256, 2, 64)
    assert len(held.train) == 1 and len(held.held_out) == 1 and held.held_out_from == "validation.path"


def test_shuffled_epochs_differ_and_dp_ranks_share_one_processs_global_batch(tmp_path):
    """Epoch 0's and 1's orders differ, each holds every training document once; on dp 2 the ranks' rows
    are one process's global batch; a resumed stream (set_state) gives the same windows."""
    rows = [f"document {i}: " + "x" * (i % 7 + 1) for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    got = data.prepare(data_keys(tmp_path, tmp_path / "docs.jsonl", "bytes"), "", 256, 2, 64)
    windows = data.Windows(got.train, 2, 64, seed=42)
    orders = [windows.order(epoch)[0] for epoch in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(36)) and not np.array_equal(*orders)

    whole_stream = data.Windows(got.train, 4, 64, seed=42)
    one = iter(whole_stream)
    ranks = [iter(data.Windows(got.train, 2, 64, DpMesh(rank), seed=42)) for rank in (0, 1)]
    for _ in range(12):  # several epochs of 30 tokens a document
        whole = next(one)
        for rank, it in enumerate(ranks):
            for a, b in zip(next(it), whole):
                assert torch.equal(a, b[2 * rank : 2 * rank + 2])
    resumed = data.Windows(got.train, 4, 64, seed=42)
    resumed.set_state(whole_stream.get_state())
    for a, b in zip(iter(resumed), [next(one) for _ in range(3)]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_resume_into_changed_files_is_refused_in_one_line(tmp_path):
    """The checkpoint records the tokenized copy's key (a hash of the files and tokenizer)."""
    from checkpoint import MARKER, CheckpointError, require_same_run, run_record
    from conftest import small_config

    cfg = small_config()
    saved, now = data.Windows.__new__(data.Windows), data.Windows.__new__(data.Windows)
    saved.key, now.key = "0123456789abcdef", "fedcba9876543210"
    (tmp_path / MARKER).write_text(json.dumps({"step": 1, "files": {}, "run": run_record(cfg, saved)}))
    require_same_run(tmp_path, cfg, print, position=saved)
    with pytest.raises(CheckpointError, match="was written with data.tokenized = '0123456789abcdef', this run has "
                       "'fedcba9876543210'"):
        require_same_run(tmp_path, cfg, print, position=now)


# the data path's silent errors, each closed -------------------------------------------------------------

def test_a_glob_with_double_star_reaches_every_depth(tmp_path):
    for depth in range(4):
        folder = tmp_path.joinpath("corpus", *["sub"] * depth)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"part{depth}.jsonl").write_text(json.dumps({"text": f"depth {depth}"}) + "\n")
    [(_, files)] = data.splits_of(str(tmp_path / "corpus" / "**" / "*.jsonl")).items()
    assert [f.name for f in files] == ["part0.jsonl", "part1.jsonl", "part2.jsonl", "part3.jsonl"]


def test_the_tokenized_copy_follows_the_files_bytes(tmp_path, tokenizer_folder):
    """A file replaced by one of the same size and modification time (rsync -a, cp -p) is tokenized again;
    the same bytes copied to another folder are not."""
    import os
    import shutil

    (tmp_path / "a").mkdir()
    docs = make_documents(tmp_path / "a" / "docs.jsonl", count=30)
    first = data.prepare(data_keys(tmp_path, docs, tokenizer_folder), "", 1000, 2, 64)
    stat = docs.stat()
    docs.write_text(docs.read_text().replace("a", "b"))  # same size
    os.utime(docs, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert docs.stat().st_size == stat.st_size and docs.stat().st_mtime_ns == stat.st_mtime_ns
    replaced = data.prepare(data_keys(tmp_path, docs, tokenizer_folder), "", 1000, 2, 64)
    assert replaced.train.tokens.built is not None and replaced.train.tokens.key != first.train.tokens.key
    assert [d.tolist() for d in documents_of(replaced.train)] != [d.tolist() for d in documents_of(first.train)]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copied = data.prepare(data_keys(tmp_path, tmp_path / "b" / "docs.jsonl", tokenizer_folder), "", 1000, 2, 64)
    assert copied.train.tokens.built is None and copied.train.tokens.key == replaced.train.tokens.key


def test_a_build_killed_before_does_not_stop_a_later_start(tmp_path):
    """What a build killed mid-way left, under the name a restarted container's process (same host name,
    same pid) would build in, is removed; the copy is built."""
    import socket

    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a document " * 40}) + "\n")
    (tmp_path / "cache").mkdir()
    key = tokens.fingerprint([tmp_path / "docs.jsonl"], "text", "bytes", tmp_path / "cache")
    left = tmp_path / "cache" / f"{key}.tmp-{socket.gethostname()}-{__import__('os').getpid()}"
    left.mkdir(parents=True)
    (left / "tokens.bin").write_bytes(b"half a build")
    got = tokens.tokenized([tmp_path / "docs.jsonl"], "text", "bytes", str(tmp_path / "cache"))
    assert got.built is not None and len(got.ids) == 440 and not left.exists()


def test_a_txt_file_is_read_in_bounded_memory(tmp_path, monkeypatch):
    """A .txt read in blocks of 1 MiB and tokenized in batches of 1M characters: Python's peak allocation
    during the build is the same for 8 and 32 MiB files, under the 32 MiB file's size (read whole, its
    bytes and text alone take twice that)."""
    import tracemalloc

    import documents

    monkeypatch.setattr(documents, "BLOCK", 1 << 20)
    monkeypatch.setattr(tokens, "BATCH", 1 << 20)
    line, peaks = "a line of a long book, one of many\n", []
    for mib in (8, 32):
        (tmp_path / f"{mib}.txt").write_text(line * ((mib << 20) // len(line)))
        tracemalloc.start()
        got = tokens.tokenized([tmp_path / f"{mib}.txt"], "text", "bytes", str(tmp_path / "cache"))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert len(got.ids) == (mib << 20) // len(line) * len(line)
    assert peaks[1] < 1.25 * peaks[0] and peaks[1] < 32 << 20, f"peaks {peaks[0] / 2**20:.1f}, {peaks[1] / 2**20:.1f} MiB"


def test_truncation_and_padding_in_tokenizer_json_are_off(tmp_path, tokenizer_folder):
    """A tokenizer.json saved with truncation to 8 ids and padding: a fresh tokenizer's pieces keep every id."""
    from transformers import AutoTokenizer

    config = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    config["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    config["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 1,
                         "pad_type_id": 0, "pad_token": "</s>"}
    (tmp_path / "truncating").mkdir()
    (tmp_path / "truncating" / "tokenizer.json").write_text(json.dumps(config))
    (tmp_path / "truncating" / "tokenizer_config.json").write_text((tokenizer_folder / "tokenizer_config.json").read_text())
    text = Path(json.__file__).read_text()[:2000]
    whole = AutoTokenizer.from_pretrained(tokenizer_folder)(text, add_special_tokens=False)["input_ids"]
    [(ids, _)] = tokens.encode(AutoTokenizer.from_pretrained(tmp_path / "truncating"), [text])
    assert ids.tolist() == whole and len(whole) > 16


def test_ids_wider_than_16_bits_are_kept(tmp_path):
    """A vocabulary of a few ids, one of them 70,000: the copy is uint32 and holds it (uint16 would wrap it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "small": 2, "big": 70_000}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>", unk_token="<unk>")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "small big small"}) + "\n")
    got = tokens.tokenized([tmp_path / "docs.jsonl"], "text", tokenizer, str(tmp_path / "cache"))
    assert got.ids.dtype == np.uint32 and got.ids.tolist() == [2, 70_000, 2, 1] and tokens.vocabulary_size(tokenizer) == 70_001
