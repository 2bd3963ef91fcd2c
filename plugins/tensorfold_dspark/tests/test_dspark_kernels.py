"""The drafter's own ops under the kernel contract on the CPU: the Markov pick passes, its controls go red."""

from __future__ import annotations

from tensorfold_contract import run_contract


def test_the_markov_pick_passes_gates_1_to_4_and_every_planted_control_is_red():
    report = run_contract(only=["dspark markov pick"], seed=20261201)
    (kernel,) = report.kernels
    mlx = kernel.implementations["mlx"]
    assert kernel.name == "dspark markov pick" and mlx.status == "pass"
    assert [mlx.gates[g].status for g in (1, 2, 3, 4)] == ["pass"] * 4
    ran = [c for c in kernel.controls if not c.status.startswith("not run")]  # cuda and metal need their device
    assert len(ran) >= 2 and all(c.status == "red" for c in ran)
    assert report.summary()["missed"] == 0
