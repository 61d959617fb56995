"""micro_batch_interleave_num and fine_grain_interleave through msp.initialize on 4 gloo processes: for N = 1, 2, 4
copies (and 1, 2, 4 fine-grain chunks) the logits and gradients of one micro-batch equal the non-interleaved
run's, and 3 AdamW steps give the single-process reference's losses and weights (relative error <= 1e-4).

The global batch is the same for every N (runner_config.batch_size = 4 / N, so a dp rank's micro-batch always holds
4 rows), which is what makes the runs comparable. MindSpore's summed-copies loss (copy_loss="sum") is checked
against the documented relation: with equal token counts per copy its gradient is exactly N x the default's.
"""
import pytest
from engine_cases import global_batch, reference_run, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed

STEPS, ROWS = 3, 4  # rows per dp rank's micro-batch
TOL = 1e-4

LAYOUTS = {  # name -> (tiny_config kwargs, [(micro_batch_interleave_num, fine_grain_interleave), ...])
    "dp2xtp2_sp": (dict(dp=2, tp=2, sp=True), [(1, 1), (1, 0), (2, 1), (4, 1)]),
    "tp4_sp_vocab_kv_replicated": (dict(tp=4, sp=True, vocab_dp=False), [(1, 1), (2, 1), (4, 1), (1, 2)]),
    "tp2xcp2_ring_sp": (dict(tp=2, cp=2, ring=True, sp=True), [(1, 1), (2, 1), (4, 1), (1, 2)]),
    "fine_grain_dp2xtp2_sp": (dict(dp=2, tp=2, sp=True), [(1, 1), (1, 2), (1, 4), (2, 2)]),
    # layers 0-1 recomputed: they run whole (their own SP split and blocking collectives), layers 2-3 interleave
    # (with 2 chunks in the chunk layout, entered and left by an all-to-all)
    "dp2xtp2_sp_recompute2": (dict(dp=2, tp=2, sp=True, recompute=[2]), [(1, 1), (2, 1), (1, 2)]),
    # layers 0-2 recomputed: layer 3 alone interleaves its chunks behind the attention's barrier (rank layout)
    "dp2xtp2_sp_recompute3": (dict(dp=2, tp=2, sp=True, recompute=[3]), [(1, 1), (1, 2)]),
    # tp = 1: nothing to overlap, the copies run whole layers one after the other (same math)
    "dp2xcp2_ulysses_tp1": (dict(dp=2, cp=2, algo="ulysses_cp"), [(1, 1), (2, 1), (4, 1)]),
}
# (1, 0): N = 1 forced through the interleave schedule (install(model, 1, 1)); (1, 1) is the plain model
CHUNK_LAYOUT = {("fine_grain_dp2xtp2_sp", 1, 2), ("fine_grain_dp2xtp2_sp", 1, 4), ("fine_grain_dp2xtp2_sp", 2, 2),
                ("dp2xtp2_sp_recompute2", 1, 2), ("tp4_sp_vocab_kv_replicated", 1, 2)}  # the runs that end in it

# the runs whose output head is replicated under SP (vocab_emb_dp) and whose layer 0 runs in the interleave schedule:
# the head's weight grad is deferred to the layer-0 scatters (not with recomputed layer 0, nor at tp = 1)
DEFERRED = {(name, mbi, fgi) for name in ("dp2xtp2_sp", "tp2xcp2_ring_sp", "fine_grain_dp2xtp2_sp")
            for mbi, fgi in LAYOUTS[name][1] if (mbi, fgi) != (1, 1)}


def _rel(a, b) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def _engine(yaml, mbi, fgi, optimizer=_adamw, copy_loss=None, layout=None):
    import msparallel_ds as msp

    cfg = tiny_config(bs=ROWS // mbi, **yaml)
    cfg["micro_batch_interleave_num"] = mbi
    cfg["model"]["model_config"]["fine_grain_interleave"] = max(fgi, 1)
    cfg = msp.load_config(cfg)
    model = tiny_model()
    if copy_loss is not None:
        layout = layout or msp.init_parallel(cfg)
        model = msp.parallelize(model, layout, copy_loss=copy_loss)
    engine = msp.initialize(model, cfg, optimizer=optimizer, layout=layout)
    if fgi == 0:
        from msparallel_ds.interleave.multi_copy import install

        install(engine.model, 1, 1)
    return engine


def _share(engine, step):
    lay = engine.layout
    dp, d = lay.size("dp"), lay.rank("dp")
    ids, labels = global_batch(step, ROWS * dp)
    share = slice(d * ROWS, (d + 1) * ROWS)
    return {"input_ids": ids[share], "labels": labels[share]}


def _grads(engine, fgi):
    """Logits (this rank's shard) and every parameter's gradient for one micro-batch, loss = token mean, on a
    model parallelized for the engine's layout (plain autograd: DeepSpeed's ZeRO hooks stay out of it); the base
    model's output called on its own (sequence parallel's rank layout: no head to reorder it); how many times
    the causal LM's forward moved chunks back to the rank layout (0: the head reorders the chunk layout); and how
    many parts of the output head's weight grad the layer-0 scatters computed (deferred.py)."""
    import torch

    import msparallel_ds as msp
    from msparallel_ds.context_parallel.batch import inputs_and_targets
    from msparallel_ds.interleave import chunk_layout
    from msparallel_ds.interleave.deferred import DeferredWgrad

    model = msp.parallelize(tiny_model(), engine.layout)
    if fgi == 0:
        from msparallel_ds.interleave.multi_copy import install

        install(model, 1, 1)
    inputs, targets = inputs_and_targets(engine._micro(_share(engine, 99), slice(None)), engine.layout)
    moves, to_rank = [], chunk_layout.to_rank_layout
    chunk_layout.to_rank_layout = lambda *a: moves.append(1) or to_rank(*a)
    parts, take = [], DeferredWgrad.take

    def counted_take(box, copy):
        dw = take(box, copy)
        parts.append(dw is not None)
        return dw

    DeferredWgrad.take = counted_take
    try:
        logits = model(**inputs, use_cache=False).logits
        (engine._token_loss_sum(logits, targets) / targets.numel()).backward()
        moved_out = len(moves)
        with torch.no_grad():
            hidden = model.model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)
    finally:
        chunk_layout.to_rank_layout, DeferredWgrad.take = to_rank, take
    return logits.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}, \
        hidden.last_hidden_state, (moved_out, len(moves) - moved_out), sum(parts)


def _run(rank, world_size, references):
    """Every layout and variant in one spawned group (process start-up dominates on a 2-core machine)."""
    return {name: _run_layout(name, *references[name]) for name in LAYOUTS}


def _run_layout(name, ref_losses, ref_state):
    from msparallel_ds.interleave import installed

    yaml, variants = LAYOUTS[name]
    out, base = {}, None
    for mbi, fgi in variants:
        engine = _engine(yaml, mbi, fgi)
        interleave = installed(engine.model)
        logits, grads, hidden, moves, deferred = _grads(engine, fgi)
        if base is None:
            base = (logits, grads, hidden)
        losses = [engine.train_batch(_share(engine, s)).item() for s in range(STEPS)]
        state = engine.full_state_dict()
        out[(mbi, fgi)] = {
            "installed": interleave,
            "logits_rel": _rel(logits, base[0]),
            "grads_rel": max(_rel(g, base[1][k]) for k, g in grads.items()),
            "base_model_rel": _rel(hidden, base[2]),
            "moves_out": moves,  # (the causal LM's forward, the base model's own)
            "deferred_wgrad_parts": deferred,
            "grads_nonzero": sum(int(g.abs().sum() > 0) for g in grads.values()) / len(grads),
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "weights": max((state[k] - v).abs().max().item() for k, v in ref_state.items()),
            "losses": losses,
        }
    if name == "dp2xtp2_sp":
        out["summed_copies"] = _summed_copies(yaml)
    return out


class _GradProbe:
    """An SGD whose step records the gradients DeepSpeed hands it (the reduced, partitioned ones)."""

    def __new__(cls, params):
        import torch

        class Probe(torch.optim.SGD):
            seen: list = []

            def step(self, closure=None):
                Probe.seen = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                              if p.grad is not None]
                return super().step(closure)

        return Probe(params, lr=1e-3)


def _summed_copies(yaml):
    """copy_loss="sum" (MindSpore) against the default, N = 2, no clipping, every copy with the same token count:
    the gradients the optimizer receives are N x the default's and the reported loss (sum / N) is the same."""
    res = {}
    for mode in ("mean", "sum"):
        engine = _engine({**yaml, "clip": 0}, 2, 1, optimizer=_GradProbe, copy_loss=mode)
        loss = engine.train_batch(_share(engine, 0)).item()
        res[mode] = (loss, type(engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer")
                                else engine.optimizer).seen, engine.applied.interleave.copy_loss)
    (lm, gm, mode_m), (ls, gs, mode_s) = res["mean"], res["sum"]
    assert len(gm) == len(gs) > 0
    return {"modes": (mode_m, mode_s), "loss_rel": abs(ls - lm) / lm,
            "grad_rel_vs_2x": max(_rel(a, 2 * b) for a, b in zip(gs, gm)),
            "grad_rel_vs_1x": max(_rel(a, b) for a, b in zip(gs, gm))}


@pytest.fixture(scope="module")
def results():
    refs, by_rows = {}, {}
    for name, (yaml, _) in LAYOUTS.items():
        rows = ROWS * yaml.get("dp", 1)
        if rows not in by_rows:
            by_rows[rows] = reference_run(STEPS, rows)[:2]
        refs[name] = by_rows[rows]
    return run_distributed(_run, 4, refs, timeout=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_interleave_matches_plain_and_single_process(name, results):
    _, variants = LAYOUTS[name]
    for rank, res in enumerate(r[name] for r in results):
        for (mbi, fgi) in variants:
            r = res[(mbi, fgi)]
            expected = None if (mbi, fgi) == (1, 1) else {"copies": mbi, "fine_grain": max(fgi, 1),
                                                          "copy_loss": "mean"}
            assert r["installed"] == expected, (name, mbi, fgi, r["installed"])
            assert r["logits_rel"] <= TOL and r["grads_rel"] <= TOL, (name, rank, mbi, fgi, r)
            # in the chunk layout the head reorders the gathered chunks: only the base model alone moves them back
            assert r["base_model_rel"] <= TOL, (name, rank, mbi, fgi, r)
            assert r["moves_out"] == (0, mbi if (name, mbi, fgi) in CHUNK_LAYOUT else 0), (name, rank, mbi, fgi, r)
            # the replicated head's weight grad, computed in the copies' layer-0 scatters: one part per copy
            assert r["deferred_wgrad_parts"] == (mbi if (name, mbi, fgi) in DEFERRED else 0), (name, rank, mbi, fgi, r)
            assert r["grads_nonzero"] > 0.9, (name, rank, mbi, fgi, r)
            assert r["loss_rel"] <= TOL, (name, rank, mbi, fgi, r)
            assert r["weights"] <= 5e-5, (name, rank, mbi, fgi, r)
    print({name: {k: {m: v for m, v in r.items() if m != "losses"} for k, r in results[0][name].items()
                  if k != "summed_copies"}})


def test_summed_copies_option_scales_gradients_by_n(results):
    for rank, res in enumerate(results):
        s = res["dp2xtp2_sp"]["summed_copies"]
        assert s["modes"] == ("mean", "sum")
        assert s["loss_rel"] <= TOL, (rank, s)
        assert s["grad_rel_vs_2x"] <= TOL, (rank, s)
        assert s["grad_rel_vs_1x"] > 0.3, (rank, s)  # the option does change the update
    print(results[0]["dp2xtp2_sp"]["summed_copies"])


def test_copy_loss_option_is_checked():
    from msparallel_ds.interleave.multi_copy import install

    with pytest.raises(ValueError, match="copy_loss='avg'"):
        install(tiny_model(), 2, copy_loss="avg")
