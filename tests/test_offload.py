"""Activation offload of listed decoder layers (swap_config): the layers' saved tensors go through
torch.autograd.graph.save_on_cpu, gradients equal the plain model's, and a layer recomputed whole is left alone."""
import pytest
import torch

from msparallel_ds.offload import offload_activations
from msparallel_ds.tiny import tiny_llama  # 4 layers


def _grads(model, ids):
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offloaded_layers_save_on_the_host_with_unchanged_gradients(monkeypatch):
    ids = torch.randint(0, 256, (2, 16))
    plain, model = tiny_llama(), tiny_llama()
    assert offload_activations(model, (0, 2)) == ["0", "2"]
    entered = []
    real = torch.autograd.graph.save_on_cpu

    def counting(*args, **kwargs):
        entered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", counting)
    want, got = _grads(plain.train(), ids), _grads(model.train(), ids)
    assert len(entered) == 2  # once per offloaded layer per forward
    assert all(torch.equal(want[n], got[n]) for n in want)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert len(entered) == 2  # nothing to save in eval


def test_a_layer_recomputed_whole_keeps_recompute():
    with pytest.warns(UserWarning, match=r"layers \[1\] are recomputed whole"):
        assert offload_activations(tiny_llama(), "all", {"1": [""], "2": ["mlp"]}) == ["0", "2", "3"]
