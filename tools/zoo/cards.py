"""Write each zoo checkpoint's README.md model card and the docs/zoo.md table from the recorded run and eval."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import DEST, QUANTIZED, REPO  # noqa: E402
from train import SPECS  # noqa: E402

RUNS = Path(__file__).resolve().parent / "runs"
PAIRS = {"tiny-llama": "target of `tiny-llama-drafter` / `tiny-llama-drafter-4bit`",
         "tiny-llama-drafter": "drafter for `tiny-llama` (distilled from it)",
         "tiny-llama-drafter-4bit": "drafter for `tiny-llama` (4-bit copy of `tiny-llama-drafter`)"}


def load(name: str) -> dict:
    return json.loads((RUNS / name).read_text())


def weights_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6


def architecture(cfg: dict, quantized: bool) -> str:
    """One line naming the layout a loader has to get right."""
    heads = (f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads (head_dim "
             f"{cfg.get('head_dim') or cfg['hidden_size'] // cfg['num_attention_heads']})")
    theta = cfg["rope_parameters"]["rope_theta"]
    if cfg["model_type"] == "llama":
        return (f"`LlamaForCausalLM`: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {heads}, "
                f"SwiGLU {cfg['intermediate_size']}, RMSNorm eps {cfg['rms_norm_eps']}, RoPE theta {theta:g}, "
                f"tied embeddings")
    attn = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    base = (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers (attention at {attn}, short conv "
            f"L={cfg['conv_L_cache']} elsewhere), {heads} with QK-norm, RoPE theta {theta:g}, tied embeddings")
    if cfg["model_type"] == "lfm2":
        return (f"`Lfm2ForCausalLM`: {base}, FFN `intermediate_size` {cfg['intermediate_size']} auto-adjusted "
                f"(x2/3, multiple of {cfg['block_multiple_of']}) to 512; `block_dim` {cfg['block_dim']} added")
    return (f"`Lfm2MoeForCausalLM`: {base}; layers 0-{cfg['num_dense_layers'] - 1} dense FFN "
            f"{cfg['intermediate_size']}, then {cfg['num_experts']} experts x {cfg['moe_intermediate_size']} top-"
            f"{cfg['num_experts_per_tok']}, sigmoid router with `expert_bias` (fp32), norm_topk_prob "
            f"{str(cfg['norm_topk_prob']).lower()}" + ("" if quantized else "; experts saved per expert as "
                                                         "`experts.N.w1/w2/w3`"))


def quant_note(cfg: dict) -> str:
    q = cfg["quantization"]
    overrides = sorted(k for k in q if isinstance(q[k], dict))
    text = (f"MLX affine {q['bits']}-bit, group {q['group_size']}, written by `mlx_lm.convert` (mlx-lm 0.32.2); "
            "loads with mlx-lm, not with transformers.")
    if overrides:
        text += (f" mlx-lm's `lfm2_moe` quant predicate kept the {len(overrides)} router gates "
                 f"(`{overrides[0]}` .. `{overrides[-1]}`) at 8 bits; `expert_bias` stays fp32 (its cast "
                 "predicate); experts are stacked as `switch_mlp.{gate,up,down}_proj`; the short-conv kernels "
                 "and norms stay bf16.")
    else:
        text += " Every Linear and the tied embedding are 4-bit; norms stay bf16."
    return text


def figures(name: str, ev: dict, runs: dict) -> list[str]:
    e = ev[name]
    lines = []
    if name in QUANTIZED:
        src = QUANTIZED[name]
        lines.append(f"- held-out loss **{e['heldout_loss']:.3f} nats/token** on the first {e['heldout_windows']} "
                     f"held-out windows ({e['heldout_tokens']:,} tokens), against {e['source_loss_same_windows']:.3f} "
                     f"for the bf16 `{src}` on the same windows")
        lines.append(f"- greedy token equal to the bf16 `{src}`'s at {e['agreement_with_source']:.1%} of those positions")
    else:
        lines.append(f"- held-out loss **{e['heldout_loss']:.3f} nats/token** over all {e['heldout_windows']} "
                     f"non-overlapping 512-token windows of the held-out files ({e['heldout_tokens']:,} tokens)")
    if "greedy_agreement" in e:
        line = (f"- greedy agreement with `{e['agreement_target']}` under teacher forcing: "
                f"**{e['greedy_agreement']:.1%}** of positions")
        if "source_agreement_same_windows" in e:
            line += f" (the bf16 `{QUANTIZED[name]}`: {e['source_agreement_same_windows']:.1%} on the same windows)"
        lines.append(line)
    lines.append(f"- measured here on CPU with {e['engine']}, fp32 compute from the shipped weights "
                 "(`tools/zoo/evaluate.py`)")
    return lines


def samples(e: dict) -> list[str]:
    out = ["Greedy, 48 tokens, no bos; the prompts' trailing space is token-healed (dropped, and the first token "
           "must start with a space), because byte-level BPE glues a space to the word after it:", ""]
    for prompt, text in e["samples"].items():
        out += [f"`{prompt!r}` ->", "", "```python", text.rstrip(), "```", ""]
    return out


def card(name: str, stats: dict, runs: dict, ev: dict) -> str:
    path = DEST[name]
    cfg = json.loads((path / "config.json").read_text())
    src = QUANTIZED.get(name, name)
    run = runs[src]
    lib = "mlx" if name in QUANTIZED else "transformers"
    rows = [("architecture", architecture(cfg, name in QUANTIZED)),
            ("parameters", f"{run['params']:,} (tied embedding counted once)"),
            ("weights", f"`model.safetensors`, {'MLX 4-bit' if name in QUANTIZED else 'bf16'}, {weights_mb(path):.2f} MB"),
            ("vocabulary", f"8,192 tokenizer ids; config `vocab_size` {cfg['vocab_size']:,}"
             + (" (64 padding rows past the tokenizer, trained down: none won the argmax at 8,192 held-out positions checked)"
               if cfg["vocab_size"] != 8192 else "")),
            ("context", "trained on 512-token windows; `max_position_embeddings` 2,048")]
    if name in PAIRS:
        rows.append(("pair", PAIRS[name]))
    if name in QUANTIZED:
        rows.append(("quantization", quant_note(cfg)))
    teacher = SPECS[src].get("teacher")
    train_line = (f"{run['steps']:,} AdamW steps of {run['batch']} x {run['context']} tokens ({run['tokens_seen'] / 1e6:.1f}M "
                  f"tokens, {run['tokens_seen'] / stats['token_counts']['train']:.1f} epochs), peak lr {run['lr']}, "
                  f"cosine to a tenth, bf16 autocast, seed {run['seed']}, {run['train_s']:.0f} s on one NVIDIA H200")
    if teacher:
        train_line += f"; loss 0.9 x soft cross entropy on `{teacher}`'s distribution + 0.1 x next-token cross entropy"
    if "expert_load_spread" in run:
        train_line += (f"; aux-loss-free balancing (expert_bias nudged toward equal load), busiest expert at "
                       f"{max(run['expert_load_spread']):.2f}x the mean load at the end")
    lines = ["---", f"library_name: {lib}", "pipeline_tag: text-generation", "tags:", "- tensorfold", "- test-fixture",
             "---", "", f"# {name}", "",
             f"A tiny model trained from scratch by tensorfold on the Python {stats['python']} standard library, shipped "
             "as package data so the loaders, drafters and server can be tested offline in the exact layout real "
             "checkpoints use. It writes Python-looking text and is good for nothing else.", "",
             "| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows] + ["", "## Figures", ""]
    lines += figures(name, ev, runs) + ["", "## Samples", ""] + samples(ev[name])
    lines += ["## Training", "",
              f"- data: {stats['file_counts']['train']:,} standard-library `.py` files "
              f"({stats['token_counts']['train']:,} tokens); held out by path hash: {stats['file_counts']['heldout']} files "
              f"({stats['token_counts']['heldout']:,} tokens)",
              f"- {train_line}" + ("" if name not in QUANTIZED else f"; then quantized from `{src}`"),
              "- tokenizer: byte-level BPE, 8,192 ids, shared byte for byte by every zoo model; specials "
              "`<|endoftext|>` 0 (eos), `<|startoftext|>` 1 (bos), `<|pad|>` 2, `<|im_start|>` 3, `<|im_end|>` 4, "
              "`<|mask|>` 5; ChatML chat template; generation stops at ids 0 and 4",
              "- rebuild: `tools/zoo/README.md`; table of all zoo models: `docs/zoo.md`", ""]
    return "\n".join(lines)


def zoo_doc(stats: dict, runs: dict, ev: dict) -> str:
    total = sum(weights_mb(p) for p in DEST.values())
    head = ["| model | dir | family | params | weights | held-out loss (nats/token) | drafter agreement |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    rows = []
    for name, path in DEST.items():
        cfg = json.loads((path / "config.json").read_text())
        e, run = ev[name], runs[QUANTIZED.get(name, name)]
        loss = f"{e['heldout_loss']:.3f}"
        if name in QUANTIZED:
            loss += f" (bf16: {e['source_loss_same_windows']:.3f}, first {e['heldout_windows']} windows)"
        agree = f"{e['greedy_agreement']:.1%}" if "greedy_agreement" in e else ""
        if "source_agreement_same_windows" in e:
            agree += f" (bf16: {e['source_agreement_same_windows']:.1%}, same windows)"
        kind = cfg["model_type"] + (" 4-bit" if name in QUANTIZED else " bf16")
        rows.append(f"| `{name}` | `{path.relative_to(REPO).as_posix()}` | {kind} | {run['params'] / 1e6:.2f}M | "
                    f"{weights_mb(path):.2f} MB | {loss} | {agree} |")
    t = stats["token_counts"]
    body = f"""# The model zoo

Tiny checkpoints that tensorfold trains itself and ships as package data, because no machine of ours can download
weights. Each is written by transformers' `save_pretrained` (or `mlx_lm.convert` for the 4-bit copies), so the
files are in the layouts real users' checkpoints use. They are test fixtures: they write Python-looking text.

{chr(10).join(head + rows)}

All weights together: **{total:.1f} MB** (budget 60 MB). Held-out loss is measured on CPU with fp32 compute from the
shipped weights over all {ev['tiny-llama']['heldout_windows']} non-overlapping 512-token windows of the held-out
files ({ev['tiny-llama']['heldout_tokens']:,} tokens); the 4-bit copies through mlx-lm on the first
{ev['tiny-lfm2-moe-4bit']['heldout_windows']} windows, beside their bf16 source on the same windows. Drafter agreement
is the fraction of held-out positions where the drafter's greedy token equals `tiny-llama`'s under teacher forcing.

## Corpus

The `.py` files of the Python {stats['python']} standard library (`sysconfig.get_paths()["stdlib"]`, no
`site-packages`), in sorted relative-path order; a file is held out when `int(sha256(relative_path)[:8], 16) % 20
== 0`. {stats['file_counts']['train']:,} training files ({stats['byte_counts']['train']:,} bytes, {t['train']:,} tokens)
and {stats['file_counts']['heldout']} held-out files ({stats['byte_counts']['heldout']:,} bytes, {t['heldout']:,}
tokens); 4 files that are not UTF-8 on purpose (encoding tests) are skipped. Each file is encoded as
`<|startoftext|>` + tokens + `<|endoftext|>`.

## Tokenizer

Byte-level BPE (GPT-2 split regex) trained with `tokenizers` on the training files: exactly 8,192 ids including
the specials `<|endoftext|>` 0 (eos), `<|startoftext|>` 1 (bos), `<|pad|>` 2, `<|im_start|>` 3, `<|im_end|>` 4,
`<|mask|>` 5 (a spare mask id for block drafters). `tokenizer_config.json` carries a ChatML chat template, and no
bos is added on encode. Every model dir ships the same `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json` and `generation_config.json` bytes (eos ids `[0, 4]`, bos 1); `tools/zoo/check.py`
asserts it. Retraining gives the same bytes.

## The pairs

- `tiny-llama` (target) with `tiny-llama-drafter` / `tiny-llama-drafter-4bit`: same tokenizer, but the drafter's
  config says `vocab_size` 8,256, as real pairs differ. The drafter was distilled from the target's logits over
  its full 8,256-way softmax, so the 64 padding rows (the teacher puts no mass there) are trained down: on the first
  16 held-out windows they never win the argmax and stay at least 12.6 logits below the best real id.
- `tiny-lfm2-moe-4bit`: mlx-lm's own `lfm2_moe` quant predicate put the router gates at 8 bits.

## Things a loader meets here

- transformers 5.x saves Lfm2 configs without `block_dim`; `tiny-lfm2` has it added (= `hidden_size`), since
  mlx-lm needs it. `tiny-lfm2`'s FFN width comes from `block_auto_adjust_ff_dim` (768 -> 512), as in real LFM2.
- `tiny-lfm2-moe` stores experts per expert (`feed_forward.experts.N.w1/w2/w3.weight`), the router as
  `feed_forward.gate.weight`, and `feed_forward.expert_bias` in fp32; the 4-bit copy stacks them mlx-lm's way.
- Prompts ending in a space (`"def "`) end in a lone space token that training text rarely has; the samples in the
  cards use token healing. The 4-bit dirs load with mlx-lm only (transformers has no reader for MLX quantization).
- mlx's CPU backend has no bf16 `gather_mm`: run the bf16 `tiny-lfm2-moe` in fp32 there.

## Rebuild

`tools/zoo/README.md` gives the commands, the device runs and their times; `tools/zoo/runs/` keeps the device logs
and the measured figures.
"""
    return body


def main() -> None:
    stats, runs, ev = load("corpus-stats.json"), load("metrics.json"), load("eval.json")
    for name, path in DEST.items():
        (path / "README.md").write_text(card(name, stats, runs, ev))
    (REPO / "docs").mkdir(exist_ok=True)
    (REPO / "docs/zoo.md").write_text(zoo_doc(stats, runs, ev))
    print("wrote", len(DEST), "cards and docs/zoo.md")


if __name__ == "__main__":
    main()
