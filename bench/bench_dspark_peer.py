"""tensorfold's DSpark path against mlx-vlm's on the same checkpoints (tiny-lfm2-moe + tiny-lfm2-moe-dspark), ids first.

Both in-process, greedy, float32, the code prompts as raw text (no chat template, the same prompt ids checked): each
side's plain decode, then its drafted decode, timed over a few rotated reps; ours twice, with the copy drafts the
server adds and with DSpark's drafts alone. OpenBLAS (Nehalem) by default, as bench_dspark's servers (`--blas`).
Every drafted reply must equal its own side's plain reply before any rate is printed; how many plain replies the two
sides share is reported. mlx-vlm is not
a tensorfold dependency: install it beside the venv without its dependencies (docs/performance.md says how), e.g.
    pip install --no-deps --target /tmp/peersite mlx-vlm==0.7.10 pillow
    PYTHONPATH=/tmp/peersite python bench/bench_dspark_peer.py
On the CPU mlx-vlm's MoE gather takes float32 only, so it loads a float32 copy of the target made here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import (CODE_PROMPTS, BenchMismatch, blas_env, check_same_ids, exit_code, fail_if_any, median,
                    platform_lines, table)

TARGET = "tiny-lfm2-moe"
DRAFTER = "tiny-lfm2-moe-dspark"


def float32_copy(source: Path, out: Path) -> Path:
    """The checkpoint dir with its weights cast to float32 (mlx-vlm's CPU MoE gather refuses bf16)."""
    import mlx.core as mx

    shutil.copytree(source, out)
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(source / "model.safetensors")).items()}
    (out / "model.safetensors").unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class Ours:
    """tensorfold in-process: the served engine's plain (lookahead) and drafted (priced holds) rounds; `copies`
    False drafts from DSpark alone, as mlx-vlm does (the server adds copy drafts from the context)."""

    def __init__(self, max_tokens: int, copies: bool = True):
        self.name = "tensorfold" if copies else "tensorfold, no copies"
        from tensorfold_core.loading import load_target, start_drafter
        from tensorfold_core.options import ServeOptions
        from tensorfold_core.specs import DrafterOptions

        from tensorfold_core.lanes.engine import Engine

        self.target = load_target(TARGET, ServeOptions(dtype="float32"))
        self.drafter = start_drafter(DRAFTER, self.target.model, self.target.tokenizer, DrafterOptions(dtype="float32"))
        self.max_tokens = max_tokens
        # one engine each for the whole run, as a server keeps one: its planner learns what drafting pays
        model = self.target.model
        self.engines = {False: Engine(model), True: Engine(model, drafter=self.drafter, timed=True, copy_drafts=copies)}

    def encode(self, text: str) -> list[int]:
        return self.target.tokenizer.encode(text)

    def decode(self, text: str, drafted: bool) -> list[int]:
        from tensorfold_core.checkmode import decode
        from tensorfold_core.lanes.types import GenerationRequest

        ids = self.encode(text)
        request = GenerationRequest(prompt_ids=ids, max_tokens=self.max_tokens, draft=drafted,
                                    stop_token_ids=frozenset(self.target.tokenizer.eos_ids))
        out, _, _ = decode(self.engines[drafted], request, len(ids) + self.max_tokens)
        return out


class Peer:
    """mlx-vlm's `stream_generate`, plain and with its DSpark drafter (`draft_kind` as its loader detects it)."""

    name = "mlx-vlm"

    def __init__(self, target: Path, drafter: Path, max_tokens: int):
        from mlx_vlm.speculative.drafters import load_drafter
        from mlx_vlm.utils import load

        self.model, self.processor = load(str(target))
        self.drafter, self.kind = load_drafter(str(drafter), kind=None)
        self.max_tokens = max_tokens

    def encode(self, text: str) -> list[int]:
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        return list(tokenizer.encode(text))

    def decode(self, text: str, drafted: bool) -> list[int]:
        from mlx_vlm.generate.dispatch import stream_generate

        options = dict(max_tokens=self.max_tokens, temperature=0.0)
        if drafted:
            options.update(draft_model=self.drafter, draft_kind=self.kind)
        return [r.token for r in stream_generate(self.model, self.processor, text, **options)][:self.max_tokens]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=len(CODE_PROMPTS))
    parser.add_argument("--blas", default="openblas-nehalem", help="bundled, openblas, openblas-CORE (bench_dspark's "
                        "default, so the in-process and HTTP figures share a BLAS)")
    args = parser.parse_args()
    env = blas_env(args.blas)
    if any(os.environ.get(k) != v for k, v in env.items()):  # a preload only acts from a process's start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        raise SystemExit("mlx-vlm is not importable: install it beside the venv (this file's docstring says how)")
    from tensorfold_core.loading import resolve_model

    print("\n".join(platform_lines(args.blas)))
    prompts = CODE_PROMPTS[:args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        sides = [Ours(args.tokens), Peer(float32_copy(resolve_model(TARGET), Path(tmp) / "target"),
                                          resolve_model(DRAFTER), args.tokens), Ours(args.tokens, copies=False)]
        for text in prompts:  # the same prompt ids on both sides, or the comparison means nothing
            check_same_ids(f"prompt ids, {text[:30]!r}", sides[0].encode(text), sides[1].encode(text))
        for side in sides:  # warm-up: kernels built on first use are not timed
            side.decode(prompts[0], False), side.decode(prompts[0], True)
        ids, seconds = {}, {}
        for rep in range(args.reps):
            cells = [(side, drafted) for side in sides for drafted in (False, True)]
            for side, drafted in cells[rep % len(cells):] + cells[:rep % len(cells)]:
                start = time.perf_counter()
                replies = [side.decode(text, drafted) for text in prompts]
                seconds.setdefault((side.name, drafted), []).append(time.perf_counter() - start)
                ids.setdefault((side.name, drafted), replies)
    failures = []
    names = [side.name for side in sides]
    for name in names:
        for i, (plain, drafted) in enumerate(zip(ids[name, False], ids[name, True])):
            try:
                check_same_ids(f"{name} drafted vs its plain, prompt {i}", plain, drafted)
            except BenchMismatch as exc:
                failures.append(exc)
    fail_if_any(failures)  # before any rate: a cell whose ids are off its own plain ones gets no speed
    # reported, not required: the engines are two implementations of the architecture (tensorfold's greedy equals
    # transformers' in the tests; mlx-vlm 0.7.10's lfm2_moe was seen to part from it a few tokens in)
    agree = sum(a == b for a, b in zip(ids["tensorfold", False], ids["mlx-vlm", False]))
    rows = []
    for name in names:
        tokens = sum(len(r) for r in ids[name, False])
        plain, drafted = (tokens / median(seconds[name, d]) for d in (False, True))
        rows.append([name, f"{plain:.1f}", f"{drafted:.1f}", f"{drafted / plain:.2f}x"])
    print(f"{TARGET} + {DRAFTER}, float32, {len(prompts)} code prompts, {args.tokens} tokens, {args.reps} reps; "
          f"every drafted reply equal to its own engine's plain one; the two engines' plain replies equal on "
          f"{agree} of {len(prompts)} prompts")
    print(table(["engine", "plain tok/s", "DSpark tok/s", "DSpark / plain"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_code(main))
