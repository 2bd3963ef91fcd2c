"""Inflate a trained zoo llama to 1B-3B-class weight bytes that keep its greedy tokens: a synthetic benchmark pair."""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SHIPPED = "plugins/*/tensorfold_*/models"  # where the zoo's checkpoint dirs live, whichever plugin ships them
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
SYNTHETIC_KEY = "tensorfold_synthetic"  # config.json key saying what a dir was inflated from, and how
SOURCE_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
OUT_DTYPES = {"bfloat16": ("BF16", 2), "float32": ("F32", 4)}
PROMPTS = (
    "import os\n\ndef read_lines(path):\n    with open(path) as f:\n        return",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
)


class InflateError(Exception):
    """A width the exact rule cannot reach, or a source it cannot read; the message names the key or tensor."""


@dataclass(frozen=True)
class Shape:
    """The widths of a llama config that inflation changes."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: dict) -> "Shape":
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        return cls(hidden, config["num_hidden_layers"], config["intermediate_size"], heads,
                   config.get("num_key_value_heads") or heads, config.get("head_dim") or hidden // heads)

    def config(self) -> dict:
        return {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "intermediate_size": self.intermediate,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim}

    def params(self, vocab: int, tied: bool) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + vocab * self.hidden * (1 if tied else 2) + self.hidden


@dataclass(frozen=True)
class Preset:
    """A named inflation: which zoo model, to which widths, shaped like which real model."""

    model: str
    shape: Shape
    like: str


PRESETS = {
    "1b": Preset("tiny-llama", Shape(2048, 16, 8192, 16, 4, 128), "Llama 3.2 1B's projection shapes"),
    "3b": Preset("tiny-llama", Shape(4096, 12, 14336, 32, 8, 128), "Llama 3 8B's projection shapes, 12 layers"),
    "0.1b": Preset("tiny-llama-drafter", Shape(1024, 8, 4096, 8, 2, 128), "a drafter for either target preset"),
    # no identity layers: on a GPU each layer of a chain step costs the host its launches
    "0.07b": Preset("tiny-llama-drafter", Shape(1024, 4, 4096, 8, 2, 128), "0.1b's widths, the 4 trained layers"),
}


def power_of_four(ratio: int) -> int | None:
    """k where ratio == 4**k, else None."""
    k = 0
    while ratio > 1 and ratio % 4 == 0:
        ratio, k = ratio // 4, k + 1
    return k if ratio == 1 else None


@dataclass(frozen=True)
class Plan:
    """Where every source weight lands, and the exact powers of two applied on the way (docs/zoo.md has the rule)."""

    src: Shape
    dst: Shape
    copies: int  # r: the residual stream holds r copies of the source's hidden vector, then zeros
    norm_shift: int  # j: H == h * r * 4**j, so norm weights scale by 2**-j and rms_norm_eps by 4**-j
    q_shift: int  # a: head_dim grew by 4**a, so the attention scale halved a times: q_proj scales by 2**a
    kv_copies: int  # m: kv slots serving each source kv head, when the query group got narrower

    @property
    def group(self) -> tuple[int, int]:
        return self.src.heads // self.src.kv_heads, self.dst.heads // self.dst.kv_heads

    def dim_map(self) -> np.ndarray:
        """Source head dim -> inflated head dim: each rotary half spreads by 4**a, so frequency i stays frequency i."""
        half = np.arange(self.src.head_dim // 2) * (self.dst.head_dim // self.src.head_dim)
        return np.concatenate([half, self.dst.head_dim // 2 + half])

    def query_heads(self) -> np.ndarray:
        """Each source query head's inflated head: source kv head c's t-th query goes to slot c*m + t//g."""
        (g0, g), m = self.group, self.kv_copies
        c, t = np.divmod(np.arange(self.src.heads), g0)
        return (c * m + t // g) * g + t % g

    def q_rows(self) -> np.ndarray:
        """Rows of q_proj (and columns of o_proj) that hold the source's query heads, in source order."""
        return (self.query_heads()[:, None] * self.dst.head_dim + self.dim_map()[None]).ravel()

    def kv_rows(self) -> list[np.ndarray]:
        """Rows of k_proj and v_proj holding the source's kv heads, one array per copy."""
        slots = np.arange(self.src.kv_heads) * self.kv_copies
        return [((slots + s)[:, None] * self.dst.head_dim + self.dim_map()[None]).ravel()
                for s in range(self.kv_copies)]

    def hidden_copies(self) -> list[np.ndarray]:
        """Residual-stream coordinates of each copy of the source's hidden vector; the rest stays zero."""
        return [k * self.src.hidden + np.arange(self.src.hidden) for k in range(self.copies)]


def make_plan(src: Shape, dst: Shape) -> Plan:
    """The exact inflation from src to dst widths, or an InflateError naming the width it cannot reach."""
    if dst.hidden % src.hidden:
        raise InflateError(f"hidden_size {dst.hidden} is not a multiple of the source's {src.hidden}")
    ratio, shift = dst.hidden // src.hidden, 0
    while ratio % 4 ** (shift + 1) == 0:
        shift += 1
    if dst.layers < src.layers or dst.intermediate < src.intermediate:
        raise InflateError(f"num_hidden_layers {dst.layers} / intermediate_size {dst.intermediate} below the "
                           f"source's {src.layers} / {src.intermediate}")
    q_shift = power_of_four(dst.head_dim // src.head_dim) if dst.head_dim % src.head_dim == 0 else None
    if q_shift is None:
        raise InflateError(f"head_dim {dst.head_dim}: must be the source's {src.head_dim} times a power of 4, "
                           "so the attention scale 1/sqrt(head_dim) changes by an exact power of 2")
    for kind in (float, np.float32):  # what transformers (float64) and MLX (float32) use as the scale
        if kind(dst.head_dim ** -0.5) * 2 ** q_shift != kind(src.head_dim ** -0.5):
            raise InflateError(f"head_dim {dst.head_dim}: head_dim**-0.5 is not exactly the source's / {2 ** q_shift}")
    if dst.heads % dst.kv_heads:
        raise InflateError(f"num_attention_heads {dst.heads} is not a multiple of num_key_value_heads {dst.kv_heads}")
    g0, g = src.heads // src.kv_heads, dst.heads // dst.kv_heads
    kv_copies = -(-g0 // g)
    if dst.kv_heads < src.kv_heads * kv_copies:
        raise InflateError(f"num_key_value_heads {dst.kv_heads}: groups of {g} queries need {src.kv_heads * kv_copies}"
                           f" kv heads to hold the source's {src.kv_heads} groups of {g0}")
    return Plan(src, dst, ratio // 4 ** shift, shift, q_shift, kv_copies)


def check_source(config: dict, source: str) -> None:
    """The rule is worked out for llama with silu, no biases and default rotary; anything else is refused."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    wrong = {"model_type": config.get("model_type") != "llama",
             "hidden_act": config.get("hidden_act", "silu") != "silu",
             "attention_bias": bool(config.get("attention_bias")), "mlp_bias": bool(config.get("mlp_bias")),
             "rope_parameters": (rope.get("rope_type") or rope.get("type") or "default") != "default",
             "rms_norm_eps": "rms_norm_eps" not in config,
             "quantization": bool(config.get("quantization") or config.get("quantization_config"))}
    bad = [key for key, is_bad in wrong.items() if is_bad]
    if bad:
        raise InflateError(f"{source}: {', '.join(bad)} not as the rule needs (llama, silu, no biases, default "
                           "rope, an explicit rms_norm_eps, float weights)")


@dataclass
class Tensor:
    """One inflated tensor: its name, shape, and the source blocks placed into zeros (rows, columns or None, values)."""

    name: str
    shape: tuple[int, ...]
    blocks: list = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


class Reader:
    """Source tensors by name, remembering which were read (every one must be, or the rule missed something)."""

    def __init__(self, weights: dict[str, np.ndarray]):
        self.weights, self.read = weights, set()

    def __call__(self, name: str) -> np.ndarray:
        self.read.add(name)
        return self.weights[name]

    def finish(self) -> None:
        unread = sorted(set(self.weights) - self.read)
        if unread:
            raise InflateError(f"source tensor {unread[0]!r} has no inflation rule ({len(unread)} unread)")


def inflated_tensors(plan: Plan, w: dict[str, np.ndarray], vocab: int, tied: bool) -> list[Tensor]:
    """Every tensor of the inflated checkpoint; extra layers copy a real layer's reads but write zeros (identity)."""
    s, d = plan.src, plan.dst
    first, copies, q_rows, kv_rows = np.arange(s.hidden), plan.hidden_copies(), plan.q_rows(), plan.kv_rows()
    inner, every_id = np.arange(s.intermediate), np.arange(vocab)
    norm_scale, q_scale = np.float32(2.0 ** -plan.norm_shift), np.float32(2.0 ** plan.q_shift)
    take = Reader(w)
    out = [Tensor("model.embed_tokens.weight", (vocab, d.hidden),
                  [(every_id, c, take("model.embed_tokens.weight")) for c in copies])]
    for layer in range(d.layers):
        src, dst, real = f"model.layers.{layer % s.layers}.", f"model.layers.{layer}.", layer < s.layers
        # Norms weight only the first copy: the copies are read once, so the readers see exactly the source's input.
        out += [Tensor(dst + "input_layernorm.weight", (d.hidden,),
                       [(first, None, take(src + "input_layernorm.weight") * norm_scale)]),
                Tensor(dst + "self_attn.q_proj.weight", (d.heads * d.head_dim, d.hidden),
                       [(q_rows, first, take(src + "self_attn.q_proj.weight") * q_scale)])]
        out += [Tensor(dst + f"self_attn.{kv}_proj.weight", (d.kv_heads * d.head_dim, d.hidden),
                       [(rows, first, take(src + f"self_attn.{kv}_proj.weight")) for rows in kv_rows]) for kv in "kv"]
        # Writers fill every copy, so the residual stream stays r identical copies; identity layers write zeros.
        out += [Tensor(dst + "self_attn.o_proj.weight", (d.hidden, d.heads * d.head_dim),
                       [(c, q_rows, take(src + "self_attn.o_proj.weight")) for c in copies] if real else []),
                Tensor(dst + "post_attention_layernorm.weight", (d.hidden,),
                       [(first, None, take(src + "post_attention_layernorm.weight") * norm_scale)])]
        out += [Tensor(dst + f"mlp.{name}_proj.weight", (d.intermediate, d.hidden),
                       [(inner, first, take(src + f"mlp.{name}_proj.weight"))]) for name in ("gate", "up")]
        out.append(Tensor(dst + "mlp.down_proj.weight", (d.hidden, d.intermediate),
                          [(c, inner, take(src + "mlp.down_proj.weight")) for c in copies] if real else []))
    out.append(Tensor("model.norm.weight", (d.hidden,), [(first, None, take("model.norm.weight") * norm_scale)]))
    if not tied:
        out.append(Tensor("lm_head.weight", (vocab, d.hidden), [(every_id, first, take("lm_head.weight"))]))
    take.finish()
    return out


def encode(values: np.ndarray, dtype: str, name: str) -> np.ndarray:
    """Float32 values as the output dtype's array; bf16 refuses any value it would round (the rule is exact)."""
    if dtype == "float32":
        return values
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    if np.any(bits & 0xFFFF):
        raise InflateError(f"{name}: a value is not exact in bfloat16 (a scaled weight underflowed?)")
    return (bits >> 16).astype(np.uint16)


def materialize(tensor: Tensor, dtype: str) -> np.ndarray:
    """The tensor's bytes: zeros with the source blocks placed."""
    out = np.zeros(tensor.shape, np.float32 if dtype == "float32" else np.uint16)
    for rows, cols, values in tensor.blocks:
        values = encode(values, dtype, tensor.name)
        if cols is None:
            out[rows] = values
        else:
            out[np.ix_(rows, cols)] = values
    return out


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A small safetensors file's tensors as float32 (bf16 widened exactly by its bit pattern)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(size)), f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SOURCE_DTYPES:
            raise InflateError(f"{path}: tensor {name!r} is {info['dtype']}; the tool reads BF16, F16 and F32")
        start, end = info["data_offsets"]
        raw = np.frombuffer(data[start:end], SOURCE_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(np.float32).reshape(info["shape"])
    return out


def read_weights(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint dir, single file or sharded."""
    index = path / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights: dict[str, np.ndarray] = {}
    for file in files:
        weights.update(read_safetensors(path / file))
    return weights


def write_weights(out: Path, tensors: list[Tensor], dtype: str, shard_bytes: int) -> list[str]:
    """Safetensors shards of at most shard_bytes (one file if it fits) and their index, one tensor in memory at once."""
    tag, itemsize = OUT_DTYPES[dtype]
    shards: list[list[Tensor]] = [[]]
    filled = 0
    for tensor in tensors:
        nbytes = tensor.size * itemsize
        if shards[-1] and filled + nbytes > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(tensor)
        filled += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for tensor in shard:
            header[tensor.name] = {"dtype": tag, "shape": list(tensor.shape),
                                   "data_offsets": [at, at + tensor.size * itemsize]}
            at += tensor.size * itemsize
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the safetensors writers do
        with (out / name).open("wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for tensor in shard:
                f.write(materialize(tensor, dtype).data)
    if len(shards) > 1:
        weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
        index = {"metadata": {"total_size": sum(t.size for t in tensors) * itemsize}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def resolve(model: str) -> Path:
    """A model name to its dir: an existing dir, else a shipped zoo model of that name."""
    if Path(model).is_dir():
        return Path(model)
    found = sorted(REPO.glob(f"{SHIPPED}/{model}"))
    if not found:
        raise InflateError(f"model {model!r}: no such dir and no shipped zoo model of that name under {SHIPPED}")
    return found[0]


def prepare_out(out: Path) -> None:
    """An empty dir, or an earlier inflation's (its weight files removed, so no stale shard is left to load)."""
    if out.exists() and any(out.iterdir()):
        config = out / "config.json"
        if not config.exists() or SYNTHETIC_KEY not in json.loads(config.read_text()):
            raise InflateError(f"{out}: not empty and not an earlier inflation; pick an empty dir")
        for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
            stale.unlink()
    out.mkdir(parents=True, exist_ok=True)


CARD = """# {name} (synthetic)

Not a trained model: `{source}` inflated by `tools/zoo/inflate.py` to {params:,} parameters ({gb:.2f} GB {dtype})
for GPU benchmarks with real acceptance and real memory traffic. Zero-padded widths, {copies} cop{ies} of the
hidden vector, identity layers {identity}, norm weights x 2^-{norm_shift}, rms_norm_eps / 4^{norm_shift}, q_proj x
2^{q_shift}: it computes `{source}`'s logits up to rounding inside reductions, so greedy tokens agree but at
near-ties. docs/zoo.md ("Synthetic benchmark pair") gives the rule and the measured agreement.
"""


def inflate(source: Path, out: Path, shape: Shape, dtype: str, shard_bytes: int, name: str) -> dict:
    """Write the inflated checkpoint dir and return its config."""
    config = json.loads((source / "config.json").read_text())
    check_source(config, str(source / "config.json"))
    plan = make_plan(Shape.of(config), shape)
    weights = read_weights(source)
    tied = bool(config.get("tie_word_embeddings", "lm_head.weight" not in weights))
    if tied:
        weights.pop("lm_head.weight", None)  # a tied checkpoint may still carry the head's copy
    tensors = inflated_tensors(plan, weights, config["vocab_size"], tied)
    prepare_out(out)
    inflated = {**config, **shape.config(), "rms_norm_eps": config["rms_norm_eps"] / 4 ** plan.norm_shift,
                "dtype": dtype, "tie_word_embeddings": tied}
    inflated[SYNTHETIC_KEY] = {"source": name, "copies": plan.copies, "norm_shift": plan.norm_shift,
                               "q_shift": plan.q_shift, "kv_copies": plan.kv_copies,
                               "identity_layers": list(range(plan.src.layers, shape.layers)),
                               "rule": "docs/zoo.md#synthetic-benchmark-pair"}
    (out / "config.json").write_text(json.dumps(inflated, indent=2) + "\n")  # first: a cut-off run's dir is ours
    files = write_weights(out, tensors, dtype, shard_bytes)
    for file in COPIED:  # byte for byte, so a target and its drafter keep one tokenizer
        if (source / file).exists():
            shutil.copyfile(source / file, out / file)
    params = shape.params(config["vocab_size"], tied)
    identity = f"{plan.src.layers}-{shape.layers - 1}" if shape.layers > plan.src.layers else "none"
    (out / "README.md").write_text(CARD.format(
        name=out.name, source=name, params=params, gb=params * OUT_DTYPES[dtype][1] / 1e9, dtype=dtype,
        copies=plan.copies, ies="y" if plan.copies == 1 else "ies", identity=identity, norm_shift=plan.norm_shift,
        q_shift=plan.q_shift))
    print(f"wrote {out}: {params:,} parameters, {sum((out / f).stat().st_size for f in files) / 1e9:.3f} GB in "
          f"{len(files)} file(s); copies {plan.copies}, norm x2^-{plan.norm_shift}, q x2^{plan.q_shift}, "
          f"kv copies {plan.kv_copies}, identity layers {identity}")
    return inflated


Runner = Callable[[list[int], int], tuple[list[int], np.ndarray]]


def tensorfold_runner(path: Path, dtype: str, device: str) -> Runner:
    """Greedy steps through tensorfold's own loader and forward."""
    from tensorfold_core.loading import load_model
    from tensorfold_core.specs import LoadOptions

    model, _, _ = load_model(str(path), LoadOptions(dtype=dtype))

    def run(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        cache, window, tokens, rows = model.new_cache(len(ids) + n), list(ids), [], []
        for _ in range(n):
            rows.append(np.array(model.forward([cache], [window], [1])[0]))
            model.keep(cache, len(window))
            window = [int(rows[-1].argmax())]
            tokens += window
        return tokens, np.stack(rows)

    return run


def mlx_lm_runner(path: Path, dtype: str, device: str) -> Runner:
    """Greedy steps through mlx-lm's loader and model."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(str(path))
    model.set_dtype(getattr(mx, dtype))

    def run(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        cache, window, tokens, rows = make_prompt_cache(model), list(ids), [], []
        for _ in range(n):
            rows.append(np.array(model(mx.array([window]), cache=cache)[0, -1].astype(mx.float32)))
            window = [int(rows[-1].argmax())]
            tokens += window
        return tokens, np.stack(rows)

    return run


def transformers_runner(path: Path, dtype: str, device: str) -> Runner:
    """Greedy steps through transformers on torch (where MLX is not installed); gpu means cuda."""
    import torch
    from transformers import AutoModelForCausalLM

    where = "cuda" if device == "gpu" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(where).eval()

    def run(ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        past, window, tokens, rows = None, list(ids), [], []
        with torch.no_grad():
            for _ in range(n):
                reply = model(input_ids=torch.tensor([window], device=where), past_key_values=past, use_cache=True)
                past = reply.past_key_values
                rows.append(reply.logits[0, -1].float().cpu().numpy())
                window = [int(rows[-1].argmax())]
                tokens += window
        return tokens, np.stack(rows)

    return run


RUNNERS = {"tensorfold": tensorfold_runner, "mlx-lm": mlx_lm_runner, "transformers": transformers_runner}


def pick_runner(name: str) -> str:
    """The named loader, or for auto the first importable of tensorfold, mlx-lm, transformers."""
    if name != "auto":
        return name
    import importlib.util

    for module, runner in (("tensorfold_core", "tensorfold"), ("mlx_lm", "mlx-lm"), ("transformers", "transformers")):
        if importlib.util.find_spec(module):
            return runner
    raise InflateError("no loader to check with: install tensorfold, mlx-lm or transformers, or pass --no-check")


@dataclass(frozen=True)
class Agreement:
    """One prompt's greedy tokens, tiny against inflated: equal prefix, first difference, largest logit gap."""

    prompt: int
    tokens: int
    equal: int
    max_logit_diff: float
    first: tuple[int, int] | None = None  # (tiny's, inflated's) token at the first difference

    def line(self) -> str:
        where = ""
        if self.first:
            where = f"; first difference at position {self.equal} (tiny {self.first[0]}, inflated {self.first[1]})"
        return (f"prompt {self.prompt}: {self.equal}/{self.tokens} greedy tokens equal{where}; "
                f"max |logit diff| {self.max_logit_diff:.2e} on the shared path")


def tokenizer_ids(path: Path, text: str) -> list[int]:
    """A prompt's ids under the checkpoint's tokenizer.json, no specials added (as the zoo encodes)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def compare(tiny: Path, big: Path, n: int, dtype: str, loader: str, device: str = "cpu",
            texts: tuple[str, ...] = PROMPTS) -> list[Agreement]:
    """Greedy tokens of both checkpoints on the same prompts; logits compared while the paths agree."""
    if loader != "transformers":  # MLX picks its device globally
        import mlx.core as mx

        mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
    prompts = [tokenizer_ids(tiny, text) for text in texts]
    runs = {}
    for key, path in (("tiny", tiny), ("big", big)):  # one model in memory at a time
        runner = RUNNERS[loader](path, dtype, device)
        runs[key] = [runner(ids, n) for ids in prompts]
        del runner
    agreements = []
    for i, ((want, want_rows), (got, got_rows)) in enumerate(zip(runs["tiny"], runs["big"])):
        equal = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), n)
        shared, vocab = min(equal + 1, n), min(want_rows.shape[1], got_rows.shape[1])  # same context, same ids
        gap = float(np.abs(want_rows[:shared, :vocab] - got_rows[:shared, :vocab]).max())
        agreements.append(Agreement(i, n, equal, gap, (want[equal], got[equal]) if equal < n else None))
    return agreements


def check(tiny: Path, big: Path, n: int, dtype: str, loader: str, device: str) -> int:
    """Print each prompt's agreement; 0 when every greedy token matches, else 1 naming the first difference."""
    loader = pick_runner(loader)
    print(f"checking greedy tokens: {len(PROMPTS)} prompts x {n} tokens, {loader}, {dtype} on {device}")
    agreements = compare(tiny, big, n, dtype, loader, device)
    for agreement in agreements:
        print("  " + agreement.line())
    bad = next((a for a in agreements if a.first), None)
    if bad:
        print(f"FAIL: {big} differs from {tiny}: prompt {bad.prompt}, first at position {bad.equal}", file=sys.stderr)
        return 1
    print(f"ok: {sum(a.equal for a in agreements)}/{n * len(agreements)} greedy tokens equal")
    return 0


def requested_shape(args: argparse.Namespace, source: Shape) -> Shape:
    """The preset's widths (or the source's, widened with the hidden size), with any flag given on top."""
    if args.preset:
        base = PRESETS[args.preset].shape
    else:
        hidden = args.hidden or source.hidden
        grow = max(1, hidden // source.hidden)  # heads widen with the hidden size, groups keep their width
        base = Shape(hidden, source.layers, source.intermediate * grow, source.heads * grow, source.kv_heads * grow,
                     source.head_dim)
    flags = {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate, "heads": args.heads,
             "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    return replace(base, **{k: v for k, v in flags.items() if v is not None})


def parse(argv: list[str] | None) -> argparse.Namespace:
    presets = "; ".join(f"{k}: {p.model} -> hidden {p.shape.hidden}, {p.shape.layers} layers, intermediate "
                        f"{p.shape.intermediate}, {p.shape.heads}/{p.shape.kv_heads} heads of {p.shape.head_dim} "
                        f"({p.like})" for k, p in PRESETS.items())
    parser = argparse.ArgumentParser(description=__doc__, epilog=f"presets: {presets}")
    parser.add_argument("--model", help="zoo model name or checkpoint dir (default: the preset's)")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint dir to write")
    parser.add_argument("--preset", choices=sorted(PRESETS))
    for flag in ("hidden", "layers", "intermediate", "heads", "kv-heads", "head-dim"):
        parser.add_argument(f"--{flag}", type=int)
    parser.add_argument("--dtype", choices=sorted(OUT_DTYPES), default="bfloat16")
    parser.add_argument("--shard-gb", type=float, default=2.0, help="largest safetensors file (default 2 GB)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt in the self-check")
    parser.add_argument("--check-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--check-with", choices=["auto", *RUNNERS], default="auto")
    parser.add_argument("--check-device", choices=["cpu", "gpu"], default="cpu", help="where the check computes")
    parser.add_argument("--no-check", action="store_true", help="skip the greedy-token self-check")
    parser.add_argument("--check-only", action="store_true", help="compare --model with an existing --out")
    args = parser.parse_args(argv)
    if not args.model and not args.preset:
        parser.error("give --model or --preset")
    if args.preset and args.model and args.model != PRESETS[args.preset].model:
        parser.error(f"preset {args.preset} inflates {PRESETS[args.preset].model}, not {args.model}")
    args.model = args.model or PRESETS[args.preset].model
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        source = resolve(args.model)
        if not args.check_only:
            shape = requested_shape(args, Shape.of(json.loads((source / "config.json").read_text())))
            started = time.perf_counter()
            inflate(source, args.out, shape, args.dtype, int(args.shard_gb * 1e9), args.model)
            print(f"({time.perf_counter() - started:.1f} s)")
        if args.no_check:
            print("self-check SKIPPED (--no-check): the greedy tokens of this checkpoint are NOT verified")
            return 0
        return check(source, args.out, args.tokens, args.check_dtype, args.check_with, args.check_device)
    except InflateError as exc:
        print(f"inflate: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
