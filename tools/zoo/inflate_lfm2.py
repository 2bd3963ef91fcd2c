"""Inflate the zoo's lfm2 target and its DSpark drafter to 1B-class weight bytes that keep their tokens and drafts."""

# python tools/zoo/inflate_lfm2.py --preset lfm2-1b --out /tmp/l1
# python tools/zoo/inflate_lfm2.py --preset lfm2-dspark-0.1b --out /tmp/ld --target /tmp/l1
# The rule is inflate.py's (docs/zoo.md, "Synthetic benchmark pair"): r copies of the hidden vector, zero padding,
# identity layers, norms x 2^-j. Per-head q/k norms take the head_dim change instead of the query's scale, and the
# DSpark drafter shares the target's widths, since it embeds and reads out through the target's own matrices.

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inflate import (COPIED, OUT_DTYPES, SYNTHETIC_KEY, InflateError, Plan, Reader, Shape, Tensor, check,
                     make_plan, prepare_out, read_weights, resolve, write_weights)

# LFM2-1.2B's order of layer kinds; the tiny target's six are its first six
LFM2_1B_LAYERS = ("conv", "conv", "full_attention") * 3 + ("conv", "full_attention") * 3 + ("conv",)


@dataclass(frozen=True)
class Preset:
    """A named inflation: which zoo model, to which widths (and, for a target, which layer kinds)."""

    model: str
    shape: Shape
    like: str
    layer_types: tuple[str, ...] = ()


PRESETS = {
    "lfm2-1b": Preset("tiny-lfm2", Shape(2048, 16, 8192, 16, 4, 128), "LFM2-1.2B's widths and layer kinds",
                      LFM2_1B_LAYERS),
    "lfm2-dspark-0.1b": Preset("tiny-lfm2-dspark", Shape(2048, 2, 4096, 16, 4, 128),
                               "a DSpark drafter at the lfm2-1b target's widths"),
}


class InterleavedPlan(Plan):
    """A plan for a drafter whose rope turns interleaved pairs: pair p of a head goes to pair p * 4**a."""

    def dim_map(self) -> np.ndarray:
        pairs = np.arange(self.src.head_dim // 2) * (self.dst.head_dim // self.src.head_dim)
        return np.stack([2 * pairs, 2 * pairs + 1], axis=1).ravel()


def lfm2_plan(src: Shape, dst: Shape, interleaved: bool = False) -> Plan:
    """inflate's plan, where one eps serves the hidden norms and the per-head ones: both must scale alike."""
    plan = make_plan(src, dst)
    if plan.norm_shift != plan.q_shift:
        raise InflateError(f"hidden_size {dst.hidden} and head_dim {dst.head_dim}: the hidden norms' eps scales by "
                           f"4^-{plan.norm_shift} and the per-head norms' by 4^-{plan.q_shift}, but the config has "
                           "one eps; pick widths whose powers of four agree")
    kind = InterleavedPlan if interleaved else Plan
    return kind(*(getattr(plan, f.name) for f in dataclasses.fields(plan)))


def source_shape(config: dict, weights: dict[str, np.ndarray], inner: str) -> Shape:
    """The source's widths; the MLP's from its weights (lfm2 configs may auto-adjust intermediate_size)."""
    shape = Shape.of(config)
    return dataclasses.replace(shape, intermediate=weights[inner].shape[0])


def check_target(config: dict, source: str) -> None:
    """The rule is worked out for lfm2 with default rope, no conv bias and float weights; anything else is refused."""
    rope = config.get("rope_parameters") or {}
    wrong = {"model_type": config.get("model_type") != "lfm2", "conv_bias": bool(config.get("conv_bias")),
             "rope_parameters": (rope.get("rope_type") or "default") != "default",
             "layer_types": not config.get("layer_types"),
             "quantization": bool(config.get("quantization") or config.get("quantization_config"))}
    bad = [key for key, is_bad in wrong.items() if is_bad]
    if bad:
        raise InflateError(f"{source}: {', '.join(bad)} not as the rule needs (lfm2, default rope, no conv bias, "
                           "layer_types listed, float weights)")


def layer_sources(src_types: list[str], dst_types: tuple[str, ...]) -> list[tuple[int, bool]]:
    """Per inflated layer, the source layer it reads like and whether it is real (else it writes zeros)."""
    if list(dst_types[:len(src_types)]) != list(src_types):
        raise InflateError(f"layer_types: the inflated {list(dst_types)} must start with the source's {src_types}")
    out = []
    for i, kind in enumerate(dst_types):
        if i < len(src_types):
            out.append((i, True))
        elif kind in src_types:
            out.append((max(j for j, t in enumerate(src_types) if t == kind), False))
        else:
            raise InflateError(f"layer_types[{i}] {kind!r}: the source has no layer of that kind to read like")
    return out


def attention(plan: Plan, take: Reader, src: str, dst: str, names: dict[str, str], real: bool) -> list[Tensor]:
    """q/k/v/out and the per-head norms, as `inflate` places them but for the scale, which goes to the k norm."""
    d, first, dims = plan.dst, np.arange(plan.src.hidden), plan.dim_map()
    # each normed head comes out 2^a larger on either side while 1/sqrt(head_dim) halves a times; zero heads stay zero
    k_scale = np.float32(2.0 ** -plan.q_shift)
    out = [Tensor(dst + names["q"], (d.heads * d.head_dim, d.hidden), [(plan.q_rows(), first, take(src + names["q"]))])]
    out += [Tensor(dst + names[kv], (d.kv_heads * d.head_dim, d.hidden),
                   [(rows, first, take(src + names[kv])) for rows in plan.kv_rows()]) for kv in "kv"]
    out += [Tensor(dst + names["q_norm"], (d.head_dim,), [(dims, None, take(src + names["q_norm"]))]),
            Tensor(dst + names["k_norm"], (d.head_dim,), [(dims, None, take(src + names["k_norm"]) * k_scale)]),
            Tensor(dst + names["o"], (d.hidden, d.heads * d.head_dim),
                   [(c, plan.q_rows(), take(src + names["o"])) for c in plan.hidden_copies()] if real else [])]
    return out


def mlp(plan: Plan, take: Reader, src: str, dst: str, up: tuple[str, str], down: str, real: bool) -> list[Tensor]:
    """Gate and up read the first copy; down writes every copy (zeros in an identity layer)."""
    d, first, inner = plan.dst, np.arange(plan.src.hidden), np.arange(plan.src.intermediate)
    out = [Tensor(dst + name, (d.intermediate, d.hidden), [(inner, first, take(src + name))]) for name in up]
    out.append(Tensor(dst + down, (d.hidden, d.intermediate),
                      [(c, inner, take(src + down)) for c in plan.hidden_copies()] if real else []))
    return out


def norm(plan: Plan, take: Reader, src: str, dst: str) -> Tensor:
    """A hidden norm weights the first copy alone, x 2^-j: its readers see exactly the source's input."""
    first = np.arange(plan.src.hidden)
    return Tensor(dst, (plan.dst.hidden,), [(first, None, take(src) * np.float32(2.0 ** -plan.norm_shift))])


LFM2_ATTENTION = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
                  "o": "self_attn.out_proj.weight", "q_norm": "self_attn.q_layernorm.weight",
                  "k_norm": "self_attn.k_layernorm.weight"}
DSPARK_ATTENTION = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
                    "o": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
                    "k_norm": "self_attn.k_norm.weight"}


def target_tensors(plan: Plan, weights: dict[str, np.ndarray], vocab: int, tied: bool,
                   layers: list[tuple[int, bool]]) -> list[Tensor]:
    """Every tensor of the inflated lfm2 target; a conv layer's B, C and x chunks each hold the source's channels."""
    s, d, take = plan.src, plan.dst, Reader(weights)
    first, copies = np.arange(s.hidden), plan.hidden_copies()
    out = [Tensor("model.embed_tokens.weight", (vocab, d.hidden),
                  [(np.arange(vocab), c, take("model.embed_tokens.weight")) for c in copies])]
    for layer, (source, real) in enumerate(layers):
        src, dst = f"model.layers.{source}.", f"model.layers.{layer}."
        out.append(norm(plan, take, src + "operator_norm.weight", dst + "operator_norm.weight"))
        if src + "conv.in_proj.weight" in weights:
            chunks = np.concatenate([k * d.hidden + first for k in range(3)])
            conv = take(src + "conv.conv.weight")
            out += [Tensor(dst + "conv.in_proj.weight", (3 * d.hidden, d.hidden),
                           [(chunks, first, take(src + "conv.in_proj.weight"))]),
                    Tensor(dst + "conv.conv.weight", (d.hidden, *conv.shape[1:]), [(first, None, conv)]),
                    Tensor(dst + "conv.out_proj.weight", (d.hidden, d.hidden),
                           [(c, first, take(src + "conv.out_proj.weight")) for c in copies] if real else [])]
        else:
            out += attention(plan, take, src, dst, LFM2_ATTENTION, real)
        out.append(norm(plan, take, src + "ffn_norm.weight", dst + "ffn_norm.weight"))
        out += mlp(plan, take, src, dst, ("feed_forward.w1.weight", "feed_forward.w3.weight"),
                   "feed_forward.w2.weight", real)
    out.append(norm(plan, take, "model.embedding_norm.weight", "model.embedding_norm.weight"))
    if not tied:
        out.append(Tensor("lm_head.weight", (vocab, d.hidden), [(np.arange(vocab), first, take("lm_head.weight"))]))
    take.finish()
    return out


def drafter_tensors(plan: Plan, weights: dict[str, np.ndarray], taps: int) -> list[Tensor]:
    """Every tensor of the inflated DSpark drafter: fc reads each tap's first copy, the heads keep their widths."""
    s, d, take = plan.src, plan.dst, Reader(weights)
    first, copies = np.arange(s.hidden), plan.hidden_copies()
    tapped = np.concatenate([t * d.hidden + first for t in range(taps)])
    out = [Tensor("fc.weight", (d.hidden, taps * d.hidden), [(c, tapped, take("fc.weight")) for c in copies]),
           norm(plan, take, "hidden_norm.weight", "hidden_norm.weight")]
    for layer in range(d.layers):
        prefix = f"layers.{layer}."
        out.append(norm(plan, take, prefix + "input_layernorm.weight", prefix + "input_layernorm.weight"))
        out += attention(plan, take, prefix, prefix, DSPARK_ATTENTION, True)
        out.append(norm(plan, take, prefix + "post_attention_layernorm.weight",
                        prefix + "post_attention_layernorm.weight"))
        out += mlp(plan, take, prefix, prefix, ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.down_proj.weight",
                   True)
    out.append(norm(plan, take, "norm.weight", "norm.weight"))
    for name, w in weights.items():  # the Markov head is over the vocabulary alone
        if name.startswith("markov_head."):
            out.append(Tensor(name, w.shape, [(np.arange(w.shape[0]), None, take(name))]))
    if "confidence_head.proj.weight" in weights:  # [normed hidden; Markov features] -> one logit
        w = take("confidence_head.proj.weight")
        columns = np.concatenate([first, d.hidden + np.arange(w.shape[1] - s.hidden)])
        out += [Tensor("confidence_head.proj.weight", (1, d.hidden + w.shape[1] - s.hidden), [([0], columns, w)]),
                Tensor("confidence_head.proj.bias", (1,), [([0], None, take("confidence_head.proj.bias"))])]
    take.finish()
    return out


CARD = """# {name} (synthetic)

Not a trained model: `{source}` inflated by `tools/zoo/inflate_lfm2.py` to {gb:.2f} GB of {dtype} weights for GPU
benchmarks with real acceptance and real memory traffic. Zero-padded widths, {copies} cop{ies} of the hidden vector,
{identity}, hidden norm weights x 2^-{shift}, eps / 4^{shift}, k norms x 2^-{shift}: it computes `{source}`'s
logits up to rounding inside reductions. docs/zoo.md ("Synthetic benchmark pair") gives the rule.
"""


def write(out: Path, source: Path, config: dict, tensors: list[Tensor], plan: Plan, dtype: str, shard_bytes: int,
          name: str, identity: list[int]) -> None:
    """The checkpoint dir: config first (a cut-off run's dir is still ours), weights, tokenizer bytes, a card."""
    prepare_out(out)
    config[SYNTHETIC_KEY] = {"source": name, "copies": plan.copies, "norm_shift": plan.norm_shift,
                             "q_shift": plan.q_shift, "kv_copies": plan.kv_copies, "identity_layers": identity,
                             "rule": "docs/zoo.md#synthetic-benchmark-pair"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = write_weights(out, tensors, dtype, shard_bytes)
    for file in COPIED:
        if (source / file).exists():
            shutil.copyfile(source / file, out / file)
    size = sum((out / f).stat().st_size for f in files)
    (out / "README.md").write_text(CARD.format(
        name=out.name, source=name, gb=size / 1e9, dtype=dtype, copies=plan.copies,
        ies="y" if plan.copies == 1 else "ies", shift=plan.norm_shift,
        identity=f"identity layers {identity[0]}-{identity[-1]}" if identity else "no identity layers"))
    print(f"wrote {out}: {size / 1e9:.3f} GB in {len(files)} file(s); copies {plan.copies}, norms x2^-"
          f"{plan.norm_shift}, kv copies {plan.kv_copies}, identity layers {identity or 'none'}")


def inflate_target(source: Path, out: Path, shape: Shape, layer_types: tuple[str, ...], dtype: str,
                   shard_bytes: int = 2 * 10 ** 9, name: str = "tiny-lfm2") -> dict:
    """Write the inflated lfm2 target and return its config."""
    config = json.loads((source / "config.json").read_text())
    check_target(config, str(source / "config.json"))
    weights = read_weights(source)
    if shape.heads * shape.head_dim != shape.hidden:
        raise InflateError(f"num_attention_heads {shape.heads} x head_dim {shape.head_dim} must be hidden_size "
                           f"{shape.hidden}: lfm2 derives head_dim from them")
    src = source_shape(config, weights, "model.layers.0.feed_forward.w1.weight")
    plan = lfm2_plan(src, shape)
    layers = layer_sources(config["layer_types"], layer_types or tuple(config["layer_types"]))
    tied = bool(config.get("tie_word_embeddings", "lm_head.weight" not in weights))
    if tied:
        weights.pop("lm_head.weight", None)
    tensors = target_tensors(plan, weights, config["vocab_size"], tied, layers)
    inflated = {**config, "hidden_size": shape.hidden, "block_dim": shape.hidden, "num_hidden_layers": len(layers),
                "intermediate_size": shape.intermediate, "block_auto_adjust_ff_dim": False,
                "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
                "layer_types": list(layer_types or config["layer_types"]),
                "norm_eps": config.get("norm_eps", 1e-5) / 4 ** plan.norm_shift, "dtype": dtype,
                "tie_word_embeddings": tied}
    inflated.pop("full_attn_idxs", None)
    write(out, source, inflated, tensors, plan, dtype, shard_bytes, name,
          [i for i, (_, real) in enumerate(layers) if not real])
    return inflated


def inflate_drafter(source: Path, out: Path, shape: Shape, target_layers: int, dtype: str,
                    shard_bytes: int = 2 * 10 ** 9, name: str = "tiny-lfm2-dspark") -> dict:
    """Write the inflated DSpark drafter for a target of `target_layers` layers and return its config."""
    config = json.loads((source / "config.json").read_text())
    dflash = config.get("dflash_config") or {}
    if "target_layer_ids" not in dflash or config.get("quantization"):
        raise InflateError(f"{source / 'config.json'}: not a float DSpark drafter (dflash_config.target_layer_ids)")
    if shape.layers != config["num_hidden_layers"]:
        raise InflateError(f"num_hidden_layers {shape.layers}: a drafter keeps its own {config['num_hidden_layers']}")
    weights = read_weights(source)
    src = source_shape(config, weights, "layers.0.mlp.gate_proj.weight")
    plan = lfm2_plan(src, shape, interleaved=not config.get("rope_is_neox_style", False))
    tensors = drafter_tensors(plan, weights, len(dflash["target_layer_ids"]))
    inflated = {**config, **shape.config(), "rms_norm_eps": config["rms_norm_eps"] / 4 ** plan.norm_shift,
                "dtype": dtype, "dflash_config": {**dflash, "num_target_layers": target_layers}}
    write(out, source, inflated, tensors, plan, dtype, shard_bytes, name, [])
    return inflated


def drafted_rounds(target: Path, drafter: Path, prompts: list[list[int]], tokens: int, depth: int) -> list[list[int]]:
    """Per prompt, the drafts kept in each round of a greedy drafted decode (copy drafts off, depth fixed)."""
    from tensorfold_core.checkmode import decode
    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.loading import load_target, start_drafter
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.specs import DrafterOptions

    loaded = load_target(str(target), ServeOptions(dtype="float32"))
    dspark = start_drafter(str(drafter), loaded.model, loaded.tokenizer, DrafterOptions(dtype="float32"))
    try:
        engine = Engine(loaded.model, drafter=dspark, fixed_depth=depth, copy_drafts=False)
        out = []
        for ids in prompts:
            request = GenerationRequest(prompt_ids=ids, max_tokens=tokens, stop_token_ids=frozenset())
            _, rounds, _ = decode(engine, request, len(ids) + tokens)
            out.append([r["kept"] for r in rounds])
        return out
    finally:
        dspark.close()


def check_pair(tiny: tuple[Path, Path], big: tuple[Path, Path], tokens: int, depth: int = 4) -> int:
    """0 when the inflated pair keeps the same drafts in every round as the tiny pair, else 1 naming where not."""
    from inflate import PROMPTS, tokenizer_ids

    prompts = [tokenizer_ids(tiny[0], text) for text in PROMPTS]
    want, got = (drafted_rounds(*pair, prompts, tokens, depth) for pair in (tiny, big))
    print(f"checking drafts: {len(prompts)} prompts x {tokens} tokens at depth {depth}, float32")
    bad = None
    for i, (a, b) in enumerate(zip(want, got)):
        same = a == b
        differ = "" if same else " DIFFER"
        print(f"  prompt {i}: {sum(b)} drafts kept in {len(b)} rounds ({sum(a)} in {len(a)} tiny){differ}")
        bad = bad if same or bad is not None else i
    if bad is not None:
        print(f"FAIL: {big[1]} drafts differ from {tiny[1]} on prompt {bad}", file=sys.stderr)
        return 1
    print(f"ok: {sum(map(sum, got))} drafts kept, round for round as the tiny pair's")
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    presets = "; ".join(f"{k}: {p.model} -> {p.shape} ({p.like})" for k, p in PRESETS.items())
    parser = argparse.ArgumentParser(description=__doc__, epilog=f"presets: {presets}")
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", required=True, type=Path, help="checkpoint dir to write")
    parser.add_argument("--target", type=Path, help="for a drafter preset: the inflated target it drafts for")
    parser.add_argument("--dtype", choices=sorted(OUT_DTYPES), default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt in the self-check")
    parser.add_argument("--no-check", action="store_true", help="skip the self-check")
    args = parser.parse_args(argv)
    if PRESETS[args.preset].layer_types == () and args.target is None:
        parser.error(f"preset {args.preset} is a drafter: give --target, the inflated target dir it drafts for")
    return args


def inflated_target(path: Path) -> dict:
    """The config of a target this tool inflated: a drafter takes its layer count and is checked beside its source."""
    config_path = path / "config.json"
    if not config_path.exists():
        raise InflateError(f"--target {path}: no config.json there")
    config = json.loads(config_path.read_text())
    if SYNTHETIC_KEY not in config:
        raise InflateError(f"--target {config_path}: not an inflated target (no {SYNTHETIC_KEY} key)")
    return config


def checks_here() -> None:
    """Refuse, before writing gigabytes, a self-check that cannot run: it decodes through tensorfold_core."""
    try:
        importlib.import_module("tensorfold_core")
    except ImportError:
        raise InflateError("the self-check decodes through tensorfold_core, which this Python cannot import: install "
                           "tensorfold, run through contract/receipts/run_on_h200.sh exec, or pass --no-check"
                           ) from None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    preset = PRESETS[args.preset]
    try:
        if not args.no_check:
            checks_here()
        source = resolve(preset.model)
        target = None if preset.layer_types else inflated_target(args.target)
        started = time.perf_counter()
        if target is None:
            inflate_target(source, args.out, preset.shape, preset.layer_types, args.dtype, name=preset.model)
        else:
            inflate_drafter(source, args.out, preset.shape, target["num_hidden_layers"], args.dtype, name=preset.model)
        print(f"({time.perf_counter() - started:.1f} s)")
        if args.no_check:
            print("self-check SKIPPED (--no-check): this checkpoint's tokens and drafts are NOT verified")
            return 0
        if target is None:
            return check(source, args.out, args.tokens, "float32", "tensorfold", "cpu")
        tiny_target = resolve(target[SYNTHETIC_KEY]["source"])
        return check_pair((tiny_target, source), (args.target, args.out), args.tokens)
    except InflateError as exc:
        print(f"inflate_lfm2: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
