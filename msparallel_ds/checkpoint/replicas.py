"""Fault recovery from data-parallel replicas: every rank's files of a sharded save are also written by one peer.

    engine.save("ckpt/", replicas=1)     # YAML: callbacks CheckpointMonitor `replicas: 1`

The peer of a rank is the next rank of its data-parallel x context-parallel group (same pp stage, same tp / ep
slice, so on another node when tp is inside a node as in our rank order). What is redundant along dp: the module
weights. What is not: under ZeRO each dp rank owns a different partition of the fp32 master weights and Adam
moments, and `sharded.writes` spreads the chunks over the dp ranks, so a rank's files hold state its peer does not
have in memory. Hence the copy is of the written BYTES: after DCP has written the files, each rank sends them to its
peer (gloo point-to-point on the checkpoint group, in MIRROR_BLOCK blocks, so neither side holds more than a block
extra), and the peer writes them as DATA/mirror/by<peer>/<file>. Global rank 0's own DCP metadata (.metadata) goes
along with its chunks, and its peer writes a copy of progress.pt too. A rank's files are DATA/__<rank>_*.distcp (and
rank 0's .metadata, progress.pt) plus DATA/mirror/by<rank>/: losing them all (its node) leaves every byte on disk
once. On load, a missing data file is copied back from the mirror before the usual checks, so its crc32s (computed
over the original bytes) verify the copy; the resumed run is the uninterrupted one. The manifest (the commit mark,
msp_checkpoint.json in the save folder) is not mirrored: it lives beside the data in the shared checkpoint folder.
Cost: twice the disk, and each rank's file sent once over the network and written once more (benchmarks/checkpoint.py).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["MIRROR", "MIRROR_BLOCK", "check_replicas", "mirror_files", "peers", "restore_missing"]

MIRROR = "mirror"
MIRROR_BLOCK = 16 << 20


def check_replicas(replicas, layout) -> int:
    """The validated `replicas` (0 or 1); 1 needs a data-parallel peer."""
    if isinstance(replicas, bool) or replicas not in (0, 1):
        raise ValueError(f"engine.save: replicas={replicas!r} must be 0 (each chunk written once) or 1 (each rank's "
                         "files also written by one data-parallel peer; YAML: callbacks CheckpointMonitor replicas)")
    if replicas and layout.size("dp_cp") < 2:
        raise ValueError(f"engine.save: replicas=1 needs a data-parallel peer, but data_parallel x context_parallel "
                         f"= {layout.size('dp_cp')} (no other rank holds this rank's slice); use replicas=0, or "
                         "train with data_parallel >= 2")
    return int(replicas)


def peers(layout) -> tuple[int, int]:
    """(the global rank this rank's files go to, the global rank whose files this rank keeps): the next and the
    previous rank of its dp x cp group."""
    ranks = dist.get_process_group_ranks(layout.group("dp_cp"))
    k, n = layout.rank("dp_cp"), len(ranks)
    return ranks[(k + 1) % n], ranks[(k - 1) % n]


def _exchange(send: torch.Tensor, dst: int, src: int, nbytes_in: int, group) -> Optional[torch.Tensor]:
    ops = [dist.isend(send, dst, group=group)] if send.numel() else []
    got = torch.empty(nbytes_in, dtype=torch.uint8) if nbytes_in else None
    if got is not None:
        ops.append(dist.irecv(got, src, group=group))
    for op in ops:
        op.wait()
    return got


def mirror_files(data: str, rank: int, layout, group, progress: dict) -> None:
    """Every rank calls after DCP wrote `data`: send this rank's files to its peer, write the previous one's."""
    dst, src = peers(layout)
    names = sorted(f for f in os.listdir(data) if f.startswith(f"__{rank}_"))
    if rank == 0:
        names.append(".metadata")
    header = json.dumps([(n, os.path.getsize(os.path.join(data, n))) for n in names]).encode()
    size_in = _exchange(torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8), dst, src, 8, group)
    got = _exchange(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, src,
                    int(size_in.view(torch.int64).item()), group)
    incoming = json.loads(bytes(got.numpy()).decode())
    out = os.path.join(data, MIRROR, f"by{rank}")
    os.makedirs(out, exist_ok=True)

    def blocks(files):
        return [(name, off, min(MIRROR_BLOCK, size - off)) for name, size in files
                for off in range(0, size, MIRROR_BLOCK)]

    sends, recvs = blocks(json.loads(header.decode())), blocks(incoming)
    handles: dict = {}
    buf = torch.empty(MIRROR_BLOCK, dtype=torch.uint8)  # read straight into one block, written straight from one
    try:
        for i in range(max(len(sends), len(recvs))):
            block = buf[:0]
            if i < len(sends):
                name, off, n = sends[i]
                block = buf[:n]
                with open(os.path.join(data, name), "rb") as f:
                    f.seek(off)
                    if f.readinto(memoryview(block.numpy())) != n:
                        raise OSError(f"{name} changed while its copy was sent")
            n_in = recvs[i][2] if i < len(recvs) else 0
            got = _exchange(block, dst, src, n_in, group)
            if got is not None:
                name = recvs[i][0]
                if name not in handles:
                    handles[name] = open(os.path.join(out, name + ".partial"), "wb")
                handles[name].write(memoryview(got.numpy()))
        for name, f in handles.items():
            f.close()
            os.replace(os.path.join(out, name + ".partial"), os.path.join(out, name))
        for name, size in incoming:  # empty files have no block
            if size == 0:
                open(os.path.join(out, name), "wb").close()
    finally:
        for f in handles.values():
            f.close()
    if src == 0:  # rank 0's peer also keeps the progress record rank 0 writes after the mirror
        torch.save(progress, os.path.join(out, "progress.pt"))


def restore_missing(data: str, source: str) -> list[str]:
    """Copy back every file of `data` that is missing (a lost node's) from a peer's mirror; returns the restored
    names. A file missing with no copy is a clear error (its data is lost: load an earlier checkpoint)."""
    from torch.distributed.checkpoint import FileSystemReader

    mirror = os.path.join(data, MIRROR)
    copies = {}
    if os.path.isdir(mirror):
        for by in sorted(os.listdir(mirror)):
            for name in os.listdir(os.path.join(mirror, by)):
                if not name.endswith(".partial"):
                    copies.setdefault(name, os.path.join(mirror, by, name))
    restored = []

    def ensure(name: str) -> None:
        path = os.path.join(data, name)
        if os.path.exists(path):
            return
        if name not in copies:
            raise ValueError(f"{source}: the checkpoint file {path} is missing and no data-parallel peer kept a copy "
                             f"({'saved without replicas' if not os.path.isdir(mirror) else 'its peer lost too'}): "
                             "its ranks' state is gone; load an earlier checkpoint. Nothing was loaded")
        tmp = path + ".restoring"
        shutil.copyfile(copies[name], tmp)
        os.replace(tmp, path)
        restored.append(name)

    ensure(".metadata")
    ensure("progress.pt")
    md = FileSystemReader(data).read_metadata()
    for name in sorted({info.relative_path for info in md.storage_data.values()}):
        ensure(name)
    return restored
