"""deepspeed.initialize with layout.mpu() on 4 gloo processes: ZeRO 0/1/2 reduce gradients over dp_cp only.

DeepSpeed's rule with an mpu (see msparallel_ds/distributed/mpu.py): gradients are summed over the
sequence-data-parallel group (dp x cp) and divided by dp, so the update is
    W -= lr * (1/dp) * sum over my dp_cp group of each rank's gradient.
Each rank's data depends on its global rank (tp peers differ too), so a reduction over the whole world, over dp
alone, or divided by dp*cp gives a different result; the test checks that those alternatives really differ.
A second pass gives tp peers the same data (as in real runs) and turns on gradient clipping: the norm must be
the global one, each replicated parameter counted once (tp rank 0 of the model-parallel group), and tp peers
must end with identical weights. Note: DeepSpeed 0.19.8 defaults gradient_clipping to 1.0, so the first pass
sets it to 0 explicitly.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed

pytestmark = pytest.mark.distributed

LR, MICRO, STEPS, CLIP = 0.1, 2, 3, 0.5
DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")


def _no_shm_build():
    """Skip DeepSpeed's shm comm op: on CPU, deepspeed.initialize otherwise JIT-compiles it (about 1 min on
    2 cores). It only serves inference_all_reduce, never training; deepspeed.ops caches this dict on purpose."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _model():
    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(data_rank, step):
    g = torch.Generator().manual_seed(1000 * step + data_rank)
    return torch.randn(MICRO, 4, generator=g), torch.randn(MICRO, 3, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _reference(data_ranks, divide_by, clip=0.0, steps=STEPS):
    """Single-process SGD: g = sum(grads of data_ranks) / divide_by, clipped to norm `clip` (DeepSpeed's
    formula, 0 = off), W -= LR * g. Returns the weights and how many steps clipping was active."""
    model, clipped = _model(), 0
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in data_ranks:
            model.zero_grad()
            _loss(model, *_batch(r, step)).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad / divide_by
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        scale = clip / (norm + 1e-6) if clip and clip / (norm + 1e-6) < 1 else 1.0
        clipped += scale < 1
        with torch.no_grad():
            for g, p in zip(grads, model.parameters()):
                p -= LR * g * scale
    return [p.detach().clone() for p in model.parameters()], clipped


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _train(rank, world_size, shape):
    _no_shm_build()
    import deepspeed
    from msparallel_ds.distributed import init_parallel

    lay = init_parallel(SimpleNamespace(world_size=world_size, mesh=dict(zip(DIMS, shape))))
    dp, dp_cp = lay.size("dp"), lay.size("dp_cp")
    report = {}
    for stage in (0, 1, 2):
        for tp_shared_data in (False, True):
            # tp peers share samples in real runs; tp-dependent data is what exposes a reduction over tp.
            def data_rank(r):
                return r - r % lay.size("tp") if tp_shared_data else r

            clip = CLIP if tp_shared_data else 0.0
            model = _model()
            engine, opt, _, _ = deepspeed.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), mpu=lay.mpu(),
                config={"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                        "gradient_clipping": clip, "steps_per_print": 10**9})
            # DeepSpeed took its groups and batch math from the mpu.
            assert engine.train_batch_size() == MICRO * dp
            assert engine.dp_world_size == dp and engine.seq_dp_world_size == dp_cp
            assert engine.seq_data_parallel_group is lay.group("dp_cp")
            assert engine.sequence_parallel_size == lay.size("cp")
            if stage > 0:
                assert opt.dp_process_group is lay.group("dp_cp")
                assert opt.model_parallel_group is lay.group("pp_tp")
            for step in range(STEPS):
                loss = _loss(engine, *_batch(data_rank(rank), step))
                engine.backward(loss)
                engine.step()
            got = [p.detach().clone() for p in engine.module.parameters()]

            expected, clipped = _reference([data_rank(r) for r in lay.ranks("dp_cp")], dp, clip)
            assert (clipped > 0) == tp_shared_data  # clipping acts where it is on
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"stage {stage}, tp_shared={tp_shared_data}: {m}")
            if not tp_shared_data:
                # The test can fail: wrong groups or divisors give visibly different weights.
                wrong = {"world": _reference(range(world_size), world_size)[0],
                         "dp only": _reference([data_rank(r) for r in lay.ranks("dp")], dp)[0],
                         "mean over dp_cp": _reference([data_rank(r) for r in lay.ranks("dp_cp")], dp_cp)[0]}
                for name, w in wrong.items():
                    if name == "mean over dp_cp" and dp_cp == dp:
                        continue
                    if name == "dp only" and lay.ranks("dp") == lay.ranks("dp_cp"):
                        continue
                    assert _max_diff(w, expected) > 1e-3, (name, _max_diff(w, expected))
            else:
                # Without clipping the result would differ: the norm really was applied.
                unclipped = _reference([data_rank(r) for r in lay.ranks("dp_cp")], dp)[0]
                assert _max_diff(unclipped, expected) > 1e-3
                # tp peers (same dp_cp coordinate) hold identical weights.
                flat = torch.cat([p.flatten() for p in got])
                peers = [torch.empty_like(flat) for _ in range(lay.size("tp"))]
                dist.all_gather(peers, flat, group=lay.group("tp"))
                for p in peers:
                    assert torch.equal(p, flat)
            report[(stage, tp_shared_data)] = _max_diff(got, expected)
            del engine, opt
    return report


@pytest.mark.parametrize("shape", [(1, 2, 1, 1, 2), (1, 1, 2, 1, 2)], ids=["dp2_tp2", "cp_ring2_tp2"])
def test_zero_reduces_over_dp_cp(shape):
    out = run_distributed(_train, 4, shape, timeout=240)
    for rank_report in out:
        assert len(rank_report) == 6 and max(rank_report.values()) <= 1e-6


def test_reference_matches_torch_sgd():
    # The reference with one data rank, no division and no clipping is plain SGD on that rank's batches.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_batch(3, step)).backward()
        opt.step()
    assert _max_diff(list(model.parameters()), _reference([3], 1)[0]) < 1e-6
