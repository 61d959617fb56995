"""MindSpore checkpoint / strategy readers (msparallel_ds.checkpoint.mindspore_files), without MindSpore."""
from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from msparallel_ds.checkpoint.mindspore_files import (
    ckpt_file, make_layout, merge, read_ckpt, read_mindspore_weights, read_strategies, read_strategy, slice_of,
    write_ckpt, write_strategy)
from msparallel_ds.checkpoint.mindspore_files.proto import Checkpoint, ParallelStrategyMap

DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 50).to(dtype)


# ---- proto ----------------------------------------------------------------------------------------------------

def test_proto_round_trips():
    c = Checkpoint()
    v = c.value.add(tag="w")
    v.tensor.dims.extend([2, 3])
    v.tensor.tensor_type = "Float32"
    v.tensor.tensor_content = b"x" * 24
    back = Checkpoint.FromString(c.SerializeToString())
    assert back == c and back.value[0].WhichOneof("value") == "tensor"
    m = ParallelStrategyMap(current_stage=1)
    pl = m.parallel_layout_item.add(param_name="0-w").parallel_layouts
    pl.dev_matrix.add().dim.extend([2, 4])
    pl.tensor_map.add().dim.extend([1, -1])
    pl.field, pl.opt_weight_shard_step, pl.opt_weight_shard_size = 0, 4, -1
    assert ParallelStrategyMap.FromString(m.SerializeToString()) == m


def _ld(field: int, payload: bytes) -> bytes:  # one length-delimited protobuf field (short payloads)
    assert len(payload) < 128
    return bytes([field << 3 | 2, len(payload)]) + payload


def test_hand_built_value_bytes(tmp_path):
    content = torch.tensor([[1, -2, 3], [4, 5, -6]], dtype=torch.int16).numpy().tobytes()
    tensor = bytes([1 << 3, 2, 1 << 3, 3]) + _ld(2, b"Int16") + _ld(3, content)  # dims 2, dims 3 (varints)
    value = _ld(1, b"w") + _ld(2, tensor)
    (tmp_path / "h.ckpt").write_bytes(_ld(1, value))
    out = read_ckpt(tmp_path / "h.ckpt")
    assert list(out) == ["w"] and out["w"].dtype == torch.int16
    assert out["w"].tolist() == [[1, -2, 3], [4, 5, -6]]
    assert Checkpoint.FromString(_ld(1, value)).value[0].tensor.dims == [2, 3]


# ---- .ckpt files ----------------------------------------------------------------------------------------------

def test_ckpt_round_trip_all_dtypes_scalars_strings(tmp_path):
    data = {f"p.{str(dt)[6:]}": _rand((3, 5), dt, i) for i, dt in enumerate(DTYPES)}
    data.update({"zero_d": torch.tensor(2.5, dtype=torch.float16), "one": torch.tensor([7], dtype=torch.int32),
                 "empty": torch.zeros(0, 4), "epoch_num": 3, "loss_scale": 1024.0, "flag": True, "note": "héllo"})
    write_ckpt(tmp_path / "a.ckpt", data)
    out = read_ckpt(tmp_path / "a.ckpt")
    assert list(out) == list(data)
    for name, v in data.items():
        if isinstance(v, torch.Tensor):
            assert out[name].dtype == v.dtype and out[name].shape == v.shape and torch.equal(out[name], v), name
    # Python numbers become 0-d tensors as MindSpore's Tensor(value) does: int -> Int64, float -> Float32
    assert out["epoch_num"].dtype == torch.int64 and out["epoch_num"].shape == () and out["epoch_num"].item() == 3
    assert out["loss_scale"].dtype == torch.float32 and out["loss_scale"].item() == 1024.0
    assert out["flag"].dtype == torch.bool and out["note"] == "héllo"
    records = Checkpoint.FromString((tmp_path / "a.ckpt").read_bytes()).value
    by_tag = {v.tag: v.tensor for v in records}
    assert list(by_tag["zero_d"].dims) == [] and list(by_tag["note"].dims) == [0]
    assert by_tag["note"].tensor_type == "str" and by_tag["note"].tensor_content == "héllo".encode("utf-32-le")
    assert by_tag["p.bfloat16"].tensor_type == "BFloat16" and by_tag["p.uint64"].tensor_type == "UInt64"


def test_dims_zero_is_a_scalar(tmp_path):
    c = Checkpoint()
    v = c.value.add(tag="s")
    v.tensor.dims.append(0)
    v.tensor.tensor_type = "Float32"
    v.tensor.tensor_content = torch.tensor([1.5]).numpy().tobytes()
    (tmp_path / "s.ckpt").write_bytes(c.SerializeToString())
    out = read_ckpt(tmp_path / "s.ckpt")["s"]
    assert out.shape == () and out.item() == 1.5


def test_chunked_large_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_file, "CHUNK_BYTES", 40)
    big, small = _rand((7, 9), torch.bfloat16), _rand((3,), torch.float32, 1)
    write_ckpt(tmp_path / "c.ckpt", {"big": big, "small": small}, crc=True)
    raw = (tmp_path / "c.ckpt").read_bytes()
    values = Checkpoint.FromString(raw[:-17]).value
    assert [v.tag for v in values] == ["big"] * 4 + ["small"]  # 126 bytes in pieces of 40
    assert all(list(v.tensor.dims) == [7, 9] for v in values[:4])
    out = read_ckpt(tmp_path / "c.ckpt")
    assert torch.equal(out["big"], big) and torch.equal(out["small"], small)


def test_crc_trailer(tmp_path):
    write_ckpt(tmp_path / "c.ckpt", {"w": _rand((4, 4), torch.float32)}, crc=True)
    raw = (tmp_path / "c.ckpt").read_bytes()
    assert raw[-17:-10] == b"crc_num" and int.from_bytes(raw[-10:], "big") == zlib.crc32(raw[:-17])
    assert torch.equal(read_ckpt(tmp_path / "c.ckpt")["w"], _rand((4, 4), torch.float32))
    bad = bytearray(raw)
    bad[30] ^= 0xFF
    (tmp_path / "bad.ckpt").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=r"bad\.ckpt.*crc32 check failed"):
        read_ckpt(tmp_path / "bad.ckpt")


def test_garbage_and_unsupported(tmp_path):
    (tmp_path / "g.ckpt").write_bytes(os.urandom(64) + b"\xff")
    (tmp_path / "e.ckpt").write_bytes(b"")
    for name in ("g.ckpt", "e.ckpt"):
        with pytest.raises(ValueError, match=rf"{name}.*not a MindSpore checkpoint or encrypted.*enc_key=None"):
            read_ckpt(tmp_path / name)
    c = Checkpoint()
    t = c.value.add(tag="m").maptensor.tensor.add(tensor_type="Int32", tensor_content=b"abcd")
    t.dims.append(1)
    (tmp_path / "m.ckpt").write_bytes(c.SerializeToString())
    with pytest.raises(ValueError, match=r"m\.ckpt.*'m'.*map tensor"):
        read_ckpt(tmp_path / "m.ckpt")
    c = Checkpoint()
    v = c.value.add(tag="q")
    v.tensor.dims.append(2)
    v.tensor.tensor_type, v.tensor.tensor_content = "Int4", b"\x12"
    (tmp_path / "q.ckpt").write_bytes(c.SerializeToString())
    with pytest.raises(ValueError, match=r"q\.ckpt.*'q'.*Int4"):
        read_ckpt(tmp_path / "q.ckpt")


# ---- strategy: layouts, slice_of, merge ----------------------------------------------------------------------

CASES = [  # (dev_matrix, tensor_map, opt_shard_size, full shape)
    ([2, 2], [0, -1], 0, (8, 6)), ([2, 2], [-1, 0], 0, (8, 6)), ([2, 2], [1, -1], 0, (8, 6)),
    ([2, 2], [-1, -1], 0, (8, 6)), ([2, 2], [1, 0], 0, (8, 6)), ([2, 2], [0, 1], 0, (8, 6)),
    ([2, 2, 2], [2, -1], 0, (8, 6)), ([2, 2, 2], [1, -1, 0], 0, (8, 6, 4)), ([2, 2, 2], [-1, 2], 0, (8, 6)),
    ([2, 2], [0, -1], 2, (8, 6)), ([2, 2], [0, -1], -1, (8, 6)), ([2, 2], [1, -1], 2, (8, 6)),
    ([2, 2], [-1, -1], 4, (8, 6)), ([2, 2], [-1, -1], -1, (8, 6)), ([2, 2, 2], [0, -1], 4, (16, 6)),
    ([2, 2, 2], [1, -1], 2, (8, 6)), ([4, 2], [0, -1], 2, (8, 6)), ([2, 4], [1, -1], 2, (8, 6)),
    ([2, 2, 2], [[2, 1], -1], 0, (8, 6)), ([4, 2, 2], [[2, 1], 0], 0, (16, 8)), ([2, 2, 2], [[2, 1], -1], 2, (16, 6)),
    ([2, 2, 2], [[1, 0], -1], 2, (16, 6)), ([2], [-1], 2, (6,)),
]


@pytest.mark.parametrize("dev,tmap,opt,shape", CASES)
def test_slice_then_merge(dev, tmap, opt, shape):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    lay = make_layout(dev, tmap, 1 if opt else 0, opt)
    n = lay.device_num
    slices = {r: slice_of(full, lay, r) for r in range(n)}
    assert torch.equal(merge("w", lay, slices), full)
    # a second pipeline stage (ranks n..2n-1) holds the same layout
    assert torch.equal(merge("w", lay, {r + n: s for r, s in slices.items()}), full)
    assert torch.equal(merge("w", lay, slices, full_shape=shape), full)


def test_hand_checked_slices():
    full = torch.arange(8 * 2).reshape(8, 2)
    rows = (lambda t: t[:, 0].div(2, rounding_mode="floor").tolist())
    # rank 2 = coordinate (1, 0); axis 1 is dev_matrix[0] -> chunk 1 of 2
    assert rows(slice_of(full, make_layout([2, 2], [1, -1]), 2)) == [4, 5, 6, 7]
    # axis 0 is the last (fastest) dev-matrix axis: rank 1 -> chunk 1, rank 2 -> chunk 0
    assert rows(slice_of(full, make_layout([2, 2], [0, -1]), 1)) == [4, 5, 6, 7]
    assert rows(slice_of(full, make_layout([2, 2], [0, -1]), 2)) == [0, 1, 2, 3]
    # + optimizer shard of 2: ranks 1 and 3 hold chunk 1, rank 3 is second in that group -> rows 6, 7
    assert rows(slice_of(full, make_layout([2, 2], [0, -1], 2, 2), 3)) == [6, 7]
    # opt size -1 = whole repeat group (4 ranks): rank 2 -> rows 4, 5
    assert rows(slice_of(full, make_layout([2, 2], [-1, -1], 1, -1), 2)) == [4, 5]
    # multi-axis map: rank 5 = (1, 0, 1); dim 0 cut by axes 2 then 0 -> chunk 1*2 + 1 = 3 of 4
    assert rows(slice_of(full, make_layout([2, 2, 2], [[2, 0], -1]), 5)) == [6, 7]
    # global rank 6 in a 4-device stage is stage-local rank 2
    assert rows(slice_of(full, make_layout([2, 2], [1, -1]), 6)) == [4, 5, 6, 7]
    # without the optimizer shard (integrated_save-free, opt_sharded=False) rank 3 holds its model-parallel slice
    assert rows(slice_of(full, make_layout([2, 2], [0, -1], 2, 2), 3, opt_sharded=False)) == [4, 5, 6, 7]


def test_merge_opt_sharded_decision_and_errors():
    full = torch.arange(32.0).reshape(8, 4)
    lay = make_layout([2, 2], [0, -1], 2, 2)
    plain = {r: slice_of(full, lay, r, opt_sharded=False) for r in range(4)}
    assert torch.equal(merge("w", lay, plain, opt_sharded=False), full)
    assert torch.equal(merge("w", lay, plain, full_shape=(8, 4)), full)  # decided from the shapes
    sharded = {r: slice_of(full, lay, r) for r in range(4)}
    del sharded[3]
    with pytest.raises(ValueError, match=r"'w'.*missing.*\[\[3\]\]"):
        merge("w", lay, sharded)
    # replicas: any one rank of each repeat group is enough
    mp = make_layout([2, 2], [0, -1])
    assert torch.equal(merge("w", mp, {r: slice_of(full, mp, r) for r in (2, 1)}), full)
    with pytest.raises(ValueError, match=r"'w'.*1 slice\(s\) missing.*\[\[1, 3\]\]"):
        merge("w", mp, {r: slice_of(full, mp, r) for r in (0, 2)})
    uneven = make_layout([2, 2], [0, -1], param_split_shape=[3, 5])
    with pytest.raises(ValueError, match="'w'.*uneven"):
        merge("w", uneven, plain)
    with pytest.raises(ValueError, match="'w'.*does not split"):
        slice_of(torch.zeros(3, 2), mp, 0, name="w")


def test_strategy_files(tmp_path):
    lays = {"w": make_layout([2, 2], [1, -1], 2, 2), "b": make_layout([2, 2], [-1], 0, 0),
            "x": make_layout([2, 2, 2], [[2, 1], -1], 1, -1)}
    write_strategy(tmp_path / "s.ckpt", lays)
    assert read_strategy(tmp_path / "s.ckpt") == lays
    assert lays["x"].opt_shard_size == 2 and lays["x"].tensor_map == ((2, 1), ())
    flat = {k: v for k, v in lays.items() if k != "x"}
    write_strategy(tmp_path / "s.json", flat)
    assert read_strategy(tmp_path / "s.json") == flat
    # merged pipeline strategy: "<stage>-<name>"
    m = ParallelStrategyMap.FromString((tmp_path / "s.ckpt").read_bytes())
    m.parallel_layout_item[0].param_name = "1-w"
    (tmp_path / "m.ckpt").write_bytes(m.SerializeToString())
    assert read_strategy(tmp_path / "m.ckpt")["w"] == lays["w"]
    folder = tmp_path / "strategy"
    folder.mkdir()
    write_strategy(folder / "ckpt_strategy_rank_0.ckpt", {"a": lays["w"]}, stage=0)
    write_strategy(folder / "ckpt_strategy_rank_4.ckpt", {"b": lays["b"]}, stage=1)
    assert read_strategies(folder) == {"a": lays["w"], "b": lays["b"]}
    write_strategy(folder / "ckpt_strategy_rank_5.ckpt", {"a": lays["b"]}, stage=1)
    with pytest.raises(ValueError, match="'a' has different layouts"):
        read_strategies(folder)
    (tmp_path / "junk.ckpt").write_bytes(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="not a MindSpore parallel strategy"):
        read_strategy(tmp_path / "junk.ckpt")


# ---- read_mindspore_weights ------------------------------------------------------------------------------------

def _full_model():
    g = torch.Generator().manual_seed(0)
    return {"wq.weight": torch.randn(8, 4, generator=g).bfloat16(), "wo.weight": torch.randn(4, 8, generator=g),
            "norm.weight": torch.randn(8, generator=g), "emb.weight": torch.randn(16, 4, generator=g).half()}


LAYOUTS = {"wq.weight": make_layout([2, 2], [0, -1], 2, 2), "wo.weight": make_layout([2, 2], [-1, 0], 2, 2),
           "norm.weight": make_layout([2, 2], [-1], 1, -1), "emb.weight": make_layout([2, 2], [1, -1])}


def _write_run(out, full, steps=((1, 5),), extra=None):
    """MindFormers' layout: out/checkpoint/rank_{r}/llama_rank_{r}-{epoch}_{step}.ckpt + out/strategy/."""
    (out / "strategy").mkdir(parents=True)
    write_strategy(out / "strategy" / "ckpt_strategy_rank_0.ckpt", LAYOUTS)
    for r in range(4):
        d = out / "checkpoint" / f"rank_{r}"
        d.mkdir(parents=True)
        for epoch, step in steps:
            t = {n: slice_of(v * step, LAYOUTS[n], r, name=n) for n, v in full.items()}
            t.update({"adam_m.wq.weight": t["wq.weight"].float(), "epoch_num": epoch, "step_num": step,
                      "global_step": torch.tensor([step], dtype=torch.int32), "note": "x"})
            t.update(extra or {})
            write_ckpt(d / f"llama_rank_{r}-{epoch}_{step}.ckpt", t)


def test_rank_folders_dp2_mp2_opt_shard(tmp_path):
    full = _full_model()
    _write_run(tmp_path, full, steps=((1, 5), (2, 10), (1, 7)), extra={"lonely": torch.ones(3)})
    for src in (tmp_path / "checkpoint", tmp_path):
        w = read_mindspore_weights(src)
        assert list(w.tensors) == list(full) + ["lonely"]
        for n, v in full.items():
            assert w.tensors[n].dtype == v.dtype and torch.equal(w.tensors[n], v * 10), n
        assert w.dropped == {"adam_m.wq.weight": "optimizer state", "epoch_num": "training state scalar",
                             "step_num": "training state scalar", "global_step": "training state scalar",
                             "note": "string"}
        assert w.uncovered == {"lonely"}
        assert [os.path.basename(f) for f in w.files[:4]] == [f"llama_rank_{r}-2_10.ckpt" for r in range(4)]
        assert w.files[-1].endswith("ckpt_strategy_rank_0.ckpt")
    w = read_mindspore_weights(tmp_path / "checkpoint", strategy=tmp_path / "strategy" / "ckpt_strategy_rank_0.ckpt")
    assert torch.equal(w.tensors["wq.weight"], full["wq.weight"] * 10)


def test_rank_folder_errors(tmp_path):
    full = _full_model()
    _write_run(tmp_path / "a", full)
    os.remove(tmp_path / "a" / "checkpoint" / "rank_3" / "llama_rank_3-1_5.ckpt")
    write_ckpt(tmp_path / "a" / "checkpoint" / "rank_3" / "llama_rank_3-1_6.ckpt", {"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="different \\(epoch, step\\)s"):
        read_mindspore_weights(tmp_path / "a" / "checkpoint")
    _write_run(tmp_path / "b", full)
    os.remove(tmp_path / "b" / "checkpoint" / "rank_3" / "llama_rank_3-1_5.ckpt")
    os.rmdir(tmp_path / "b" / "checkpoint" / "rank_3")
    with pytest.raises(ValueError, match=r"'wq.weight'.*missing.*\[\[3\]\]"):
        read_mindspore_weights(tmp_path / "b" / "checkpoint")
    _write_run(tmp_path / "c", full)
    for f in os.listdir(tmp_path / "c" / "strategy"):
        os.remove(tmp_path / "c" / "strategy" / f)
    os.rmdir(tmp_path / "c" / "strategy")
    with pytest.raises(ValueError, match="pass --strategy"):
        read_mindspore_weights(tmp_path / "c" / "checkpoint")


def test_single_ckpt_and_safetensors_index(tmp_path):
    from safetensors.torch import save_file

    full = _full_model()
    write_ckpt(tmp_path / "one.ckpt", {**full, "moment1.wo.weight": full["wo.weight"], "step_num": 3})
    w = read_mindspore_weights(tmp_path / "one.ckpt")
    assert list(w.tensors) == list(full) and all(torch.equal(w.tensors[n], full[n]) for n in full)
    assert set(w.dropped) == {"moment1.wo.weight", "step_num"} and not w.uncovered
    st = tmp_path / "st"
    st.mkdir()
    names = list(full)
    save_file({n: full[n] for n in names[:2]}, str(st / "m-00001-of-00002.safetensors"), metadata={"format": "ms"})
    save_file({n: full[n] for n in names[2:]} | {"adam_v.norm.weight": full["norm.weight"].clone()},
              str(st / "m-00002-of-00002.safetensors"))
    wmap = {n: f"m-0000{1 + (i >= 2)}-of-00002.safetensors" for i, n in enumerate(names)}
    wmap["adam_v.norm.weight"] = "m-00002-of-00002.safetensors"
    (st / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    for src in (st, st / "model.safetensors.index.json"):
        w = read_mindspore_weights(src)
        assert set(w.tensors) == set(full) and all(torch.equal(w.tensors[n], full[n]) for n in full)
        assert w.dropped == {"adam_v.norm.weight": "optimizer state"} and len(w.files) == 2
    w = read_mindspore_weights(st / "m-00001-of-00002.safetensors")
    assert set(w.tensors) == set(names[:2])  # safetensors keeps names sorted
    with pytest.raises(FileNotFoundError):
        read_mindspore_weights(tmp_path / "nope")


_TORCH_OF = {"Float16": torch.float16, "Float32": torch.float32, "Float64": torch.float64,
             "BFloat16": torch.bfloat16, "Int8": torch.int8, "Int16": torch.int16, "Int32": torch.int32,
             "Int64": torch.int64, "UInt8": torch.uint8, "UInt16": torch.uint16, "UInt32": torch.uint32,
             "UInt64": torch.uint64, "Bool": torch.bool}


@pytest.mark.parametrize("name", ["dtypes.ckpt", "dtypes_crc.ckpt"])
def test_reads_every_dtype_mindspore_wrote(name):
    """tests/fixtures/mindspore/dtypes: written by mindspore.save_checkpoint (2.7.0), values listed by MindSpore."""
    from pathlib import Path

    folder = Path(__file__).parent / "fixtures" / "mindspore" / "dtypes"
    expected = json.loads((folder / "expected.json").read_text())
    got = read_ckpt(str(folder / name))
    assert set(got) == set(expected)
    for key, want in expected.items():
        t = got[key]
        assert t.dtype == _TORCH_OF[want["dtype"]] and list(t.shape) == want["shape"], (key, t.dtype, t.shape)
        ref = torch.tensor(want["value"], dtype=torch.float64 if t.is_floating_point() else None)
        if t.dtype in (torch.uint16, torch.uint32, torch.uint64):  # torch has no uint64 literal above int64's range
            assert [int(v) for v in t.flatten().tolist()] == [int(v) for v in ref.flatten().tolist()], key
        else:
            assert torch.equal(t.to(ref.dtype), ref), key
