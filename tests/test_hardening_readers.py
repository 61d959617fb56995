"""Hardening round 2, the readers (each test says what happened before the fix):
5. strategy files with absurd device matrices; 6. large YAMLs under the size cap; plus a fuzz test over the .ckpt,
strategy and YAML readers: a clear error or the correct result, within a time (hypothesis deadline) and memory
(peak RSS growth) bound."""
import json
import resource
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIX = Path(__file__).parent / "fixtures" / "mindspore"
FUZZ = settings(max_examples=40, deadline=timedelta(seconds=10), derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak so far (Linux: KiB)


# ------------------------------------------------------------------------------ 5. absurd strategy layouts
@pytest.mark.parametrize("dev_matrix, tensor_map, opt", [
    ([2147483648, 2], [[-1], [0]], 2),   # before: a loop over 4e9 ranks for minutes, growing to GBs; now
                                         # the right tensor (ranks 0-3 have (2, 2)'s coordinates)
    ([65536, 65536], [[1], [0]], 0),     # before: torch.empty of 4 TiB
    ([2147483648, 2], [[-1], [0]], -1),  # opt shard -1 = a 2e9 repeat group
    ([2, 0], [[-1], [0]], 2),            # before: ZeroDivisionError
    ([2, 2], [[0], [0]], 2),             # one axis splitting two dims
    ([2, 3], [[-1], [7]], 2),            # an axis outside the matrix
])
def test_absurd_strategy_layouts_are_one_clear_error(tmp_path, dev_matrix, tensor_map, opt):
    from msparallel_ds.checkpoint.mindspore_files import read_mindspore_weights
    from msparallel_ds.checkpoint.mindspore_files.proto import ParallelStrategyMap

    src = tmp_path / "run"
    shutil.copytree(FIX / "llama_mp2", src)
    path = src / "strategy" / "ckpt_strategy_rank_0.ckpt"
    msg = ParallelStrategyMap()
    msg.ParseFromString(path.read_bytes())
    name = "model.layers.1.attention.wo.weight"
    (item,) = [i for i in msg.parallel_layout_item if i.param_name == name]
    lay = item.parallel_layouts
    del lay.dev_matrix[0].dim[:]
    lay.dev_matrix[0].dim.extend(dev_matrix)
    del lay.tensor_map[:]
    for axes in tensor_map:
        lay.tensor_map.add().dim.extend(axes)
    lay.opt_weight_shard_size = opt
    path.write_bytes(msg.SerializeToString())
    before = _rss_mib()
    if dev_matrix[0] == 2147483648 and opt == 2:  # ranks 0-3 sit where they sit in (2, 2): the same tensors
        want = read_mindspore_weights(FIX / "llama_mp2").tensors[name]
        assert torch.equal(read_mindspore_weights(src).tensors[name], want)
    else:
        with pytest.raises(ValueError, match=name) as err:
            read_mindspore_weights(src)
        assert "\n" not in str(err.value) and len(str(err.value)) < 1000, str(err.value)
    assert _rss_mib() - before < 256


def test_strategy_json_that_is_not_a_strategy(tmp_path):
    """Before: a list, a missing key or a string dev_matrix surfaced as AttributeError / KeyError / TypeError."""
    from msparallel_ds.checkpoint.mindspore_files import read_strategy

    cases = {"list.json": [1, 2], "nokeys.json": {"parallel_layout_item": {"w": {"dev_matrix": [2]}}},
             "strs.json": {"parallel_layout_item": {"w": {"dev_matrix": "22", "tensor_map": [0]}}},
             "broken.json": "{"}
    for fname, data in cases.items():
        p = tmp_path / fname
        p.write_text(data if isinstance(data, str) else json.dumps(data))
        with pytest.raises(ValueError, match=fname.replace(".", r"\.")):
            read_strategy(p)


# ------------------------------------------------------------------------------ 6. large YAMLs
def test_large_yaml_is_refused_quickly_and_read_once(tmp_path, monkeypatch):
    """Before: a 2 MB list took 47 s and 755 MB (parsed twice by the pure-Python loader); 14 MB ran past 2 minutes
    at 3 GB. Now the event stream is counted first (stops at MAX_NODES) and a config is parsed once, by libyaml."""
    import yaml

    from msparallel_ds.config import ConfigError
    from msparallel_ds.config import reader
    from msparallel_ds.suggest.auto import load_config_auto

    big = tmp_path / "big.yaml"
    big.write_text("parallel_config:\n  data_parallel: 1\nx:\n" + "".join(f"- {i}\n" for i in range(400_000)))
    before = _rss_mib()
    with pytest.raises(ConfigError, match="more than 20000 YAML values"):
        load_config_auto(big)
    assert _rss_mib() - before < 200
    calls = []
    real = yaml.load
    monkeypatch.setattr(reader.yaml, "load", lambda *a, **k: calls.append(k.get("Loader")) or real(*a, **k))
    good = tmp_path / "good.yaml"
    good.write_text("parallel_config:\n  data_parallel: 2\n  model_parallel: 1\n")
    assert load_config_auto(good).parallel_config.data_parallel == 2
    assert len(calls) == 1 and (calls[0] is getattr(yaml, "CSafeLoader", yaml.SafeLoader)), calls


# ------------------------------------------------------------------------------ fuzz: .ckpt, strategy, YAML
@FUZZ
@given(st.data())
def test_fuzz_ckpt_reader(tmp_path, data):
    from msparallel_ds.checkpoint.mindspore_files import read_ckpt, write_ckpt

    good = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int32), "s": "hi"}
    path = tmp_path / "f.ckpt"
    write_ckpt(path, good, crc=data.draw(st.booleans()))
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(0, 4))):
        op, pos = data.draw(st.sampled_from(["flip", "cut", "dup", "big"])), data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            raw = raw[:pos]
        elif op == "dup":
            raw = raw + raw[pos:]
        else:  # a length or dim varint made huge
            raw[pos:pos + 1] = b"\xff\xff\xff\xff\xff\xff\xff\xff\x7f"
        if not raw:
            raw = bytearray(b"\x0a")
    path.write_bytes(bytes(raw))
    before = _rss_mib()
    try:
        out = read_ckpt(path)
    except ValueError as e:
        assert str(path) in str(e)
    else:
        for k, v in out.items():
            assert k not in good or isinstance(v, str) or v.numel() * v.element_size() <= len(raw)
    assert _rss_mib() - before < 256


@FUZZ
@given(dev=st.lists(st.integers(-2, 2**33), min_size=0, max_size=4),
       tmap=st.lists(st.one_of(st.integers(-2, 4), st.lists(st.integers(-1, 4), max_size=3)), max_size=3),
       opt=st.tuples(st.integers(-2, 4), st.integers(-3, 2**32)), ranks=st.integers(1, 8))
def test_fuzz_strategy_reader_and_merge(tmp_path, dev, tmap, opt, ranks):
    from msparallel_ds.checkpoint.mindspore_files import merge, read_strategy, slice_of

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"parallel_layout_item": {"w": {
        "dev_matrix": dev, "tensor_map": tmap, "opt_weight_shard_step": opt[0], "opt_weight_shard_size": opt[1]}}}))
    full = torch.arange(64.0).reshape(8, 8)
    before = _rss_mib()
    try:
        layout = read_strategy(path)["w"]
        slices = {r: slice_of(full, layout, r, name="w") for r in range(ranks)}
        merged = merge("w", layout, slices)
    except ValueError as e:
        assert "s.json" in str(e) or "'w'" in str(e), str(e)
    else:
        assert torch.equal(merged, full)
    assert _rss_mib() - before < 256


_SCALARS = st.one_of(st.integers(-2**70, 2**70), st.text(max_size=20), st.booleans(), st.none(),
                     st.floats(allow_nan=True))
_TREES = st.recursive(_SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=6),
                                                       st.dictionaries(st.text(max_size=8), kids, max_size=6)),
                      max_leaves=40)


@FUZZ
@given(tree=_TREES, repeat=st.integers(1, 30_000), depth=st.integers(0, 60), junk=st.binary(max_size=64))
def test_fuzz_yaml_reader(tree, repeat, depth, junk):
    import yaml

    from msparallel_ds.config import ConfigError, ParallelConfig, load_config

    body = yaml.safe_dump({"parallel_config": {"data_parallel": 1}, "x": [tree] * min(repeat, 3),
                           "y": list(range(repeat))})
    deep = "[" * depth + "1" + "]" * depth
    before = _rss_mib()
    for text in (body.encode(), f"z: {deep}\n".encode() + body.encode(), junk, body.encode()[: len(body) // 2]):
        try:
            assert isinstance(load_config(text), ParallelConfig)
        except ConfigError as e:
            assert "\n" not in str(e).strip() or "invalid configuration" in str(e)
    assert _rss_mib() - before < 256
