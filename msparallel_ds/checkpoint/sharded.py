"""Sharded training checkpoints on torch.distributed.checkpoint (DCP): every rank writes only what it owns.

    engine.save("ckpt/", sharded=True)                   # or async_save=True: returns once the state is staged
    engine.load("ckpt/")                                 # any layout: tp, pp, vpp, ep, dp, ZeRO level, world size

What is stored, per parameter under its HF name, as DCP keys `NAME/fp32`, `NAME/exp_avg`, `NAME/exp_avg_sq`: the
FULL logical tensor, described to DCP chunk by chunk. A tensor split over tp (or ep) by the shard spec is a DTensor
on that group's mesh with Shard(spec.dim), so DCP records each tp rank's chunk with its offset; a replicated one is
a plain tensor. Each chunk is written by ONE of its replicas (`writes`: parameter i's chunk by dp x cp rank
i mod dp*cp; with ZeRO-1 in the pipeline engine by the rank owning its optimizer state), so data-parallel replicas
are written once and no rank holds more than its share. ZeRO-1/2 (DeepSpeed) weights and moments are flat partitions:
the save copies this rank's fragments (checkpoint.zero_stage) and the writer thread rebuilds one parameter's
tp-local tensors at a time onto its writer over a gloo clone of the dp group, so they reload under any dp size or
ZeRO level and an async save returns after local copies.
Loading asks DCP for this rank's chunk under the new layout (a DTensor on the new tp mesh), in buckets of
LOAD_BUCKET_BYTES, after every check (names, shapes, the saved model config, every chunk's crc32) passed on every
rank. The progress (steps, lr scheduler) is DATA/progress.pt; the manifest (folder.MANIFEST, written last, with one
crc32 per written chunk, over its stored bytes) marks the save complete.

DCP's collectives run on a dedicated gloo group, so an async save's writer thread never interleaves with training's
collectives; at most one save is in flight per process (the next save, load or `wait_pending` waits for it), and a
save killed mid-write leaves the previous manifest, so the previous checkpoint loads.
"""
from __future__ import annotations

import json
import os
import threading
import uuid
import zlib
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from .folder import MANIFEST, acquire_lock, release_lock, remove_superseded, sweep_stale_temps
from .format import CheckpointSaveError, _save_failure, agreed, atomic_write, check_model_config, check_names
from .writers import writes

__all__ = ["DCP_FORMAT", "LOAD_BUCKET_BYTES", "load_sharded", "open_sharded", "read_manifest", "save_sharded",
           "wait_pending", "write_whole", "writes"]

DCP_FORMAT = "msparallel_ds.dcp/1"
PROGRESS = "progress.pt"
LOAD_BUCKET_BYTES = 256 << 20
_PENDING: list = []  # [(thread, box)] of the save in flight in this process


def _group(layout):
    """The gloo group DCP runs on (made once per layout, by every rank at its first sharded save or load)."""
    g = getattr(layout, "_msp_ckpt_group", None)
    if g is None:
        g = dist.new_group(backend="gloo")
        layout._msp_ckpt_group = g
    return g


def _dcp_tensor(t: torch.Tensor, shard, layout):
    """`t` (this rank's chunk) as DCP sees it: a DTensor on the shard group's mesh when split."""
    if not shard.is_split or layout.size(shard.group) == 1:
        return t
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t, _mesh(layout, shard.group), [Shard(shard.dim)], run_check=False)


def _mesh(layout, name: str):
    from torch.distributed.device_mesh import DeviceMesh

    meshes = layout.__dict__.setdefault("_msp_ckpt_meshes", {})
    if name not in meshes:
        meshes[name] = DeviceMesh.from_group(layout.group(name), "cpu", mesh_dim_names=(name,))
    return meshes[name]


def wait_pending() -> None:
    """Wait for this process's save in flight; its failure is raised here (CheckpointSaveError)."""
    while _PENDING:
        thread, box = _PENDING.pop()
        thread.join()
        if box.get("error"):
            raise CheckpointSaveError(box["error"])


# ---------------------------------------------------------------------------------------------- save
def _chunk_crcs(data: str, rank: int) -> dict[str, int]:
    """crc32 of the stored bytes of every chunk this rank wrote (DCP's storage_data: file, offset, length)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(data).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        if info.relative_path.startswith(f"__{rank}_"):
            out[_chunk_key(index)] = _crc_of(os.path.join(data, info.relative_path), info.offset, info.length)
    return out


def _chunk_key(index) -> str:
    return f"{index.fqn}@{','.join(map(str, index.offset or ()))}"


def _crc_of(path: str, offset: int, length: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            block = f.read(min(length, 16 << 20))
            if not block:
                break
            crc, length = zlib.crc32(block, crc), length - len(block)
    return crc


def _nonfinite(sd: dict) -> list[str]:
    """Keys of tensors holding NaN or inf: one min/max pass each (both propagate NaN), no mask allocated."""
    out = []
    for k, t in sd.items():
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
            out.append(k)
    return out


def save_sharded(engine, save_dir: str, records: Iterable, *, optimizer_step: float, model,
                 async_save: bool = False, replicas: int = 0, rebuild=None) -> None:
    """Every rank calls. `records` yields (HF name, Shard, {key: this rank's chunk}) for the chunks this rank writes
    (collectives inside run in the same order on every rank). `rebuild` (checkpoint.zero_stage.Rebuild): more such
    records, made in the writer from a snapshot already taken (`rebuild.staged`), with collectives on its own gloo
    groups. Returns when written, or with `async_save` once the chunks are staged on CPU (the rebuild, writing,
    checksums and manifest go on in a thread). `replicas=1`: each rank's files are also written by a
    data-parallel peer (checkpoint.replicas)."""
    from .replicas import check_replicas

    replicas = check_replicas(replicas, engine.layout)
    wait_pending()
    layout, group = engine.layout, _group(engine.layout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    box: list = [None, None]
    if rank == 0:
        try:
            acquire_lock(save_dir)
            sweep_stale_temps(save_dir)
            box[1] = f"dcp-{engine.global_steps:09d}-{uuid.uuid4().hex[:8]}"
        except Exception as e:  # shared below
            box[0] = _save_failure(e, save_dir)
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        raise CheckpointSaveError(box[0])
    data = os.path.join(save_dir, box[1])
    try:
        sd = {}
        for name, shard, rec in records:
            for k, t in rec.items():
                sd[f"{name}/{k}"] = _dcp_tensor(t.detach().to("cpu", copy=True), shard, layout)
        staged = {**sd, **(rebuild.staged if rebuild else {})}
        for name in rebuild.groups if rebuild else ():
            if layout.size(name) > 1:
                _mesh(layout, name)  # made here: the writer thread only reads them
        bad: list = [None] * world
        dist.all_gather_object(bad, _nonfinite(staged)[:3], group=group)
        del staged  # a sync save's rebuild frees the snapshot as it goes: no reference may outlive this check
        bad = [b for part in bad for b in part]
        if bad:
            raise CheckpointSaveError(
                f"engine.save: refusing to write non-finite training state to {save_dir}: tensors hold NaN/inf "
                f"(first: {bad[:3]}); the previous checkpoint there is kept. Training diverged: lower the learning "
                "rate or check the data, and resume from the kept checkpoint with engine.load")
    except BaseException:
        if rank == 0:
            release_lock(save_dir)
        raise
    sched, config = engine.lr_scheduler, getattr(model, "config", None)
    progress = {"optimizer_step": float(optimizer_step), "global_steps": engine.global_steps,
                "lr_scheduler": sched.state_dict() if sched is not None else None}
    meta = {"format": DCP_FORMAT, "data": box[1], "checksum": "crc32",
            "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
            "global_steps": engine.global_steps, "world_size": world,
            "mesh": {n: layout.size(n) for n in ("pp", "dp", "cp", "tp", "ep")}}
    state = {}

    def write():
        message = None
        try:
            from torch.distributed.checkpoint import FileSystemWriter, save

            for name, shard, rec in rebuild() if rebuild else ():
                for k, t in rec.items():
                    sd[f"{name}/{k}"] = _dcp_tensor(t, shard, layout)
            save(sd, storage_writer=FileSystemWriter(data), process_group=group)
            sd.clear()  # the staged chunks are on disk
            crcs = _chunk_crcs(data, rank)
            if replicas:
                from .replicas import mirror_files

                mirror_files(data, rank, layout, group, progress)
        except Exception as e:  # DCP raises on every rank when any rank's write failed
            message, crcs = _save_failure(e, data), None
        parts: list = [None] * world
        dist.all_gather_object(parts, (message, crcs), group=group)
        message = next((m for m, _ in parts if m is not None), None)
        if rank == 0:
            try:
                if message is None:
                    torch.save(progress, os.path.join(data, PROGRESS))
                    record = {**meta, "checksums": {k: v for _, c in parts for k, v in c.items()}}
                    path = os.path.join(save_dir, MANIFEST)
                    atomic_write(path, lambda f: f.write(json.dumps(record).encode()), suffix=".json")
                    remove_superseded(save_dir, keep=box[1])  # older data, other formats: superseded now
            except Exception as e:
                message = _save_failure(e, save_dir)
            finally:
                release_lock(save_dir)
        out = [message]
        dist.broadcast_object_list(out, src=0, group=group)
        state["error"] = out[0]

    if not async_save:
        write()
        if state["error"]:
            raise CheckpointSaveError(state["error"])
        return
    thread = threading.Thread(target=write, name="msp-async-save", daemon=True)
    thread.start()
    _PENDING.append((thread, state))


def write_whole(params: dict, progress: dict, model_config: Optional[dict], save_dir: str) -> None:
    """This process alone writes a full-size training state ({name: {key: tensor}}) into the empty folder
    save_dir in the sharded format (convert-checkpoint --sharded); engine.load reshards it for any layout."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    name = f"dcp-{progress['global_steps']:09d}-{uuid.uuid4().hex[:8]}"
    data = os.path.join(save_dir, name)
    save({f"{n}/{k}": t for n, rec in params.items() for k, t in rec.items()}, storage_writer=FileSystemWriter(data),
         no_dist=True)
    torch.save(progress, os.path.join(data, PROGRESS))
    record = {"format": DCP_FORMAT, "data": name, "checksum": "crc32", "model_config": model_config,
              "global_steps": progress["global_steps"], "world_size": 1, "checksums": _chunk_crcs(data, 0)}
    atomic_write(os.path.join(save_dir, MANIFEST), lambda f: f.write(json.dumps(record).encode()), suffix=".json")


# ---------------------------------------------------------------------------------------------- load
def read_manifest(load_dir: str) -> dict[str, Any]:
    path = os.path.join(load_dir, MANIFEST)
    try:
        with open(path) as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable msparallel_ds checkpoint manifest ({type(e).__name__}: {e}); "
                         "load an earlier checkpoint or save again") from None
    if not isinstance(man, dict) or man.get("format") != DCP_FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {man.get('format') if isinstance(man, dict) else man!r}"
                         f" (expected {DCP_FORMAT})")
    return man


def _verify(data: str, md, stored: dict, rank: int, world: int, source: str) -> None:
    """This rank's share (every world-th chunk) of the crc32 checks of the whole checkpoint."""
    entries = sorted(md.storage_data.items(), key=lambda kv: _chunk_key(kv[0]))
    for index, info in entries[rank::world]:
        key = _chunk_key(index)
        want = stored.get(key)
        got = _crc_of(os.path.join(data, info.relative_path), info.offset, info.length)
        if want is None or got != want:
            raise ValueError(f"{source}: chunk {key} does not match its checksum (crc32 {got:#010x}, saved "
                             f"{want if want is None else f'{want:#010x}'}): the file {info.relative_path} is "
                             "corrupted (flipped bytes, a bad disk or copy); load an earlier checkpoint or copy it "
                             "again. Nothing was loaded")


def open_sharded(engine, load_dir: str, wanted: list, model, *, subset: bool = False) -> dict[str, Any]:
    """Check everything before any tensor is touched, on every rank (agreed): `wanted` lists (name, local shape,
    Shard, keys) this rank loads. Returns the plan load_sharded reads."""
    from torch.distributed.checkpoint import FileSystemReader

    wait_pending()
    layout, group = engine.layout, _group(engine.layout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def restore():  # a lost node's files, from its data-parallel peers' copies (checkpoint.replicas)
        from .replicas import restore_missing

        return restore_missing(os.path.join(load_dir, read_manifest(load_dir)["data"]), load_dir) if rank == 0 else []

    agreed(restore, f"engine.load({load_dir!r})")

    def check():
        man = read_manifest(load_dir)
        data = os.path.join(load_dir, man["data"])
        md = FileSystemReader(data).read_metadata()
        saved = md.state_dict_metadata
        check_names((n for n, *_ in wanted), {k.rsplit("/", 1)[0] for k in saved}, load_dir, subset=subset)
        check_model_config(man.get("model_config"), model, load_dir)
        items = []
        for name, shape, shard, keys in wanted:
            split = shard.is_split and layout.size(shard.group) > 1
            full = shard.full_shape(shape, layout.size(shard.group)) if split else tuple(shape)
            for k in keys:
                if f"{name}/{k}" not in saved:
                    continue  # moments of a checkpoint saved before the first step
                got = tuple(saved[f"{name}/{k}"].size)
                if got != tuple(full):
                    raise ValueError(f"{load_dir}: parameter {name}: checkpoint tensor of shape {got} does not fit "
                                     f"parameter of shape {tuple(shape)} under this layout (full {tuple(full)}; was "
                                     "it saved from another model?). Nothing was loaded")
                items.append((name, k, tuple(shape), shard))
        _verify(data, md, man.get("checksums") or {}, rank, world, load_dir)
        progress = torch.load(os.path.join(data, PROGRESS), map_location="cpu", weights_only=True)
        return {"data": data, "items": items, "progress": progress}

    return agreed(check, f"engine.load({load_dir!r})")


def load_sharded(engine, plan: dict, apply: Callable[[str, dict], None]) -> dict[str, Any]:
    """Read this rank's chunks (under this layout) in buckets and hand each parameter's {key: tensor} to `apply`.
    Returns the progress record (global_steps, optimizer_step, lr_scheduler) for format.resume_progress."""
    from torch.distributed.checkpoint import FileSystemReader, load

    layout, group = engine.layout, _group(engine.layout)
    buckets, size = [[]], 0
    for item in plan["items"]:
        n = 4 * torch.Size(item[2]).numel()
        if size and size + n > LOAD_BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += n
    count = torch.tensor([len(buckets)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # every rank calls DCP's load as often
    buckets += [[] for _ in range(int(count.item()) - len(buckets))]
    for bucket in buckets:
        sd = {f"{name}/{k}": _dcp_tensor(torch.empty(shape, dtype=torch.float32), shard, layout)
              for name, k, shape, shard in bucket}
        load(sd, storage_reader=FileSystemReader(plan["data"]), process_group=group)
        recs: dict = {}
        for name, k, _, _ in bucket:
            t = sd[f"{name}/{k}"]
            recs.setdefault(name, {})[k] = t.to_local() if hasattr(t, "to_local") else t
        for name, rec in recs.items():
            apply(name, rec)
    return plan["progress"]
