"""MindFormers 2.1's pynative Muon (pynative/optimizer/muon.py + muon_utils.py): what a `parallelism:` / `training:`
YAML (the deepseek4 configs) runs. It is optim.muon's Muon (momentum, Nesterov input, decoupled decay, AdamW for the
rest, whole matrices under tp and ZeRO) with four differences, each read from the wheel:

- Newton-Schulz follows `ns_coefficients`, a per-step schedule (`_normalize_ns_schedule`, muon.py:2323): a flat
  [a, b, c] repeated `ns_steps` (default 5) times, or segments [[[a, b, c], count], ...] (the deepseek4 YAMLs:
  8 x (3.4445, -4.775, 2.0315) then 2 x (2.0, -1.5, 0.5), 10 steps; `ns_steps` then unread).
- The input is normalised in float32 as X / clamp(||X||_F, min=eps) (`eps`, default 1e-7; muon.py:1185), then cast
  to the iteration dtype (bfloat16 there); each step is A = X X^T, B = addmm(A, A, A, beta=b, alpha=c),
  X = addmm(X, B, X, beta=a) (muon.py:1192), on the wide orientation.
- `make_model_muon_fns` splits fused tensors and each piece is orthogonalised and scaled on its own:
  lr * matched_adamw_rms * sqrt(max(piece rows, piece cols)) (muon.py:1219). Of gpt_model.py:798's rules only the
  routed experts' `experts.weight1` ([gate | up] halves) has a counterpart in HF's layouts: the fused experts'
  `experts.gate_up_proj` [E, 2I, H], split into its gate and up halves (dim -2; MindFormers' pieces are their
  transposes, which Newton-Schulz maps to the same wide matrix). weight2 (reshape only) is HF's expert down
  projection; the MLA rules (linear_qb / linear_kvb / linear_qkv, fc1 halves) concern MindFormers' concatenated tensors, which HF
  keeps apart (DeepSeek-V4's q_a/q_b/kv/o_a projections match no rule in MindFormers either).
- `adamw_include` (fnmatch globs, default ["*word_embeddings*", "*output_layer*"]) picks the 2-D/3-D weights kept
  on AdamW (muon.py:2375), matched against the parameter's name and, for the embedding table and the output head,
  also against MindFormers' names for them (embedding.word_embeddings.weight, output_layer.weight).

`comm_strategy` (allgather / allgather_deredundency: which rank runs Newton-Schulz, same update) and
`use_fused_adamw` (one AdamW kernel, the same formula) are validated and change nothing here. QK-clip: MindFormers'
apply_qk_clip_scaling (pynative gpt_model.py:892) rescales only layers whose core attention tracks
`max_logits_val` (FlashAttention); DeepSeek-V4's CompressedSparseAttention does not, so for deepseek_v4 it is a
no-op there and here; for other models it is not applied here (warned).
"""
from __future__ import annotations

import math
import warnings
from fnmatch import fnmatch

import torch
import torch.nn as nn

from .muon import Muon, _adamw_only, muon_groups

__all__ = ["PynativeMuon", "newton_schulz", "ns_schedule", "pynative_muon_groups", "check_pynative_keys",
           "warn_qk_clip"]

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_ADAMW_INCLUDE = ("*word_embeddings*", "*output_layer*")
MF_ALIASES = ("embedding.word_embeddings.weight", "output_layer.weight")  # embedding table, output head
COMM_STRATEGIES = ("allgather", "allgather_deredundency")


def _bad(key, value, rule, fix):
    return ValueError(f"optimizer.{key}={value!r} {rule} (MindFormers 2.1 pynative/optimizer/muon.py); {fix}")


def ns_schedule(coefficients=None, steps=None) -> tuple[tuple[float, float, float], ...]:
    """muon.py:2323 _normalize_ns_schedule: the per-step (a, b, c) triples of `ns_coefficients` / `ns_steps`."""
    coefficients = DEFAULT_COEFFICIENTS if coefficients is None else coefficients
    fix = "write [a, b, c] or [[[a, b, c], count], ...] (e.g. [[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]])"
    if not isinstance(coefficients, (list, tuple)) or not coefficients:
        raise _bad("ns_coefficients", coefficients, "must be a non-empty list", fix)
    first = coefficients[0]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        steps = 5 if steps is None else steps
        if len(coefficients) != 3 or not all(isinstance(v, (int, float)) for v in coefficients):
            raise _bad("ns_coefficients", coefficients, "as a flat triple must hold 3 numbers", fix)
        if int(steps) <= 0:
            raise _bad("ns_steps", steps, "must be positive", "set ns_steps >= 1")
        return (tuple(float(v) for v in coefficients),) * int(steps)
    out: list[tuple[float, float, float]] = []
    for i, seg in enumerate(coefficients):
        ok = (isinstance(seg, (list, tuple)) and len(seg) == 2 and isinstance(seg[0], (list, tuple))
              and len(seg[0]) == 3 and isinstance(seg[1], int) and not isinstance(seg[1], bool) and seg[1] > 0)
        if not ok:
            raise _bad("ns_coefficients", coefficients, f"segment {i} ({seg!r}) must be [[a, b, c], count > 0]", fix)
        out.extend([tuple(float(v) for v in seg[0])] * seg[1])
    return tuple(out)


@torch.no_grad()
def newton_schulz(g: torch.Tensor, schedule, eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """muon.py:1185-1216 newton_schulz: the last two dims are the matrix, a leading dim a batch."""
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = (x / norm.clamp(min=eps)).to(dtype)
    addmm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for a, b, c in schedule:
        a_mat = x @ x.mT
        b_mat = addmm(a_mat, a_mat, a_mat, beta=b, alpha=c)
        x = addmm(x, b_mat, x, beta=a, alpha=1.0)
    return x.mT if tall else x


class PynativeMuon(Muon):
    """optim.muon.Muon with the pynative Newton-Schulz (`ns_coefficients` schedule, `eps`) and per-piece scaling
    of the fused expert gate/up tensors that pynative_muon_groups marks."""

    def __init__(self, params, ns_coefficients=None, ns_steps=None, eps: float = 1e-7, **kwargs):
        self.ns_schedule = ns_schedule(ns_coefficients, ns_steps)
        self.ns_eps = float(eps)
        super().__init__(params, **kwargs)

    def _orthogonalise(self, u, p, group):
        pieces = u.chunk(2, dim=-2) if getattr(p, "muon_gate_up_halves", False) else (u,)
        out = []
        for piece in pieces:  # muon.py:1219 _apply_muon_ns: split -> NS per piece -> (lr * its scale) * X -> merge
            x = newton_schulz(piece, self.ns_schedule, self.ns_eps, self.ns_dtype)
            out.append((group["lr"] * math.sqrt(max(piece.shape[-2:])) * group["matched_adamw_rms"]) * x.float())
        return torch.cat(out, dim=-2), -1.0

    def rebuild_kwargs(self) -> dict:
        return {**super().rebuild_kwargs(), "ns_coefficients": [[list(t), 1] for t in self.ns_schedule],
                "eps": self.ns_eps}


def pynative_muon_groups(model: nn.Module, groups, adamw_include=None) -> list[dict]:
    """muon_groups with muon.py:2375's routing (2-D/3-D weights not matching `adamw_include`), marking each fused
    expert gate_up tensor to be orthogonalised as its two halves."""
    patterns = DEFAULT_ADAMW_INCLUDE if adamw_include is None else adamw_include
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    if not all(isinstance(pat, str) for pat in patterns):
        raise _bad("adamw_include", adamw_include, "must be a list of glob strings", "e.g. ['*word_embeddings*']")
    aliases: dict[int, list[str]] = {}
    out_emb = getattr(model, "get_output_embeddings", None)
    out_emb = out_emb() if callable(out_emb) else None
    out_ids = {id(p) for p in out_emb.parameters()} if isinstance(out_emb, nn.Module) else set()
    emb_ids = _adamw_only(model) - out_ids  # embedding tables (by type / accessor / MindFormers names)
    for name, p in model.named_parameters():
        names = aliases.setdefault(id(p), [])
        names.append(name)
        if id(p) in emb_ids:
            names.append(MF_ALIASES[0])
        if id(p) in out_ids:
            names.append(MF_ALIASES[1])
        if p.dim() == 3 and name.endswith("experts.gate_up_proj"):
            p.muon_gate_up_halves = True
    adamw = {pid for pid, names in aliases.items() if any(fnmatch(n, pat) for n in names for pat in patterns)}
    return muon_groups(model, groups, adamw)


def check_pynative_keys(opt) -> None:
    """The pynative keys that change no update here: one clear error for a value MindFormers refuses."""
    if opt.comm_strategy is not None and opt.comm_strategy not in COMM_STRATEGIES:
        raise _bad("comm_strategy", opt.comm_strategy, f"must be one of {COMM_STRATEGIES}",
                   "use allgather (both compute the same update)")
    if opt.eps is not None and not opt.eps > 0:
        raise _bad("eps", opt.eps, "must be > 0 (the Newton-Schulz norm's lower clamp)", "leave it unset (1e-7)")


def warn_qk_clip(model: nn.Module, opt) -> None:
    """QK-clip (default on in the pynative Muon): a no-op for DeepSeek-V4 in MindFormers (module docstring)."""
    if opt.qk_clip_enabled is False:
        return
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "deepseek_v4":
        return
    warnings.warn(f"optimizer.qk_clip_enabled={opt.qk_clip_enabled} (pynative Muon default True): MindFormers' "
                  "QK-clip (rescaling the q/k projections of attention layers that track their max logit) is not "
                  "applied here; the Muon and AdamW updates are", stacklevel=3)
