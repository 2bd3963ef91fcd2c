"""The runner: records from every installed plugin, gates on each implementation this device runs, controls."""

from __future__ import annotations

import fnmatch
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from . import devices, gates
from .gates import GateResult
from .record import KINDS, KernelRecord, Source
from .report import ControlResult, ImplResult, KernelResult, Report


@dataclass
class Registered:
    """A record with the plugin and distribution that registered it (what `--only` may name)."""

    record: KernelRecord | None
    plugin: str
    distribution: str | None
    error: str = ""  # the plugin's hook failed, or returned something that is not a KernelRecord

    def names(self) -> list[str]:
        out = [self.plugin]
        if self.record is not None:
            out += [self.record.name, self.record.family]
        if self.distribution:
            out += [self.distribution, self.distribution.replace("-", "_")]
        return [n.lower() for n in out]

    def matches(self, patterns: Iterable[str]) -> bool:
        return any(fnmatch.fnmatchcase(n, p.lower()) for p in patterns for n in self.names())


def discover(pm=None) -> list[Registered]:
    """Every record each installed plugin registers through `tensorfold_kernels`, in plugin order."""
    if pm is None:
        from tensorfold_core.plugins import new_plugin_manager  # core's registry: entry points of "tensorfold"

        pm = new_plugin_manager()
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    found = []
    for hookimpl in reversed(pm.hook.tensorfold_kernels.get_hookimpls()):  # pluggy keeps them last-first
        dist = dists.get(id(hookimpl.plugin))
        dist_name = dist.metadata["name"] if dist else None
        try:
            records = list(hookimpl.function() or [])
        except Exception as exc:  # a broken plugin is reported, not allowed to stop the others' proof
            found.append(Registered(None, hookimpl.plugin_name, dist_name,
                                    f"tensorfold_kernels() raised {type(exc).__name__}: {exc}"))
            continue
        for record in records:
            if isinstance(record, KernelRecord):
                found.append(Registered(record, hookimpl.plugin_name, dist_name))
            else:
                found.append(Registered(None, hookimpl.plugin_name, dist_name,
                                        f"tensorfold_kernels() returned {type(record).__name__}, not a KernelRecord"))
    return found


def _shapes(shapes, kind: str, device: devices.Device) -> tuple[list, int]:
    """The shapes this implementation runs here: heavy ones wait for a GPU (composed ops on the CPU backend)."""
    if kind == "mlx" and device.backend == "cpu":
        light = [s for s in shapes if not s.heavy]
        return light, len(shapes) - len(light)
    return list(shapes), 0


def _gates_1_to_4(record: KernelRecord, kind: str, impl, device, inputs: gates.Inputs,
                  wanted: tuple[int, ...] = (2, 3, 4)) -> dict[int, GateResult]:
    """Gate 1, then the wanted gates of 2..4 (a control asks only for its own)."""
    served, heavy = _shapes(record.shapes, kind, device)
    edges, _ = _shapes(record.edges, kind, device)
    if not served:
        why = f"all {heavy} served shapes are heavy (left to a GPU)"
        return {g: GateResult(g, "not run", why) for g in (1, *wanted)}
    results = {1: gates.gate_build(record, kind, impl, served, inputs)}
    if results[1].status != "pass":
        return {**results, **{g: GateResult(g, "not run", "gate 1 is red") for g in wanted}}
    if 2 in wanted:
        results[2] = gates.gate_match(2, record, kind, impl, served, inputs)
        if heavy:
            results[2].detail += f"; {heavy} heavy shapes left to a GPU"
    if 3 in wanted:
        results[3] = (gates.gate_match(3, record, kind, impl, edges, inputs) if edges
                      else GateResult(3, "pass", "no edge shapes recorded"))
    if 4 in wanted:
        runnable = {k: v for k, v in record.implementations.items() if k in device.runs}
        results[4] = gates.gate_bits(record, kind, impl, served, inputs, runnable)
    return results


def run_implementation(record: KernelRecord, kind: str, device: devices.Device, inputs: gates.Inputs) -> ImplResult:
    impl = record.implementations[kind]
    t0 = time.perf_counter()
    if kind in device.runs:
        results = _gates_1_to_4(record, kind, impl, device, inputs)
    else:
        results = {g: GateResult(g, device.reason_not_run(kind)) for g in (1, 2, 3, 4)}
    results[5] = gates.gate_limits(record, kind, impl, device)
    known = []
    for g in (1, 2, 3, 4):
        finding = next((f for f in record.findings if f.matches(kind, g, device.backend)), None)
        if results[g].status == "fail" and finding is not None:
            results[g].status = "known"
            results[g].detail += f" [known finding: {finding.note}]"
            known.append(finding.note)
    if kind not in device.runs:
        status = device.reason_not_run(kind)
    elif any(results[g].status == "fail" for g in (1, 2, 3, 4)):
        status = "fail"
    elif any(results[g].status == "not run" for g in (1, 2, 3, 4)):
        status = "not run"
    else:
        status = "known findings" if known else "pass"
    return ImplResult(kind, status, results, known, time.perf_counter() - t0)


def run_control(record: KernelRecord, index: int, device: devices.Device, inputs: gates.Inputs) -> ControlResult:
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
        ran = _gates_1_to_4(record, control.kind, planted, device, inputs, wanted=(control.gate,))
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


def run_record(reg: Registered, device: devices.Device, seed: int,
               progress: Callable[[str], None] | None = None) -> KernelResult:
    record = reg.record
    if record is None:
        return KernelResult(f"({reg.plugin})", "?", reg.plugin, reg.distribution, problems=[reg.error])
    # a record that breaks a rule still runs all it can, so its author sees everything at once; it fails anyway
    result = KernelResult(record.name, record.family, reg.plugin, reg.distribution, problems=record.problems())
    if not record.shapes:
        return result
    inputs = gates.Inputs(record, seed)  # dropped with the record: heavy shapes hold hundreds of MB
    for kind in (k for k in record.implementations if k in KINDS):
        if progress:
            progress(f"{record.name} [{kind}]")
        result.implementations[kind] = run_implementation(record, kind, device, inputs)
    for i, control in enumerate(record.controls):
        if control.kind in result.implementations and control.gate in (2, 3, 4, 5):
            if progress:
                progress(f"{record.name} control {control.name!r}")
            result.controls.append(run_control(record, i, device, inputs))
    return result


def run_contract(only: Iterable[str] = (), seed: int | None = None, pm=None, device: devices.Device | None = None,
                 progress: Callable[[str], None] | None = None) -> Report:
    """Run every registered record (or those `only` names: kernel, family, plugin or distribution; globs allowed)."""
    only = list(only)
    seed = secrets.randbits(32) if seed is None else seed
    device = device or devices.current()
    found = discover(pm)
    chosen = [r for r in found if not only or r.matches(only)]
    if only and not chosen:
        known = sorted({n for r in found for n in (r.plugin, r.record.family if r.record else r.plugin)})
        raise NoMatch(only, known)
    report = Report(device=device, seed=seed, only=only, registered=len(found))
    for reg in chosen:
        report.kernels.append(run_record(reg, device, seed, progress))
    return report


class NoMatch(ValueError):
    """`--only` named nothing that is registered."""

    def __init__(self, only: list, known: list):
        super().__init__(f"--only {' '.join(only)} matches no kernel, family, plugin or distribution "
                         f"(registered: {', '.join(known) or 'none'})")
