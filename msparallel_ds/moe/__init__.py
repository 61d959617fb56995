"""Mixture-of-experts: expert parallel (EP) with MindFormers' semantics.

settings.py   the YAML's MoE keys (legacy moe_config / mcore model_config), validated, and the model check
dispatch.py   the all-to-all token dispatch / combine around the HF experts' own forward on local experts
apply.py      shard a part's experts over the ep group (what parallelize calls) and mark their parameters
deepspeed.py  hand the expert parameters and groups to DeepSpeed's ZeRO (expert-data-parallel reduction)
"""
