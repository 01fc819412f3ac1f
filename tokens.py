"""Your documents or conversations tokenized once per machine, in pieces by the tokenizer's Rust batch path
(every core), into what every rank memory-maps: tokens.bin, each one's ids end to end as raw uint16/uint32
(nanoGPT's np.memmap shards), and starts.npy, where each begins (Megatron's .idx); for conversations also
mask.bin, whether each token is a target (chat.py's spans), and targets.npy, their count in each. Plain
numpy, not datasets' Arrow: a window is then a slice by offset. The copy lives in cache_folder/<key>/,
the key a hash of the files' bytes and the tokenizer (its chat template too): a change in either, a new build.
"""

import copy
import fcntl
import functools
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

from chat import render
from documents import Conversation, DataError, read_documents

PIECE = 1 << 16  # characters: a longer document is tokenized in pieces, cut where CUT matches
CUT = re.compile(r"(?<=\S)\n(?=\S)")  # a lone line end between non-spaces: byte-level pre-tokenizers split there
BATCH = 1 << 22  # characters a tokenizer call takes, across pieces: bounds the build's memory
FORMAT = 2  # of the files below; part of the key


@dataclass
class Tokens:
    """One split's documents or conversations, tokenized: number i is ids[starts[i] : starts[i + 1]]."""
    ids: np.ndarray  # memory-mapped
    starts: np.ndarray
    key: str  # the files' and tokenizer's hash: what a resume compares
    skipped: int  # empty and null documents; conversations without an assistant turn to train
    built: float | None  # seconds the build took; None: read from the cache
    mask: np.ndarray | None = None  # conversations: whether each token is a target, memory-mapped
    targets: np.ndarray | None = None  # conversations: each one's count of targets


def tokenized(source, field: str, tokenizer, cache_folder: str) -> Tokens:
    """`source`'s documents tokenized (each with its tokenizer's special tokens and an EOS), or conversations
    as their chat template renders them: read from cache_folder, or built there first. One process of a
    machine hashes and builds; the others wait on its lock."""
    try:
        Path(cache_folder).mkdir(parents=True, exist_ok=True)
        with open(Path(cache_folder) / "lock", "w") as lock:  # this machine's
            fcntl.flock(lock, fcntl.LOCK_EX)
            folder = Path(cache_folder) / fingerprint(source, field, tokenizer, Path(cache_folder))
            built = None if (folder / "meta.json").is_file() else build(source, field, tokenizer, folder)
    except OSError as e:
        raise DataError(f"data.cache_folder = {cache_folder!r} cannot hold the tokenized copy: {e.strerror or e}") from None
    meta = json.loads((folder / "meta.json").read_text())
    mapped = lambda name, dtype: np.memmap(folder / name, dtype, "r") if meta["tokens"] else np.zeros(0, dtype)  # noqa: E731
    chats, starts = meta["conversations"], np.load(folder / "starts.npy", mmap_mode="r")
    return Tokens(mapped("tokens.bin", meta["dtype"]), starts, folder.name, meta["skipped"], built,
                  mapped("mask.bin", np.bool_) if chats else None, np.load(folder / "targets.npy") if chats else None)


def fingerprint(source, field: str, tokenizer, cache_folder: Path) -> str:
    """A hash of every file's bytes (in path order), the text field, and the tokenizer with its chat template."""
    files = source if isinstance(source, list) else [p for f in source.cache_files
                                                      for p in Path(f["filename"]).parent.iterdir()]  # a datasets folder
    vocabulary = "bytes" if tokenizer == "bytes" else plain_backend(tokenizer).to_str()
    text = json.dumps([FORMAT, field, content_hashes(sorted(files), cache_folder), vocabulary, special_tokens(tokenizer),
                       cuts_cleanly(tokenizer), getattr(tokenizer, "chat_template", None)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def content_hashes(files: list[Path], cache_folder: Path) -> list[str]:
    """Each file's SHA-256, read once per machine: cache_folder/hashes.json keeps it by the file's path, size,
    inode, mtime and ctime, which any write changes (rsync -a, cp -p and tar x keep mtime, not ctime)."""
    memo_file = cache_folder / "hashes.json"
    memo = json.loads(memo_file.read_text()) if memo_file.is_file() else {}
    stats = {p: os.stat(p) for p in files}
    keys = [json.dumps([str(p.resolve()), s.st_size, s.st_ino, s.st_mtime_ns, s.st_ctime_ns]) for p, s in stats.items()]
    new = {key: path for path, key in zip(files, keys) if key not in memo}
    for key, path in new.items():
        with open(path, "rb") as f:
            memo[key] = hashlib.file_digest(f, "sha256").hexdigest()
    if new:  # else every start of every rank would rewrite it
        tmp = memo_file.with_name(f"hashes.json.tmp-{socket.gethostname()}")  # on a shared disk, another node's
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_file)
    return [memo[key] for key in keys]


def build(source, field: str, tokenizer, folder: Path) -> float:
    """Tokenize in batches (`jobs`), appending to tokens.bin (and mask.bin); then starts.npy and meta.json,
    and the folder renamed into place: a build cut short leaves no folder a later run would read."""
    start, counts = time.perf_counter(), {"skipped": 0, "conversations": False}
    prefix, suffix = (np.array(ids, np.int64) for ids in special_tokens(tokenizer))
    dtype = np.dtype(np.uint16 if vocabulary_size(tokenizer) <= 1 << 16 else np.uint32)
    mine = f"{folder.name}.tmp-{socket.gethostname()}-"  # this machine's builds, on a shared disk too
    for killed in folder.parent.glob(mine + "*"):  # we hold this machine's lock: any other was cut short
        shutil.rmtree(killed)
    tmp = folder.with_name(mine + str(os.getpid()))
    tmp.mkdir()
    lengths, targets = [], []  # of each document or conversation
    with open(tmp / "tokens.bin", "wb") as out, open(tmp / "mask.bin", "wb") as mask_out:
        for batch in batches(jobs(source, field, tokenizer, counts)):
            chats = batch[0][4] is not None
            for (_, i, first, last, spans), (ids, offsets) in zip(batch, encode(tokenizer, [j[0] for j in batch], chats)):
                if ids.max(initial=0) > np.iinfo(dtype).max:
                    raise DataError(f"{tokenizer.name_or_path}'s tokenizer gives id {ids.max():,}, wider than {dtype.name}")
                ids = np.concatenate([prefix] * first + [ids] + [suffix] * last)
                out.write(ids.astype(dtype).tobytes())
                if i == len(lengths):  # its first piece
                    lengths.append(0)
                lengths[i] += len(ids)
                if chats:  # a whole conversation; the special tokens of a plain one
                    mask = np.concatenate([np.zeros(len(prefix) * first, bool), in_spans(offsets, spans),
                                           np.ones(len(suffix) * last, bool)])
                    targets.append(int(mask.sum()))
                    mask_out.write(mask.tobytes())
    np.save(tmp / "starts.npy", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    np.save(tmp / "targets.npy", np.array(targets, np.int64))
    (tmp / "meta.json").write_text(json.dumps({"dtype": dtype.name, "documents": len(lengths), "tokens": int(sum(lengths)),
                                               **counts}))
    try:
        os.replace(tmp, folder)
    except OSError:  # another node's build came first: the same ids
        shutil.rmtree(tmp)
        if not (folder / "meta.json").is_file():
            raise
    return time.perf_counter() - start


def jobs(source, field: str, tokenizer, counts: dict):
    """What to tokenize, in order: (text, its document's number, prefix?, suffix?, target spans or None):
    a document in pieces (cut if the tokenizer cuts cleanly), a conversation whole (chat.render). Counts
    what is skipped (empty or null; no assistant turn to train), and whether these are conversations."""
    piece, number = PIECE if cuts_cleanly(tokenizer) else None, 0
    for item in read_documents(source, field):
        if isinstance(item, Conversation):
            counts["conversations"] = True
            if not item.trained:
                counts["skipped"] += 1
                continue
            text, spans, plain = render(item, tokenizer)
            yield text, number, plain, plain, spans
            number += 1
            continue
        parts = pieces([item] if isinstance(item, str) else item or [], piece)
        part, first = next(parts), True
        if not part:
            counts["skipped"] += 1
            continue
        for after in parts:  # one piece behind: the last one takes the suffix
            yield part, number, first, False, None
            part, first = after, False
        yield part, number, first, True, None
        number += 1


def batches(jobs):
    """`jobs` in lists of BATCH characters or more."""
    batch, chars = [], 0
    for job in jobs:
        batch.append(job)
        chars += len(job[0])
        if chars >= BATCH:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def pieces(chunks, size: int | None):
    """The text of `chunks` (strings read in turn) in pieces of about `size` characters, cut where CUT
    matches (None: whole); empty text gives one empty piece."""
    if size is None:
        yield "".join(chunks)
        return
    rest = ""
    for chunk in chunks:
        rest, start = rest + chunk, 0
        while len(rest) - start > size and (cut := CUT.search(rest, start + size)):
            yield rest[start : cut.end()]
            start = cut.end()
        rest = rest[start:]
    yield rest


def in_spans(offsets: np.ndarray, spans: list) -> np.ndarray:
    """Whether each token, by its characters [start, end), holds a character of a span (as transformers'
    assistant masks): a header's last token or the line end after an end-of-turn token does not."""
    starts, ends = np.array(spans).T
    last = np.searchsorted(starts, offsets[:, 1], side="left") - 1  # the last span that starts before the token ends
    return (last >= 0) & (offsets[:, 0] < ends[np.maximum(last, 0)])


def encode(tokenizer, texts: list[str], offsets: bool = False) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Each text's ids without special tokens, and with `offsets` each token's [start, end) characters: UTF-8
    bytes, or the tokenizer's batch path on every core (plain_backend's)."""
    if tokenizer == "bytes":
        ids = [np.frombuffer(text.encode(), np.uint8).astype(np.int64) for text in texts]
        chars = [np.repeat(np.arange(len(t)), [len(c.encode()) for c in t]) for t in texts] if offsets else ids
        return [(i, np.stack([c, c + 1], 1) if offsets else None) for i, c in zip(ids, chars)]
    backend = plain_backend(tokenizer)
    if not offsets:
        return [(np.array(e.ids, np.int64), None) for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return [(np.array(e.ids, np.int64), np.array(e.offsets, np.int64).reshape(-1, 2))
            for e in backend.encode_batch(texts, add_special_tokens=False)]


@functools.lru_cache(maxsize=4)
def plain_backend(tokenizer):
    """A copy of the tokenizer's Rust tokenizer with truncation and padding off, whatever its tokenizer.json
    says: transformers turns them off only once the tokenizer is called."""
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.no_truncation()
    backend.no_padding()
    return backend


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before a document, ids after it): those its tokenizer adds (Llama's BOS), then its EOS."""
    if tokenizer == "bytes":
        return [], []
    plain, full = tokenizer("x", add_special_tokens=False)["input_ids"], tokenizer("x")["input_ids"]
    at = next(i for i in range(len(full)) if full[i : i + len(plain)] == plain)
    prefix, suffix, eos = full[:at], full[at + len(plain) :], tokenizer.eos_token_id
    return prefix, suffix + [eos] if eos is not None and suffix[-1:] != [eos] else suffix


PROBE = "def f(x):\n    return x\n\n\nclass A:\n\tpass\n# done.\n\nThe end\n\n  end\nof it. And\r\nmore\n"


def cuts_cleanly(tokenizer) -> bool:
    """Whether pieces cut at CUT give the whole text's ids (byte-level BPE: yes; SentencePiece's
    Metaspace, which marks a text's start: no, so its documents are tokenized whole)."""
    whole = encode(tokenizer, [PROBE])[0][0]
    return bool(np.array_equal(np.concatenate([ids for ids, _ in encode(tokenizer, list(pieces([PROBE], 1)))]), whole))


def vocabulary_size(tokenizer) -> int:
    """The largest id it gives, plus one."""
    return 256 if tokenizer == "bytes" else max(tokenizer.get_vocab().values()) + 1
