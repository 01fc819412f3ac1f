"""What the model trains on: the standard library's bytes (the default), or your documents
(`data.path`) tokenized and packed into windows whose `position_ids` restart at every document
(model.forward_logits builds block-causal masks from them). Every 10th document is held out; data-
parallel rank r of D reads documents r, r + D, ... from an (epoch, document, token) a checkpoint saves.
"""

import glob
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from config import global_batch_size

SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # datasets' builders
IGNORED = -100  # F.cross_entropy's ignore_index


class DataError(ValueError):
    """What stops a run before any work: data.path or data.tokenizer that cannot give batches."""


@dataclass
class Corpus:
    train: object  # the standard library's bytes (a tensor) or your documents (a datasets.Dataset)
    held_out: object
    tokenizer: object = "bytes"  # or transformers' tokenizer
    source: str = "bytes"  # the tokenizer's folder
    ids: int = 256  # the tokenizer's vocabulary


def prepare(cfg: dict) -> Corpus:
    """[data] checked against the model and the global batch, on every rank before any process
    group: each problem is one DataError line. The tokenizer is data.tokenizer, else the HF folder's."""
    d, c, m, t = cfg["data"], cfg["checkpoint"], cfg["model"], cfg["training"]
    hf_folder = c["initial_load_path"] if c["initial_load_in_hf"] else ""
    source = d["tokenizer"] or hf_folder
    if not d["path"]:
        if source and source != "bytes":
            raise DataError(f"data.path is empty: the standard library's bytes, as ids 0-255, mean nothing to {source}'s "
                            f"vocabulary of {m['vocab_size']:,}; set data.path to your documents, or data.tokenizer = "
                            "bytes to train on those ids anyway")
        require_vocabulary(256, "bytes", m)
        return Corpus(*load_stdlib_bytes(d["max_bytes"]))
    if not source:
        raise DataError(f"data.path = {d['path']!r} needs a tokenizer: set data.tokenizer to a folder with "
                        "tokenizer.json, or bytes (ids 0-255)")
    tokenizer = load_tokenizer(source)
    ids = 256 if tokenizer == "bytes" else len(tokenizer)
    require_vocabulary(ids, source, m)
    train, held_out = split_documents(load_documents(d["path"]))
    need = global_batch_size(cfg) * t["seq_len"] + 1
    if (have := count_tokens(train, tokenizer, need)) < need:
        raise DataError(f"data.path = {d['path']!r} holds {have:,} training tokens ({len(train)} documents, every "
                        f"10th held out), fewer than one global batch's {need:,}")
    return Corpus(train, held_out, tokenizer, source, ids)


def require_vocabulary(size: int, source: str, m: dict) -> None:
    if size > m["vocab_size"]:
        raise DataError(f"the {source} tokenizer has {size:,} ids, more than model.vocab_size = {m['vocab_size']:,}")


def training_batches(corpus: Corpus, cfg: dict, dp_mesh=None):
    """(endless batches: this rank's share of each step, all its microbatches; their position, which checkpoints save)."""
    t, rank_batch = cfg["training"], global_batch_size(cfg) // cfg["parallelism"]["dp_shard"]
    if isinstance(corpus.train, torch.Tensor):
        generator = torch.Generator().manual_seed(t["seed"])
        return random_windows(corpus.train, rank_batch, t["seq_len"], generator, dp_mesh), generator
    packed = PackedDocuments(corpus.train, corpus.tokenizer, rank_batch, t["seq_len"], dp_mesh)
    return iter(packed), packed


def held_out_batches(corpus: Corpus, cfg: dict, dp_mesh=None):
    """Batches of held-out data as training's, always the same ones; None where a dp rank would get no document."""
    t, rank_batch = cfg["training"], global_batch_size(cfg) // cfg["parallelism"]["dp_shard"]
    if isinstance(corpus.held_out, torch.Tensor):
        generator = torch.Generator().manual_seed(t["seed"] + 1)
        return random_windows(corpus.held_out, rank_batch, t["seq_len"], generator, dp_mesh)
    if len(corpus.held_out) < dp_coordinates(dp_mesh)[1]:
        return None
    return iter(PackedDocuments(corpus.held_out, corpus.tokenizer, rank_batch, t["seq_len"], dp_mesh))


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
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{folder} has no tokenizer transformers can load (tokenizer.json, or tokenizer.model "
                        f"with its tokenizer_config.json): {str(e).strip().splitlines()[0]}") from None


def encode(tokenizer, text: str) -> list[int]:
    """A document's ids: with the special tokens its tokenizer adds (Llama's BOS), then its EOS."""
    if tokenizer == "bytes":
        return list(text.encode())
    ids = tokenizer(text, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and ids[-1:] != [eos] else ids


def load_documents(path: str):
    """Every document at `path` as a `datasets.Dataset` with a `text` column (memory-mapped): a
    `datasets` folder (save_to_disk), or a file, a glob or a folder of .txt (a document each),
    .jsonl/.json or .parquet (a record each) files of one kind."""
    import datasets

    datasets.disable_progress_bars()
    if Path(path, "dataset_info.json").is_file() or Path(path, "state.json").is_file():
        table = datasets.load_from_disk(path)
    else:
        files = sorted(p for p in (Path(path).rglob("*") if Path(path).is_dir() else map(Path, glob.glob(path)))
                       if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"data.path = {path!r} matches no {', '.join(SUFFIXES)} file")
        kinds = {SUFFIXES[p.suffix] for p in files}
        if len(kinds) > 1:
            raise DataError(f"data.path = {path!r} mixes {' and '.join(sorted(kinds))} files: give one kind")
        kind = kinds.pop()
        options = {"sample_by": "document"} if kind == "text" else {}
        table = datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train", **options)
    if isinstance(table, datasets.DatasetDict):
        table = table["train"] if "train" in table else next(iter(table.values()))
    if "text" not in table.column_names:
        raise DataError(f"data.path = {path!r} has no 'text' field (its fields: {', '.join(table.column_names)})")
    return table.select_columns(["text"])


def split_documents(table) -> tuple:
    """(train, held_out): every 10th document held out, as the standard library's files."""
    return table.select([i for i in range(len(table)) if i % 10]), table.select(range(0, len(table), 10))


def count_tokens(table, tokenizer, enough: int) -> int:
    """Tokens in `table`'s documents, counted until `enough`: the check before any work reads no more."""
    total = 0
    for row in table:
        total += len(encode(tokenizer, row["text"] or ""))
        if total >= enough:
            break
    return total


class PackedDocuments:
    """This dp rank's share of `texts`, packed end to end into batches of windows, endlessly
    (a new epoch where they end). Iterating gives (inputs, targets, position_ids), each
    [batch_size, seq_len]; `get_state`/`set_state` are the data position a checkpoint saves."""

    def __init__(self, table, tokenizer, batch_size: int, seq_len: int, dp_mesh=None):
        self.dp_rank, self.dp_size = dp_coordinates(dp_mesh)
        self.group = dp_mesh.get_group() if dp_mesh is not None else None
        self.texts, self.tokenizer = table.select(range(self.dp_rank, len(table), self.dp_size)), tokenizer
        self.batch_size, self.seq_len = batch_size, seq_len
        self.epoch = self.doc = self.token = 0  # where the next window starts
        self.cached = (None, [])  # (document, its ids): one tokenized at a time

    def __iter__(self):
        while True:
            windows = [self.window() for _ in range(self.batch_size)]
            yield tuple(torch.tensor(column) for column in zip(*windows))

    def window(self) -> tuple[list[int], list[int], list[int]]:
        """The next seq_len tokens, each's target and position; the position moves seq_len tokens
        on (the last target is the next window's first token)."""
        ids, starts = self.take(self.seq_len)
        here = (self.epoch, self.doc, self.token)
        next_id, next_start = self.take(1)
        self.epoch, self.doc, self.token = here
        targets = [IGNORED if start else token for token, start in zip(ids[1:] + next_id, starts[1:] + next_start)]
        positions = []
        for start in starts:
            positions.append(0 if start or not positions else positions[-1] + 1)
        return ids, targets, positions

    def take(self, n: int) -> tuple[list[int], list[bool]]:
        """n tokens from the position on, and whether each starts a document; the position moves."""
        ids, starts, empty = [], [], 0
        while len(ids) < n:
            if self.cached[0] != self.doc:
                self.cached = (self.doc, encode(self.tokenizer, self.texts[self.doc]["text"] or ""))
            empty = 0 if self.cached[1] else empty + 1
            if empty > len(self.texts):
                raise DataError(f"data rank {self.dp_rank}'s {len(self.texts)} documents are all empty")
            part = self.cached[1][self.token : self.token + n - len(ids)]
            starts += [self.token == 0] + [False] * (len(part) - 1) if part else []
            ids += part
            self.token += len(part)
            if self.token >= len(self.cached[1]):
                self.doc, self.token = self.doc + 1, 0
                if self.doc == len(self.texts):
                    self.epoch, self.doc = self.epoch + 1, 0
        return ids, starts

    def get_state(self) -> torch.Tensor:
        """Every dp rank's (epoch, document, token), [dp_size, 3]: the same tensor on every rank
        (a collective), which DCP saves once."""
        mine = torch.tensor([self.epoch, self.doc, self.token])
        if self.group is None:
            return mine.unsqueeze(0)
        mine = mine.cuda() if dist.get_backend(self.group) == "nccl" else mine
        every = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(every, mine, group=self.group)
        return torch.stack(every).cpu()

    def set_state(self, state: torch.Tensor) -> None:
        self.epoch, self.doc, self.token = state[self.dp_rank].tolist()
