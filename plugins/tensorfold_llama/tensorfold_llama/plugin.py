"""The llama plugin's hooks: the llama family, the llama drafter and the tiny checkpoints shipped with it."""

from __future__ import annotations

from pathlib import Path

from tensorfold_core import hookimpl
from tensorfold_core.specs import DrafterKind, Family, ShippedModel

from .ops import OPS

MODELS = Path(__file__).parent / "models"


def _load(ckpt, options):
    from .load import load  # mlx modules load only when a llama checkpoint does

    return load(ckpt, options)


def _shard_plan(model):
    from .shard import plan  # imported with the model, as the loader is

    return plan(model)


@hookimpl
def tensorfold_families():
    return [Family(name="llama", model_types=("llama", "mistral"), load=_load, kernels=OPS, shard_plan=_shard_plan,
                   description="Llama 1/2/3 and Mistral-style decoders, dense or MLX affine-quantized")]


SHIPPED = [
    dict(name="tiny-llama", default=True, drafter="tiny-llama-drafter",
         description="a tiny llama trained for tests and demos"),
    dict(name="tiny-llama-drafter", role="drafter", description="the drafter of tiny-llama"),
    dict(name="tiny-llama-drafter-4bit", role="drafter", description="the drafter of tiny-llama, 4-bit affine"),
]


@hookimpl
def tensorfold_models():
    return [ShippedModel(path=MODELS / spec["name"], **spec) for spec in SHIPPED if (MODELS / spec["name"]).is_dir()]


@hookimpl
def tensorfold_drafters():
    return [DrafterKind.of_module("llama", "tensorfold_llama.drafter",
                                  description="a smaller llama on the target's tokenizer drafting greedy chains")]


@hookimpl
def tensorfold_kernels():
    from .kernels import records  # mlx and the contract load only when the contract runs

    return records()
