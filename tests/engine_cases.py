"""Shared pieces of the engine parity tests: a tiny MindFormers YAML per layout, the global batch, and the
single-process reference run (same initial weights, same data, AdamW, global-norm clipping)."""

VOCAB, SEQ, LR, BETAS, EPS = 256, 32, 1e-3, (0.9, 0.95), 1e-8


def tiny_config(*, dp=1, tp=1, cp=1, algo="colossalai_cp", ring=False, uly=1, sp=False, vocab_dp=True, zero=1,
                recompute=False, select=None, bs=1, gas=1, clip=1.0, swap=False, offload=None):
    """A MindFormers-style YAML (as a dict) for the tiny Llama below."""
    par = {"data_parallel": dp, "model_parallel": tp, "context_parallel": cp, "pipeline_stage": 1,
           "use_seq_parallel": sp, "vocab_emb_dp": vocab_dp, "micro_batch_num": 1}
    if cp > 1:
        par["context_parallel_algo"] = algo
        if algo == "hybrid_cp":
            par["ulysses_degree_in_cp"] = uly
    recompute_config = {"recompute": recompute}
    if select:
        recompute_config["select_recompute"] = select
    return {
        "parallel_config": par,
        "parallel": {"enable_parallel_optimizer": zero > 0,
                     "parallel_optimizer_config": {"optimizer_level": f"level{max(zero, 1)}"}},
        "recompute_config": recompute_config,
        **({"swap_config": {"swap": True, "layer_swap": [{"layers": offload, "backward_prefetch": 1}]}}
           if offload is not None else {}),
        "runner_config": {"batch_size": bs, "gradient_accumulation_steps": gas},
        "runner_wrapper": {"use_clip_grad": clip > 0, **({"max_grad_norm": clip} if clip else {})},
        "optimizer": {"type": "AdamW", "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0, "learning_rate": LR,
                      **({"swap": True} if swap else {})},
        "model": {"model_config": {"num_layers": 4, "num_heads": 4, "n_kv_heads": 2, "hidden_size": 64,
                                   "seq_length": SEQ, "vocab_size": VOCAB, "use_ring_attention": ring,
                                   "compute_dtype": "float32", "param_init_type": "float32"}},
    }


def tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attention_dropout=0.0, attn_implementation="eager")
    return LlamaForCausalLM(cfg).float()


def global_batch(step, rows, ignore_some=False):
    """Step `step`'s global batch: input_ids and labels [rows, SEQ]; a few labels ignored (-100) when asked, so
    micro-batches and cp shards hold unequal token counts."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = ids.clone()
    if ignore_some:
        mask = torch.rand(rows, SEQ, generator=g) < 0.3
        mask[0, : SEQ // 2] = True  # row 0's first half: a whole cp shard / micro-batch nearly empty
        labels[mask] = -100
    return ids, labels


def train_steps(engine, steps, batch_of=global_batch, **track):
    """`steps` engine steps, each dp rank on its share of batch_of(step, global rows): {"losses", "rows" (global),
    "micro" (micro-batch size), and per keyword name the list of track[name](engine) after each step}."""
    rows, lay = engine.micro_batch_size * engine.gradient_accumulation_steps, engine.layout
    out = {"losses": [], **{name: [] for name in track}}
    for step in range(steps):
        ids, labels = batch_of(step, rows * lay.size("dp"))
        share = slice(lay.rank("dp") * rows, (lay.rank("dp") + 1) * rows)
        out["losses"].append(engine.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
        for name, read in track.items():
            out[name].append(read(engine))
    out.update(rows=rows * lay.size("dp"), micro=engine.micro_batch_size)
    return out


def reference_run(steps, rows, *, clip=1.0, ignore_some=False, batch_of=None, optimizer=None, norms=None):
    """Single process: HF loss (mean over the global batch's tokens), AdamW (or optimizer(params)), clip_grad_norm_
    (DeepSpeed's formula); batches from batch_of(step, rows) (default global_batch). Returns per-step losses, final
    state dict and how many steps clipping scaled the gradient; each step's global gradient norm is appended to
    `norms` when given."""
    import torch

    model = tiny_model()
    opt = (optimizer or (lambda p: torch.optim.AdamW(p, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)))(
        model.parameters())
    losses, clipped = [], 0
    for step in range(steps):
        ids, labels = batch_of(step, rows) if batch_of else global_batch(step, rows, ignore_some)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        if clip > 0 or norms is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            clipped += bool(clip > 0 and norm > clip)
            if norms is not None:
                norms.append(norm.item())
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, clipped
