"""Mixture-of-experts: expert parallel (EP) with MindFormers' semantics.

settings.py   the YAML's MoE settings (read and validated by config/moe.py) and their check against the HF model
plan.py       the MoE part of a Plan: expert-data-parallel size, notes, expert parameters per stage (memory)
dispatch.py   the all-to-all token dispatch / combine around the HF experts' own forward on local experts
capacity.py   the capacity / token-drop rule (only when the YAML sets a capacity factor)
aux_loss.py   the router's load-balancing and z loss, MindFormers' coefficient and scope
apply.py      shard a part's experts over the ep group (what parallelize calls) and mark their parameters
deepspeed.py  hand the expert parameters and groups to DeepSpeed's ZeRO (expert-data-parallel reduction)

Nothing is imported here eagerly: config/ imports settings.py lazily and must not pull in the runtime.
"""
