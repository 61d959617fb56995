"""MindRecord files (what MindSpore's FileWriter writes and MindDataset reads), read without MindSpore.

Layout (MindSpore mindspore/ccsrc/minddata/mindrecord: shard_header.cc, shard_column.cc, shard_reader.cc):
  bytes [0, 8): little-endian uint64 L; bytes [8, 8+L): the header as JSON (schema, blob_fields, page_size,
  header_size, shard_addresses, version). Page p starts at header_size + p * page_size.
  The shard's SQLite index (<file>.db, table INDEXES) gives each row's blob page and byte range; a row's blob there is
  an 8-byte length then the blob. With one blob column the blob is that column; with several, each column is an
  8-byte big-endian length then its bytes, in blob_fields order. From version 3.0 int32/int64 array columns are
  compressed when the schema has one: a 4-byte big-endian count, a bitmap of 2 bits per value (0: int8 .. 3: int64,
  most significant bits first), then each value little-endian at that width.
"""
from __future__ import annotations

import json
import os
import sqlite3
import struct
from typing import Dict, List, Optional, Sequence

import numpy as np

_DTYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float64": np.float64}
_WIDTH = (np.dtype("<i1"), np.dtype("<i2"), np.dtype("<i4"), np.dtype("<i8"))


class MindRecordError(ValueError):
    """A MindRecord file that cannot be read as MindSpore would read it."""


def _uncompress_ints(buf: bytes, dtype) -> np.ndarray:
    n = int.from_bytes(buf[:4], "big")
    bitmap = np.frombuffer(buf, dtype=np.uint8, count=(n + 3) // 4, offset=4)
    kinds = np.stack([(bitmap >> s) & 3 for s in (6, 4, 2, 0)], axis=1).reshape(-1)[:n]
    out = np.empty(n, dtype=dtype)
    pos = 4 + (n + 3) // 4
    if n and (kinds == kinds[0]).all():  # one width for the whole row: a single frombuffer
        out[:] = np.frombuffer(buf, dtype=_WIDTH[kinds[0]], count=n, offset=pos)
        return out
    for i, k in enumerate(kinds.tolist()):
        w = 1 << k
        out[i] = int.from_bytes(buf[pos:pos + w], "little", signed=True)
        pos += w
    return out


class MindRecordShard:
    """One shard file: its header, its index and random access to its rows."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise MindRecordError(f"MindRecord file {path} does not exist")
        if not os.path.isfile(path + ".db"):
            raise MindRecordError(f"MindRecord file {path} has no index {path}.db next to it (FileWriter writes both; "
                                  "copy the .db with the data file)")
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MindRecordError(f"{path} is not a MindRecord file (shorter than its header length)")
            (n,) = struct.unpack("<Q", head)
            if n > os.path.getsize(path):
                raise MindRecordError(f"{path} is not a MindRecord file (header length {n} past the end)")
            try:
                self.header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise MindRecordError(f"{path} is not a MindRecord file (header is not JSON: {e})") from None
        schema = self.header["schema"][0]
        self.schema: Dict[str, dict] = schema["schema"]
        self.blob_fields: List[str] = list(schema.get("blob_fields") or [])
        self.header_size = int(self.header["header_size"])
        self.page_size = int(self.header["page_size"])
        self.compress = str(self.header.get("version", "0")) >= "3.0" and any(
            v.get("type") in ("int32", "int64") and "shape" in v for v in self.schema.values())
        con = sqlite3.connect(f"file:{path}.db?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT PAGE_ID_BLOB, PAGE_OFFSET_BLOB, PAGE_OFFSET_BLOB_END FROM INDEXES "
                               "ORDER BY ROW_ID").fetchall()
        except sqlite3.DatabaseError as e:
            raise MindRecordError(f"{path}.db is not a MindRecord index ({e})") from None
        finally:
            con.close()
        self.index = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        self._file = None

    def __len__(self) -> int:
        return len(self.index)

    def shard_paths(self) -> List[str]:
        """All shards written together with this one (MindSpore loads them all when given one file name)."""
        folder = os.path.dirname(self.path)
        return [os.path.join(folder, os.path.basename(a)) for a in self.header.get("shard_addresses", [self.path])]

    def check_columns(self, columns: Sequence[str], key: str) -> None:
        for c in columns:
            if c not in self.schema:
                raise MindRecordError(f"{key}: column {c!r} is not in {self.path} (its columns: "
                                      f"{sorted(self.schema)}); fix: name one of those in input_columns")
            if c not in self.blob_fields:
                raise MindRecordError(f"{key}: column {c!r} of {self.path} is a scalar (raw page) column, which this "
                                      "reader does not decode; fix: write it as an array column ({'shape': [-1]})")

    def row(self, i: int, columns: Sequence[str]) -> Dict[str, np.ndarray]:
        if self._file is None:
            self._file = open(self.path, "rb")
        page, start, end = (int(x) for x in self.index[i])
        self._file.seek(self.header_size + page * self.page_size + start)
        raw = self._file.read(end - start)
        blob = raw[8:8 + struct.unpack("<Q", raw[:8])[0]]
        parts: Dict[str, bytes] = {}
        if len(self.blob_fields) == 1:
            parts[self.blob_fields[0]] = blob
        else:
            pos = 0
            for name in self.blob_fields:
                n = int.from_bytes(blob[pos:pos + 8], "big")
                parts[name] = blob[pos + 8:pos + 8 + n]
                pos += 8 + n
        out = {}
        for c in columns:
            spec = self.schema[c]
            dtype = _DTYPES.get(spec["type"])
            if dtype is None:  # bytes / string blobs
                out[c] = parts[c]
            elif self.compress and dtype in (np.int32, np.int64):
                out[c] = _uncompress_ints(parts[c], dtype)
            else:
                out[c] = np.frombuffer(parts[c], dtype=dtype).copy()
            shape = spec.get("shape")
            if dtype is not None and shape and len(shape) > 1:
                out[c] = out[c].reshape(shape)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class MindRecordFiles:
    """The rows of several shard files in MindDataset's order with shuffle off: files in list order, rows in write
    order. Random access by global position."""

    def __init__(self, files: Sequence[str], columns: Optional[Sequence[str]], key: str):
        self.shards = [MindRecordShard(f) for f in files]
        self.columns = list(columns or self.shards[0].blob_fields)
        for s in self.shards:
            s.check_columns(self.columns, key)
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, pos: int) -> Dict[str, np.ndarray]:
        f = int(np.searchsorted(self.starts, pos, side="right") - 1)
        return self.shards[f].row(pos - int(self.starts[f]), self.columns)

    def close(self) -> None:
        for s in self.shards:
            s.close()
