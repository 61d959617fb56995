"""MindFormers MoE keys -> MoESettings, with MindFormers' own rules. Sources: the mindformers 2.1.0 wheel (1.3.2
where noted), paths under mindformers/.

- Legacy (`moe_config:`, use_legacy: true): the keys of tools/register/template.py:344-393, with MoEConfig's defaults
  (modules/transformer/moe.py:130-141); an unknown key is a KeyError there (template.py:112-116). expert_num 1 is
  a dense model (models/llama/llama_transformer.py:929).
- mcore (`model.model_config`, use_legacy: false): the spellings parallel_core/transformer_config_utils.py:247 and
  :354-385 map to one TransformerConfig key (two of them at once is an error, :496-500); `moe_config:` is not
  read (template.py:701-702).
- msparallel_ds folds expert parallel out of dp x cp x tp inside a pipeline stage, as blocks of ep consecutive
  ranks (mcore / Megatron-Core), for both spellings: (dp*cp*tp) % ep == 0; each tp rank routes its own sequence
  slice (with or without sequence parallel), so the tensor-parallel ranks of an expert-parallel group hold
  different tokens. MoE with model_parallel > 1 and SP off is refused for the legacy moe_config only, as
  MindFormers does (tools/check_rules.py:169-176 reads moe_config).
"""
from __future__ import annotations

import difflib
import math
import warnings
from typing import Any, Mapping, Optional

from .errors import ConfigIssue, ConfigWarning
from .schema import ParallelConfig

PC, LEGACY, MC = "parallel_config", "moe_config", "model.model_config"
LEGACY_KEYS = (
    "expert_num", "capacity_factor", "aux_loss_factor", "num_experts_chosen", "expert_group_size", "group_wise_a2a",
    "comp_comm_parallel", "comp_comm_parallel_degree", "save_token_distribution", "cur_layer",
    "enable_cold_hot_expert", "update_step", "hot_expert_num", "cold_token_percent", "moe_module_name",
    "routing_policy", "norm_topk_prob", "enable_sdrop", "use_fused_ops_topkrouter", "router_dense_type",
    "shared_expert_num", "use_shared_expert_gating", "max_router_load", "topk_method", "topk_group", "n_group",
    "first_k_dense_replace", "moe_intermediate_size", "routed_scaling_factor", "aux_loss_types", "aux_loss_factors",
    "z_loss_factor", "balance_via_topk_bias", "topk_bias_update_rate", "use_allgather_dispatcher",
    "moe_shared_expert_overlap", "expert_model_parallel", "use_gating_sigmoid", "enable_deredundency",
    "npu_nums_per_device", "use_gmm", "enable_gmm_safe_tokens", "use_fused_ops_permute", "callback_moe_droprate",
    "dispatch_global_max_bs", "ep_extend_tp")
# MoEConfig.__init__ validators (modules/transformer/moe.py:142-157)
LEGACY_BOOLS = ("group_wise_a2a", "comp_comm_parallel", "save_token_distribution", "enable_cold_hot_expert",
                "ep_extend_tp")
LEGACY_POSITIVE = ("comp_comm_parallel_degree", "update_step", "expert_group_size")
LEGACY_FIELDS = {"num_experts": "expert_num", "top_k": "num_experts_chosen", "capacity_factor": "capacity_factor",
                 "z_loss_coeff": "z_loss_factor", "shared_experts": "shared_expert_num",
                 "moe_intermediate_size": "moe_intermediate_size", "expert_bias": "balance_via_topk_bias",
                 "first_k_dense_replace": "first_k_dense_replace", "norm_topk_prob": "norm_topk_prob",
                 "bias_update_rate": "topk_bias_update_rate", "expert_model_parallel": "expert_model_parallel",
                 "routed_scaling_factor": "routed_scaling_factor"}
# MoESettings field (or rule input) -> the model_config spellings of one TransformerConfig key (utils.py:247, :354-385)
MCORE = {
    "num_experts": ("expert_num", "n_routed_experts", "num_experts", "num_moe_experts"),
    "top_k": ("num_experts_chosen", "num_experts_per_tok", "moe_router_topk"),
    "capacity_factor": ("capacity_factor", "moe_expert_capacity_factor"),
    "drop_policy": ("enable_sdrop", "moe_token_drop_policy"),
    "aux_loss_coeff": ("moe_aux_loss_coeff",),
    "aux_loss_scope": ("moe_router_load_balancing_type",),
    "z_loss_coeff": ("z_loss_factor", "moe_z_loss_coeff"),
    "shared_experts": ("n_shared_experts", "shared_expert_num"),
    "shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size",),
    "moe_intermediate_size": ("moe_intermediate_size", "moe_ffn_hidden_size"),
    "expert_bias": ("balance_via_topk_bias", "moe_router_enable_expert_bias"),
    "bias_update_rate": ("topk_bias_update_rate", "moe_router_bias_update_rate"),
    "first_k_dense_replace": ("first_k_dense_replace",),
    "norm_topk_prob": ("norm_topk_prob",),
    "routed_scaling_factor": ("routed_scaling_factor", "moe_router_topk_scaling_factor"),  # utils.py:358
    "n_group": ("n_group", "moe_router_num_groups"),
    "topk_group": ("topk_group", "moe_router_group_topk"),
}
# also set by dense configs
_NOT_MOE_ALONE = ("first_k_dense_replace", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor")
# every moe_* key MindFormers 2.1 reads (TransformerConfig fields, utils.py mapping): a near miss is a typo
MCORE_MOE_KEYS = {n for names in MCORE.values() for n in names if n.startswith("moe_")} | {
    "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_dtype", "moe_router_topk_scaling_factor", "moe_router_force_expert_balance", "moe_router_fusion",
    "moe_shared_expert_overlap", "moe_layer_freq", "moe_permute_fusion", "moe_apply_probs_on_input",
    "moe_n_hash_layers"}
ROUTER_DTYPES = {"float64": "float64", "fp64": "float64", "float32": "float32", "fp32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}
SCOPES = {"sub_seq_aux_loss": "sub_sequence", "seq_aux_loss": "sequence", "gbs_aux_loss": "global_batch"}
MAX_INT = 1 << 40
_BAD = object()
_KINDS = {  # kind -> (rule, fix)
    "count": ("must be a whole number >= 1", "write a positive whole number"),
    "count0": ("must be a whole number >= 0", "write 0 or a positive whole number"),
    "int": ("must be a whole number", "write a whole number"),
    "num": ("must be a finite number", "write a number"),
    "bool": ("must be true or false", "write true or false"),
    "str": ("must be a string", "write one of the documented names"),
    "list": ("must be a list", "write a YAML list, e.g. [expert]"),
    "policy": ("must be probs, position or a boolean (enable_sdrop)", "write probs or position"),
}


def _typed(value: Any, kind: str) -> Any:
    if kind in ("count", "count0", "int"):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)  # e.g. `shared_expert_num: 8.0` in a real config; MindFormers multiplies with it
        if not isinstance(value, int) or isinstance(value, bool) or abs(value) > MAX_INT:
            return _BAD
        return value if value >= {"count": 1, "count0": 0, "int": -MAX_INT}[kind] else _BAD
    if kind == "num":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok and abs(value) <= 1e30 else _BAD
    if kind == "policy":  # transformer_config_utils.py:92-98: a bool is enable_sdrop (true: position)
        if isinstance(value, bool):
            return "position" if value else "probs"
        return value if value in ("probs", "position") else _BAD
    want = {"bool": bool, "str": str, "list": list}[kind]
    return value if isinstance(value, want) else _BAD


class _Reader:
    """Typed values from one YAML section; every bad value is one ConfigIssue under the key path as written."""

    def __init__(self, sec: Mapping, prefix: str, issues: list[ConfigIssue]):
        self.sec, self.prefix, self.issues, self.keys, self.bad = sec, prefix, issues, {}, set()

    def path(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def get(self, names: Any, kind: str, default: Any = None, field: Optional[str] = None) -> Any:
        """The value of the first spelling present, `default` when none is, None when it is invalid (reported)."""
        names = (names,) if isinstance(names, str) else names
        present = [n for n in names if self.sec.get(n) is not None]
        if not present:
            return default
        if len(present) > 1:
            self.issues.append(ConfigIssue(self.path(present[1]), self.sec[present[1]],
                                           f"sets the same MindFormers setting as {self.path(present[0])} "
                                           "(parallel_core/transformer_config_utils.py:496-500 refuses both)",
                                           f"keep one of {', '.join(present)}"))
        name = present[0]
        if field:
            self.keys[field] = self.path(name)
        value = _typed(self.sec[name], kind)
        if value is _BAD:
            self.issues.append(ConfigIssue(self.path(name), self.sec[name], *_KINDS[kind]))
            self.bad.add(name)
            return None
        return value

    def issue(self, field: str, value: Any, rule: str, fix: str) -> None:
        self.issues.append(ConfigIssue(self.keys.get(field, self.path(field)), value, rule, fix))


def _warn(text: str) -> None:
    warnings.warn(text, ConfigWarning, stacklevel=5)


def read_moe(raw: Mapping, cfg: ParallelConfig) -> tuple[Optional[Any], list[ConfigIssue]]:
    """(MoESettings or None when the YAML describes no experts, issues). Legacy `moe_config:` unless use_legacy is
    false; the mcore keys of model.model_config otherwise (or when moe_config describes no experts)."""
    issues: list[ConfigIssue] = []
    sec, mc = raw.get(LEGACY), (raw.get("model") or {})
    mc = mc.get("model_config") if isinstance(mc, Mapping) else None
    mc = mc if isinstance(mc, Mapping) else {}
    settings = None
    if sec is not None and not cfg.use_legacy:
        _warn(f"{LEGACY}: MindFormers mcore models (use_legacy: false) do not read moe_config "
              f"(tools/register/template.py:701-702); the MoE keys of {MC} apply")
    elif isinstance(sec, Mapping):
        settings = _legacy({k: v for k, v in sec.items() if isinstance(k, str)}, cfg, issues)
    elif sec is not None:
        issues.append(ConfigIssue(LEGACY, sec, "must be a mapping", "write `moe_config:` with indented keys"))
    if settings is None and _has_mcore_keys(mc):
        settings = _mcore({k: v for k, v in mc.items() if isinstance(k, str)}, cfg, issues)
    issues += _parallel_rules(cfg, settings, raw.get(LEGACY) if settings and settings.source == LEGACY else None)
    return settings, issues


def _has_mcore_keys(mc: Mapping) -> bool:
    names = {n for f, spellings in MCORE.items() if f not in _NOT_MOE_ALONE for n in spellings}
    return any(isinstance(k, str) and mc[k] is not None and (k in names or k.startswith("moe_")) for k in mc)


def _settings(**kw: Any) -> Any:
    from ..moe.settings import MoESettings  # lazy: keeps config/ importable whatever moe/__init__ pulls in

    return MoESettings(**kw)


def _legacy(sec: dict, cfg: ParallelConfig, issues: list[ConfigIssue]) -> Optional[Any]:
    for key in [k for k in sec if k not in LEGACY_KEYS]:
        close = difflib.get_close_matches(key, LEGACY_KEYS, n=1, cutoff=0.6)
        issues.append(ConfigIssue(f"{LEGACY}.{key}", sec.pop(key), "is not a MindFormers moe_config key "
                                  "(tools/register/template.py:112-116 raises KeyError)",
                                  f"did you mean `{close[0]}`?" if close else "remove it"))
    r = _Reader(sec, LEGACY, issues)
    r.keys = {f: r.path(k) for f, k in LEGACY_FIELDS.items()}
    experts = r.get("expert_num", "count", 1)
    top_k = r.get("num_experts_chosen", "count", 1)
    aux = r.get("aux_loss_factor", "num", 0.05)
    if aux is not None and not 0 < aux < 1:
        r.issue("aux_loss_factor", aux, "must be > 0 and < 1 (modules/transformer/moe.py:143, :158-160)",
                "write a value between 0 and 1, e.g. 0.05")
    if None not in (top_k, experts) and top_k > experts:
        r.issue("top_k", top_k, f"must not be larger than {LEGACY}.expert_num={experts} "
                "(modules/transformer/moe.py:161-163)", f"choose at most {experts} experts per token")
    capacity = r.get("capacity_factor", "num", 1.1)
    routing = r.get("routing_policy", "str", "TopkRouterV1")
    if routing is not None and routing not in ("TopkRouterV1", "TopkRouterV2"):
        r.issue("routing_policy", routing, "must be TopkRouterV1 or TopkRouterV2 (modules/transformer/moe.py:565-572; "
                "MoEV2 takes TopkRouterV2 only, :304)", "write TopkRouterV2")
    terms = _aux_terms(r)
    emp = r.get("expert_model_parallel", "count")
    if emp is not None and emp not in (1, cfg.tp):
        r.issue("expert_model_parallel", emp, f"must be 1 or {cfg.key(f'{PC}.model_parallel')}={cfg.tp} "
                "(models/llama/llama_layer.py:312-315)", f"write 1 (experts not split over model_parallel), {cfg.tp}, "
                "or leave it out")
    for key in LEGACY_BOOLS:
        r.get(key, "bool")
    for key in LEGACY_POSITIVE:
        r.get(key, "count")
    dtype = r.get("router_dense_type", "str", "float32")
    if dtype is not None and dtype not in ("float16", "float32", "bfloat16"):
        r.issue("router_dense_type", dtype, "must be float16, float32 or bfloat16 (modules/transformer/moe.py:154)",
                "write float32")
    first_k = r.get("first_k_dense_replace", "int")
    settings = dict(
        source=LEGACY, num_experts=experts, top_k=top_k, z_loss_coeff=r.get("z_loss_factor", "num", 0.0),
        drop_policy="position" if r.get("enable_sdrop", "bool", False) else "probs",  # utils.py:92-98
        shared_experts=r.get("shared_expert_num", "count0"), shared_expert_intermediate_size=None,
        moe_intermediate_size=r.get("moe_intermediate_size", "count"),
        first_k_dense_replace=int(first_k) if first_k is not None else None,
        norm_topk_prob=r.get("norm_topk_prob", "bool"), expert_bias=r.get("balance_via_topk_bias", "bool", False),
        bias_update_rate=r.get("topk_bias_update_rate", "num"), expert_model_parallel=emp,
        routed_scaling_factor=_scaling(r, "routed_scaling_factor"), router_dtype=dtype,
        aux_loss_scope="sub_sequence")  # each dp group's own tokens: modules/transformer/moe.py:493, :1413-1427
    use_gmm = r.get("use_gmm", "bool", False)
    if experts is None or experts <= 1 or r.bad:
        return None  # dense (expert_num 1), or invalid values (reported)
    if "aux_loss_types" in sec and sec["aux_loss_types"] is not None:
        coeff = terms.get("expert", 0.0)  # TopkRouterV2 / MoEV3: modules/transformer/moe.py:953, moev3.py:137
        extra = {k: v for k, v in terms.items() if k != "expert" and v}
        if extra:
            _warn(f"{LEGACY}.aux_loss_types: the {', '.join(extra)} balance loss(es) ({extra}) are not applied by "
                  f"msparallel_ds; only the expert-level loss (factor {coeff:g}) is")
    elif routing == "TopkRouterV1":
        coeff = aux  # MoE with TopkRouterV1 scales its loss by aux_loss_factor (1.3.2 modules/transformer/moe.py:603)
    else:
        coeff = 0.0
        if "aux_loss_factor" in sec:
            _warn(f"{LEGACY}.aux_loss_factor={aux:g} has no effect with routing_policy=TopkRouterV2: MindFormers takes "
                  "the balance loss from aux_loss_types/aux_loss_factors (modules/transformer/moe.py:953, :1196-1213), "
                  f"so it is off, here as there; write aux_loss_types: [expert] and aux_loss_factors: [{aux:g}] to "
                  "turn it on")
    # MoEV3 (use_gmm) is dropless; MoEV2 drops above the capacity when capacity_factor > 0, else sizes the
    # capacity to the busiest expert (modules/transformer/moe.py:1249-1255, :1396): dropless
    dropless = use_gmm or capacity <= 0
    return _settings(**settings, capacity_factor=None if dropless else capacity, aux_loss_coeff=coeff,
                     keys=tuple(r.keys.items()))


def _scaling(r: _Reader, name: str) -> Optional[float]:
    value = r.get(name, "num")
    if value is not None and value <= 0:
        r.issue(name, value, "must be > 0 (it multiplies the routing weights: modules/transformer/moe.py:1195)",
                "write e.g. 1.0 (no scaling)")
    return value


def _aux_terms(r: _Reader) -> dict[str, float]:
    """aux_loss_types / aux_loss_factors (modules/transformer/moe.py:60-84): lists, types in expert/device/comm."""
    types, factors = r.get("aux_loss_types", "list"), r.get("aux_loss_factors", "list")
    if types is None:
        return {}
    bad = [t for t in types if t not in ("expert", "device", "comm")]
    if bad:
        r.issue("aux_loss_types", types, "may hold only expert, device and comm (modules/transformer/moe.py:80-81)",
                f"remove {bad}")
        return {}
    nums = [_typed(f, "num") for f in factors or []]
    if "aux_loss_factors" in r.bad:
        return {}
    if factors is None or len(factors) != len(types) or _BAD in nums:
        r.issue("aux_loss_factors", factors, f"must be a list of {len(types)} number(s), one per aux_loss_types "
                "entry (modules/transformer/moe.py:82-83; a shorter list drops loss terms silently)",
                f"give one factor per type in {types}")
        return {}
    return dict(zip(types, nums))


def _mcore(mc: dict, cfg: ParallelConfig, issues: list[ConfigIssue]) -> Any:
    for key in [k for k in mc if k.startswith("moe_") and k not in MCORE_MOE_KEYS]:
        close = difflib.get_close_matches(key, sorted(MCORE_MOE_KEYS), n=1, cutoff=0.8)
        if close:  # other unknown moe_* keys may be a model family's own; a near miss of a known one is a typo
            issues.append(ConfigIssue(f"{MC}.{key}", mc[key], "is not a MindFormers MoE key (not in "
                                      "parallel_core/transformer_config_utils.py)", f"did you mean `{close[0]}`?"))
    r = _Reader(mc, MC, issues)
    got = {f: r.get(names, kind, default, f) for f, names, kind, default in (
        ("num_experts", MCORE["num_experts"], "count", None), ("top_k", MCORE["top_k"], "count", None),
        ("capacity_factor", MCORE["capacity_factor"], "num", None),
        ("drop_policy", MCORE["drop_policy"], "policy", "probs"),  # default: transformer_config.py:2018-2028
        ("aux_loss_coeff", MCORE["aux_loss_coeff"], "num", 0.0),  # default 0: transformer_config.py:1964
        ("aux_loss_scope", MCORE["aux_loss_scope"], "str", "sub_seq_aux_loss"),  # transformer_config.py:1860-1870
        ("z_loss_coeff", MCORE["z_loss_coeff"], "num", None),
        ("shared_experts", MCORE["shared_experts"], "count0", None),
        ("shared_expert_intermediate_size", MCORE["shared_expert_intermediate_size"], "count", None),
        ("moe_intermediate_size", MCORE["moe_intermediate_size"], "count", None),
        ("first_k_dense_replace", MCORE["first_k_dense_replace"], "int", None),
        ("norm_topk_prob", MCORE["norm_topk_prob"], "bool", None),
        ("routed_scaling_factor", MCORE["routed_scaling_factor"], "num", None),
        ("expert_bias", MCORE["expert_bias"], "bool", False),
        ("bias_update_rate", MCORE["bias_update_rate"], "num", None),
        ("n_group", MCORE["n_group"], "count0", None), ("topk_group", MCORE["topk_group"], "count0", None),
        ("router_dtype", ("moe_router_dtype",), "str", "float32"))}  # default float32: transformer_config.py:1927
    if got["router_dtype"] is not None and got["router_dtype"] not in ROUTER_DTYPES:
        r.issue("router_dtype", got["router_dtype"], "must be one of " + ", ".join(ROUTER_DTYPES) + " (parallel_core/"
                "transformer_config.py:33-42, convert_str_to_mstype)", "write float32")
    elif got["router_dtype"] is not None:
        got["router_dtype"] = ROUTER_DTYPES[got["router_dtype"]]
    experts, top_k, scope = got["num_experts"], got["top_k"], got["aux_loss_scope"]
    if got["routed_scaling_factor"] is not None and got["routed_scaling_factor"] <= 0:
        r.issue("routed_scaling_factor", got["routed_scaling_factor"], "must be > 0 (it multiplies the routing "
                "weights: parallel_core/training_graph/transformer/moe/router.py:295)", "write e.g. 1.0 (no scaling)")
    if got["capacity_factor"] is not None and got["capacity_factor"] < 0:
        got["capacity_factor"] = None  # a negative capacity factor means dropless (transformer_config.py:2448-2450)
    if scope is not None and scope not in SCOPES:
        cap = " (and moe_expert_capacity_factor works only with them: transformer_config.py:2451-2455)" \
            if got["capacity_factor"] is not None else ""
        r.issue("aux_loss_scope", scope, f"must be one of {', '.join(SCOPES)} (parallel_core/training_graph/"
                f"transformer/moe/router.py:139, :200-204){cap}", "pick one of those; moe_aux_loss_coeff: 0 turns "
                "the balance loss off")
    for name in ("aux_loss_coeff", "z_loss_coeff"):
        if (got[name] or 0) < 0:
            r.issue(name, got[name], "must be >= 0 (a negative coefficient rewards imbalance)", "write 0 or more")
    if experts and top_k and top_k > experts:
        r.issue("top_k", top_k, f"must not be larger than the {experts} experts", f"choose at most {experts}")
    _group_rules(r, experts, top_k, got["n_group"], got["topk_group"])
    first_k, layers = got["first_k_dense_replace"], cfg.model.num_layers
    if first_k is not None and (first_k < -1 or (layers is not None and first_k > layers)):
        r.issue("first_k_dense_replace", first_k, f"must be -1 or between 0 and num_layers={layers} "
                "(parallel_core/transformer_config.py:2522-2553)", "count the leading dense layers, or write -1")
    for name in ("moe_router_force_expert_balance", "moe_apply_probs_on_input"):
        if mc.get(name) is True:
            _warn(f"{MC}.{name}=true is not applied by msparallel_ds: the HF model's router and expert forward run "
                  "as they are")
    for name in ("n_group", "topk_group"):
        got.pop(name)
    if r.bad:
        return None  # invalid values (reported)
    got["aux_loss_scope"] = SCOPES.get(scope, "sub_sequence")
    # The mcore MoE (parallel_core/training_graph/transformer/moe) has no capacity and no z-loss: the capacity
    # factor is only validated (transformer_config.py:2448-2455) and moe_z_loss_coeff is read by nothing
    for name, what in (("capacity_factor", "never drops tokens (the capacity factor is only validated: "
                        "parallel_core/transformer_config.py:2448-2455; nothing under parallel_core/training_graph"
                        "/transformer/moe reads it)"), ("z_loss_coeff", "has no router z-loss (the TopKRouter "
                        "returns only the load-balancing loss: parallel_core/training_graph/transformer/moe/router.py"
                        ":427-437)")):
        if got[name]:
            _warn(f"{r.keys.get(name, name)}={got[name]:g}: MindFormers' mcore MoE {what}; it has no effect here "
                  "either (moe_config with use_legacy: true keeps capacity_factor and z_loss_factor)")
    got["capacity_factor"], got["z_loss_coeff"] = None, 0.0
    return _settings(source="model_config", expert_model_parallel=None, keys=tuple(r.keys.items()), **got)


def _group_rules(r: _Reader, experts: Optional[int], top_k: Optional[int], n_group: Optional[int],
                 topk_group: Optional[int]) -> None:
    """Group-limited routing (parallel_core/transformer_config.py:2490-2510), when topk_group is set (non-zero)."""
    if not topk_group:
        return
    if not n_group:
        r.issue("topk_group", topk_group, "needs n_group (moe_router_num_groups) for group-limited routing",
                "set n_group, or topk_group: 0")
    elif experts and experts % n_group:
        r.issue("n_group", n_group, f"must divide the {experts} experts", f"use a divisor of {experts}")
    elif topk_group > n_group:
        r.issue("topk_group", topk_group, f"must not exceed n_group={n_group}", f"use at most {n_group}")
    elif top_k and top_k % topk_group:
        r.issue("top_k", top_k, f"must be divisible by topk_group={topk_group}", f"use a multiple of {topk_group}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 4096) + 1) if n % d == 0]


def dp_is_known(cfg: ParallelConfig) -> bool:
    """False when the data-parallel degree comes from the world size (`parallelism.data_parallel_shard: -1`)."""
    return not (cfg.parallelism is not None and cfg.parallelism.data_parallel_shard == -1)


def _parallel_rules(cfg: ParallelConfig, s: Optional[Any], legacy: Optional[Mapping]) -> list[ConfigIssue]:
    """Expert parallel against the other degrees, for MoE settings s (None: the HF model decides the experts)."""
    out: list[ConfigIssue] = []
    ep, tp, cp, dp = cfg.ep, cfg.tp, cfg.cp, cfg.dp
    k = cfg.key
    ep_key = k(f"{PC}.expert_parallel")
    if s is not None and s.num_experts and ep > 1 and s.num_experts % ep:
        cite = "1.3.2 modules/transformer/moe.py:223-228" if legacy is not None else \
            "parallel_core/training_graph/transformer/moe/moe_layer.py:60-63"
        out.append(ConfigIssue(s.key("num_experts"), s.num_experts, f"must be a multiple of {ep_key}={ep}: every "
                               f"expert-parallel rank holds whole experts ({cite})",
                               f"use a multiple of {ep}, or expert_parallel one of {_divisors(s.num_experts)}"))
    if ep > 1 and dp_is_known(cfg):
        fold, names, cite = dp * cp * tp, "data_parallel x context_parallel x model_parallel", \
            "expert-parallel groups are folded out of those ranks (mcore layout)"
        if legacy is not None and s.expert_model_parallel != 1:
            fold, names, cite = dp * cp, "data_parallel x context_parallel", \
                "expert data parallel = dp x cp / ep: models/llama/llama_layer.py:322-330"
        elif legacy is not None:
            cite = "expert data parallel = dp x cp x mp / ep with expert_model_parallel=1: llama_layer.py:330"
        elif s is not None:
            fold, names, cite = dp * tp, "data_parallel x model_parallel", \
                "parallel_core/training_graph/transformer/moe/ffn.py:189-195"
        if fold % ep:
            out.append(ConfigIssue(ep_key, ep, f"must divide {names} = {fold} ({cite})",
                                   f"use one of {_divisors(fold)}"))
        elif legacy is not None and legacy.get("use_gmm") is True and (dp * tp) % ep:
            out.append(ConfigIssue(ep_key, ep, f"must divide data_parallel x model_parallel = {dp * tp} with "
                                   f"{LEGACY}.use_gmm=true (modules/transformer/moev3.py:890-896)",
                                   f"use one of {_divisors(dp * tp)}, or use_gmm: false"))
    sp_key, tp_key = k(f"{PC}.use_seq_parallel"), k(f"{PC}.model_parallel")
    if tp > 1 and not cfg.parallel_config.use_seq_parallel:
        # only MindFormers' legacy MoE is refused (its check reads moe_config); mcore runs, each tp rank routing
        # its own sequence slice (models/moe.py, style token_slice_block)
        if legacy is not None and cfg.parallel.parallel_mode == "semi_auto_parallel":
            out.append(ConfigIssue(sp_key, False, f"must be true for a MoE model with {tp_key}={tp} > 1 "
                                   "(tools/check_rules.py:169-176, :215)", "set use_seq_parallel: true"))
    return out
