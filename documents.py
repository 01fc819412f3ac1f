"""Your documents where they are: the files of a split (a file, glob or folder; a Hub dataset snapshot's
file names; a datasets folder), read one document or conversation at a time by our own readers, which
name the file and line (or byte offset) of a bad record in one line: datasets' builders give tracebacks
without them. A record with `messages`, or with `prompt` and `completion`, is a conversation (TRL's formats).
"""

import codecs
import glob
import json
from pathlib import Path
from typing import NamedTuple

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")  # .txt: a document per file; the others a record each
BLOCK = 1 << 24  # bytes of a .txt file read at once: a file of any size is never whole in memory


class DataError(ValueError):
    """What stops a run before any work: data that cannot give batches, named with its file and where."""


class Conversation(NamedTuple):
    """A chat record: `messages` for the chat template, of which those at `trained` (the assistant's) are
    targets; or (prompt, completion) as text, not templated, the completion the target (as TRL's)."""
    messages: list | tuple
    trained: tuple
    where: str
    tools: list | None = None


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
        matches = map(Path, glob.glob(path, recursive=True))  # ** reaches every depth
        splits = {"train": sorted(p for p in matches if p.suffix in SUFFIXES and p.is_file())}
    splits = {name: files for name, files in splits.items() if files}
    if not splits:
        raise DataError(f"{key} = {path!r} matches no {', '.join(SUFFIXES)} file")
    for name, files in splits.items():
        if len({p.suffix.replace(".jsonl", ".json") for p in files}) > 1:
            raise DataError(f"{key} = {path!r} mixes {' and '.join(sorted({p.suffix for p in files}))} files in its "
                            f"{name} split: give one kind")
    return splits


def read_documents(source, field: str):
    """Each document's text (a string; None for null; a .txt file's, in pieces) or Conversation, from
    splits_of's files or a datasets.Dataset. A corpus holds one kind: documents or conversations."""
    first = {}  # kind: where it was first seen
    for item, where in records(source, field):
        first.setdefault(isinstance(item, Conversation), where)
        if len(first) > 1:
            raise DataError(f"{first[True]} is a conversation, {first[False]} a document: give documents or "
                            "conversations, not both")
        yield item


def records(source, field: str):
    """(each record's document or Conversation, where it is)."""
    if not isinstance(source, list):  # a datasets.Dataset
        columns, where = chosen_columns(source.column_names, field, "the datasets folder"), "the datasets folder"
        for batch in source.select_columns(columns).iter(batch_size=1000):
            yield from ((record_item(dict(zip(columns, row)), field, where), where) for row in zip(*map(batch.get, columns)))
        return
    for file in source:
        if file.suffix == ".txt":
            yield read_txt(file), str(file)
            continue
        try:
            yield from (read_parquet if file.suffix == ".parquet" else read_json)(file, field)
        except OSError as e:
            raise DataError(f"{file} cannot be read: {e.strerror or e}") from None


def read_txt(file: Path):
    """The file's text, BLOCK bytes at a time (tokens.pieces cuts it)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with open(file, "rb") as f:
            while True:
                data, pending = f.read(BLOCK), len(decoder.getstate()[0])
                try:
                    text = decoder.decode(data, final=not data)
                except UnicodeDecodeError as e:
                    raise not_utf8(file, offset - pending + e.start, e.object[e.start : e.start + 4]) from None
                if text:
                    yield text
                if not data:
                    return
                offset += len(data)
    except OSError as e:
        raise DataError(f"{file} cannot be read: {e.strerror or e}") from None


def read_json(file: Path, field: str):
    """A JSON array of records, or JSON lines (.jsonl, or a .json that is not an array): line by line."""
    with open(file, "rb") as f:
        if f.read(4096).lstrip().startswith(b"["):
            try:
                records = json.loads(file.read_bytes())
            except json.JSONDecodeError as e:
                raise DataError(f"{file}:{e.lineno}: not valid JSON ({e.msg})") from None
            except UnicodeDecodeError as e:
                raise not_utf8(file, e.start, e.object[e.start : e.start + 4]) from None
            for i, record in enumerate(records):
                yield record_item(record, field, f"{file}: record {i + 1}"), f"{file}: record {i + 1}"
            return
        f.seek(0)
        offset = 0
        for number, raw in enumerate(f, 1):
            try:
                record = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError as e:
                raise DataError(f"{file}:{number}: not a JSON record ({e.msg}, column {e.colno})") from None
            except UnicodeDecodeError as e:
                raise not_utf8(file, offset + e.start, raw[e.start : e.start + 4]) from None
            offset += len(raw)
            if record is not None:
                yield record_item(record, field, f"{file}:{number}"), f"{file}:{number}"


def not_utf8(file: Path, offset: int, data: bytes) -> DataError:
    return DataError(f"{file}: the bytes at offset {offset:,} ({data!r}...) are not UTF-8; convert the file, e.g. "
                     "iconv -f latin1 -t utf-8")


def read_parquet(file: Path, field: str):
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(file)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError
        raise DataError(f"{file} is not a parquet file pyarrow reads: {str(e).splitlines()[0]}") from None
    columns, row = chosen_columns(table.schema_arrow.names, field, str(file)), 0
    for batch in table.iter_batches(batch_size=1000, columns=columns):
        for record in batch.to_pylist():
            row += 1
            yield record_item(record, field, f"{file}: row {row}"), f"{file}: row {row}"


def chosen_columns(names: list, field: str, where: str) -> list:
    """The columns a table's records are read from: a conversation's, else the text field."""
    tools = ["tools"] if "tools" in names else []
    if "messages" in names:
        return ["messages", *tools]
    if "prompt" in names and "completion" in names:
        return ["prompt", "completion", *tools]
    require_field(field, names, where)
    return [field]


def record_item(record, field: str, where: str):
    """A record's Conversation, else its text: `messages` first, then `prompt` with `completion`, then `field`."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is a JSON {type(record).__name__}, not an object with a {field!r} field or messages")
    if "messages" in record:
        return conversation(record["messages"], None, where, record.get("tools"))
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return Conversation((prompt, completion), (1,), where)
        return conversation(prompt, completion, where, record.get("tools"))
    require_field(field, list(record), where)
    return check_text(record[field], field, where)


def conversation(prompt, completion, where: str, tools) -> Conversation:
    """`prompt` (or all the messages) + `completion`; trained: the assistant's messages (of the completion if any)."""
    for name, messages in (("messages" if completion is None else "prompt", prompt), ("completion", completion or [])):
        if not isinstance(messages, list):
            raise DataError(f"{where}: {name} is a {type(messages).__name__}, not a list of messages (role, content)"
                            + (": give prompt and completion both as text or both as messages" if completion else ""))
    messages = prompt + (completion or [])
    for i, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"{where}: message {i} has no 'role'")
        if message.get("content") is None and not message.get("tool_calls"):
            raise DataError(f"{where}: message {i} ({message['role']}) has no 'content'")
    first = 0 if completion is None else len(prompt)
    trained = tuple(i for i in range(first, len(messages)) if messages[i]["role"] == "assistant")
    if trained[:1] == (0,):
        raise DataError(f"{where}: message 1 is the assistant's: a conversation opens with a system or user message")
    return Conversation(messages, trained, where, tools)


def require_field(field: str, fields, where: str) -> None:
    if field not in fields:
        raise DataError(f"{where} has no {field!r} field (its fields: {', '.join(fields)}); name yours with "
                        "data.text_field, or give conversations as messages, or prompt and completion")


def check_text(text, field: str, where: str):
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: {field} is a {type(text).__name__}, not text")
    return text
