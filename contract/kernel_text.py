"""The text a custom kernel is built from: its code as written, less comments and indentation."""

# MLX copies a custom kernel's whole text into every call's primitive and hashes it again at every launch
# (CustomKernel::eval_gpu), so a forward of a hundred launches pays for its comments each token.
# TENSORFOLD_KERNEL_COMMENTS=1 builds the text as written (the same code: a bench variant compares the two).

from __future__ import annotations

import functools
import os


def served_text(text: str) -> str:
    """`text` with its // comments, indentation and blank lines dropped; lines kept, for the preprocessor."""
    if os.environ.get("TENSORFOLD_KERNEL_COMMENTS") == "1":
        return text
    return _stripped(text)


@functools.lru_cache(maxsize=512)
def _stripped(text: str) -> str:
    """Cached: the contract names and builds a kernel from its text at every launch of a case."""
    lines = (_code(line).strip() for line in text.splitlines())
    return "".join(line + "\n" for line in lines if line)


def _code(line: str) -> str:
    """The line up to a // that opens a comment (one inside a string literal, as in inline asm, does not)."""
    if '"' not in line:
        return line.split("//", 1)[0]
    quoted, i = False, 0
    while i < len(line):
        if quoted and line[i] == "\\":
            i += 2
            continue
        if line[i] == '"':
            quoted = not quoted
        elif not quoted and line.startswith("//", i):
            return line[:i]
        i += 1
    return line


def select_chain(var: str, prefix: str, count: int) -> str:
    """`var == 0 ? prefix0 : ... : prefix<count - 1>`: one of `count` inputs by index (MLX passes each its pointer)."""
    return " : ".join([f"{var} == {i} ? {prefix}{i}" for i in range(count - 1)] + [f"{prefix}{count - 1}"])


def narrowed(body: str, targets: tuple[str, ...], count: int) -> str:
    """`body` with each select chain assigned to a target (`kc = `, say) cut to its first `count` inputs, its entries
    kept as they are, so a control planted in them stays planted."""
    for target in targets:
        if body.count(target) != 1:
            raise ValueError(f"the body assigns {target!r} {body.count(target)} times, expected once")
        start = body.index(target) + len(target)
        end = body.index(";", start)
        entries = body[start:end].split(" : ")
        if not 1 <= count <= len(entries):
            raise ValueError(f"{target!r} chooses among {len(entries)} inputs: cannot keep {count}")
        cut = entries[:count - 1] + [entries[count - 1].split(" ? ")[-1]]
        body = body[:start] + " : ".join(cut) + body[end:]
    return body


def build(kind: str, name: str, input_names, output_names, body: str, header: str = "", shared_memory: int = 0):
    """mx.fast.cuda_kernel (kind "cuda") or mx.fast.metal_kernel over the served text of `body` and `header`."""
    import mlx.core as mx

    common = dict(name=name, input_names=list(input_names), output_names=list(output_names),
                  source=served_text(body), header=served_text(header))
    if kind == "cuda":
        return mx.fast.cuda_kernel(**common, shared_memory=shared_memory)
    return mx.fast.metal_kernel(**common)
