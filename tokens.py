"""Your documents tokenized once per machine, in pieces by the tokenizer's Rust batch path (every core),
into what every rank memory-maps: tokens.bin, each document's ids end to end as raw uint16/uint32
(nanoGPT's np.memmap shards), and starts.npy, where each document begins (Megatron's .idx). Plain
numpy, not datasets' Arrow: a window is then a slice by offset. The copy lives in cache_folder/<key>/,
the key a hash of the files (path, size, mtime) and the tokenizer: a change in either, a new build.
"""

import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from documents import DataError, read_documents

PIECE = 1 << 16  # characters: a longer document is tokenized in pieces, cut where CUT matches
CUT = re.compile(r"\n(?=\S)")  # a line end before a non-space: byte-level BPE's pre-tokenizers split there
BATCH = 1 << 22  # characters a tokenizer call takes, across pieces: bounds the build's memory
FORMAT = 1  # of the files below; part of the key


@dataclass
class Tokens:
    """One split's documents, tokenized: document i is ids[starts[i] : starts[i + 1]]."""
    ids: np.ndarray  # memory-mapped
    starts: np.ndarray
    key: str  # the files' and tokenizer's hash: what a resume compares
    skipped: int  # empty and null documents
    built: float | None  # seconds the build took; None: read from the cache


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
    folder renamed into place: a build cut short leaves no folder a later run would read (only its .tmp-*)."""
    start, piece = time.perf_counter(), PIECE if cuts_cleanly(tokenizer) else None
    prefix, suffix = (np.array(ids, np.int64) for ids in special_tokens(tokenizer))
    dtype = np.uint16 if vocabulary_size(tokenizer) <= 1 << 16 else np.uint32
    tmp = folder.with_name(f"{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")  # its own, on a shared disk too
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
    try:
        os.replace(tmp, folder)
    except OSError:  # another node's build came first: the same ids
        shutil.rmtree(tmp)
        if not (folder / "meta.json").is_file():
            raise
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
