"""Train a DSpark drafter (tiny-lfm2-moe-dspark by default): the DFlash block objective on the frozen target's
taps, plus Markov and confidence heads."""

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

from dspark_torch import DSparkDrafter, DSparkSpec, read_checkpoint, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "plugins/tensorfold_lfm2/tensorfold_lfm2/models/tiny-lfm2-moe"
PROMPT_LEN = 64  # generated sequences: a corpus window, then the target's greedy continuation


class Target:
    """The frozen target through transformers: its tapped layers' post-layer rows and its logits over windows."""

    def __init__(self, path: Path, layers: list[int], device: str):
        from transformers import AutoModelForCausalLM

        model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
        if info.get("missing_keys") or info.get("mismatched_keys"):  # a target left random would teach garbage
            raise SystemExit(f"{path}: transformers left weights unread: {info}")
        self.model = model.to(device).eval()
        self.model.requires_grad_(False)
        self.layers, self.rows = layers, {}
        decoder = self.model.model.layers
        for i in layers:
            decoder[i].register_forward_hook(self._keep(i))

    def _keep(self, i: int):
        def hook(module, args, out):
            self.rows[i] = out[0] if isinstance(out, tuple) else out  # the residual stream after layer i
        return hook

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(taps [b, t, len(layers) * h] side by side in layer order, logits [b, t, vocab] float32)."""
        logits = self.model(input_ids=ids).logits.float()
        taps = torch.cat([self.rows[i].float() for i in self.layers], dim=-1)
        self.rows.clear()
        return taps, logits

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, new: int) -> torch.Tensor:
        """prompts [b, p] followed by `new` greedy tokens each (no stop at an eos: the text after it is still text)."""
        try:
            out = self.model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                      max_new_tokens=new, min_new_tokens=new, pad_token_id=2, eos_token_id=None)
            if out.shape[1] == prompts.shape[1] + new:
                return out
        except Exception as exc:  # a transformers without this model's cached generate: the slow exact loop
            print(f"generate failed ({type(exc).__name__}: {exc}); recomputing the prefix each step", flush=True)
        ids = prompts
        for _ in range(new):
            ids = torch.cat([ids, self.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids


def generated(target: Target, tokens: torch.Tensor, count: int, length: int, batch: int, gen: torch.Generator,
              seconds: float = math.inf):
    """`count` sequences of `length`: a random corpus window of PROMPT_LEN tokens and the target's greedy rest; fewer
    where the batches so far took `seconds`."""
    out, start = [], time.time()
    for i in range(0, count, batch):
        if out and time.time() - start > seconds:
            break
        n = min(batch, count - i)
        starts = torch.randint(0, tokens.numel() - PROMPT_LEN, (n,), generator=gen).to(tokens.device)
        prompts = tokens[starts[:, None] + torch.arange(PROMPT_LEN, device=tokens.device)]
        out.append(target.greedy(prompts, length - PROMPT_LEN))
    return torch.cat(out)


def windows(tokens: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - length, (count,), generator=gen).to(tokens.device)
    return tokens[starts[:, None] + torch.arange(length, device=tokens.device)]


def anchors_of(batch: int, length: int, k: int, block: int, low: int, gen: torch.Generator, device) -> torch.Tensor:
    """k distinct pending positions a sequence in [low, length - block], sorted: a block's labels stay inside."""
    choices = torch.rand(batch, length - block + 1 - low, generator=gen).argsort(dim=1)[:, :k] + low
    return choices.sort(dim=1).values.to(device)


def block_inputs(drafter: DSparkDrafter, embedding: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor):
    """Each anchor's block [pending, mask...] embedded, its rows' positions, and what each row may attend:
    the context rows before its pending token and every row of its own block (the published training mask)."""
    s, (b, t), k = drafter.spec, ids.shape, anchors.shape[1]
    offsets = torch.arange(s.block_size, device=ids.device)
    positions = (anchors[:, :, None] + offsets).reshape(b, k * s.block_size)
    block_ids = torch.full((b, k, s.block_size), s.mask_token_id, device=ids.device, dtype=ids.dtype)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    row_anchor = anchors.repeat_interleave(s.block_size, dim=1)  # [b, k*block]
    context = torch.arange(t, device=ids.device)[None, None] < row_anchor[:, :, None]
    which = torch.arange(k, device=ids.device).repeat_interleave(s.block_size)
    own = (which[:, None] == which[None]).expand(b, -1, -1)
    return embedding[block_ids.reshape(b, -1)], positions, torch.cat([context, own], dim=2)


def block_losses(drafter: DSparkDrafter, target: Target, ids: torch.Tensor, anchors: torch.Tensor, args) -> dict:
    """The block objective: row j of a block at pending position p predicts the target's greedy token after p + j
    (the target's head on the final row, plus W2 W1[token at p + j]); the confidence head learns whether that pick is
    the target's. Soft cross entropy on the target's distribution, hard on its argmax, rows weighted exp(-j/gamma)."""
    s = drafter.spec
    taps, t_logits = target(ids)
    b, k, bs = ids.shape[0], anchors.shape[1], s.block_size
    embedding = target.embedding.float()
    x, positions, mask = block_inputs(drafter, embedding, ids, anchors)
    context = drafter.context_rows(taps)
    ctx_positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(b, -1)
    with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        final = drafter.blocks(x, positions, context, ctx_positions, mask)
    final = final.float()
    previous = ids.gather(1, positions)  # the token each row follows: the pending one, then the true tokens after it
    logits = final @ embedding.T + drafter.markov(previous)
    t_rows = t_logits.gather(1, positions[..., None].expand(-1, -1, t_logits.shape[-1]))
    labels = t_rows.argmax(-1)
    logp = F.log_softmax(logits, dim=-1)
    hard = -logp.gather(-1, labels[..., None])[..., 0]
    soft = -(F.softmax(t_rows, dim=-1) * logp).sum(-1)
    weight = torch.exp(-torch.arange(bs, device=ids.device).float() / args.gamma).repeat(k)[None]
    ce = ((args.alpha * soft + (1 - args.alpha) * hard) * weight).sum() / (weight.sum() * b)
    picks = logits.argmax(-1)
    right = (picks == labels).float()
    conf = drafter.confidence_logit(final.detach(), previous, detach=True)
    bce = F.binary_cross_entropy_with_logits(conf, right)
    return dict(loss=ce + bce, ce=ce, bce=bce, agree=right.mean())


@torch.no_grad()
def drafted_blocks(drafter: DSparkDrafter, target: Target, ids: torch.Tensor, anchors: torch.Tensor):
    """Blocks drafted as served at `anchors` (each row's Markov term from the draft before it): the leading drafts
    equal to the target's greedy tokens, [b, k, block] as 0/1, and each row's running chance."""
    b, bs = ids.shape[0], drafter.spec.block_size
    taps, t_logits = target(ids)
    embedding = target.embedding.float()
    x, positions, mask = block_inputs(drafter, embedding, ids, anchors)
    ctx_positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(b, -1)
    final = drafter.blocks(x, positions, drafter.context_rows(taps), ctx_positions, mask).float()
    base = (final @ embedding.T).view(b, -1, bs, embedding.shape[0])
    final = final.view(b, -1, bs, final.shape[-1])
    want = t_logits.argmax(-1).gather(1, positions).view(b, -1, bs)
    previous = ids.gather(1, anchors)
    drafts, running, chance = [], torch.ones_like(previous, dtype=torch.float32), []
    for j in range(bs):
        pick = (base[:, :, j] + drafter.markov(previous)).argmax(-1)
        running = running * torch.sigmoid(drafter.confidence_logit(final[:, :, j], previous))
        drafts.append(pick)
        chance.append(running)
        previous = pick
    return (torch.stack(drafts, -1) == want).long().cumprod(-1), torch.stack(chance, -1)


def accepted_per_block(drafter: DSparkDrafter, target: Target, seqs: torch.Tensor, args, gen) -> dict:
    """Held-out greedy continuations, blocks at random pending positions inside the continuation, every position
    alike: drafts accepted = the leading ones equal to the target's tokens."""
    bs = drafter.spec.block_size
    accepted, by_row, chances, blocks = [], torch.zeros(bs), [], 0
    for i in range(0, seqs.shape[0], args.eval_batch):
        ids = seqs[i:i + args.eval_batch]
        anchors = anchors_of(ids.shape[0], ids.shape[1] - 1, args.anchors, bs, PROMPT_LEN, gen, ids.device)
        lead, chance = drafted_blocks(drafter, target, ids, anchors)
        accepted.append(lead.sum(-1).flatten().cpu())
        by_row += lead.float().sum((0, 1)).cpu()
        chances.append(chance.flatten(0, 1).cpu())
        blocks += lead.shape[0] * lead.shape[1]
    accepted = torch.cat(accepted).float()
    chance = torch.cat(chances).mean(0)
    return {"blocks": blocks, "block_size": bs, "accepted_per_block": round(float(accepted.mean()), 3),
            "full_blocks": round(float((accepted == bs).float().mean()), 3),
            "row_accept_rate": [round(float(v), 3) for v in by_row / blocks],
            "mean_chance_by_row": [round(float(v), 3) for v in chance]}


def served_accepted_per_block(drafter: DSparkDrafter, target: Target, seqs: torch.Tensor, args, prompt_len: int,
                              tokens: int) -> dict:
    """What eval_dspark.py serves: blocks walked along each decode from `prompt_len`, the next pending token past the
    drafts a block kept, while a block fits in the first `tokens` greedy tokens. Per round, not per position: a
    stretch the drafter lands counts once (the per-position mean weighs easy stretches more: docs/dspark.md)."""
    bs, out = drafter.spec.block_size, []
    for i in range(0, seqs.shape[0], args.eval_batch):
        ids = seqs[i:i + args.eval_batch]
        last = min(prompt_len + tokens - bs, ids.shape[1] - 1 - bs)
        anchors = torch.arange(prompt_len, last + 1, device=ids.device)[None].expand(ids.shape[0], -1).contiguous()
        for row in drafted_blocks(drafter, target, ids, anchors)[0].sum(-1).tolist():
            p = 0
            while p < len(row):
                out.append(row[p])
                p += row[p] + 1
    return {"blocks": len(out), "accepted_per_block": round(sum(out) / max(1, len(out)), 3),
            "prompt_len": prompt_len, "tokens": tokens}


RESIZE_EVERY = 500  # steps between re-sizings of a timed run's schedule


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to a tenth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", type=Path, default=TARGET)
    ap.add_argument("--name", help="the drafter dir's name under --out (default: the target's name + -dspark)")
    ap.add_argument("--data", type=Path, default=ROOT / ".zoo/data")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / ".zoo/dspark")))
    ap.add_argument("--steps", type=int, default=None, help="fixed step count (default: sized from --budget-s)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="training wall time the step count is sized to")
    ap.add_argument("--wall-s", type=float, default=540.0, help="the whole run's wall time, generation included")
    ap.add_argument("--slack", type=float, default=1.0, help="steps sized to budget / (measured step time * slack)")
    ap.add_argument("--batch", type=int, default=64, help="sequences a step (half corpus, half generated)")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=24, help="blocks a sequence")
    ap.add_argument("--gen-seqs", type=int, default=12288, help="greedy continuations of training windows")
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--gen-s", type=float, default=120.0, help="no new generation batch past this many seconds")
    ap.add_argument("--eval-seqs", type=int, default=512, help="greedy continuations of held-out windows")
    ap.add_argument("--eval-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--alpha", type=float, default=0.5, help="weight of the soft cross entropy")
    ap.add_argument("--gamma", type=float, default=4.0, help="row j's weight is exp(-j / gamma)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this drafter dir (the published layout, e.g. the shipped one) instead of fresh "
                    "weights: a longer run over several device calls, each with its own schedule")
    ap.add_argument("--layers", type=int, default=DSparkSpec.num_hidden_layers, help="drafter layers (fresh weights)")
    args = ap.parse_args()
    args.name = args.name or f"{args.target.name}-dspark"
    if args.init is not None and args.layers != DSparkSpec.num_hidden_layers:
        ap.error("--layers shapes fresh weights; --init keeps its checkpoint's")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))  # the CPU run shares two cores: more threads only thrash
    args.bf16 = device == "cuda"
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
    t0 = time.time()
    start = read_checkpoint(args.init) if args.init is not None else None
    spec = start.spec if start is not None else DSparkSpec(num_hidden_layers=args.layers)
    target = Target(args.target, spec.target_layer_ids, device)
    data = {s: torch.from_numpy(np.load(args.data / f"{s}.npy").astype(np.int64)).to(device)
            for s in ("train", "heldout")}
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    heldout = generated(target, data["heldout"], args.eval_seqs, args.length, args.gen_batch, gen) \
        if args.eval_seqs else None  # on a CPU the served drafter is measured afterwards instead (eval_dspark.py)
    greedy = generated(target, data["train"], args.gen_seqs, args.length, args.gen_batch, gen, args.gen_s)
    log(f"generated {greedy.shape[0]} + {args.eval_seqs} held-out greedy sequences of {args.length} "
        f"in {time.time() - t0:.0f}s")

    drafter = (start if start is not None else DSparkDrafter(spec)).to(device)
    if start is None:
        with torch.no_grad():  # the final norm starts as the target's own, so the tied head reads rows at its scale
            drafter.norm.weight.copy_(target.model.model.embedding_norm.weight.float())
    else:
        log(f"from {args.init}")
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")
    steps, warmup, step, t_train, curve = args.steps, 100, 0, time.time(), []
    half = args.batch // 2
    sized, t_calib, calibrated = args.steps is None, time.time(), 0
    while steps is None or step < steps:
        # size the cosine schedule from the measured step time at step 25, then again every RESIZE_EVERY steps from
        # the pace so far: steps slowed ~40% after the first ones on the H200 (2026-12-05), and a run sized once
        # stopped at its wall time before its cosine ended
        if sized and (step == 25 or (step > 25 and step % RESIZE_EVERY == 0)):
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            per = (now - t_calib) / (step - calibrated)  # the pace since the last sizing
            t_calib, calibrated = now, step
            if steps is None:  # 45 s kept for the eval and save
                end = now + min(args.budget_s - (now - t_train), args.wall_s - (now - t0) - 45)
            resized = max(step + 1, step + int(max(0.0, end - now) / (per * args.slack)))
            if resized != steps:
                log(f"{per * 1e3:.1f} ms/step -> {resized} steps" + (f" (was {steps})" if steps else ""))
            steps = resized
        if step == 5:
            if device == "cuda":
                torch.cuda.synchronize()
            t_calib, calibrated = time.time(), step
        pick = torch.randint(0, greedy.shape[0], (args.batch - half,), generator=gen).to(device)
        ids = torch.cat([windows(data["train"], half, args.length, gen), greedy[pick]])
        anchors = anchors_of(ids.shape[0], ids.shape[1], args.anchors, spec.block_size, 1, gen, device)
        lr = lr_at(step, steps or 10**9, args.lr, min(warmup, max(1, (steps or 10**9) // 10)))
        for g in opt.param_groups:
            g["lr"] = lr
        out = block_losses(drafter, target, ids, anchors, args)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == (steps or 0) - 1:
            row = {k: round(float(v.detach()), 4) for k, v in out.items()}
            curve.append((step, row))
            log(f"step {step} {json.dumps(row)} lr {lr:.2e} t {time.time() - t_train:.0f}s")
        if step and step % 2000 == 0:
            write_checkpoint(drafter, args.out / args.name, args.target)
        step += 1
        if time.time() - t0 > args.wall_s - 45:  # a busy machine ran slower than measured: stop, keep the time to save
            log(f"stopped at step {step} of {steps}: past the wall time")
            break
    train_s = time.time() - t_train
    drafter.eval()
    metrics = {"name": args.name, "spec": spec.config(), "init": str(args.init) if args.init else None, "steps": step, "batch": args.batch, "length": args.length,
               "anchors": args.anchors, "gen_seqs": args.gen_seqs, "gen_seqs_made": greedy.shape[0],
               "where": torch.cuda.get_device_name() if device == "cuda" else "this CPU", "lr": args.lr, "alpha": args.alpha,
               "gamma": args.gamma, "seed": args.seed, "train_s": round(train_s, 1), "loss_curve": curve,
               "params": sum(p.numel() for p in drafter.parameters()),
               "heldout": accepted_per_block(drafter, target, heldout, args, torch.Generator().manual_seed(0))
               if heldout is not None else None,
               # the served evaluation's view of the same continuations: per round, the first 64 greedy tokens
               "heldout_served": served_accepted_per_block(drafter, target, heldout, args, PROMPT_LEN, 64)
               if heldout is not None else None}
    log(json.dumps({k: v for k, v in metrics.items() if k not in ("loss_curve", "spec")}))
    write_checkpoint(drafter, args.out / args.name, args.target)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log(f"all done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
