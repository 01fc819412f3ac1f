"""What the model trains on: the standard library's bytes (the default), or your documents or conversations
(`data.path`), tokenized once (tokens.py). Documents are packed end to end into windows whose `position_ids`
restart at every document (model.forward_logits builds block-causal masks from them); conversations are
packed whole, best fit, their targets the assistant's tokens (chat.py). Each epoch in a new seeded order.
Held out: validation.path, else the corpus' validation split, else every 10th document from the 10th.
"""

import bisect
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from config import global_batch_size
from documents import DataError, splits_of
from tokens import Tokens, tokenized, vocabulary_size

IGNORED = -100  # F.cross_entropy's ignore_index


@dataclass
class Documents:
    tokens: Tokens
    docs: np.ndarray  # which of its documents, in their order

    def __len__(self) -> int:
        return len(self.docs)

    def lengths(self) -> np.ndarray:
        starts = np.asarray(self.tokens.starts)
        return starts[self.docs + 1] - starts[self.docs]

    def conversations(self) -> bool:
        return self.tokens.mask is not None

    def windows(self, batch_size: int, seq_len: int, dp_mesh=None, seed: int | None = None):
        """Its batches: documents end to end (Windows), conversations whole (Packed)."""
        return (Packed if self.conversations() else Windows)(self, batch_size, seq_len, dp_mesh, seed)

    def trained(self, seq_len: int) -> tuple[int, int, int, int]:
        """(tokens, targets, how many are cut, of those how many left out) of what trains: documents whole;
        conversations' first seq_len tokens, those with a target in them (Packed's)."""
        lengths = self.lengths()
        if not self.conversations():
            return int(lengths.sum()), int(lengths.sum()) - len(self), 0, 0  # a document's first token is no target
        targets = self.targets_within(seq_len)
        return (int(np.minimum(lengths, seq_len)[targets > 0].sum()), int(targets.sum()), int((lengths > seq_len).sum()),
                int((targets == 0).sum()))

    def targets_within(self, seq_len: int) -> np.ndarray:
        """Conversations': each one's targets in its first seq_len tokens."""
        targets, cut = self.tokens.targets[self.docs].copy(), np.flatnonzero(self.lengths() > seq_len)
        first = np.asarray(self.tokens.starts)[self.docs[cut]]
        targets[cut] = [int(self.tokens.mask[f : f + seq_len].sum()) for f in first]
        return targets


@dataclass
class Corpus:
    train: object  # the standard library's bytes (a tensor) or your Documents
    held_out: object  # the same, or None
    tokenizer: object = "bytes"  # or transformers' tokenizer
    source: str = "bytes"  # the tokenizer's folder
    held_out_from: str = "every 10th file"


def prepare(d: dict, validation_path: str, vocab_size: int, batch_size: int, seq_len: int) -> Corpus:
    """[data] checked against the model's vocabulary and one global batch (`batch_size` windows of seq_len), on
    every rank before any process group (each problem one DataError line); your documents tokenized, or read
    from the cache."""
    source, path = d["tokenizer"], d["path"]
    if not path:
        if source and source != "bytes":
            raise DataError(f"data.path is empty: the standard library's bytes, as ids 0-255, mean nothing to {source}'s "
                            f"vocabulary of {vocab_size:,}; set data.path to your documents, or data.tokenizer = "
                            "bytes to train on those ids anyway")
        require_vocabulary(256, "bytes", vocab_size)
        if validation_path:
            raise DataError(f"validation.path = {validation_path!r} needs data.path: the standard library's bytes "
                            "hold out every 10th file")
        return Corpus(*load_stdlib_bytes(d["max_bytes"]))
    if not source:
        raise DataError(f"data.path = {path!r} needs a tokenizer: set data.tokenizer to a folder with "
                        "tokenizer.json, or bytes (ids 0-255)")
    tokenizer = load_tokenizer(source)
    require_vocabulary(vocabulary_size(tokenizer), source, vocab_size)
    read = lambda split: tokenized(split, d["text_field"], tokenizer, d["cache_folder"])  # noqa: E731
    splits = splits_of(path)
    if d["split"] not in splits:
        raise DataError(f"data.path = {path!r} has no {d['split']!r} split (its splits: {', '.join(splits)}); set data.split")
    held, how = held_out_split(splits, d["split"], validation_path)
    train = read(splits[d["split"]])
    if held is not None:
        train, held_out = whole(train), whole(read(held))
    else:  # a share that leaves a corpus of under 10 documents all of them
        every = np.arange(len(train.starts) - 1)
        train, held_out = Documents(train, every[every % 10 != 9]), Documents(train, every[9::10])
    if len(held_out) and held_out.conversations() != train.conversations():
        raise DataError(f"data.path = {path!r} and its held-out {how} are not both documents or both conversations")
    tokens, _, _, lost = train.trained(seq_len)
    if tokens < (1 if train.conversations() else batch_size * seq_len + 1):  # conversations repeat to fill a batch
        need = "one" if train.conversations() else f"one global batch's {batch_size * seq_len + 1:,}"
        left_out = f", {lost:,} with no target in their first {seq_len}" if lost else ""
        raise DataError(f"data.path = {path!r} holds {tokens:,} training tokens ({len(train):,} {kind(train)}, "
                        f"{train.tokens.skipped:,} {kind(train, 'skipped')}{left_out}; held out: {how}), fewer than {need}")
    return Corpus(train, held_out if len(held_out) else None, tokenizer, source, how)


def kind(documents: Documents, skipped: str = "") -> str:
    """What the corpus holds, or (`skipped`) what of it was skipped."""
    if skipped:
        return "without an assistant turn to train skipped" if documents.conversations() else "empty or null skipped"
    return "conversations" if documents.conversations() else "documents"


def held_out_split(splits: dict, split: str, validation_path: str):
    """(the held-out split's files, or None for a share of data.split's; where it comes from). A test split is never read."""
    if validation_path:
        held = splits_of(validation_path, "validation.path")
        if "validation" in held or len(held) == 1:
            return held.get("validation", next(iter(held.values()))), "validation.path"
        raise DataError(f"validation.path = {validation_path!r} has no 'validation' split (its splits: {', '.join(held)})")
    if "validation" in splits and split != "validation":
        return splits["validation"], "its validation split"
    return None, "every 10th document"


def whole(tokens: Tokens) -> "Documents":
    return Documents(tokens, np.arange(len(tokens.starts) - 1))


def require_vocabulary(size: int, source: str, vocab_size: int) -> None:
    if size > vocab_size:
        raise DataError(f"the {source} tokenizer has {size:,} ids, more than model.vocab_size = {vocab_size:,}")


def training_batches(corpus: Corpus, cfg: dict, dp_mesh=None):
    """(endless batches: this rank's share of each step, all its microbatches; their position, which checkpoints save)."""
    t, rank_batch = cfg["training"], global_batch_size(cfg) // cfg["parallelism"]["dp_shard"]
    if isinstance(corpus.train, torch.Tensor):
        generator = torch.Generator().manual_seed(t["seed"])
        return random_windows(corpus.train, rank_batch, t["seq_len"], generator, dp_mesh), generator
    windows = corpus.train.windows(rank_batch, t["seq_len"], dp_mesh, seed=t["seed"])
    return iter(windows), windows


def held_out_batches(corpus: Corpus, cfg: dict, dp_mesh=None):
    """Batches of held-out data as training's, always the same ones (in their order); None for none."""
    t, rank_batch = cfg["training"], global_batch_size(cfg) // cfg["parallelism"]["dp_shard"]
    if isinstance(corpus.held_out, torch.Tensor):
        generator = torch.Generator().manual_seed(t["seed"] + 1)
        return random_windows(corpus.held_out, rank_batch, t["seq_len"], generator, dp_mesh)
    return None if corpus.held_out is None else iter(corpus.held_out.windows(rank_batch, t["seq_len"], dp_mesh))


# -----------------------------------------------------------------------------
# the default: bytes of the Python standard library's own source, on every machine, no download

def load_stdlib_bytes(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held_out) byte tensors. Files are read in sorted order; every 10th goes to
    held_out. Third-party packages are skipped so the text is the same for one Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    train, held_out, total = bytearray(), bytearray(), 0
    for i, path in enumerate(files):
        text = path.read_bytes()
        (held_out if i % 10 == 0 else train).extend(text)
        total += len(text)
        if total >= max_bytes:
            break
    return torch.frombuffer(train, dtype=torch.uint8).long(), torch.frombuffer(held_out, dtype=torch.uint8).long()


def random_windows(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator, dp_mesh=None):
    """Endless (inputs, targets, None) of random windows: no position_ids, one causal sequence each.
    Every rank draws the global batch's starts from one seeded generator (the data position a
    checkpoint saves) and keeps its dp rank's share: one process with dp_size x batch_size sees it all."""
    dp_rank, dp_size = dp_coordinates(dp_mesh)
    while True:
        starts = torch.randint(len(data) - seq_len - 1, (batch_size * dp_size,), generator=generator)
        starts = starts[dp_rank * batch_size : (dp_rank + 1) * batch_size]
        x = torch.stack([data[s : s + seq_len] for s in starts])
        y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts])
        yield x, y, None


def dp_coordinates(dp_mesh) -> tuple[int, int]:
    return (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)




# -----------------------------------------------------------------------------
# your documents

def load_tokenizer(folder: str):
    """transformers' tokenizer of `folder` (tokenizer.json, tokenizer_config.json, ...), or "bytes":
    a text's UTF-8 bytes as ids 0-255."""
    if folder == "bytes":
        return "bytes"
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{folder} has no tokenizer transformers can load (tokenizer.json, or tokenizer.model "
                        f"with its tokenizer_config.json): {str(e).strip().splitlines()[0]}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # tokens.encode's batch path
        raise DataError(f"{folder}'s tokenizer ({type(tokenizer).__name__}) has no tokenizers backend: give a tokenizer.json")
    return tokenizer


class Windows:
    """Endless batches of `documents` end to end, each epoch in a new order drawn from `seed` (None: in
    their order, every time). Of each global batch, dp_size x batch_size windows of seq_len in a row, dp
    rank r takes the r-th batch_size. A window is a slice of the memory map by offsets, as arrays; its
    position, which a checkpoint saves, is one token offset into the endless stream, on every rank."""

    def __init__(self, documents: Documents, batch_size: int, seq_len: int, dp_mesh=None, seed: int | None = None):
        self.ids, self.key = documents.tokens.ids, documents.tokens.key
        self.first, self.lengths = np.asarray(documents.tokens.starts)[documents.docs], documents.lengths()
        self.total = int(self.lengths.sum())
        self.dp_rank, self.dp_size = dp_coordinates(dp_mesh)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.offset, self.orders = 0, {}

    def __iter__(self):
        b, n, column = self.batch_size, self.seq_len, np.arange(self.seq_len)
        while True:
            ids, starts = self.take(self.offset + self.dp_rank * b * n, b * n + 1)  # the last target: one more
            self.offset += self.dp_size * b * n
            targets = np.where(starts[1:], IGNORED, ids[1:])  # a document's first token is no target
            restarts = starts[:-1].reshape(b, n) | (column == 0)
            positions = column - np.maximum.accumulate(np.where(restarts, column, 0), axis=1)
            yield torch.from_numpy(ids[:-1].reshape(b, n)), torch.from_numpy(targets.reshape(b, n)), torch.from_numpy(positions)

    def take(self, offset: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The stream's tokens offset..offset + count, and whether each begins a document."""
        ids, starts = [], []
        while count:
            epoch, at = divmod(offset, self.total)
            part = min(count, self.total - at)
            order, ends = self.order(epoch)
            k0, k1 = np.searchsorted(ends, [at, at + part - 1], side="right")
            picked, end = order[k0 : k1 + 1], ends[k0 : k1 + 1]
            begin = end - self.lengths[picked]  # in the stream
            counts, stream = np.minimum(end, at + part) - np.maximum(begin, at), np.arange(at, at + part)
            ids.append(self.ids[np.repeat(self.first[picked] - begin, counts) + stream])
            starts.append(stream == np.repeat(begin, counts))
            offset, count = offset + part, count - part
        return np.concatenate(ids).astype(np.int64), np.concatenate(starts)

    def order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The documents' order in `epoch` and where each ends in it; two epochs kept (a window spans them)."""
        if epoch not in self.orders:
            order = np.arange(len(self.lengths)) if self.seed is None else \
                np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
            self.orders = {e: o for e, o in self.orders.items() if e == epoch - 1}
            self.orders[epoch] = order, np.cumsum(self.lengths[order])
        return self.orders[epoch]

    def packed(self, tokens: int) -> str:
        return f"packed end to end into windows of {self.seq_len}"

    def get_state(self) -> torch.Tensor:
        return torch.tensor([self.offset])

    def set_state(self, state: torch.Tensor) -> None:
        self.offset = int(state[0])


class Packed:
    """Endless batches of whole conversations (one over seq_len: its first seq_len tokens, alone; left out
    if they hold no target), each epoch in a new order drawn from `seed` (None: theirs), put best fit into
    windows of seq_len; the rest of a window is padding, no target. Of each global batch's windows, dp rank
    r takes the r-th batch_size; the position a checkpoint saves is (epoch, window), into windows of this
    seq_len (part of `key`)."""

    OPEN = 256  # windows open for more conversations at once: past that, the fullest is closed

    def __init__(self, documents: Documents, batch_size: int, seq_len: int, dp_mesh=None, seed: int | None = None):
        tokens, kept = documents.tokens, documents.targets_within(seq_len) > 0
        self.ids, self.mask, self.key = tokens.ids, tokens.mask, f"{tokens.key} in windows of {seq_len}"
        self.first = np.asarray(tokens.starts)[documents.docs[kept]]
        self.lengths = np.minimum(documents.lengths()[kept], seq_len)
        self.dp_rank, self.dp_size = dp_coordinates(dp_mesh)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.epoch, self.window, self.packings = 0, 0, {}

    def __iter__(self):
        b = self.batch_size
        while True:
            windows = [self.next_window() for _ in range(self.dp_size * b)][self.dp_rank * b : (self.dp_rank + 1) * b]
            yield tuple(torch.from_numpy(np.stack(rows)) for rows in zip(*map(self.rows, windows)))

    def next_window(self) -> np.ndarray:
        """The conversations of the window at the position, which moves on by one."""
        if self.window == len(self.packing(self.epoch)[1]) - 1:
            self.epoch, self.window = self.epoch + 1, 0
        members, bounds = self.packing(self.epoch)
        self.window += 1
        return members[bounds[self.window - 1] : bounds[self.window]]

    def rows(self, conversations: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A window's inputs, targets (the next token where it is a target of the same conversation) and positions."""
        lengths, n = self.lengths[conversations], self.seq_len
        used, begin = int(lengths.sum()), np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions = np.concatenate([np.arange(used) - begin, np.arange(n - used)])  # padding: a block of its own
        index = np.repeat(self.first[conversations], lengths) + positions[:used]
        ids, targets = np.zeros(n, np.int64), np.full(n, IGNORED, np.int64)
        ids[:used] = self.ids[index]
        targets[: used - 1] = np.where(self.mask[index[1:]] & (positions[1:used] > 0), ids[1:used], IGNORED)
        return ids, targets, positions

    def packing(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the conversations, window after window; where each window begins), of `epoch`: each conversation in
        the epoch's order goes into the open window with the least room that holds it, else a new one."""
        if epoch not in self.packings:
            count = len(self.lengths)
            order = np.arange(count) if self.seed is None else np.random.default_rng([self.seed, epoch]).permutation(count)
            rooms, windows = [], []  # rooms: (room, window) of the open windows, sorted
            for c, length in zip(order.tolist(), self.lengths[order].tolist()):
                k = bisect.bisect_left(rooms, (length, -1))
                room, w = rooms.pop(k) if k < len(rooms) else (self.seq_len, len(windows))
                if w == len(windows):
                    windows.append([])
                windows[w].append(c)
                if room > length:
                    bisect.insort(rooms, (room - length, w))
                if len(rooms) > self.OPEN:
                    del rooms[0]
            self.packings = {epoch: (np.array([c for w in windows for c in w], np.int64),
                                   np.cumsum([0] + [len(w) for w in windows]))}
        return self.packings[epoch]

    def packed(self, tokens: int) -> str:
        """How, for the data line: the windows of an epoch, and their share holding `tokens` (not padding)."""
        windows = len(self.packing(0)[1]) - 1
        filled = tokens / (windows * self.seq_len)
        return f"packed whole, best fit, into {windows:,} windows of {self.seq_len} ({filled:.0%} filled)"

    def get_state(self) -> torch.Tensor:
        return torch.tensor([self.epoch, self.window])

    def set_state(self, state: torch.Tensor) -> None:
        self.epoch, self.window = int(state[0]), int(state[1])
