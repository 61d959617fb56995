"""A HF Llama runs context-parallel attention by name: loss, logits and weight grads equal the unsharded model's."""
from types import SimpleNamespace

import pytest

from harness import run_distributed
from models import tiny_llama

MESHES = {"ring": (4, 1), "ulysses": (1, 4), "hybrid": (2, 2), "allgather": (4, 1)}  # ulysses 4 > 2 kv heads: replicated


def _hf_parity(rank, world_size, algos):
    import torch
    import torch.distributed as dist

    from msparallel_ds.context_parallel.batch import cp_mean_loss, cp_token_loss, shard_batch
    from msparallel_ds.context_parallel.api import unshard_sequence
    from msparallel_ds.distributed import init_parallel
    from msparallel_ds.integrations.hf_attention import use_cp_attention

    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 32), generator=g)
    labels = input_ids.clone()
    labels[0, 5] = -100  # ignored tokens must be weighted correctly across ranks
    ref = tiny_llama()
    out = ref(input_ids=input_ids, labels=labels)
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    results = {}
    for algo in algos:
        ring, uly = MESHES[algo]
        if ring * uly != world_size:
            continue
        lay = init_parallel(SimpleNamespace(world_size=world_size, cp_algo=algo,
                                            mesh=dict(pp=1, dp=1, cp_ring=ring, cp_ulysses=uly, tp=1)))
        model = tiny_llama()
        use_cp_attention(model, lay, algo=algo)
        shard = shard_batch({"input_ids": input_ids, "labels": labels}, lay, algo=algo)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        share = cp_token_loss(logits, shard["shift_labels"], lay)
        share.backward()
        full_logits = unshard_sequence(logits.detach(), lay, dim=1, algo=algo)
        err_grad = 0.0
        for n, p in model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=lay.group("cp"))
            err_grad = max(err_grad, (grad - ref_grads[n]).abs().max().item())
        results[algo] = {"loss": abs(cp_mean_loss(share, lay).item() - out.loss.item()),
                         "logits": (full_logits - out.logits.detach()).abs().max().item(), "grad": err_grad}
    return results


@pytest.mark.distributed
def test_hf_llama_context_parallel_matches_unsharded():
    results = run_distributed(_hf_parity, 4, ["ring", "ulysses", "hybrid", "allgather"], timeout=300)
    for rank, per_algo in enumerate(results):
        assert set(per_algo) == {"ring", "ulysses", "hybrid", "allgather"}
        for algo, err in per_algo.items():
            assert err["loss"] < 1e-5 and err["logits"] < 1e-4 and err["grad"] < 1e-4, (rank, algo, err)
