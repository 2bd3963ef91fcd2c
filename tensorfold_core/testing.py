"""Helpers for tests of core and plugins: tiny real checkpoints, reference logits, round-by-round engine runs."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from .lanes.engine import Engine
from .lanes.stream import Stream
from .lanes.types import DoneEvent, GenerationRequest, TokenEvent

PROMPT = [5, 77, 301, 12, 190, 44, 9, 256, 3, 120, 66, 350, 21, 8, 143, 99, 270, 31, 7, 200]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
          "import os\nimport sys\nprint(os.path.join('a', 'b'))\n", "for i in range(10):\n    print(i * i)\n",
          "Hello world! The quick brown fox jumps over the lazy dog. 0123456789 éà中文 ✓\n"]


def write_tokenizer(path: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE with the zoo's special tokens and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>",
        "add_bos_token": False, "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))


def llama_config(**overrides):
    """A tiny LlamaConfig; overrides pick GQA, bias, rope scaling, tying."""
    from transformers import LlamaConfig

    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=0)
    base.update(overrides)
    return LlamaConfig(**base)


def seeded_weights(model, seed: int, std: float = 0.08, stds: dict[str, float] | None = None) -> None:
    """Every matrix drawn from numpy's seeded generator (`stds` by name suffix); vectors stay as built."""
    # not transformers' init: a release that changed it made the random llama repeat one token and broke tests; the
    # std is 4x transformers' usual 0.02, since a flatter init cannot tell tokens apart
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() < 2:
                continue
            scale = next((v for suffix, v in (stds or {}).items() if name.endswith(suffix)), std)
            drawn = rng.standard_normal(tuple(param.shape), dtype=np.float32) * scale
            param.copy_(torch.from_numpy(drawn).to(param.dtype))


def tiny_llama_checkpoint(path: Path, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """A random LlamaForCausalLM saved by transformers (safetensors), with a real tokenizer beside it."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(**overrides)
    model = LlamaForCausalLM(config)
    seeded_weights(model, seed)
    model = model.to(getattr(torch, dtype))
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, vocab_size=min(config.vocab_size, 384))
    return path


def truncated_drafter(target: Path, path: Path, layers: int = 1, vocab_size: int = 448) -> Path:
    """A drafter cut from a target's first layers, its vocab padded wider, on the same tokenizer files."""
    from safetensors.numpy import load_file, save_file

    target, path = Path(target), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    old_vocab = config["vocab_size"]
    config.update(num_hidden_layers=layers, vocab_size=vocab_size)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    weights = {}
    for name, tensor in load_file(str(target / "model.safetensors")).items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = np.concatenate([tensor, np.zeros((vocab_size - old_vocab, tensor.shape[1]), tensor.dtype)])
        weights[name] = tensor
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).exists():
            shutil.copy(target / name, path / name)
    return path


def loaded_tiny_pair(root: Path, seed: int = 8):
    """A two-layer tiny llama loaded for serving, and the dir of a one-layer drafter cut from it: (model, tokenizer,
    drafter dir)."""
    from .loading import load_model

    target = tiny_llama_checkpoint(Path(root) / "target", seed=seed, num_hidden_layers=2)
    drafter = truncated_drafter(target, Path(root) / "drafter", layers=1)
    model, tokenizer, _ = load_model(str(target))
    return model, tokenizer, drafter


def mlx_quantized_copy(source: Path, path: Path, bits: int = 4, group_size: int = 64) -> Path:
    """mlx-lm's own affine conversion of a checkpoint, with the source's tokenizer files kept byte-identical."""
    from mlx_lm import convert

    convert(str(source), mlx_path=str(path), quantize=True, q_bits=bits, q_group_size=group_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(source) / name, Path(path) / name)
    return Path(path)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint dir, to edit without touching a session's fixture."""
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    """Change config.json keys; a value of ... removes the key."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is ...]:
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config, indent=1))


def transformers_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Every row's logits from transformers in float32 (torch, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


def mlx_lm_logits(path: Path, tokens: list[int], dtype: mx.Dtype | None = None) -> mx.array:
    """Every row's logits from mlx-lm's own loader and model (set to `dtype` if given), as float32."""
    import mlx_lm

    model, _ = mlx_lm.load(str(path))
    if dtype is not None:
        model.set_dtype(dtype)
    return model(mx.array([tokens]))[0].astype(mx.float32)


def window_logits(model, tokens: list[int], windows: list[int] | None = None, capacity: int = 64) -> mx.array:
    """Every row's logits of `tokens` run on one fresh cache as consecutive windows (one window by default)."""
    cache, rows, at = model.new_cache(capacity), [], 0
    for size in windows or [len(tokens)]:
        rows.append(model.forward([cache], [tokens[at:at + size]], [size]))
        model.keep(cache, size)
        at += size
    return mx.concatenate(rows)


class Run:
    """Drives an engine round by round: arrivals join between rounds up to `parallel` streams."""

    def __init__(self, model, parallel, chunk=8, lookahead=None):
        self.model, self.parallel = model, parallel
        self.engine = Engine(model, prefill_chunk=chunk, lookahead=lookahead)
        self.events: dict[int, list] = {}
        self.waiting = []
        self.round_rows = []

    def submit(self, sid, request):
        self.events[sid] = []
        self.waiting.append((sid, request))

    def admit(self):
        while self.waiting and len(self.engine.streams) < self.parallel:
            sid, request = self.waiting.pop(0)
            limit = len(request.prompt_ids) + request.max_tokens
            self.engine.add(Stream(id=sid, request=request, cache=self.model.new_cache(limit),
                                   on_event=self.events[sid].append, limit=limit))

    def step(self):
        self.admit()
        ran = self.engine.round()
        self.round_rows.append(self.engine.last_windows)  # planned once, as the server plans it
        return ran

    def finish(self):
        while self.waiting or not self.engine.idle():
            self.step()

    def tokens(self, sid):
        return [t for e in self.events[sid] if isinstance(e, TokenEvent) for t in e.token_ids]

    def done(self, sid):
        return next(e for e in self.events[sid] if isinstance(e, DoneEvent))


def drive(model, drafter, requests, parallel, *, timed=True, each_round=None) -> list[list[int]]:
    """Every request through one engine with `drafter`, `parallel` at a time, round after round (`each_round` hears
    the engine after each); each reply's ids."""
    run = Run(model, parallel)
    run.engine = Engine(model, prefill_chunk=8, drafter=drafter, timed=timed)
    run.engine.time_rows(parallel)  # as the server's engine does
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    while run.waiting or not run.engine.idle():
        run.admit()
        run.engine.round()
        if each_round is not None:
            each_round(run.engine)
    return [run.tokens(sid) for sid in range(len(requests))]


def serial(request: GenerationRequest) -> GenerationRequest:
    """The same request as the serial reference: one token a round, no drafts."""
    return dataclasses.replace(request, draft=False)


def solo(model, request: GenerationRequest) -> list[int]:
    """The request's token ids, alone on the engine; a serial request is checked to have carried no drafts."""
    run = Run(model, parallel=1)
    run.submit(0, request)
    run.finish()
    assert request.draft or run.done(0).usage["tensorfold"]["drafted"] == 0
    return run.tokens(0)


def served_by_thread(host, request: GenerationRequest, timeout_s: float = 60.0) -> list[int]:
    """The request's token ids as a started host's engine thread serves them (a server's path, without HTTP)."""
    events, done = [], threading.Event()

    def on_event(event) -> None:
        events.append(event)
        if isinstance(event, DoneEvent):
            done.set()

    host.submit(request, on_event)
    if not done.wait(timeout_s):
        raise TimeoutError(f"no reply within {timeout_s} s")
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def array_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every distinct mx.array an object holds (through lists, tuples, dicts and attributes): what a
    cache or slot really occupies, whatever its own arithmetic says."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(array_bytes(item, seen) for item in obj)
    if isinstance(obj, dict):
        return sum(array_bytes(item, seen) for item in obj.values())
    fields = getattr(obj, "__dict__", None) or {name: getattr(obj, name, None)
                                               for name in getattr(type(obj), "__slots__", ())}
    return sum(array_bytes(value, seen) for value in fields.values())


# ---- a package's import graph (imports inside functions included), for the layering tests ----

def module_names(package_dir: Path, package_name: str) -> dict[str, Path]:
    """Every module of a package (sub-packages too), by dotted name; a package is its `__init__.py`."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package_name, *parts])] = path
    return out


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports anywhere in its text (a function's body included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from pkg.mod import name` imports pkg.mod
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {name for name in found if name in modules and name != module}


def import_graph(package_dir: Path, package_name: str) -> dict[str, set[str]]:
    modules = module_names(package_dir, package_name)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def import_cycles(package_dir: Path, package_name: str) -> list[list[str]]:
    """Each set of modules that import one another round a circle (a strongly connected component), sorted."""
    graph = import_graph(Path(package_dir), package_name)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's algorithm; a package has few enough modules for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def forward_alike(models, caches: dict, windows: list) -> None:
    """Each model forwards the windows over its own caches, the logits bit-equal; each keeps all rows but the last
    (left unkept, as a rejected draft's)."""
    ours, theirs = (m.forward(caches[id(m)][:len(windows)], windows, [len(w) for w in windows]) for m in models)
    assert mx.array_equal(ours, theirs).item()
    for m in models:
        for cache, window in zip(caches[id(m)], windows):
            m.keep(cache, len(window) - 1)


def logits_alike(models: list, prompts: list[list[int]]) -> bool:
    """Three forwards of every model over the same streams' ragged windows (the prompts, three rows each, then one
    or two rows), each kept whole: whether every model's logits were the first model's bit for bit each time."""
    caches = {id(m): [m.new_cache(64) for _ in prompts] for m in models}
    alike = True
    for windows in (prompts, [[7, 8, 9]] * len(prompts), [[11 + i] * (1 + i % 2) for i in range(len(prompts))]):
        logits = [m.forward(caches[id(m)], windows, [len(w) for w in windows]) for m in models]
        alike = alike and all(mx.array_equal(logits[0], other).item() for other in logits[1:])
        for m in models:
            for cache, window in zip(caches[id(m)], windows):
                m.keep(cache, len(window))
    return alike
