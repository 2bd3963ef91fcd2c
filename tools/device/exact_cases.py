"""One family's exactness cases (gpu_exact.py's child): the serial solo reference, then the same requests drafted,
shared, joined, cancelled around and resumed, token ids compared."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parent process reads the tables only: MLX and the engine load in the children
    from tensorfold_core.lanes.types import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
DSPARK = "dspark"  # a family whose drafter is a DSpark checkpoint built here (no lfm2 drafter is shipped)
DSPARK_RANK = 256  # Markov rows taught from the references' bigrams, so the drafts land
CHUNK = 8  # prompt chunk of the runs under test: prompts span several chunks and interleave with decode rounds
REFERENCE_CHUNK = 256  # the reference reads each prompt in one chunk: chunking must change nothing
BUDGET = 8 << 30  # the ledger's bytes: nothing here waits for room
PROMPT_CACHE = 1 << 30


@dataclass(frozen=True)
class FamilySpec:
    """A target and the drafter served with it; `bits` > 0: the target is quantized here first (MLX affine)."""

    target: str
    drafter: str | None
    bits: int = 0


FAMILIES = {
    "llama": FamilySpec("tiny-llama", "tiny-llama-drafter"),
    "llama-4bit": FamilySpec("tiny-llama", "tiny-llama-drafter-4bit", bits=4),
    "lfm2": FamilySpec("tiny-lfm2", DSPARK),
    "lfm2_moe": FamilySpec("tiny-lfm2-moe", DSPARK),
    "lfm2_moe-4bit": FamilySpec("tiny-lfm2-moe-4bit", DSPARK),
}

# code prompts; 8, 9 and 10 continue 1, 2 and 0, so a later one resumes an earlier one's kept prefix
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Point:\n    def __init__(self, x, y):\n",
           "def fib(n):\n    if n < 2:\n", "for i in range(10):\n    print(", "import json\n\n\ndef load(path):\n",
           "    def __repr__(self):\n        return", "try:\n    import numpy as np\nexcept ImportError:\n",
           "def parse_args():\n    parser = argparse.ArgumentParser(",
           ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
            "    def norm(self):\n"),
           "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(",
           "import os\nimport sys\n\n\ndef main(argv):\n    args = parse_args(argv)\n    with open(args.path) as f:\n",
           "Hello world! The quick brown fox jumps over the lazy dog. Hello world! The quick"]
VICTIMS = ["while True:\n    line = input(", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"]
VICTIM_ID = 1000  # stream ids of the cancelled neighbours
PASS_ID = 10000  # stream ids of a resumed run's second pass


# ---- checkpoints made for the run, in a temporary dir ----

def copy_beside(source: Path, out: Path, skip=("config.json", "README.md")) -> None:
    """The source's tokenizer and generation files, byte for byte (weights and config are written apart)."""
    for path in source.iterdir():
        if path.is_file() and path.name not in skip and not path.name.startswith("model.safetensors"):
            shutil.copy(path, out / path.name)


def quantized_copy(source: Path, out: Path, bits: int, group_size: int = 64) -> Path:
    """An MLX affine copy of a float checkpoint in mlx-lm's layout (weight codes, scales, biases and a quantization
    block), made with MLX alone: the machine has no mlx-lm and no flag quantizes a target at load."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, w in mx.load(str(shard)).items():
            if name.endswith(".weight") and w.ndim == 2 and "norm" not in name and w.shape[-1] % group_size == 0:
                base = name[:-len(".weight")]
                tensors[name], tensors[f"{base}.scales"], tensors[f"{base}.biases"] = mx.quantize(
                    w, group_size=group_size, bits=bits)
            else:
                tensors[name] = w
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    config = json.loads((source / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    copy_beside(source, out)
    return out


def dspark_checkpoint(target: Path, out: Path, mask_id: int, sequences: list[list[int]]) -> Path:
    """A DSpark drafter for `target` the way the dspark tests make one (their helpers), its Markov head taught the
    sequences' bigrams; written with MLX, since the machine may lack the safetensors package."""
    import mlx.core as mx

    sys.path.insert(0, str(ROOT / "plugins" / "tensorfold_dspark" / "tests"))
    from dspark_helpers import bigrams_of, dspark_config, dspark_weights

    config = dspark_config(target, rank=DSPARK_RANK)
    config["dflash_config"]["mask_token_id"] = mask_id
    weights = dspark_weights(config, seed=0, bigrams=bigrams_of(sequences))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()},
                        metadata={"format": "pt"})
    copy_beside(target, out)
    return out


# ---- serving: an engine and its admission, driven as the host drives them ----

@dataclass
class Job:
    """A request to serve; `cancel_after` rounds after it joins, the client gives up on it (None: never)."""

    sid: int
    request: "GenerationRequest"
    cancel_after: int | None = None


@dataclass
class Served:
    """What a stream's events said."""

    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    usage: dict = field(default_factory=dict)
    error: str | None = None
    cut: bool = False  # not run to its end: the child's time ran out (a case that is not compared)

    def on_event(self, event) -> None:
        from tensorfold_core.lanes.types import DoneEvent, ErrorEvent, TokenEvent

        if isinstance(event, TokenEvent):
            self.tokens.extend(event.token_ids)
        elif isinstance(event, DoneEvent):
            self.finish, self.usage = event.finish_reason, event.usage
        elif isinstance(event, ErrorEvent):
            self.error = repr(event.error)


class Server:
    """One engine over the model (shared rounds forced on, so a backend that is not row-invariant shows its
    mismatches) with the host's admission and ledger; a prompt cache when `resume`."""

    def __init__(self, model, *, drafter=None, chunk: int = CHUNK, resume: bool = False,
                 deadline: float = float("inf")):
        from tensorfold_core.lanes.engine import Engine
        from tensorfold_core.memory.admission import Admission
        from tensorfold_core.memory.ledger import Ledger
        from tensorfold_core.memory.prompt_cache import PromptCache

        self.model, self.deadline = model, deadline  # past the deadline (perf_counter), streams are cut
        ledger = Ledger(BUDGET)
        self.admission = Admission(model, ledger, PromptCache(ledger, PROMPT_CACHE) if resume else None, drafter,
                                   resume=resume, marks=chunk)
        self.engine = Engine(model, prefill_chunk=chunk, drafter=drafter, on_leave=self.admission.leave)

    def serve(self, jobs: list[Job], parallel: int) -> dict[int, Served]:
        """`rounds` on a thread of its own, as the server's engine thread serves what its loading thread loaded:
        MLX's streams are per thread, so an array the loading thread left unevaluated fails there, and here."""
        from tensorfold_core.backend import release_thread

        result: dict = {}

        def run() -> None:
            try:
                result["served"] = self.rounds(jobs, parallel)
            except BaseException as error:  # raised again on the calling thread
                result["error"] = error
            finally:
                release_thread()

        thread = threading.Thread(target=run, name="exact-engine")
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["served"]

    def rounds(self, jobs: list[Job], parallel: int) -> dict[int, Served]:
        """Streams join one a round while a slot is free (so they join an engine already running); a job's
        cancel lands `cancel_after` rounds after it joined."""
        from tensorfold_core.lanes.stream import Stream

        out = {job.sid: Served() for job in jobs}
        waiting, joined, rounds = list(jobs), {}, 0
        while waiting or not self.engine.idle():
            if time.perf_counter() > self.deadline:  # the rest is not run: cut what is left, compare what ended
                for sid in [job.sid for job in waiting] + list(self.engine.streams):
                    out[sid].cut = True
                    self.engine.cancel(sid)
                waiting = []
            if waiting and len(self.engine.streams) < parallel:
                job = waiting.pop(0)
                prompt = job.request.prompt_ids
                limit = len(prompt) + job.request.max_tokens
                admitted = self.admission.admit(job.sid, prompt, limit)
                if admitted is None:
                    raise RuntimeError(f"stream {job.sid} found no room in a ledger of {BUDGET} bytes")
                cache, cached = admitted
                self.engine.add(Stream(id=job.sid, request=job.request, cache=cache, on_event=out[job.sid].on_event,
                                       limit=limit, cached_tokens=cached))
                joined[job.sid] = (job, rounds)
            for sid, (job, at) in joined.items():
                if job.cancel_after is not None and rounds - at == job.cancel_after:
                    self.engine.cancel(sid)
            if not self.engine.round() and not waiting and not self.engine.idle():
                raise RuntimeError(f"the engine stalled with streams {sorted(self.engine.streams)}")
            rounds += 1
        return out


# ---- the cases ----

def make_requests(tokenizer, n: int, tokens: int, draft: bool) -> list:
    """Prompt i greedy (case 2i) and seeded (case 2i+1); lengths staggered so streams leave at different rounds."""
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.sampling import SamplingParams

    stop = frozenset(tokenizer.eos_ids)
    out = []
    for i, prompt in enumerate(PROMPTS[:n]):
        ids, max_tokens = tokenizer.encode(prompt), tokens + 3 * (i % 4)
        out.append(GenerationRequest(ids, max_tokens, SamplingParams(), stop, draft=draft))
        out.append(GenerationRequest(ids, max_tokens, SamplingParams(temperature=0.8, seed=100 + i), stop,
                                     draft=draft))
    return out


def victims(tokenizer, parallel: int, tokens: int, draft: bool) -> list:
    """Neighbours cancelled mid-run (one per 4 slots): the first while it may still read its prompt, the next
    while decoding; long enough that they are still running then."""
    from tensorfold_core.lanes.types import GenerationRequest

    return [Job(VICTIM_ID + j, GenerationRequest(tokenizer.encode(VICTIMS[j % len(VICTIMS)]), 4 * tokens + 16,
                                                 draft=draft), cancel_after=2 + 3 * j)
            for j in range(max(1, parallel // 4))]


def with_victims(requests: list, neighbours: list[Job], parallel: int, offset: int = 0) -> list[Job]:
    """The cases as jobs, a neighbour joining second and the next after the first wave."""
    jobs = [Job(offset + k, r) for k, r in enumerate(requests)]
    for j, victim in enumerate(neighbours):
        jobs.insert(min(len(jobs), 1 + j * parallel), victim)
    return jobs


def label(case: int) -> str:
    return f"prompt {case // 2} {'greedy' if case % 2 == 0 else 'seeded'}"


class Check:
    """The cases compared against the reference, by run; mismatches name the case and the first differing token."""

    def __init__(self, reference: list[list[int]]):
        self.reference = reference
        self.runs: dict[str, dict] = {}
        self.mismatches: list[str] = []

    def compare(self, run: str, served: dict[int, Served], offset: int = 0) -> None:
        entry = self.runs.setdefault(run, {"cases": 0, "mismatches": 0, "drafted": 0, "accepted": 0,
                                           "cached_tokens": 0, "cancelled": 0, "neighbours": 0,
                                           "cut": 0})
        for sid, s in served.items():
            stats = s.usage.get("tensorfold", {})
            entry["drafted"] += stats.get("drafted", 0)
            entry["accepted"] += stats.get("accepted", 0)
            if sid >= VICTIM_ID and sid < PASS_ID:
                entry["neighbours"] += 1
                entry["cancelled"] += s.finish == "cancelled"
                continue
            case = sid - offset
            if s.cut:
                entry["cut"] += 1
                continue
            entry["cases"] += 1
            entry["cached_tokens"] += s.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            want = self.reference[case]
            if s.error is not None or s.finish is None or s.tokens != want:
                entry["mismatches"] += 1
                self.mismatches.append(f"{run} {label(case)}: {difference(want, s)}")


def difference(want: list[int], served: Served) -> str:
    if served.error is not None:
        return f"failed: {served.error}"
    if served.finish is None:
        return "never finished"
    got = served.tokens
    at = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    show = lambda ids: ids[at] if at < len(ids) else "end"
    return f"first difference at token {at} of {len(want)} (reference {show(want)}, got {show(got)})"


def tok_per_s(served: dict[int, Served], seconds: float) -> float:
    return round(sum(len(s.tokens) for s in served.values()) / max(seconds, 1e-9), 1)


def family_drafter(spec: FamilySpec, target_dir: Path, target, requests: list, reference: list[list[int]],
                   tmp: Path):
    """The family's drafter started in front of the target, and what it is (None, None: the family has none)."""
    from tensorfold_core.loading import start_drafter
    from tensorfold_core.specs import DrafterOptions

    if spec.drafter is None:
        return None, None
    name, what = spec.drafter, spec.drafter
    if spec.drafter == DSPARK:
        mask_id = target.tokenizer.backend.token_to_id("<|mask|>")
        if mask_id is None:
            raise RuntimeError(f"{spec.target}: its tokenizer has no <|mask|> token for a DSpark drafter's blocks")
        seen = [r.prompt_ids + ids for r, ids in zip(requests, reference)]
        name = dspark_checkpoint(target_dir, tmp / f"dspark-for-{spec.target}", mask_id, seen)
        what = "dspark, built here by the dspark tests' helpers, its Markov head taught the references' bigrams"
    return start_drafter(str(name), target.model, target.tokenizer, DrafterOptions(dtype="bfloat16")), what


class Cases:
    """The runs under test, each on a fresh engine (a resumed run's two passes share one), checked as they end."""

    def __init__(self, model, tokenizer, drafter, check: Check, tokens: int, deadline: float):
        self.model, self.tokenizer, self.drafter, self.check, self.tokens = model, tokenizer, drafter, check, tokens
        self.deadline = deadline
        self.servers: list[Server] = []
        self.speeds: dict[str, float] = {}

    def server(self, drafted: bool, resume: bool = False) -> Server:
        self.servers.append(Server(self.model, drafter=self.drafter if drafted else None, resume=resume,
                                   deadline=self.deadline))
        return self.servers[-1]

    def alone(self, run: str, requests: list) -> None:
        start = time.perf_counter()
        served = self.server(requests[0].draft).serve([Job(k, r) for k, r in enumerate(requests)], 1)
        self.done(run, served, 0, start)

    def together(self, run: str, requests: list, parallel: int, server: Server | None = None, offset: int = 0):
        drafted = requests[0].draft
        server = server or self.server(drafted)
        jobs = with_victims(requests, victims(self.tokenizer, parallel, self.tokens, drafted), parallel, offset)
        start = time.perf_counter()
        served = server.serve(jobs, parallel)
        self.speeds[f"{run} tok/s"] = tok_per_s(served, time.perf_counter() - start)
        self.done(run, served, offset, start)

    def done(self, run: str, served: dict[int, Served], offset: int, start: float) -> None:
        """Check the run, and say on stderr how it went (a child cut by its timeout shows how far it got)."""
        self.check.compare(run, served, offset)
        entry = self.check.runs[run]
        print(f"{run}: {entry['cases']} cases, {entry['mismatches']} mismatches, {entry['cut']} cut, "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    def resumed(self, run: str, requests: list, parallel: int) -> None:
        """Two passes through one prompt cache: the first resumes earlier prompts' prefixes, the second each
        prompt's own kept state."""
        server = self.server(requests[0].draft, resume=True)
        for n, offset in enumerate((0, PASS_ID)):
            self.together(f"{run}, pass {n + 1}", requests, parallel, server, offset)


def run_family(name: str, tokens: int, prompts: int, streams: list[int], seconds: float = 0) -> dict:
    """Every case of one family under this process's kernel table mode; the report as a dict. `seconds` > 0: the
    cases still running that long after the start are cut (not compared, counted as cut)."""
    import mlx.core as mx

    from tensorfold_core.loading import load_target, resolve_model
    from tensorfold_core.options import ServeOptions

    spec, started = FAMILIES[name], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-exact-") as tmp:
        target_dir = resolve_model(spec.target)
        if spec.bits:
            target_dir = quantized_copy(target_dir, Path(tmp) / f"{spec.target}-{spec.bits}bit", spec.bits)
        target = load_target(str(target_dir), ServeOptions(dtype="bfloat16"))
        print(f"loaded and probed in {time.perf_counter() - started:.1f} s: {target.probe}", file=sys.stderr,
              flush=True)
        model, tokenizer = target.model, target.tokenizer
        report = {"family": name, "target": spec.target + (f", quantized here to {spec.bits} bits" if spec.bits
                                                          else ""),
                  "device": str(mx.default_device()), "kernels": model.kernels, "probe": target.probe}

        serial = make_requests(tokenizer, prompts, tokens, draft=False)
        reference = Server(model, chunk=REFERENCE_CHUNK)
        reference.serve([Job(0, serial[0])], 1)  # a warm-up: kernels built on first use are not timed
        start = time.perf_counter()
        solo = reference.serve([Job(k, r) for k, r in enumerate(serial)], 1)
        report["plain tok/s (alone, prefill included)"] = tok_per_s(solo, time.perf_counter() - start)
        print(f"solo reference: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        failed = [f"{label(k)}: {s.error}" for k, s in solo.items() if s.error is not None]
        if failed:
            raise RuntimeError(f"the serial solo reference failed: {'; '.join(failed)}")
        check = Check([solo[k].tokens for k in range(len(serial))])

        drafter, report["drafter"] = family_drafter(spec, target_dir, target, serial, check.reference, Path(tmp))
        drafted = make_requests(tokenizer, prompts, tokens, draft=True)
        cases = Cases(model, tokenizer, drafter, check, tokens, started + seconds if seconds else float("inf"))
        if drafter is not None:
            cases.alone("drafted alone", drafted)
        for parallel in streams:
            cases.together(f"plain {parallel} together", serial, parallel)
            if drafter is not None:
                cases.together(f"drafted {parallel} together", drafted, parallel)
        cases.resumed(f"resumed plain {streams[0]} together", serial, streams[0])
        if drafter is not None:
            cases.resumed(f"resumed drafted {streams[0]} together", drafted, streams[0])
            if getattr(drafter, "stats", {}).get("ahead"):  # TENSORFOLD_HOLD_AHEAD=1: holds queued, and taken
                report["holds ahead (queued/taken)"] = f"{drafter.stats['ahead']}/{drafter.stats['ahead_used']}"
            drafter.close()
    report.update(cases=sum(r["cases"] for r in check.runs.values()), mismatches=check.mismatches,
                  cut=sum(r["cut"] for r in check.runs.values()), runs=check.runs, speeds=cases.speeds,
                  rounds=sum(s.engine.rounds for s in [reference, *cases.servers]),
                  seconds=round(time.perf_counter() - started, 1))
    return report
