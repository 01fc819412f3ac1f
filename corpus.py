"""Your documents, tokenized once per machine: the files of a split, read with one line for each bad one,
tokenized in pieces by the tokenizer's Rust batch path (every core), into what every rank memory-maps:
tokens.bin, every document's ids end to end as raw uint16/uint32 (nanoGPT's np.memmap shards), and
starts.npy, where each document begins (Megatron's .idx). Plain numpy, not datasets' Arrow: a window
is then a slice by offset, and our own readers can name the file and line of a bad record. The copy
lives in cache_folder/<key>/, the key a hash of the files (path, size, mtime) and the tokenizer: a
change in either is a new key, so a new build.
"""

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")  # .txt: a document per file; the others a record each
PIECE = 1 << 16  # characters: a longer document is tokenized in pieces, cut where CUT matches
CUT = re.compile(r"\n(?=\S)")  # a line end before a non-space: byte-level BPE's pre-tokenizers split there
BATCH = 1 << 22  # characters a tokenizer call takes, across pieces: bounds the build's memory
FORMAT = 1  # of the files below; part of the key


class DataError(ValueError):
    """What stops a run before any work: data that cannot give batches, named with its file and where."""


@dataclass
class Tokens:
    """One split's documents, tokenized: document i is ids[starts[i] : starts[i + 1]]."""
    ids: np.ndarray  # memory-mapped
    starts: np.ndarray
    key: str  # the files' and tokenizer's hash: what a resume compares
    skipped: int  # empty and null documents
    built: float | None  # seconds the build took; None: read from the cache


# -----------------------------------------------------------------------------
# where a split's documents are: files, or a datasets folder (save_to_disk)

def splits_of(path: str, key: str = "data.path") -> dict:
    """{split: its files (sorted) or a datasets.Dataset}: a file or glob is one split, "train"; a folder
    written by save_to_disk has its own; any other folder's splits come from its file names, as
    datasets' load_dataset reads a Hub snapshot (data/train-00000-of-00002.parquet, ...)."""
    import datasets
    from datasets.data_files import DataFilesDict, get_data_patterns

    folder = Path(path)
    if any((folder / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        saved = datasets.load_from_disk(path)
        return dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}
    if folder.is_dir():
        try:
            found = DataFilesDict.from_patterns(get_data_patterns(path), base_path=path)
        except FileNotFoundError:  # datasets' EmptyDatasetError: no file at all
            found = {}
        splits = {str(name): sorted(Path(f) for f in files if Path(f).suffix in SUFFIXES) for name, files in found.items()}
    else:
        splits = {"train": sorted(p for p in map(Path, glob.glob(path)) if p.suffix in SUFFIXES and p.is_file())}
    splits = {name: files for name, files in splits.items() if files}
    if not splits:
        raise DataError(f"{key} = {path!r} matches no {', '.join(SUFFIXES)} file")
    for name, files in splits.items():
        if len({p.suffix.replace(".jsonl", ".json") for p in files}) > 1:
            raise DataError(f"{key} = {path!r} mixes {' and '.join(sorted({p.suffix for p in files}))} files in its "
                            f"{name} split: give one kind")
    return splits


# -----------------------------------------------------------------------------
# reading documents: each one's text, or None (null); a bad record is one line naming its file and where

def read_documents(source, field: str):
    if not isinstance(source, list):  # a datasets.Dataset
        require_field(field, source.column_names, "the datasets folder")
        for batch in source.select_columns([field]).iter(batch_size=1000):
            yield from (check_text(text, field, "the datasets folder") for text in batch[field])
        return
    for file in source:
        yield from {".txt": read_txt, ".parquet": read_parquet}.get(file.suffix, read_json)(file, field)


def read_txt(file: Path, field: str):
    data = file.read_bytes()
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: the bytes at offset {e.start:,} ({data[e.start:e.start + 4]!r}...) are not "
                        "UTF-8; convert the file, e.g. iconv -f latin1 -t utf-8") from None


def read_json(file: Path, field: str):
    """A JSON array of records, or JSON lines (.jsonl, or a .json that is not an array)."""
    with open(file, encoding="utf-8") as f:
        try:
            if f.read(4096).lstrip().startswith("["):
                f.seek(0)
                try:
                    records = json.load(f)
                except json.JSONDecodeError as e:
                    raise DataError(f"{file}:{e.lineno}: not valid JSON ({e.msg})") from None
                yield from (record_text(r, field, f"{file}: record {i + 1}") for i, r in enumerate(records))
                return
            f.seek(0)
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{file}:{number}: not a JSON record ({e.msg}, column {e.colno})") from None
                    yield record_text(record, field, f"{file}:{number}")
        except UnicodeDecodeError as e:
            raise DataError(f"{file}: bytes that are not UTF-8 ({e.object[e.start:e.start + 4]!r}...) in the "
                            f"{f.tell():,} bytes read; JSON is UTF-8") from None


def read_parquet(file: Path, field: str):
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(file)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError
        raise DataError(f"{file} is not a parquet file pyarrow reads: {str(e).splitlines()[0]}") from None
    require_field(field, table.schema_arrow.names, str(file))
    for batch in table.iter_batches(batch_size=1000, columns=[field]):
        yield from (check_text(text, field, str(file)) for text in batch.column(0).to_pylist())


def record_text(record, field: str, where: str):
    require_field(field, list(record) if isinstance(record, dict) else None, where)
    return check_text(record[field], field, where)


def require_field(field: str, fields, where: str) -> None:
    if fields is None:
        raise DataError(f"{where} is not a JSON object with a {field!r} field")
    if field not in fields:
        raise DataError(f"{where} has no {field!r} field (its fields: {', '.join(fields)}); name yours with "
                        "data.text_field")


def check_text(text, field: str, where: str):
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: {field} is a {type(text).__name__}, not text")
    return text


# -----------------------------------------------------------------------------
# tokenized once

def tokenized(source, field: str, tokenizer, cache_folder: str) -> Tokens:
    """`source`'s documents tokenized (each with its tokenizer's special tokens and an EOS): read from
    cache_folder, or built there first. One process of a machine builds; the others wait on a lock."""
    key = fingerprint(source, field, tokenizer)
    folder = Path(cache_folder) / key
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            built = None if (folder / "meta.json").is_file() else build(source, field, tokenizer, folder)
    except OSError as e:
        raise DataError(f"data.cache_folder = {cache_folder!r} cannot hold the tokenized copy: {e.strerror or e}") from None
    meta = json.loads((folder / "meta.json").read_text())
    ids = np.memmap(folder / "tokens.bin", dtype=meta["dtype"], mode="r") if meta["tokens"] else np.zeros(0, np.uint16)
    return Tokens(ids, np.load(folder / "starts.npy", mmap_mode="r"), key, meta["skipped"], built)


def fingerprint(source, field: str, tokenizer) -> str:
    """A hash of every file's path, size and modification time, the text field, and the tokenizer."""
    files = source if isinstance(source, list) else [p for f in source.cache_files for p in Path(f["filename"]).parent.iterdir()]
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(files)]
    vocabulary = "bytes" if tokenizer == "bytes" else tokenizer.backend_tokenizer.to_str()
    text = json.dumps([FORMAT, field, stats, vocabulary, special_tokens(tokenizer), cuts_cleanly(tokenizer)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(source, field: str, tokenizer, folder: Path) -> float:
    """Tokenize in batches of pieces, appending to tokens.bin; then starts.npy and meta.json, and the
    folder renamed into place: a build cut short leaves no folder a later run would read."""
    start, piece = time.perf_counter(), PIECE if cuts_cleanly(tokenizer) else None
    prefix, suffix = (np.array(ids, np.int64) for ids in special_tokens(tokenizer))
    dtype = np.uint16 if vocabulary_size(tokenizer) <= 1 << 16 else np.uint32
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    lengths, skipped, batch, chars = [], 0, [], 0  # batch: (piece, its document, its first piece?, last?)
    with open(tmp / "tokens.bin", "wb") as out:
        def flush():
            for (_, doc, first, last), ids in zip(batch, encode(tokenizer, [text for text, *_ in batch])):
                ids = np.concatenate([prefix] * first + [ids] + [suffix] * last)
                lengths[doc] += len(ids)
                out.write(ids.astype(dtype).tobytes())
            batch.clear()

        for text in read_documents(source, field):
            if not text:
                skipped += 1
                continue
            lengths.append(0)
            parts = pieces(text, piece)
            for i, part in enumerate(parts):
                batch.append((part, len(lengths) - 1, i == 0, i == len(parts) - 1))
                chars += len(part)
                if chars >= BATCH:
                    flush()
                    chars = 0
        flush()
    np.save(tmp / "starts.npy", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    (tmp / "meta.json").write_text(json.dumps({"dtype": np.dtype(dtype).name, "documents": len(lengths),
                                               "tokens": int(sum(lengths)), "skipped": skipped}))
    os.replace(tmp, folder)
    return time.perf_counter() - start


def pieces(text: str, size: int | None) -> list[str]:
    """`text` cut into pieces of about `size` characters where CUT matches (None: whole)."""
    parts, start = [], 0
    while size and len(text) - start > size and (cut := CUT.search(text, start + size)):
        parts.append(text[start : cut.end()])
        start = cut.end()
    return parts + [text[start:]]


def encode(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each text's ids without special tokens: UTF-8 bytes, or the tokenizer's batch path on every core."""
    if tokenizer == "bytes":
        return [np.frombuffer(text.encode(), np.uint8).astype(np.int64) for text in texts]
    return [np.array(e.ids, np.int64) for e in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before a document, ids after it): those its tokenizer adds (Llama's BOS), then its EOS."""
    if tokenizer == "bytes":
        return [], []
    plain, full = tokenizer("x", add_special_tokens=False)["input_ids"], tokenizer("x")["input_ids"]
    at = next(i for i in range(len(full)) if full[i : i + len(plain)] == plain)
    prefix, suffix, eos = full[:at], full[at + len(plain) :], tokenizer.eos_token_id
    return prefix, suffix + [eos] if eos is not None and suffix[-1:] != [eos] else suffix


PROBE = "def f(x):\n    return x\n\n\nclass A:\n\tpass\n# done.\n\n  end\n"


def cuts_cleanly(tokenizer) -> bool:
    """Whether pieces cut at CUT give the whole text's ids (byte-level BPE: yes; SentencePiece's
    Metaspace, which marks a text's start: no, so its documents are tokenized whole)."""
    whole = encode(tokenizer, [PROBE])[0]
    return bool(np.array_equal(np.concatenate(encode(tokenizer, pieces(PROBE, 1))), whole))


def vocabulary_size(tokenizer) -> int:
    return 256 if tokenizer == "bytes" else len(tokenizer)
