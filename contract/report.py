"""The contract's report: one line per kernel and implementation, the control lines, the SUMMARY and the JSON."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ImplResult:
    """One implementation's gates; status is pass, fail, known findings, or not run (and why)."""

    kind: str
    status: str
    gates: dict
    known: list = field(default_factory=list)
    seconds: float = 0.0

    def not_run_why(self) -> str | None:
        """Why this implementation did not run here ("no CUDA device", ...), or None where it ran."""
        if not self.status.startswith("not run"):
            return None
        if self.status.startswith("not run ("):
            return self.status[len("not run ("):-1]
        gate = self.gates.get(1)  # e.g. every served shape heavy: gate 1 says so
        return gate.detail if gate is not None and gate.detail else "not run"

    def limit_problems(self) -> set[str]:
        gate = self.gates.get(5)
        return {name for name, _ in gate.problems} if gate is not None else set()

    def as_json(self) -> dict:
        return {"status": self.status, "gates": {str(g): r.as_json() for g, r in sorted(self.gates.items())},
                "known_findings": self.known, "seconds": round(self.seconds, 3)}

    @classmethod
    def from_json(cls, kind: str, data: dict) -> "ImplResult":
        from .gates import GateResult

        gates = {int(g): GateResult.from_json(int(g), r) for g, r in data["gates"].items()}
        return cls(kind, data["status"], gates, list(data.get("known_findings", [])), data.get("seconds", 0.0))


@dataclass
class ControlResult:
    """One planted defect: red (its gate caught it), missed (it did not), or not run here."""

    name: str
    kind: str
    gate: int
    status: str
    detail: str = ""

    def as_json(self) -> dict:
        return {"name": self.name, "implementation": self.kind, "gate": self.gate, "status": self.status,
                "detail": self.detail}

    @classmethod
    def from_json(cls, data: dict) -> "ControlResult":
        return cls(data["name"], data["implementation"], data["gate"], data["status"], data.get("detail", ""))


@dataclass
class KernelResult:
    """One record's outcome: its implementations, its controls, and any reason it could not run."""

    name: str
    family: str
    plugin: str
    distribution: str | None
    implementations: dict = field(default_factory=dict)
    controls: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    @property
    def status(self) -> str:
        states = [r.status for r in self.implementations.values()]
        if self.problems or "fail" in states:
            return "fail"
        return "pass" if any(s in ("pass", "known findings") for s in states) else "not run"

    def as_json(self) -> dict:
        return {"name": self.name, "family": self.family, "plugin": self.plugin, "distribution": self.distribution,
                "status": self.status, "problems": self.problems,
                "implementations": {k: r.as_json() for k, r in self.implementations.items()},
                "controls": [c.as_json() for c in self.controls]}


@dataclass
class Report:
    """Everything one contract run found, and the one line that sums it up."""

    device: object
    seed: int
    only: list
    registered: int
    kernels: list = field(default_factory=list)
    isolated: bool = False  # each record ran in a child process of its own

    def summary(self) -> dict:
        ran = [c for k in self.kernels for c in k.controls if c.status in ("red", "missed")]
        not_run: dict[str, int] = {}
        for why in sorted(w for k in self.kernels for r in k.implementations.values() if (w := r.not_run_why())):
            not_run[why] = not_run.get(why, 0) + 1
        return {
            "kernels": len(self.kernels),
            "pass": sum(k.status == "pass" for k in self.kernels),
            "not_run": not_run,  # implementations that did not run here, by why: not counted as passing
            "fail": sum(k.status == "fail" for k in self.kernels),
            "known_findings": sum(len(r.known) for k in self.kernels for r in k.implementations.values()),
            "controls": len(ran),
            "red": sum(c.status == "red" for c in ran),
            "missed": sum(c.status == "missed" for c in ran),
            "limit_problems": sum(len(r.limit_problems()) for k in self.kernels for r in k.implementations.values()),
        }

    @property
    def ok(self) -> bool:
        s = self.summary()
        return s["fail"] == 0 and s["missed"] == 0

    def summary_line(self) -> str:
        return summary_line(self.summary())

    def lines(self) -> list[str]:
        out = [f"tensorfold contract on {self.device.name} ({self.device.backend}, mlx {self.device.mlx}), "
               f"seed {self.seed}" + (", each record isolated" if self.isolated else "")]
        width = max([len(k.name) for k in self.kernels] + [10])
        for k in self.kernels:
            for problem in k.problems:
                out.append(f"{k.name:<{width}}  -      fail  {problem}")
            for kind, r in k.implementations.items():
                marks = "  ".join(f"{g}:{r.gates[g].status}" for g in sorted(r.gates)
                                  if not r.gates[g].status.startswith("not run ("))
                out.append(f"{k.name:<{width}}  {kind:<5}  {r.status}  {marks}".rstrip())
                for g in sorted(r.gates):
                    if r.gates[g].status in ("fail", "known"):
                        out.append(f"{'':<{width}}    gate {g}: {r.gates[g].detail}")
            for c in k.controls:
                verdict = {"red": "red as planted", "missed": "MISSED"}.get(c.status, c.status)
                line = f"{'':<{width}}    control [{c.kind}] {c.name} -> gate {c.gate}: {verdict}"
                out.append(line + (f" ({c.detail})" if c.status == "missed" and c.detail else ""))
        out.append(self.summary_line())
        return out

    def as_json(self) -> dict:
        return {"summary": self.summary(), "ok": self.ok, "seed": self.seed, "only": self.only,
                "isolated": self.isolated,
                "kernels": [k.as_json() for k in self.kernels], "device": self.device.as_json()}


def summary_line(s: dict) -> str:
    """The SUMMARY line of a report's summary (the H200 script rebuilds it from the JSON with this)."""
    passed = f"{s['pass']} pass gates 1-4"
    not_run = s.get("not_run") or {}
    if not_run:
        n = sum(not_run.values())
        why = next(iter(not_run)) if len(not_run) == 1 else ", ".join(f"{c} {w}" for w, c in not_run.items())
        passed += f" where they ran ({n} implementation{'' if n == 1 else 's'} not run: {why})"
    return (f"SUMMARY {s['kernels']} kernels: {passed}, {s['fail']} fail, {s['known_findings']} known findings; "
            f"{s['controls']} controls: {s['red']} red as planted, {s['missed']} missed; "
            f"{s['limit_problems']} limit problems")
