"""The interleave order, from the collectives' event recorder (deterministic, no timing): in forward and in
backward, while one copy's tensor/sequence-parallel collective is in flight (between its issue and its wait),
another copy computes; in backward each QKV / gate-up input-grad collective is in flight during that copy's
weight-grad GEMMs, and in forward each QKV / gate-up all-gather during the copy's GEMM of its own rows.
Negative control: with N = 1 no window holds another copy's compute.

2 gloo processes (tp2), one forward + backward of a tiny Llama per case; events are
(event, copy, phase, name) with event in issue | wait | compute | sync.
"""
import pytest
from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed

CASES = {  # name -> (tiny_config kwargs, micro_batch_interleave_num, fine_grain_interleave)
    "sp_n1": (dict(tp=2, sp=True), 1, 1),
    "sp_n2": (dict(tp=2, sp=True), 2, 1),
    "sp_n4": (dict(tp=2, sp=True), 4, 1),
    "no_sp_n2": (dict(tp=2, sp=False), 2, 1),
    "sp_fine_grain2": (dict(tp=2, sp=True), 1, 2),
}


def _record(rank, world_size):
    import msparallel_ds as msp
    from msparallel_ds.interleave.multi_copy import install
    from msparallel_ds.distributed.instruments import current_log, recording

    logs = {}
    for name, (yaml, mbi, fgi) in CASES.items():
        cfg = tiny_config(bs=4 // mbi, **yaml)
        cfg["micro_batch_interleave_num"] = mbi
        cfg["model"]["model_config"]["fine_grain_interleave"] = fgi
        layout = msp.init_parallel(msp.load_config(cfg))
        runs = []
        for _ in range(2):  # twice: the log must be the same
            model = msp.parallelize(tiny_model(), layout)
            if mbi == fgi == 1:
                install(model, 1, 1)  # N = 1 through the interleave schedule
            ids, _ = global_batch(0, 4)
            with recording() as log:
                model(input_ids=ids, use_cache=False).logits.sum().backward()
            runs.append(list(log))
        logs[name] = runs
    logs["off_after"] = current_log()  # no recorder left on
    return logs


ENDS = ("output_head:", "L0.scatter:")  # the model's ends: the head's input gather, the layer-0 scatter (own test)


def _windows(log, phase, chunks=False, names=False):
    """(copy, name, copies that computed between its issue and its wait (names: their compute marks)) for every
    async collective of the decoder layers in phase."""
    open_, out = {}, []
    for i, (event, copy, ph, name) in enumerate(log):
        if ph != phase:
            continue
        if event == "issue":
            open_[(copy, name)] = i
        elif event == "wait":
            j = open_.pop((copy, name))
            others = {n if names else c for e, c, p, n in log[j + 1:i]
                      if e == "compute" and p == phase and c != copy and (not chunks or isinstance(c, tuple))}
            if not name.startswith(ENDS):
                out.append((copy, name, others))
    assert not open_, f"collectives issued and never waited: {open_}"
    return out


@pytest.fixture(scope="module")
def logs():
    return run_distributed(_record, 2, timeout=300)


def test_recorder_is_deterministic_and_off_by_default(logs):
    for rank_logs in logs:
        assert rank_logs["off_after"] is None
        for name in CASES:
            first, second = rank_logs[name]
            assert first == second, name
            assert first == logs[0][name][0], (name, "ranks disagree")  # same program order on every rank


@pytest.mark.parametrize("name,copies", [("sp_n2", 2), ("sp_n4", 4), ("no_sp_n2", 2)])
def test_each_copy_collective_overlaps_another_copy_compute(logs, name, copies):
    log = logs[0][name][0]
    for phase in ("fwd", "bwd"):
        wins = _windows(log, phase)
        kinds = {n.split(":")[1] for _, n, _ in wins}
        if name.startswith("sp"):
            assert kinds == ({"all_gather", "reduce_scatter"}), (phase, kinds)
        else:
            assert kinds == {"all_reduce"}, (phase, kinds)
        per_copy = {c: sum(1 for w in wins if w[0] == c) for c in range(copies)}
        assert len(set(per_copy.values())) == 1 and per_copy[0] >= 4 * 2, per_copy  # 4 layers, >= 2 per layer
        bare = [w for w in wins if not w[2]]
        # only the schedule's edge (the last copy's last wait in forward, the first copy's first in backward)
        assert len(bare) <= 1, (phase, bare)
        assert len(wins) - len(bare) >= 8 * copies - 1
    # no blocking tp collective inside a copy's forward
    assert not [e for e in log if e[0] == "sync" and e[1] is not None and e[2] == "fwd"]


def test_order_pattern_issue_other_computes_then_wait(logs):
    """The literal pattern of the issue, forward and backward: A issues, B computes, A waits."""
    log = logs[0]["sp_n2"][0]
    for phase in ("fwd", "bwd"):
        seq = [(e, c) for e, c, p, _ in log if p == phase and e in ("issue", "compute", "wait")]
        found = any(seq[i][0] == "issue" and any(seq[k] == ("compute", 1 - seq[i][1]) for k in range(i + 1, j))
                    and seq[j] == ("wait", seq[i][1]) for i in range(len(seq)) for j in range(i + 1, len(seq)))
        assert found, phase


def test_input_grad_collective_in_flight_during_weight_grad(logs):
    log = logs[0]["sp_n2"][0]
    issued = [i for i, (e, c, p, n) in enumerate(log)
              if e == "issue" and p == "bwd" and n.endswith("_in:reduce_scatter")]
    assert len(issued) == 2 * 4 * 2  # copies x layers x (QKV, gate/up)
    for i in issued:
        _, copy, _, name = log[i]
        assert log[i + 1] == ("compute", copy, "bwd", name.split(":")[0] + ":wgrad"), log[i:i + 2]
        wait_at = next(j for j in range(i, len(log)) if log[j][:2] == ("wait", copy) and log[j][3] == name)
        assert wait_at > i + 1


@pytest.mark.parametrize("name,copies", [("sp_n1", 1), ("sp_n2", 2), ("sp_fine_grain2", 1), ("sp_n4", 4)])
def test_collectives_multiply_own_rows_in_flight(logs, name, copies):
    """Local-first gathers, remote-first reduce-scatters: right after each QKV / gate-up all-gather, and each
    out-proj / down-proj reduce-scatter, is issued, the copy multiplies its own rows (the collective's window holds
    the copy's own GEMM, also at N = 1); the backward has no such step. With more than 2 streams (N = 4) the
    reduce-scatters are not split (fine_grain.remote_first): the whole GEMM runs, then the collective starts."""
    log = logs[0][name][0]
    issued = [i for i, (e, c, p, n) in enumerate(log) if e == "issue" and p == "fwd"
              and n.endswith((":all_gather", ":reduce_scatter")) and not n.startswith(ENDS)]
    assert len(issued) == 4 * 4 * copies * (2 if name.endswith("grain2") else 1)
    split = [i for i in issued if copies <= 2 or log[i][3].endswith(":all_gather")]
    assert len(split) == len(issued) // (2 if copies > 2 else 1)
    for i in issued:
        _, copy, _, name_ = log[i]
        layer_op = name_.split(":")[0]
        if i in split:
            assert log[i + 1] == ("compute", copy, "fwd", layer_op + ":gemm_local"), log[i:i + 2]
        else:
            assert log[i - 1] == ("compute", copy, "fwd", layer_op + ":gemm"), log[i - 1:i + 1]
    assert sum(1 for e in log if e[3].endswith(":gemm_local") and not e[3].startswith(ENDS)) == len(split)


@pytest.mark.parametrize("name,copies", [("sp_n1", 1), ("sp_n2", 2), ("sp_n4", 4), ("sp_fine_grain2", 1)])
def test_model_ends_overlap_head_gemms(logs, name, copies):
    """The model's ends under SP are async too: the output head's input all-gather is in flight during the head's
    GEMM of this rank's own rows (forward), and each copy's layer-0 scatter all-gather (backward) during that
    copy's part of the head's weight-grad GEMM, deferred there (deferred.py). No blocking collective is left."""
    log = logs[0][name][0]
    issued = log.index(("issue", None, "fwd", "output_head:gather_replicated"))
    assert log[issued + 1] == ("compute", None, "fwd", "output_head:gemm_local"), log[issued:issued + 2]
    assert log.index(("wait", None, "fwd", "output_head:gather_replicated")) > issued + 1
    for copy in range(copies):
        issued = log.index(("issue", copy, "bwd", "L0.scatter:all_gather"))
        assert log[issued + 1:issued + 3] == [("compute", copy, "bwd", "output_head:wgrad_deferred"),
                                              ("wait", copy, "bwd", "L0.scatter:all_gather")], log[issued:issued + 3]
    assert sum(1 for e in log if e[3] == "output_head:wgrad_deferred") == copies
    assert not [e for e in log if e[0] == "sync"]


def test_fine_grain_chunks_overlap(logs):
    """The two chunks run a step apart across layers, in the chunk layout (each gathered chunk a causal prefix
    block, no barrier at the attention): every collective's window holds the other chunk's GEMM or attention, not
    only a norm, except at the schedule's edge (the first gather in forward, the last reduce-scatter; in backward
    their mirrors), as with 2 copies. In lockstep 4 per layer were thin; behind the barrier (rank layout) one per
    layer and the edge."""
    log = logs[0]["sp_fine_grain2"][0]
    for phase in ("fwd", "bwd"):
        wins = _windows(log, phase, chunks=True)
        assert {w[0] for w in wins} == {(0, 0), (0, 1)}
        assert len(wins) == 2 * 4 * 4  # chunks x layers x collectives
        thin = [w[:2] for w in _windows(log, phase, chunks=True, names=True)
                if all(n.endswith(("norm1", "norm2")) for n in w[2])]
        assert len(thin) <= 2, (phase, thin)


def test_n1_has_no_cross_copy_overlap(logs):
    log = logs[0]["sp_n1"][0]
    for phase in ("fwd", "bwd"):
        wins = _windows(log, phase)
        assert len(wins) == 4 * 4 and not any(w[2] for w in wins)


@pytest.mark.parametrize("name,copies,halves", [("sp_n2", 2, True), ("sp_n4", 4, False), ("sp_n1", 1, True)])
def test_attention_cut_in_two_steps_by_rows(logs, name, copies, halves):
    """A copy with >= 2 rows runs its (local, sdpa) attention as two steps, one per half of its rows, so another
    copy's step lies between the halves; with one row per copy (N = 4 here) the attention is one step."""
    log = logs[0][name][0]
    for copy in range(copies):
        for layer in range(4):
            at = [i for i, e in enumerate(log) if e == ("compute", copy, "fwd", f"L{layer}.attention")]
            assert len(at) == (2 if halves else 1), (copy, layer, at)
            if halves and copies > 1:
                assert any(log[k][0] == "compute" and log[k][1] != copy for k in range(at[0] + 1, at[1])), at
