"""MoE settings as a MindFormers YAML gives them (legacy `moe_config:` or mcore `model.model_config` keys), and the
check of those settings against the HF model's config.

Reading and validating the YAML keys is the config front-end's job (config/moe.py, with MindFormers' rules and
source citations); this module only holds the result, so the runtime can import it without the YAML machinery.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

EP_KEY = "parallel_config.expert_parallel"
HF_EXPERT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts")
DEFAULT_BIAS_UPDATE_RATE = 1e-3
_PREFIX = {"moe_config": "moe_config.", "model_config": "model.model_config."}


@dataclass(frozen=True)
class MoESettings:
    """What the YAML says about the experts. None in a field: the YAML does not set it (the HF model decides)."""

    source: str                        # "moe_config" (legacy) | "model_config" (mcore)
    num_experts: Optional[int]         # None: not set in the YAML (the HF model decides)
    top_k: Optional[int]
    capacity_factor: Optional[float]   # None: dropless (MindFormers mcore default / Megatron)
    drop_policy: str                   # "probs" | "position" (MindFormers moe_token_drop_policy; legacy: probs)
    aux_loss_coeff: float              # 0.0: off
    aux_loss_scope: str                # "global_batch" (gbs_aux_loss) | "sequence" (seq_aux_loss) |
                                       # "sub_sequence" (sub_seq_aux_loss: mcore default and the legacy MoE: the
                                       # tokens each rank holds, i.e. its micro-batch's part of the sequence)
    z_loss_coeff: float
    shared_experts: Optional[int]
    shared_expert_intermediate_size: Optional[int]
    moe_intermediate_size: Optional[int]
    first_k_dense_replace: Optional[int]
    norm_topk_prob: Optional[bool]
    expert_bias: bool                  # moe_router_enable_expert_bias / balance_via_topk_bias (moe.expert_bias)
    bias_update_rate: Optional[float]
    expert_model_parallel: Optional[int]  # legacy only
    routed_scaling_factor: Optional[float] = None  # routing weights x this (router.py:295); None: the HF model's
    router_dtype: Optional[str] = None  # the router's compute dtype (moe_router_dtype / router_dense_type; moe.routing)
    # (field, YAML key path as written) for messages; not part of the settings' value
    keys: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "keys"}

    def key(self, name: str) -> str:
        """The YAML key path the user wrote for field `name` (e.g. model.model_config.n_routed_experts)."""
        return dict(self.keys).get(name, _PREFIX.get(self.source, "") + name)

    @property
    def bias_update_rate_or_default(self) -> float:
        """The expert-bias update rate; MindFormers' and Megatron-Core's default 1e-3 when the YAML leaves it out."""
        return DEFAULT_BIAS_UPDATE_RATE if self.bias_update_rate is None else float(self.bias_update_rate)

    @property
    def dense_layers(self) -> int:
        """Leading decoder layers with a dense feed-forward instead of experts (first_k_dense_replace; -1: none)."""
        return max(self.first_k_dense_replace or 0, 0)

    def expert_size(self, ffn_hidden_size: int) -> int:
        """Intermediate size of one routed expert: moe_intermediate_size, else the model's ffn size (the legacy
        Llama-family MoE builds its experts with intermediate_size: models/llama/llama_transformer.py:912-928)."""
        return self.moe_intermediate_size or ffn_hidden_size

    def shared_size(self, ffn_hidden_size: int) -> int:
        """Total intermediate size of the shared experts (0: none). MindFormers: moe_shared_expert_intermediate_size,
        else expert size x shared_expert_num (parallel_core/transformer_config.py:2433-2446,
        models/llama/llama_layer.py:810-811)."""
        if self.shared_expert_intermediate_size:
            return self.shared_expert_intermediate_size
        return self.expert_size(ffn_hidden_size) * (self.shared_experts or 0)


def hf_num_experts(hf_config: Any) -> Optional[int]:
    """Routed experts of an HF config (Qwen2/3-MoE: num_experts, Mixtral: num_local_experts, DeepSeek:
    n_routed_experts), or None for a dense model."""
    for name in HF_EXPERT_ATTRS:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 4096) + 1) if n % d == 0]


def check_model(settings: Optional[MoESettings], hf_config, ep: int) -> None:
    """YAML vs the HF model config: expert count (HF: num_experts / num_local_experts / n_routed_experts),
    top-k (num_experts_per_tok), moe_intermediate_size when both set; num_experts % ep == 0 for the HF model;
    ep > 1 on a model with no experts -> clear error naming parallel_config.expert_parallel. settings None = YAML set
    no MoE keys (only ep checks)."""
    from ..config.errors import ConfigError, ConfigIssue

    kind = type(hf_config).__name__
    experts = hf_num_experts(hf_config)
    issues: list[ConfigIssue] = []
    if experts is None:
        if ep > 1:
            issues.append(ConfigIssue(EP_KEY, ep, f"needs a mixture-of-experts model, but the HF model ({kind}) has "
                                      f"no experts (none of {', '.join(HF_EXPERT_ATTRS)})",
                                      "set parallel_config.expert_parallel: 1 for a dense model, or load a MoE model"))
        if settings is not None and settings.num_experts:
            issues.append(ConfigIssue(settings.key("num_experts"), settings.num_experts,
                                      f"sets experts but the HF model ({kind}) is dense",
                                      "remove the MoE keys from the YAML, or load the MoE model it describes"))
        if issues:
            raise ConfigError(issues)
        return
    if settings is not None:
        checks = (("num_experts", experts, f"{kind} routed experts"),
                  ("top_k", getattr(hf_config, "num_experts_per_tok", None), f"{kind}.num_experts_per_tok"),
                  ("moe_intermediate_size", getattr(hf_config, "moe_intermediate_size", None),
                   f"{kind}.moe_intermediate_size"))
        for name, theirs, what in checks:
            ours = getattr(settings, name)
            if ours is not None and isinstance(theirs, int) and ours != theirs:
                issues.append(ConfigIssue(settings.key(name), ours, f"does not match the HF model: {what} = {theirs}",
                                          f"write {theirs} (the YAML must describe the model it trains)"))
    if ep > 1 and experts % ep:
        issues.append(ConfigIssue(EP_KEY, ep, f"must divide the HF model's {experts} routed experts ({kind}): each "
                                  "expert-parallel rank holds num_experts / expert_parallel whole experts",
                                  f"use one of {[d for d in _divisors(experts) if d > 1] or [1]}"))
    if issues:
        raise ConfigError(issues)
