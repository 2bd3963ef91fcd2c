"""Train the zoo's tiny checkpoints on the tokenized stdlib corpus: one GPU, fixed seeds, time-boxed runs."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM, LlamaConfig, LlamaForCausalLM

VOCAB = 8192
DRAFTER_VOCAB = 8256  # padded past the tokenizer, as the real llama pair is; the extra rows stay unused
BOS, EOS, PAD, IM_END = 1, 0, 2, 4
CONTEXT = 512
SHARD_BYTES = 15 * 2**20  # files come back from the device at most 16 MiB each

COMMON = dict(bos_token_id=BOS, eos_token_id=[EOS, IM_END], pad_token_id=PAD, tie_word_embeddings=True, max_position_embeddings=2048)

# name -> (family, config kwargs, training settings); `budget_s` is the wall time the step count is sized to.
SPECS: dict[str, dict] = {
    "tiny-llama": dict(
        family="llama",
        config=dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=640, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        lr=2e-3, budget_s=110, seed=1,
    ),
    "tiny-llama-drafter": dict(
        family="llama",
        config=dict(vocab_size=DRAFTER_VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        lr=3e-3, budget_s=80, seed=2, teacher="tiny-llama",
    ),
    "tiny-lfm2": dict(
        family="lfm2",
        # intermediate 768 with auto-adjust gives a 512-wide FFN, exercising the real checkpoints' rule.
        config=dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, block_auto_adjust_ff_dim=True,
                    block_multiple_of=256, block_ffn_dim_multiplier=1.0, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=2, norm_eps=1e-5, conv_L_cache=3, conv_bias=False,
                    layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"]),
        lr=2e-3, budget_s=100, seed=3,
    ),
    "tiny-lfm2-moe": dict(
        family="lfm2_moe",
        # Expert width a multiple of 64 so every expert matrix takes mlx-lm's group-64 quantization.
        config=dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=192,
                    num_hidden_layers=6, num_dense_layers=2, num_experts=8, num_experts_per_tok=2,
                    use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.0,
                    num_attention_heads=8, num_key_value_heads=2, norm_eps=1e-5, conv_L_cache=3, conv_bias=False,
                    layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"]),
        lr=2e-3, budget_s=120, seed=4,
    ),
}
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "lfm2": (Lfm2Config, Lfm2ForCausalLM),
            "lfm2_moe": (Lfm2MoeConfig, Lfm2MoeForCausalLM)}


def make_config(name: str):
    spec = SPECS[name]
    cls, _ = FAMILIES[spec["family"]]
    return cls(**COMMON, **spec["config"])


def make_model(name: str) -> torch.nn.Module:
    _, model_cls = FAMILIES[SPECS[name]["family"]]
    torch.manual_seed(SPECS[name]["seed"])
    return model_cls(make_config(name))


def count_params(model: torch.nn.Module) -> int:
    # parameters() yields a tied embedding once
    return sum(p.numel() for p in model.parameters())


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "expert_bias") and hasattr(m, "gate")]


class ExpertBalancer:
    """Aux-loss-free balancing: nudge each MoE block's expert_bias toward equal load, as LFM2-MoE trains."""

    def __init__(self, model: torch.nn.Module, rate: float = 1e-3):
        self.blocks = moe_blocks(model)
        self.rate = rate
        self.counts = [None] * len(self.blocks)
        for i, block in enumerate(self.blocks):
            block.gate.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, out):
            if module.training:
                self.counts[i] = torch.bincount(out[2].flatten(), minlength=module.num_experts).float()
        return hook

    @torch.no_grad()
    def step(self) -> None:
        for block, counts in zip(self.blocks, self.counts):
            if counts is not None:
                load = counts / counts.sum()
                block.expert_bias += self.rate * torch.sign(load.mean() - load)

    def spread(self) -> list[float]:
        """Busiest expert's load over the mean load, per block, at the last step (1.0 is perfect balance)."""
        return [round(float(c.max() / c.mean()), 2) for c in self.counts if c is not None]


def batches(tokens: torch.Tensor, batch: int, gen: torch.Generator):
    """Endless random windows of CONTEXT+1 tokens from the training stream."""
    span = torch.arange(CONTEXT + 1, device=tokens.device)
    while True:
        starts = torch.randint(0, tokens.numel() - CONTEXT - 1, (batch,), generator=gen, device="cpu")
        yield tokens[starts.to(tokens.device)[:, None] + span]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to a tenth


def optimizer_for(model: torch.nn.Module, lr: float, device: str) -> torch.optim.Optimizer:
    # Decay the matrices only: shrinking norm gains toward zero would fight the normalisation.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")


def autocast(device: str):
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def loss_of(model, window: torch.Tensor, device: str, teacher=None, alpha: float = 0.9) -> torch.Tensor:
    """Next-token cross entropy; with a teacher, mostly soft cross entropy on its distribution (distillation)."""
    inputs, labels = window[:, :-1], window[:, 1:]
    with autocast(device):
        logits = model(input_ids=inputs).logits
    logp = F.log_softmax(logits.float(), dim=-1)
    hard = F.nll_loss(logp.reshape(-1, logp.shape[-1]), labels.reshape(-1))
    if teacher is None:
        return hard
    with torch.no_grad(), autocast(device):
        t_logits = teacher(input_ids=inputs).logits
    p_t = F.softmax(t_logits.float(), dim=-1)
    # The teacher puts no mass on the drafter's padding rows, so the full softmax learns to keep them low.
    soft = -(p_t * logp[..., : p_t.shape[-1]]).sum(-1).mean()
    return alpha * soft + (1 - alpha) * hard


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, device: str, batch: int, max_windows: int | None = None,
             teacher=None) -> dict:
    """Held-out loss in nats/token over non-overlapping windows; with a teacher, greedy agreement too."""
    model.eval()
    n = (tokens.numel() - 1) // CONTEXT
    if max_windows:
        n = min(n, max_windows)
    starts = torch.arange(n, device=tokens.device) * CONTEXT
    span = torch.arange(CONTEXT + 1, device=tokens.device)
    total, count, agree = 0.0, 0, 0
    for i in range(0, n, batch):
        w = tokens[starts[i : i + batch, None] + span]
        with autocast(device):
            logits = model(input_ids=w[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
        if teacher is not None:
            with autocast(device):
                t = teacher(input_ids=w[:, :-1]).logits.float()
            agree += (logits.argmax(-1) == t.argmax(-1)).sum().item()
    model.train()
    out = {"heldout_loss": total / count, "heldout_tokens": count}
    if teacher is not None:
        out["greedy_agreement"] = agree / count
    return out


def save_shards(model: torch.nn.Module, out: Path, name: str) -> list[str]:
    """bf16 state dict (tied head dropped, expert_bias kept fp32) in shards small enough to come back."""
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state = {k: (v if k.endswith("expert_bias") else v.to(torch.bfloat16)).contiguous() for k, v in state.items()}
    shards, cur, size = [], {}, 0
    for k in sorted(state):
        nbytes = state[k].numel() * state[k].element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = state[k]
        size += nbytes
    shards.append(cur)
    names = []
    for i, shard in enumerate(shards):
        path = out / f"{name}.{i}.safetensors"
        save_file(shard, str(path))
        names.append(path.name)
    return names


def train_one(name: str, data: dict, args, device: str, teachers: dict, log) -> tuple[torch.nn.Module, dict]:
    spec = SPECS[name]
    model = make_model(name).to(device)
    model.train()
    teacher = teachers.get(spec.get("teacher"))
    balancer = ExpertBalancer(model) if spec["family"] == "lfm2_moe" else None
    opt = optimizer_for(model, spec["lr"], device)
    gen = torch.Generator().manual_seed(spec["seed"])
    stream = batches(data["train"], args.batch, gen)
    budget = spec["budget_s"] * args.budget_scale
    steps = args.steps.get(name, args.steps.get("*"))
    warmup = 100 if steps is None else min(100, max(1, steps // 10))
    t0, calib_t, step, losses = time.time(), None, 0, []
    while True:
        if steps is None and step == args.calib_steps + 5:
            # Size the run from measured step time so the cosine schedule is a fixed step count.
            per_step = (time.time() - calib_t) / args.calib_steps
            # Past ~10 epochs of an 8M-token corpus the held-out loss stops improving, so cap there too.
            max_steps = int(args.max_epochs * data["train"].numel() / (args.batch * CONTEXT))
            steps = max(step + 1, min(max_steps, int(budget / per_step)))
            log(f"{name}: {per_step * 1e3:.1f} ms/step -> {steps} steps")
        if steps is not None and step >= steps:
            break
        if step == 5:
            if device == "cuda":
                torch.cuda.synchronize()
            calib_t = time.time()
        lr = lr_at(step, steps or 10**9, spec["lr"], warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = loss_of(model, next(stream), device, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if balancer:
            balancer.step()
        if step % 100 == 0 or step == (steps or 0) - 1:
            losses.append((step, round(loss.item(), 4)))
            log(f"{name} step {step} loss {loss.item():.4f} lr {lr:.2e} t {time.time() - t0:.0f}s")
        if step and step % 500 == 0:
            probe = evaluate(model, data["heldout"], device, args.eval_batch, 32)["heldout_loss"]
            log(f"{name} step {step} heldout(32 windows) {probe:.4f}")
        step += 1
        if time.time() - t0 > budget * 1.5:
            log(f"{name}: stopped at step {step}, past 1.5x its budget")  # a safety net, never the plan
            break
    train_s = time.time() - t0
    metrics = {"params": count_params(model), "steps": step, "batch": args.batch, "context": CONTEXT,
               "tokens_seen": step * args.batch * CONTEXT, "train_s": round(train_s, 1), "lr": spec["lr"],
               "seed": spec["seed"], "loss_curve": losses}
    if balancer:
        metrics["expert_load_spread"] = balancer.spread()
    metrics.update(evaluate(model, data["heldout"], device, args.eval_batch, args.eval_windows, teacher))
    log(f"{name}: {json.dumps({k: v for k, v in metrics.items() if k != 'loss_curve'})}")
    return model, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=Path(".zoo/data"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".zoo/run")))
    ap.add_argument("--only", nargs="*", default=list(SPECS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--eval-batch", type=int, default=64)
    ap.add_argument("--eval-windows", type=int, default=None)
    ap.add_argument("--steps", nargs="*", default=[], metavar="[NAME=]N",
                    help="fixed step counts, for all models or by name (default: sized from budget_s)")
    ap.add_argument("--budget-scale", type=float, default=1.0)
    ap.add_argument("--calib-steps", type=int, default=30)
    ap.add_argument("--max-epochs", type=float, default=10.0)
    args = ap.parse_args()
    args.steps = {(kv.split("=")[0] if "=" in kv else "*"): int(kv.split("=")[-1]) for kv in args.steps}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    logf = open(args.out / "train.log", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    import transformers
    log(f"torch {torch.__version__} transformers {transformers.__version__} device {device} "
        f"{torch.cuda.get_device_name() if device == 'cuda' else ''}")
    data = {s: torch.from_numpy(np.load(args.data / f"{s}.npy").astype(np.int64)).to(device)
            for s in ("train", "heldout")}
    all_metrics, teachers = {}, {}
    for name in args.only:
        model, metrics = train_one(name, data, args, device, teachers, log)
        metrics["files"] = save_shards(model, args.out, name)
        all_metrics[name] = metrics
        (args.out / "metrics.json").write_text(json.dumps(all_metrics, indent=1))
        if any(s.get("teacher") == name for s in SPECS.values()):
            teachers[name] = model.eval().requires_grad_(False)
        else:
            del model
    log("all done")


if __name__ == "__main__":
    main()
