"""A record's steps (each implementation's gates, then each control) and their outcomes, in or out of a child."""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from . import devices, gates
from .gates import GateResult, OnShape
from .record import KINDS, KernelRecord, Source
from .registry import Registered
from .report import ControlResult, ImplResult, KernelResult

OnGate = Callable[[int, GateResult], None]  # hears each gate of an implementation as it ends


PART = "part"  # an implementation part's status until `join_parts` finishes the whole


class Step(NamedTuple):
    """One thing a record runs: its `kind` implementation, or the control at index `control` planted into it; an
    implementation's `gates` of 2-4 alone where it runs in parts side by side (gate 1 builds in each part)."""

    kind: str
    control: int | None = None
    gates: tuple[int, ...] | None = None


def record_steps(record: KernelRecord) -> list[Step]:
    """Each implementation of a known kind, then each control planted into one of them, in record order."""
    kinds = [k for k in record.implementations if k in KINDS]
    return [Step(k) for k in kinds] + [Step(c.kind, i) for i, c in enumerate(record.controls)
                                       if c.kind in kinds and c.gate in (2, 3, 4, 5)]


def step_name(record: KernelRecord, step: Step) -> str:
    if step.control is None:
        part = f" gate{'s' if len(step.gates) > 1 else ''} {', '.join(map(str, step.gates))}" if step.gates else ""
        return f"{record.name} [{step.kind}]{part}"
    return f"{record.name} control {record.controls[step.control].name!r}"


def run_step(record: KernelRecord, step: Step, device: devices.Device, inputs: gates.Inputs,
             on_gate: OnGate | None = None, on_shape: OnShape | None = None):
    if step.control is None and step.gates is not None:
        return run_part(record, step.kind, step.gates, device, inputs, on_gate, on_shape)
    if step.control is None:
        return run_implementation(record, step.kind, device, inputs, on_gate, on_shape)
    return run_control(record, step.control, device, inputs, on_shape)


def new_result(reg: Registered) -> KernelResult:
    record = reg.record
    if record is None:
        return KernelResult(f"({reg.plugin})", "?", reg.plugin, reg.distribution, problems=[reg.error])
    # a record that breaks a rule still runs all it can, so its author sees everything at once; it fails anyway
    return KernelResult(record.name, record.family, reg.plugin, reg.distribution, problems=record.problems())


def place(result: KernelResult, step: Step, outcome) -> None:
    if step.control is None:
        result.implementations[step.kind] = outcome
    else:
        result.controls.append(outcome)


def run_record(reg: Registered, device: devices.Device, seed: int,
               progress: Callable[[str], None] | None = None) -> KernelResult:
    """One record's steps in this process, in order."""
    result = new_result(reg)
    record = reg.record
    if record is None or not record.shapes:
        return result
    inputs = gates.Inputs(record, seed)  # dropped with the record: heavy shapes hold hundreds of MB
    for step in record_steps(record):
        if progress:
            progress(step_name(record, step))
        place(result, step, run_step(record, step, device, inputs))
    return result


def _shapes(shapes, kind: str, device: devices.Device) -> tuple[list, int]:
    """The shapes this implementation runs here: heavy ones wait for a GPU (composed ops on the CPU backend)."""
    if kind == "mlx" and device.backend == "cpu":
        light = [s for s in shapes if not s.heavy]
        return light, len(shapes) - len(light)
    return list(shapes), 0


def _gates_1_to_4(record: KernelRecord, kind: str, impl, device, inputs: gates.Inputs,
                  wanted: tuple[int, ...] = (2, 3, 4), every: bool = False,
                  on_gate: OnGate | None = None, on_shape: OnShape | None = None) -> dict[int, GateResult]:
    """Gate 1, then the wanted gates of 2..4 (a control asks only for its own; it stops at its first red shape,
    an implementation runs `every` shape so each red one is named). `on_gate` hears each gate as it ends."""
    served, heavy = _shapes(record.shapes, kind, device)
    edges, _ = _shapes(record.edges, kind, device)
    if not served:
        why = f"all {heavy} served shapes are heavy (left to a GPU)"
        return {g: GateResult(g, "not run", why) for g in (1, *wanted)}
    results: dict[int, GateResult] = {}
    clock = [time.perf_counter()]

    def done(gate: int, result: GateResult) -> None:
        now = time.perf_counter()  # where a record's time goes, gate by gate (on CUDA MLX's compiles dominate)
        result.seconds, clock[0] = now - clock[0], now
        results[gate] = result
        if on_gate is not None:
            on_gate(gate, result)

    done(1, gates.gate_build(record, kind, impl, served, inputs, on_shape))
    if results[1].status != "pass":
        return {**results, **{g: GateResult(g, "not run", "gate 1 is red") for g in wanted}}

    def each(gate: int) -> bool:  # name every red shape, unless one finding excuses them all here
        return every and not _blanket(record, kind, gate, device)

    if 2 in wanted:
        result = gates.gate_match(2, record, kind, impl, served, inputs, each(2), on_shape)
        if heavy:
            result.detail += f"; {heavy} heavy shapes left to a GPU"
        done(2, result)
    if 3 in wanted:
        done(3, gates.gate_match(3, record, kind, impl, edges, inputs, each(3), on_shape) if edges
             else GateResult(3, "pass", "no edge shapes recorded"))
    if 4 in wanted:
        runnable = {k: v for k, v in record.implementations.items() if k in device.runs}
        done(4, gates.gate_bits(record, kind, impl, served, inputs, runnable, each(4), on_shape))
    return results


def _blanket(record: KernelRecord, kind: str, gate: int, device: devices.Device) -> bool:
    """Whether a finding excuses every red shape of this gate here (no case, no symptom named): then naming each
    red shape tells nothing more, and the gate stops at its first (on CUDA, MLX's quantized_matmul over 128 row
    counts of every served shape took most of the contract's time)."""
    return any(f.case is None and f.symptom is None and f.matches(kind, gate, device.backend, mlx=device.mlx)
               for f in record.findings)


def run_implementation(record: KernelRecord, kind: str, device: devices.Device, inputs: gates.Inputs,
                       on_gate: OnGate | None = None, on_shape: OnShape | None = None) -> ImplResult:
    impl = record.implementations[kind]
    t0 = time.perf_counter()
    if kind in device.runs:
        results = _gates_1_to_4(record, kind, impl, device, inputs, every=True, on_gate=on_gate, on_shape=on_shape)
    else:
        results = {g: GateResult(g, device.reason_not_run(kind)) for g in (1, 2, 3, 4)}
    return finish_implementation(record, kind, device, results, time.perf_counter() - t0)


def run_part(record: KernelRecord, kind: str, wanted: tuple[int, ...], device: devices.Device, inputs: gates.Inputs,
             on_gate: OnGate | None = None, on_shape: OnShape | None = None) -> ImplResult:
    """Gate 1 and the `wanted` gates of one implementation, unfinished (`join_parts` finishes the whole); the part
    with gate 2 checks gate 5 too."""
    impl = record.implementations[kind]
    t0 = time.perf_counter()
    results = _gates_1_to_4(record, kind, impl, device, inputs, wanted, every=True, on_gate=on_gate,
                            on_shape=on_shape)
    if 2 in wanted:
        results[5] = gates.gate_limits(record, kind, impl, device)
    return ImplResult(kind, PART, results, [], time.perf_counter() - t0)


def join_parts(record: KernelRecord, kind: str, device: devices.Device,
               parts: list[tuple[tuple[int, ...], ImplResult]]) -> ImplResult:
    """One implementation from its parts, each `(gates, result)`: the gates of the part with gate 2 (gate 1 and 5
    among them), each other part's own gates over them, then finished as a whole; its seconds the longest part's
    (they ran side by side)."""
    parts = sorted(parts, key=lambda part: 2 not in part[0])
    results = dict(parts[0][1].gates)
    for wanted, part in parts[1:]:
        for gate in wanted:
            results[gate] = part.gates.get(gate, GateResult(gate, "not run (its part never reached it)"))
    return finish_implementation(record, kind, device, results, max(part.seconds for _, part in parts))


def _excuse(record: KernelRecord, kind: str, result: GateResult, device: devices.Device) -> list[str]:
    """Mark a red gate known when a finding matches each of its red shapes; the notes of the findings used."""
    if result.status != "fail" or not record.findings:
        return []
    notes, texts, covered = [], [], True
    for label, text in result.failures or [(None, result.detail)]:
        finding = next((f for f in record.findings
                        if f.matches(kind, result.gate, device.backend, label, text, device.mlx)), None)
        if finding is not None:
            texts.append(f"{text} [known finding: {finding.note}]")
            notes += [finding.note] if finding.note not in notes else []
            continue
        covered = False
        elsewhere = next((f for f in record.findings
                          if f.matches(kind, result.gate, device.backend, label, text, any_version=True)), None)
        texts.append(text + (f" [a known finding matches on mlx {', '.join(elsewhere.versions())}, not on mlx "
                             f"{device.mlx}: re-check it there]" if elsewhere else ""))
    result.detail = "; ".join(texts)
    if not covered:
        return []
    result.status = "known"
    return notes


def finish_implementation(record: KernelRecord, kind: str, device: devices.Device, results: dict,
                          seconds: float) -> ImplResult:
    """Gate 5, the known findings, and the implementation's status from its gates."""
    if 5 not in results:
        results[5] = gates.gate_limits(record, kind, record.implementations[kind], device)
    known = []
    for g in (1, 2, 3, 4):
        if g in results:
            known += _excuse(record, kind, results[g], device)  # one per finding per gate it excuses
    if kind not in device.runs:
        status = device.reason_not_run(kind)
    elif any(results[g].status == "fail" for g in (1, 2, 3, 4)):
        status = "fail"
    elif any(results[g].status == "not run" for g in (1, 2, 3, 4)):
        status = "not run"
    else:
        status = "known findings" if known else "pass"
    return ImplResult(kind, status, results, known, seconds)


def run_control(record: KernelRecord, index: int, device: devices.Device, inputs: gates.Inputs,
                on_shape: OnShape | None = None) -> ControlResult:
    """Plant one defect and expect its gate red; green there is 'missed', and so is a planted build failure."""
    control = record.controls[index]
    result = ControlResult(control.name, control.kind, control.gate, "missed")
    try:
        planted = control.plant(record.implementations[control.kind])
    except Exception as exc:  # a control that no longer applies (its source text moved) proves nothing
        result.detail = f"could not be planted: {type(exc).__name__}: {exc}"
        return result
    if control.gate == 5:
        if not isinstance(planted, Source):
            result.detail = "gate 5 checks sources only; plant it into a cuda or metal source"
            return result
        gate = gates.gate_limits(record, control.kind, planted, device)
    elif control.kind not in device.runs:
        result.status, result.detail = device.reason_not_run(control.kind), ""
        return result
    else:
        ran = _gates_1_to_4(record, control.kind, planted, device, inputs, wanted=(control.gate,),
                            on_shape=on_shape)
        if ran[1].status != "pass":
            result.detail = f"gate 1 went red instead (the planted variant did not build): {ran[1].detail}"
            return result
        gate = ran[control.gate]
    result.detail = gate.detail
    if gate.status == "fail":
        result.status = "red"
    elif gate.status == "pass":
        result.detail = f"gate {control.gate} stayed green: {gate.detail}"
    elif gate.status == "not run":  # e.g. every served shape is heavy: nothing here could catch it
        result.status, result.detail = f"not run ({gate.detail})", ""
    return result
