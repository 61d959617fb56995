"""Grads of tp-replicated weights (the SP norms) summed over tp by tensor_parallel/replicated.py: one async
all-reduce per weight started as its grad completes and one wait at the end of the backward, against the
single-process model's grads; the weights are real Parameters again after every forward; a reentrant checkpoint
(whose recompute reads the real weights) still gets every grad summed exactly once.

2 gloo processes (tp2 + SP), the tiny Llama of the engine tests, one forward + backward per case.
"""
import pytest
from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-5


def _norm_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "norm" in n}


def _tied(model):
    """Layer 1's attention norm shares layer 0's weight (one Parameter in two modules)."""
    layers = model.model.layers
    layers[1].input_layernorm.weight = layers[0].input_layernorm.weight
    return model


def _cases(rank, world_size):
    import torch

    import msparallel_ds as msp
    from msparallel_ds.distributed.instruments import recording
    from msparallel_ds.tensor_parallel.apply import tp_parallelize

    ids, _ = global_batch(0, 2)
    expected = {}
    for tied in (False, True):
        ref = _tied(tiny_model()) if tied else tiny_model()
        ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        expected[tied] = _norm_grads(ref)

    layout = msp.init_parallel(msp.load_config(tiny_config(tp=2, sp=True, bs=2)))
    builds = {
        "async_sums": lambda: msp.parallelize(tiny_model(), layout),
        "hooks_only": lambda: tp_parallelize(tiny_model(), layout, sequence_parallel=True),  # no install()
        "reentrant_checkpoint": lambda: msp.parallelize(tiny_model(), layout),
        "non_reentrant_checkpoint": lambda: msp.parallelize(tiny_model(), layout),
        "tied_norms": lambda: msp.parallelize(_tied(tiny_model()), layout),
    }
    out = {}
    for name, build in builds.items():
        model = build()
        if name.endswith("checkpoint"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": name.startswith("reentrant")})
            model.train()
        with recording() as log:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads = _norm_grads(model)
        events = [(e, n) for e, _, p, n in log if p == "bwd"]
        want = expected[name == "tied_norms"]
        out[name] = {
            "err": max((grads[k] - want[k]).abs().max().item() for k in want),
            "n_norms": len(want),
            "async": sum(e == "grad_issue" for e, _ in events), "waited": sum(e == "grad_wait" for e, _ in events),
            "blocking_all_reduce": sum(ev == ("sync", "all_reduce") for ev in events),
            "params_are_leaves": all(isinstance(p, torch.nn.Parameter) and p.is_leaf for p in model.parameters()),
        }
    model = msp.parallelize(tiny_model(), layout)
    try:
        model(input_ids=ids.float(), use_cache=False)  # an embedding rejects float ids inside the forward
    except RuntimeError:
        pass
    out["after_raising_forward"] = all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_cases, 2, timeout=300)


def test_async_sums_match_single_process_with_one_wait_per_weight(results):
    for res in results:
        r = res["async_sums"]
        assert r["err"] < TOL, r
        assert r["async"] == r["waited"] == r["n_norms"] == 9, r  # 2 per layer x 4 + the final norm
        assert r["blocking_all_reduce"] == 0, r
        assert r["params_are_leaves"], r


def test_hooks_alone_sum_the_same_grads_blocking(results):
    """Negative control of the mechanism: without install() the hooks sum, blocking, one rendezvous each."""
    for res in results:
        r = res["hooks_only"]
        assert r["err"] < TOL, r
        assert r["async"] == 0 and r["blocking_all_reduce"] == 9, r


@pytest.mark.parametrize("name", ["reentrant_checkpoint", "non_reentrant_checkpoint"])
def test_checkpointed_layers_sum_every_grad_once(results, name):
    for res in results:
        r = res[name]
        assert r["err"] < TOL, r
        assert r["async"] + r["blocking_all_reduce"] == 9, r  # reentrant: the recomputed layers' norms by the hook
        assert r["params_are_leaves"], r


def test_a_weight_shared_by_two_modules_is_summed_once(results):
    for res in results:
        r = res["tied_norms"]
        assert r["err"] < TOL, r
        assert r["async"] == r["n_norms"] == 8 and r["blocking_all_reduce"] == 0, r


def test_weights_restored_after_a_forward_that_raised(results):
    assert all(res["after_raising_forward"] for res in results)
