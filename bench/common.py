"""Helpers for benchmarks: a fresh `tensorfold serve` subprocess per cell, the openai client, prompts, id checks."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx

MODEL = "tiny-llama"
OPENBLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
            "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")

# Python the tiny models continue for a while (none of these draws an eos first under greedy decoding)
SHORT_PROMPTS = ["def ", "import os\n", "class Foo:\n    def ", "from collections import", "def test_",
                 "for i in range(", "    @property\n    def ", "try:\n    import"]
LONG_PROMPTS = [
    'import os\nimport re\nimport sys\nfrom collections import namedtuple\n\n__all__ = ["Entry", "scan", "main"]\n\n'
    'Entry = namedtuple("Entry", "path size mtime")\n\n\ndef scan(root, pattern=None):\n    """Yield an Entry for '
    'every file under root whose name matches pattern."""\n    regex = re.compile(pattern) if pattern else None\n'
    '    for dirpath, dirnames, filenames in os.walk(root):\n        dirnames.sort()\n        for name in '
    'sorted(filenames):\n            if regex is not None and not regex.search(name):\n                continue\n'
    '            path = os.path.join(dirpath, name)\n            try:\n                st = os.stat(path)\n'
    '            except OSError:\n                continue\n            yield Entry(path, st.st_size, st.st_mtime)'
    '\n\n\ndef main(args=None):\n    if args is None:\n        args = sys.argv[1:]\n',
    'import unittest\nfrom test import support\n\n\nclass ListTests(unittest.TestCase):\n\n    def setUp(self):\n'
    '        self.items = [3, 1, 2]\n\n    def test_sort(self):\n        self.items.sort()\n'
    '        self.assertEqual(self.items, [1, 2, 3])\n\n    def test_reverse(self):\n        self.items.reverse()\n'
    '        self.assertEqual(self.items, [2, 1, 3])\n\n    def test_index(self):\n',
    'class Queue:\n    """A simple FIFO queue built on a list."""\n\n    def __init__(self, maxsize=0):\n'
    '        self.maxsize = maxsize\n        self._items = []\n\n    def __len__(self):\n'
    '        return len(self._items)\n\n    def empty(self):\n        return not self._items\n\n    def full(self):\n'
    '        return 0 < self.maxsize <= len(self._items)\n\n    def put(self, item):\n        if self.full():\n'
    '            raise ValueError("queue is full")\n        self._items.append(item)\n\n    def get(self):\n',
]
CODE_PROMPTS = SHORT_PROMPTS + LONG_PROMPTS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exit_on_sigterm(signum, frame):
    sys.exit(128 + signum)  # unwinds, so every open server() stops its child instead of leaving it serving


signal.signal(signal.SIGTERM, _exit_on_sigterm)


def wait_up(proc: subprocess.Popen, log, url: str, timeout: float) -> None:
    """Until the server at `url` answers /health with 200; its log's tail if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited: {log.read()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("server did not start in time")


@contextlib.contextmanager
def server(model: str | None, *flags: str, env: dict | None = None, timeout: float = 300):
    """A fresh server process; yields its base URL and stops it afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "tensorfold_core", "serve", *([model] if model else []), "--port", str(port), *flags]
    # stderr goes to a file: a pipe nobody reads would block the server once its logs fill the pipe's buffer
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, log, url, timeout)
        yield url
    except Exception:  # a request the server failed (a 500 says "its log holds the cause"): show that log
        log.seek(0)
        print(f"the server's log (its last 4000 characters):\n{log.read()[-4000:]}", file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


CORETYPES = {"skylakex": "SkylakeX"}  # OpenBLAS spellings that capitalize() misses


def openblas_env() -> dict:
    """LD_PRELOAD of Debian's pthread OpenBLAS where installed, so MLX's CPU matmuls use it."""
    for path in OPENBLAS:
        if os.path.exists(path):
            return {"LD_PRELOAD": path}
    return {}


def blas_env(blas: str) -> dict:
    """The environment of a BLAS setting: 'bundled' (MLX's own), 'openblas', or 'openblas-CORE' (OpenBLAS with
    OPENBLAS_CORETYPE=CORE: nehalem is the row-invariant one on AVX-512 Xeons, skylakex is not)."""
    if blas == "bundled":
        return {}
    env = openblas_env()
    if not env:
        raise SystemExit(f"--blas {blas}: Debian's libopenblas0-pthread is not installed")
    core = blas.removeprefix("openblas").removeprefix("-")
    return {**env, "OPENBLAS_CORETYPE": CORETYPES.get(core, core.capitalize())} if core else env


def words(text: str) -> list[str]:
    return re.findall(r"\S+", text)


def tokenize(prompts: list[str], model: str = MODEL) -> list[list[int]]:
    """Prompt ids by the model's own tokenizer, so every cell (and mlx-lm) reads the same ids."""
    from tensorfold_core.checkpoint import Checkpoint
    from tensorfold_core.loading import resolve_model

    tokenizer = Checkpoint.open(resolve_model(model)).tokenizer()
    return [tokenizer.encode(p) for p in prompts]


def model_dir(model: str) -> str:
    from tensorfold_core.loading import resolve_model

    return str(resolve_model(model))


def random_prompts(count: int, length: int, vocab: int = 8192, seed: int = 0) -> list[list[int]]:
    """Uniform random token ids above the special tokens: text no drafter has seen."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(count)]


def complete(client, prompt_ids: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
             draft: bool = True, stream: bool = True, model: str = MODEL) -> dict:
    """One completion; its token ids, finish reason, draft stats, and times (seconds since the request)."""
    body = {"draft": draft, "return_token_ids": True}
    start = time.perf_counter()
    if not stream:
        reply = client.completions.create(model=model, prompt=prompt_ids, max_tokens=max_tokens,
                                          temperature=temperature, seed=seed, extra_body=body)
        wall = time.perf_counter() - start
        choice = reply.choices[0]
        return {"ids": list(getattr(choice, "token_ids", None) or []), "finish": choice.finish_reason,
                "stats": _tensorfold(reply.usage), "first": None, "last": wall, "wall": wall}
    chunks = client.completions.create(model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=temperature,
                                       seed=seed, stream=True, stream_options={"include_usage": True},
                                       extra_body=body)
    ids, first, last, finish, stats = [], None, None, None, {}
    for chunk in chunks:
        for choice in chunk.choices:
            new = getattr(choice, "token_ids", None) or []
            if new:
                last = time.perf_counter() - start
                first = last if first is None else first
                ids += new
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            stats = _tensorfold(chunk.usage)
    return {"ids": ids, "finish": finish, "stats": stats, "first": first, "last": last,
            "wall": time.perf_counter() - start}


def _tensorfold(usage) -> dict:
    extra = getattr(usage, "model_extra", None) or {}
    return dict(extra.get("tensorfold") or {})


def decode_rate(replies: list[dict]) -> float:
    """Decode tokens per second over replies: tokens after each first one, over first-to-last token time."""
    tokens = sum(max(len(r["ids"]) - 1, 0) for r in replies)
    seconds = sum(r["last"] - r["first"] for r in replies if r["first"] is not None)
    return tokens / seconds if seconds > 0 else 0.0


def capabilities(url: str) -> dict:
    return httpx.get(url + "/v1/capabilities", timeout=10).json()


def first_difference(got: list[int], want: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None when equal."""
    got, want = list(got), list(want)
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


class BenchMismatch(Exception):
    """A cell's output is not its reference's: it gets no speed, and the benchmark exits 1."""


VARIANTS = {"": {}, "op-by-op": {"TENSORFOLD_COMPILE": "0"}, "rope-rows": {"TENSORFOLD_ROPE_ROWS": "1"},
            "rope-windows": {"TENSORFOLD_ROPE_ROWS": "0"}, "in-step": {"TENSORFOLD_LOOKAHEAD": "0"},
            "drafter-builtin": {"TENSORFOLD_DRAFTER_BUILTIN": "1"}, "per-stream": {"TENSORFOLD_STREAM_ATTENTION": "0"},
            "unfused-residual": {"TENSORFOLD_FUSED_RESIDUAL": "0"}, "rope-apart": {"TENSORFOLD_ROPE_QKV": "0"},
            "rope-in": {"TENSORFOLD_ROPE_IN": "1"}, "host-arrays": {"TENSORFOLD_DEVICE_STEP_ARRAYS": "0"},
            "swiglu-down": {"TENSORFOLD_SWIGLU_IN": "down"}, "stack-builtin": {"TENSORFOLD_STACK_KV": "0"},
            "commented": {"TENSORFOLD_KERNEL_COMMENTS": "1"}, "all-inputs": {"TENSORFOLD_NARROW_INPUTS": "0"},
            "held": {"TENSORFOLD_HELD_ON_TARGET": "1"}, "read-back": {"TENSORFOLD_HELD_ON_TARGET": "0"},
            "norms-apart": {"TENSORFOLD_NORM_IN": "0"}, "small-inputs": {"TENSORFOLD_PAD_INPUTS": "0"},
            "parts-compiled": {"TENSORFOLD_WHOLE_FORWARD": "0"}, "rows-read": {"TENSORFOLD_DEVICE_GREEDY": "0"},
            "ops-100": {"MLX_MAX_OPS_PER_BUFFER": "100"}, "ops-250": {"MLX_MAX_OPS_PER_BUFFER": "250"},
            "w8": {"TENSORFOLD_GEMV_NARROW": "8"}, "w16-mt2": {"TENSORFOLD_GEMV_NARROW": "16:2"},
            "u1": {"TENSORFOLD_GEMV_STEPS": "1"}, "u2": {"TENSORFOLD_GEMV_STEPS": "2"},
            "vc32": {"TENSORFOLD_ATTENTION_CHUNKS": "8,32"},
            "kc16-vc32": {"TENSORFOLD_ATTENTION_CHUNKS": "16,32"}, "l2-256": {"TENSORFOLD_GEMV_LOAD": "l2-256"},
            "l2-128": {"TENSORFOLD_GEMV_LOAD": "l2-128"},
            "ops-5": {"MLX_MAX_OPS_PER_BUFFER": "5"}, "ops-20": {"MLX_MAX_OPS_PER_BUFFER": "20"},
            "graphs-off": {"MLX_USE_CUDA_GRAPHS": "0"}, "graphs-on": {"MLX_USE_CUDA_GRAPHS": "1"},
            "maxt2": {"TENSORFOLD_GEMV_MAXT": "2"},
            "conv-spans": {"TENSORFOLD_WHOLE_CONV_SPANS": "1"}, "unpadded": {"TENSORFOLD_WHOLE_PAD_ROWS": "0"},
            "trace-first": {"TENSORFOLD_WHOLE_TRACE_AFTER": "0"},
            "lazy-catch-up": {"TENSORFOLD_DSPARK_LAZY_CATCH_UP": "1"}, "hold-ahead": {"TENSORFOLD_HOLD_AHEAD": "1"}}


def kernel_mode_child(script: str, mode: str, *args: str) -> dict:
    """`script --child ARGS --mode MODE` in a process of its own under the mode's kernel table (TENSORFOLD_KERNELS,
    read at load; a mode `TABLE-OP+OP` leaves those ops to MLX; one ending `:op-by-op` compiles no layer part,
    TENSORFOLD_COMPILE=0, `:rope-windows` ropes each stream's window apart, TENSORFOLD_ROPE_ROWS=0 (`:rope-rows`,
    =1, is the default), `:in-step` runs no round ahead, TENSORFOLD_LOOKAHEAD=0, and `:drafter-builtin` runs a llama
    drafter on MLX's ops instead of the target's table, TENSORFOLD_DRAFTER_BUILTIN=1, `:per-stream` launches a
    layer's attention a stream at a time, TENSORFOLD_STREAM_ATTENTION=0, `:unfused-residual` adds the residual and
    computes swiglu apart from o_proj's and down_proj's launches, TENSORFOLD_FUSED_RESIDUAL=0, `:rope-apart` slices
    and ropes q, k and v op by op, TENSORFOLD_ROPE_QKV=0, `:rope-in` ropes in the normed q|k|v launch's store
    instead of in a launch of its own after it, TENSORFOLD_ROPE_IN=1, `:host-arrays` makes a forward's positions and
    row maps on the host each step instead of by device ops, TENSORFOLD_DEVICE_STEP_ARRAYS=0,
    `:swiglu-down` has down_proj compute swiglu as it reads gate|up's output instead of gate|up storing it,
    TENSORFOLD_SWIGLU_IN=down, `:stack-builtin` stacks the layers' new keys and values with MLX's ops,
    TENSORFOLD_STACK_KV=0, `:commented` builds the kernels' text with its comments, TENSORFOLD_KERNEL_COMMENTS=1,
    `:all-inputs` launches the streams attention with all 8 cache slots and stack kv with all 32 layers' inputs,
    TENSORFOLD_NARROW_INPUTS=0, `:held` keeps a drafter's drafts (DSpark's holds, the llama drafter's chains) on
    the device for the verify, TENSORFOLD_HELD_ON_TARGET=1 (a GPU's default), `:read-back` reads them to the host
    first, =0, `:norms-apart` launches a layer's norms apart from the q|k|v and gate|up launches that read them,
    TENSORFOLD_NORM_IN=0,
    `:small-inputs` leaves a kernel's inputs of 8 bytes or less in MLX's shared small pool, TENSORFOLD_PAD_INPUTS=0,
    `:parts-compiled` calls each layer's compiled parts and its attention from Python instead of the whole forward's
    one compiled call, TENSORFOLD_WHOLE_FORWARD=0, `:rows-read` reads a greedy round's logits rows and draws on the
    host instead of reading the device's greedy ids, TENSORFOLD_DEVICE_GREEDY=0, `:ops-100`, `:ops-250`, `:ops-5` and
    `:ops-20` commit MLX's CUDA graphs every 100, 250, 5 or 20 kernels (20 is MLX's default: a mode that names it
    stays there when the caller's environment sets another), MLX_MAX_OPS_PER_BUFFER,
    `:graphs-off` launches kernels without CUDA graphs, MLX_USE_CUDA_GRAPHS=0 (tensorfold_core's
    default; `:graphs-on`, =1, is MLX's), `:w8` splits K
    over 8 warps in the bf16 GEMVs of fewer than 4,096 outputs instead of 16 (`:w16-mt2` keeps 16 with two
    16-column tiles a warp, the default until one), TENSORFOLD_GEMV_NARROW (32 warps ask more registers than a block
    of 1,024 threads may hold), `:u1` has a GEMV warp load one step at a time (the 8-warp split's default),
    `:u2` two (the 16-warp split's; both splits' until the wide one's was measured), TENSORFOLD_GEMV_STEPS=1 or 2,
    and `:vc32` and `:kc16-vc32` have an attention thread issue 32 value loads (and 16 key loads) together instead
    of 16 (and 8), TENSORFOLD_ATTENTION_CHUNKS (64 value loads ask 168 registers a thread, more than 512 threads may
    hold), `:l2-256` and `:l2-128` have the bf16 GEMVs' 16-byte loads ask L2 for 256 or 128 bytes,
    TENSORFOLD_GEMV_LOAD, and `:maxt2` has the bf16 GEMVs repeat 16-row blocks past 16 rows instead of reading
    the weights once for 32, TENSORFOLD_GEMV_MAXT=2, and `:conv-spans` keys lfm2's whole forward by every stream's
    window size, not only by its rows, TENSORFOLD_WHOLE_CONV_SPANS=1, and `:unpadded` runs either family's whole
    forward at every row count instead of padded to a multiple of 8, TENSORFOLD_WHOLE_PAD_ROWS=0, and `:trace-first`
    traces a whole forward's key at its first meeting, not its second, TENSORFOLD_WHOLE_TRACE_AFTER=0, and
    `:lazy-catch-up` leaves a held DSpark drafter's catch-up to its hold's async eval,
    TENSORFOLD_DSPARK_LAZY_CATCH_UP=1, and `:hold-ahead` queues a drafting stream's next hold on its verify's device
    draws before the host reads them, TENSORFOLD_HOLD_AHEAD=1): the JSON its last line prints."""
    served, _, variant = mode.partition(":")
    if variant not in VARIANTS:
        raise SystemExit(f"mode {mode}: unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    table, _, builtin_ops = served.partition("-")
    env = dict(os.environ, TENSORFOLD_KERNELS=table, TENSORFOLD_KERNELS_BUILTIN=builtin_ops.replace("+", ","),
               **VARIANTS[variant])
    done = subprocess.run([sys.executable, script, "--child", *args, "--mode", mode], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise BenchMismatch(f"mode {mode}: the child failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_same_ids(label: str, reference: list[int], other: list[int]) -> None:
    """Raise BenchMismatch unless `other` is `reference` exactly, lengths included, naming the first difference."""
    at = first_difference(other, reference)
    if at is None:
        return
    got = other[at] if at < len(other) else "past its end"
    want = reference[at] if at < len(reference) else "past its end"
    raise BenchMismatch(f"{label}: token {at} is {got}, the reference's is {want} "
                        f"(lengths: {len(other)} here, {len(reference)} in the reference)")


def check_same_replies(label: str, reference: list[list[int]], other: list[list[int]]) -> None:
    """Every reply's ids against the reference reply of the same prompt; a missing or extra reply fails too."""
    if len(other) != len(reference):
        raise BenchMismatch(f"{label}: {len(other)} replies here, {len(reference)} in the reference")
    for i, (want, got) in enumerate(zip(reference, other)):
        check_same_ids(f"{label}, prompt {i}", want, got)


def fail_if_any(failures: list[BenchMismatch]) -> None:
    """Raise the first of a table's mismatches (counting the rest), once the table is printed."""
    if failures:
        more = f" (and {len(failures) - 1} more failed cells above)" if len(failures) > 1 else ""
        raise BenchMismatch(f"{failures[0]}{more}")


def interleaved(modes: list[str], rounds: int, run, kept=None) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """`run(mode)` for every mode, `rounds` times, each round starting one mode later; a mode whose run fails (a
    launch the device refuses) is left out of every later round and named with why (a FAIL line), and the others go
    on, so that one call to the device still brings back their figures. None running is a failure of its own. Each
    run's end is noted on stderr (no figures: those wait for every check), so a run cut at its cap says how far it
    got, and `kept(runs)` is handed the raw results so far (a bench's --json), which a cut run keeps."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    failed: dict[str, str] = {}
    for n in range(rounds):
        for mode in modes[n % len(modes):] + modes[:n % len(modes)]:
            if mode in failed:
                continue
            start = time.perf_counter()
            try:
                runs[mode].append(run(mode))
            except BenchMismatch as exc:
                failed[mode] = str(exc)
                print(f"FAIL {exc}; no speed quoted for it", file=sys.stderr)
                continue
            print(f"ran {mode}, round {n + 1} of {rounds}, in {time.perf_counter() - start:.0f} s", file=sys.stderr,
                  flush=True)
            if kept is not None:
                kept(runs)
    if len(failed) == len(modes):
        raise BenchMismatch("no mode ran")
    return {mode: r for mode, r in runs.items() if mode not in failed}, failed


def exit_code(main: Callable[[], int]) -> int:
    """A benchmark's exit code: a BenchMismatch becomes one FAIL line on stderr and 1."""
    try:
        return main()
    except BenchMismatch as exc:
        print(f"FAIL {exc}; no speed quoted for it", file=sys.stderr)
        return 1


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def spread(values) -> str:
    values = [v for v in values if v is not None]
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table, so the output pastes into docs/performance.md as it is."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
    return "\n".join([line(headers), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, cells)])


def platform_lines(blas: str | None = None) -> list[str]:
    """The machine a run measured: CPU model, cores, load, MLX and mlx-lm versions, BLAS."""
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    versions = []
    for name in ("mlx", "mlx-lm", "openai"):
        with contextlib.suppress(Exception):
            versions.append(f"{name} {importlib.metadata.version(name)}")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [f"platform: {platform.platform()}; CPU: {cpu}, {os.cpu_count()} cores; load average {load}",
             f"versions: python {platform.python_version()}, {', '.join(versions)}"]
    if blas is not None:
        lines.append(f"BLAS: {blas}")
    return lines


def drafts_by_source(url: str) -> dict[str, tuple[float, float]]:
    """The server's draft tokens offered and kept so far by the proposer that gave them (/metrics, per source)."""
    # imported here: the GPU machine's benches import this module with a minimal site and never read /metrics
    from prometheus_client.parser import text_string_to_metric_families

    column = {"tensorfold:draft_tokens_total": 0, "tensorfold:accepted_draft_tokens_total": 1}
    counts: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name in column:
                counts.setdefault(sample.labels["source"], [0.0, 0.0])[column[sample.name]] = sample.value
    return {source: (offered, kept) for source, (offered, kept) in counts.items()}
