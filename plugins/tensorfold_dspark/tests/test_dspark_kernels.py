"""The drafter's own ops under the kernel contract on the CPU: each record's mlx implementation passes, and every
planted control that runs without a device goes red."""

from __future__ import annotations

import pytest

from tensorfold_contract import run_contract


@pytest.mark.parametrize("name, seed", [("dspark markov pick", 20261201), ("dspark block attention", 20261202),
                                        ("dspark confidence head", 20261202), ("dspark tap copy", 20261203),
                                        ("dspark draft ids", 20261204),
                                        ("dspark block attention streams", 20261205)])
def test_each_drafter_record_passes_gates_1_to_4_and_every_control_that_runs_here_is_red(name, seed):
    report = run_contract(only=[name], seed=seed)
    (kernel,) = report.kernels
    mlx = kernel.implementations["mlx"]
    assert kernel.name == name and mlx.status == "pass"
    assert [mlx.gates[g].status for g in (1, 2, 3, 4)] == ["pass"] * 4
    ran = [c for c in kernel.controls if not c.status.startswith("not run")]  # cuda and metal need their device
    assert sum(c.kind == "mlx" for c in ran) >= 2
    assert {c.kind for c in ran} == {"mlx", "cuda", "metal"}  # the launch-limit controls run without a device
    assert all(c.status == "red" for c in ran), [(c.name, c.status, c.detail) for c in ran]
    assert report.summary()["missed"] == 0
