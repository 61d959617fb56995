"""Read and write MindSpore .ckpt files (mindspore.save_checkpoint / load_checkpoint) without MindSpore.

The file format, as MindSpore 2.7 writes it (mindspore/train/serialization.py, _exec_save):

- a concatenation of serialized `Checkpoint` messages (proto.py), each holding one `Value`; since repeated fields
  of concatenated messages merge, the whole file is also one `Checkpoint` (that is how MindSpore parses it);
- a tensor is written as raw little-endian bytes in pieces of at most 512 MiB (`1024 * SLICE_SIZE` KiB); every piece
  is its own Value with the same tag, dims and tensor_type, and the pieces join in order;
- dims are the shape: a 0-d tensor (also a Python int / float passed in append_dict, saved as Int64 / Float32) has
  no dims; MindSpore reads dims [0] as a scalar too;
- a string is tensor_type "str", dims [0], content the numpy "U" bytes (UTF-32-LE);
- with crc_check=True the file ends in b"crc_num" + the crc32 of all preceding bytes as 10 big-endian bytes;
- an encrypted file (enc_key=...) is AES ciphertext, which does not parse as protobuf.
"""
from __future__ import annotations

import mmap
import os
import zlib

import torch

from ..format import atomic_write
from .proto import Checkpoint

# tensor_type (str(mindspore dtype)) <-> torch dtype; bf16 is stored as raw 2-byte bfloat16.
MS_TO_TORCH = {
    "Float16": torch.float16, "Float32": torch.float32, "Float64": torch.float64, "BFloat16": torch.bfloat16,
    "Int8": torch.int8, "Int16": torch.int16, "Int32": torch.int32, "Int64": torch.int64,
    "UInt8": torch.uint8, "UInt16": torch.uint16, "UInt32": torch.uint32, "UInt64": torch.uint64, "Bool": torch.bool,
}
TORCH_TO_MS = {v: k for k, v in MS_TO_TORCH.items()}

CHUNK_BYTES = 512 * 1024 * 1024  # MindSpore's piece size for one Value (1024 * SLICE_SIZE KiB)
CRC_MARK = b"crc_num"
_TRAILER = len(CRC_MARK) + 10
_ENCRYPTED_HINT = ("not a MindSpore checkpoint or encrypted (save it unencrypted with "
                   "mindspore.save_checkpoint(..., enc_key=None))")

_Value = Checkpoint.Value


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    out = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7
    raise ValueError("truncated varint")


def _values(buf, end: int):
    """Yield each Checkpoint.Value: the file is a run of (field 1, length-delimited) records."""
    pos = 0
    while pos < end:
        if buf[pos] != 0x0A:  # field 1, wire type 2: the only thing MindSpore writes at the top level
            raise ValueError(f"unexpected byte {buf[pos]:#x} at offset {pos}")
        size, pos = _varint(buf, pos + 1, end)
        if pos + size > end:
            raise ValueError(f"a record at offset {pos} runs past the end of the file")
        value = _Value()
        value.ParseFromString(bytes(buf[pos:pos + size]))
        pos += size
        yield value


def _decode(path: str, tag: str, dims: list[int], ttype: str, data: bytes) -> torch.Tensor | str:
    if ttype == "str":
        return data.decode("utf-32-le").rstrip("\x00")  # numpy "U" pads to a fixed width with NULs
    dtype = MS_TO_TORCH.get(ttype)
    if dtype is None:
        what = "Int4 (qint4x2) tensors" if ttype == "Int4" else f"tensor_type {ttype!r}"
        raise ValueError(f"{path}: parameter {tag!r}: {what} are not supported")
    item = torch.empty((), dtype=dtype).element_size()
    shape = [] if list(dims) == [0] and len(data) == item else list(dims)  # dims [0] = scalar (MindSpore's rule)
    numel = 1
    for d in shape:
        numel *= d
    if numel * item != len(data):
        raise ValueError(f"{path}: parameter {tag!r}: {len(data)} bytes do not fit shape {shape} of {ttype}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def has_crc(path: str | os.PathLike) -> bool:
    """Whether the file ends in MindSpore's crc trailer (save_checkpoint(..., crc_check=True))."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _TRAILER:
            return False
        f.seek(size - _TRAILER)
        return f.read(len(CRC_MARK)) == CRC_MARK


def read_ckpt(path: str | os.PathLike, *, require_crc: bool = False) -> dict[str, torch.Tensor | str]:
    """All values of a MindSpore .ckpt in file order: tensors keep their dtype, strings stay str.

    Verifies the crc trailer when there is one; require_crc=True (MindSpore's load_checkpoint(crc_check=True)) also
    refuses a file without one: a crc-protected file cut at a record boundary has lost its trailer and otherwise
    reads as a shorter valid file. A tag written twice, map tensors (MapParameter), Int4 tensors, encrypted or
    foreign files raise ValueError naming the file."""
    path = os.fspath(path)
    out: dict[str, torch.Tensor | str] = {}
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path}: empty file, {_ENCRYPTED_HINT}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                end = len(buf)
                if end >= _TRAILER and bytes(buf[end - _TRAILER:end - 10]) == CRC_MARK:
                    end -= _TRAILER
                    want = int.from_bytes(buf[end + len(CRC_MARK):], "big")
                    if zlib.crc32(buf[:end]) != want:
                        raise ValueError(f"{path}: crc32 check failed, the checkpoint file is damaged")
                elif require_crc:
                    raise ValueError(f"{path}: no crc trailer, but this checkpoint should carry one (it was saved "
                                     "with crc_check=True, or its sibling files carry one): the file was cut short; "
                                     "copy it again from the source")
                pending: list = []  # the pieces of the tensor being read: (tag, dims, type, [bytes])

                def flush():
                    if pending:
                        tag, dims, ttype, parts = pending.pop()
                        if tag in out:  # MindSpore would let the later one win: silently wrong weights
                            raise ValueError(f"{path}: parameter {tag!r} is written twice; a checkpoint holds each "
                                             "name once (a damaged or concatenated file?)")
                        out[tag] = _decode(path, tag, dims, ttype, b"".join(parts))

                try:
                    for value in _values(buf, end):
                        if value.WhichOneof("value") == "maptensor":
                            raise ValueError(f"{path}: parameter {value.tag!r} is a map tensor (MapParameter), "
                                             "which is not supported")
                        t = value.tensor
                        key = (value.tag, list(t.dims), t.tensor_type)
                        if pending and pending[0][:3] == key:
                            pending[0][3].append(t.tensor_content)
                            continue
                        flush()
                        pending.append((*key, [t.tensor_content]))
                    flush()
                except ValueError as e:
                    if str(e).startswith(path):
                        raise
                    raise ValueError(f"{path}: {_ENCRYPTED_HINT} ({e})") from None
                except Exception as e:  # protobuf's DecodeError and friends
                    raise ValueError(f"{path}: {_ENCRYPTED_HINT} ({type(e).__name__}: {e})") from None
            finally:
                buf.release()
    return out


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())  # raw little-endian bytes, whatever the dtype (bf16 too)


def _records(name: str, value) -> list[tuple[list[int], str, bytes | memoryview]]:
    """(dims, tensor_type, content) pieces for one value, as MindSpore's save_checkpoint makes them."""
    if isinstance(value, str):
        return [([0], "str", value.encode("utf-32-le"))]
    if isinstance(value, bool):
        value = torch.tensor(value)
    elif isinstance(value, int):  # MindSpore wraps append_dict numbers in Tensor(): int -> Int64, float -> Float32
        value = torch.tensor(value, dtype=torch.int64)
    elif isinstance(value, float):
        value = torch.tensor(value, dtype=torch.float32)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"write_ckpt: {name!r} is a {type(value).__name__}, expected a tensor, str, int or float")
    ttype = TORCH_TO_MS.get(value.dtype)
    if ttype is None:
        raise TypeError(f"write_ckpt: {name!r} has dtype {value.dtype}, which MindSpore checkpoints cannot hold")
    dims, data = list(value.shape), _tensor_bytes(value)
    pieces = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    return [(dims, ttype, p) for p in pieces]


def write_ckpt(path: str | os.PathLike, tensors: dict, *, crc: bool = False) -> None:
    """Write `tensors` (name -> tensor / str / int / float) as mindspore.save_checkpoint would, atomically.

    crc=True appends MindSpore's crc trailer (save_checkpoint(..., crc_check=True))."""
    def write(f) -> None:
        crc_num = 0
        for name, value in tensors.items():
            for dims, ttype, content in _records(name, value):
                msg = Checkpoint()
                v = msg.value.add()
                v.tag = name
                v.tensor.dims.extend(dims)
                v.tensor.tensor_type = ttype
                v.tensor.tensor_content = bytes(content)
                blob = msg.SerializeToString()
                crc_num = zlib.crc32(blob, crc_num)
                f.write(blob)
        if crc:
            f.write(CRC_MARK + crc_num.to_bytes(10, "big"))

    atomic_write(os.fspath(path), write, suffix=".ckpt")
