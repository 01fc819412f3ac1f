"""Your documents where they are: the files of a split (a file, glob or folder; a Hub dataset snapshot's
file names; a datasets folder), read one document at a time by our own readers, which name the file and
line (or byte offset) of a bad record in one line: datasets' builders give tracebacks without them.
"""

import glob
import json
from pathlib import Path

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")  # .txt: a document per file; the others a record each


class DataError(ValueError):
    """What stops a run before any work: data that cannot give batches, named with its file and where."""


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


def read_documents(source, field: str):
    """Each document's text, or None (null), from splits_of's files or datasets.Dataset."""
    if not isinstance(source, list):  # a datasets.Dataset
        require_field(field, source.column_names, "the datasets folder")
        for batch in source.select_columns([field]).iter(batch_size=1000):
            yield from (check_text(text, field, "the datasets folder") for text in batch[field])
        return
    for file in source:
        try:
            yield from {".txt": read_txt, ".parquet": read_parquet}.get(file.suffix, read_json)(file, field)
        except OSError as e:
            raise DataError(f"{file} cannot be read: {e.strerror or e}") from None


def read_txt(file: Path, field: str):
    data = file.read_bytes()
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise not_utf8(file, e.start, data[e.start : e.start + 4]) from None


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
            yield from (record_text(r, field, f"{file}: record {i + 1}") for i, r in enumerate(records))
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
                yield record_text(record, field, f"{file}:{number}")


def not_utf8(file: Path, offset: int, data: bytes) -> DataError:
    return DataError(f"{file}: the bytes at offset {offset:,} ({data!r}...) are not UTF-8; convert the file, e.g. "
                     "iconv -f latin1 -t utf-8")


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
    if not isinstance(record, dict):
        raise DataError(f"{where} is a JSON {type(record).__name__}, not an object with a {field!r} field")
    require_field(field, list(record), where)
    return check_text(record[field], field, where)


def require_field(field: str, fields, where: str) -> None:
    if field not in fields:
        raise DataError(f"{where} has no {field!r} field (its fields: {', '.join(fields)}); name yours with "
                        "data.text_field")


def check_text(text, field: str, where: str):
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: {field} is a {type(text).__name__}, not text")
    return text


