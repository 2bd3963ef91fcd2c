"""Each record in a child process of its own: a crash in MLX or in a kernel fails that step, not the whole run.

The parent spawns `python -m tensorfold_contract --child SPEC` for one record and the steps it still owes: each
implementation this device runs, with the controls planted into it, in a child of its own beside the others'. The
child finds the same record through the installed entry points, runs the steps in order and reports on a pipe:
each step's start, the gate and shape it is on, each finished gate, each finished step. When the child dies (a
signal, or an exit before its last step), the step it was on fails with what killed it and where (faulthandler's
innermost frame), and a fresh child takes the steps that remain.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from . import devices, gates
from .gates import GateResult
from .registry import Registered, discover
from .report import ControlResult, ImplResult, KernelResult
from .steps import PART, Step, finish_implementation, join_parts, new_result, place, record_steps, run_step, step_name


def _step(value) -> Step:
    """A step as it crossed the pipe: a JSON list [kind, control index or null, an implementation part's gates or
    null]."""
    part = value[2] if len(value) > 2 else None
    return Step(str(value[0]), None if value[1] is None else int(value[1]), None if part is None else tuple(part))


class _Child:
    """One child process over a record's remaining steps, and everything it reported before it ended."""

    def __init__(self, index: int, name: str, seed: int, steps: list[Step]):
        self.spec = {"index": index, "name": name, "seed": seed, "steps": [list(s) for s in steps]}
        self.done: dict = {}  # step -> its result, as JSON
        self.started: Step | None = None
        self.gates: dict[int, GateResult] = {}  # the gates the started implementation finished
        self.at: tuple[int, str] | None = None  # the gate and shape the started step was on
        self.error = ""
        self.rc: int | None = None
        self.log = ""

    def run(self, progress: Callable[[str], None] | None, describe: Callable[[Step], str]) -> None:
        read, write = os.pipe()
        spec = dict(self.spec, fd=write)
        with tempfile.TemporaryFile(mode="w+") as log:
            try:
                proc = subprocess.Popen([sys.executable, "-m", "tensorfold_contract", "--child", json.dumps(spec)],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        pass_fds=(write,))
            finally:
                os.close(write)
            with os.fdopen(read) as events:
                for line in events:
                    self._event(json.loads(line), progress, describe)
            self.rc = proc.wait()
            log.seek(0)
            self.log = log.read()

    def _event(self, event: dict, progress, describe) -> None:
        if "start" in event:
            self.started, self.gates, self.at = _step(event["start"]), {}, None
            if progress:
                progress(describe(self.started))
        elif "at" in event:
            self.at = (int(event["at"][0]), str(event["at"][1]))
        elif "gate" in event:
            self.gates[int(event["gate"])] = GateResult.from_json(int(event["gate"]), event["result"])
        elif "done" in event:
            self.done[_step(event["done"])] = event["result"]
        elif "error" in event:
            self.error = event["error"]

    def why(self) -> str:
        """What ended the child: its signal or exit status, and where (faulthandler's innermost frame)."""
        if self.error:
            return self.error
        if self.rc is not None and self.rc < 0:
            try:
                name = signal.Signals(-self.rc).name
            except ValueError:
                name = "unknown signal"
            what = f"crashed (signal {-self.rc}, {name})"
        else:
            what = f"the isolated process exited {self.rc} before this step ended"
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', self.log.split("most recent call first")[-1])
        if frames:
            path, line, func = frames[0]
            what += f" in {func}() at {os.path.basename(path)}:{line}"
        else:
            last = [ln for ln in self.log.strip().splitlines() if ln.strip()][-1:]
            what += f": {last[0][:300]}" if last else ""
        return what


def _crashed(reg: Registered, step: Step, device: devices.Device, child: _Child, ran_gates: dict):
    """The step a child died on: its finished gates kept, the gate it was in red with why, the rest not run."""
    record = reg.record
    why = child.why()
    gate, label = child.at or (1, None)
    if step.control is not None:
        control = record.controls[step.control]
        where = f" in gate {gate}" + (f" on {label}" if label else "") if child.at else ""
        return ControlResult(control.name, control.kind, control.gate, "missed", f"{why}{where}")
    results = dict(ran_gates)
    order = [1, *(step.gates or (2, 3, 4))]  # the gates this step runs
    while gate in results and gate in order[:-1]:  # it died between gates: blame the next
        gate, label = order[order.index(gate) + 1], None
    text = f"{label}: {why}" if label else why
    results[gate] = GateResult(gate, "fail", text, failures=[(label, text)])
    for later in order[order.index(gate) + 1:] if gate in order else ():
        results.setdefault(later, GateResult(later, f"not run (crashed in gate {gate})"))
    if step.gates is not None:  # a part: `join_parts` finishes the implementation
        return ImplResult(step.kind, PART, results, [], 0.0)
    return finish_implementation(record, step.kind, device, results, 0.0)


def run_record_isolated(reg: Registered, index: int, device: devices.Device, seed: int,
                        progress: Callable[[str], None] | None = None) -> KernelResult:
    """One record's steps in child processes: each implementation this device runs, with its controls, in a lane of
    its own beside the others; in a lane one child while nothing crashes, a fresh one after each crash."""
    result = new_result(reg)
    record = reg.record
    if record is None or not record.shapes:
        return result
    steps = record_steps(record)
    outcomes: dict = {}
    # on a GPU MLX compiles its own kernels a shape, most of them in gate 3's edge shapes: that gate gets a lane
    split = ("mlx",) if device.backend != "cpu" and record.edges else ()
    lanes = lanes_of(steps, device.runs, split)
    with ThreadPoolExecutor(len(lanes)) as pool:  # the threads only wait on their children's pipes
        for done in pool.map(lambda lane: _run_lane(reg, index, device, seed, lane, progress), lanes):
            outcomes.update(done)
    for step in steps:
        parts = [(s.gates, outcome) for s, outcome in outcomes.items()
                 if s.gates is not None and step.control is None and s.kind == step.kind]
        place(result, step, join_parts(record, step.kind, device, parts) if parts else outcomes[step])
    return result


def lanes_of(steps: list[Step], runs: tuple[str, ...], split: tuple[str, ...] = ()) -> list[list[Step]]:
    """A record's steps by the implementation they run (its controls with it), in record order; kinds this device
    cannot run (they meet gate 5 alone) join the first lane. A `split` kind's gate 3 runs in a lane of its own, its
    gates 2 and 4 (and controls) in the kind's lane."""
    # a record's slowest implementation sets its time (on CUDA, MLX's own quantized_matmul compiling a kernel a
    # shape), so the others run beside it rather than after it
    lanes: dict[tuple, list[Step]] = {}
    for step in steps:
        kind = step.kind if step.kind in runs else steps[0].kind
        if step.control is None and step.kind in split and step.kind in runs:
            lanes.setdefault((kind,), []).append(Step(step.kind, None, (2, 4)))
            lanes.setdefault((kind, 3), []).append(Step(step.kind, None, (3,)))
        else:
            lanes.setdefault((kind,), []).append(step)
    return list(lanes.values())


def _run_lane(reg: Registered, index: int, device: devices.Device, seed: int, steps: list[Step],
              progress: Callable[[str], None] | None) -> dict:
    """Steps of one record in child processes, in order; each step's outcome."""
    record = reg.record
    outcomes: dict = {}
    pending = list(steps)
    while pending:
        child = _Child(index, record.name, seed, pending)
        child.run(progress, lambda step: step_name(record, step))
        for step, data in child.done.items():
            outcomes[step] = ImplResult.from_json(step.kind, data) if step.control is None \
                else ControlResult.from_json(data)
        pending = [s for s in pending if s not in outcomes]
        if not pending:
            break
        if child.started not in pending:  # it died before it began a step: nothing a fresh child would change
            for step in pending:
                outcomes[step] = _unstarted(reg, step, device, child.why())
            break
        outcomes[child.started] = _crashed(reg, child.started, device, child, child.gates)
        pending.remove(child.started)
    return outcomes


def _unstarted(reg: Registered, step: Step, device: devices.Device, why: str):
    record = reg.record
    if step.control is not None:
        control = record.controls[step.control]
        return ControlResult(control.name, control.kind, control.gate, "missed", f"never ran: {why}")
    results = {g: GateResult(g, "fail", f"never ran: {why}") if g == 1 else GateResult(g, "not run (never ran)")
               for g in (1, 2, 3, 4)}
    return finish_implementation(record, step.kind, device, results, 0.0)


def child_main(spec: dict) -> int:
    """The child: run the named record's steps, reporting each on the pipe the parent passed."""
    import faulthandler

    faulthandler.enable()  # a crash writes the Python stack to the log the parent reads
    with os.fdopen(spec["fd"], "w", buffering=1) as pipe:
        def emit(event: dict) -> None:
            pipe.write(json.dumps(event) + "\n")
            pipe.flush()

        found = discover()
        index = spec["index"]
        reg = found[index] if 0 <= index < len(found) else None
        if reg is None or reg.record is None or reg.record.name != spec["name"]:
            emit({"error": f"the isolated process found no record {spec['name']!r} at {index} (the installed "
                           f"plugins changed?)"})
            return 3
        record = reg.record
        device = devices.current()
        inputs = gates.Inputs(record, spec["seed"])
        def on_shape(gate: int, label: str) -> None:
            emit({"at": [gate, label]})

        def on_gate(gate: int, result: GateResult) -> None:
            emit({"gate": gate, "result": {**result.as_json(), "failures": [list(f) for f in result.failures]}})

        for step in map(_step, spec["steps"]):
            emit({"start": list(step)})
            outcome = run_step(record, step, device, inputs, on_gate, on_shape)
            emit({"done": list(step), "result": outcome.as_json()})
    return 0
