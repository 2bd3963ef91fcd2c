"""The lfm2 plugin's hooks: the lfm2 and lfm2_moe families and the tiny checkpoints shipped with them."""

from __future__ import annotations

from pathlib import Path

from tensorfold_core import hookimpl
from tensorfold_core.specs import Family, ShippedModel

from .ops import OPS

MODELS = Path(__file__).parent / "models"


def _load(ckpt, options):
    from .load import load  # mlx modules load only when an lfm2 checkpoint does

    return load(ckpt, options)


def _shard_plan(model):
    from .shard import plan  # imported with the model, as the loader is

    return plan(model)


@hookimpl
def tensorfold_families():
    return [
        Family(name="lfm2", model_types=("lfm2",), load=_load, kernels=OPS, shard_plan=_shard_plan,
               description="LFM2: short-conv and attention hybrids, dense or MLX affine-quantized"),
        Family(name="lfm2_moe", model_types=("lfm2_moe",), load=_load, kernels=OPS, shard_plan=_shard_plan,
               description="LFM2-MoE: LFM2 with sigmoid-routed experts, dense or MLX affine-quantized"),
    ]


SHIPPED = [
    dict(name="tiny-lfm2", description="a tiny LFM2 trained for tests and demos"),
    dict(name="tiny-lfm2-moe", description="a tiny LFM2-MoE trained for tests and demos"),
    dict(name="tiny-lfm2-moe-4bit", description="a tiny LFM2-MoE, 4-bit affine (8-bit routers)"),
]


@hookimpl
def tensorfold_models():
    return [ShippedModel(path=MODELS / spec["name"], **spec) for spec in SHIPPED if (MODELS / spec["name"]).is_dir()]


@hookimpl
def tensorfold_kernels():
    from .kernels import records  # mlx and the contract load only when the contract runs

    return records()
