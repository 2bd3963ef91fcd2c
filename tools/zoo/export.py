"""Turn the device run's state dicts into shipped checkpoints: save_pretrained bf16, tokenizer, MLX 4-bit copies."""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train  # noqa: E402
from tokenizer import EOS, IM_END, SPECIALS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LLAMA_MODELS = REPO / "plugins/tensorfold_llama/tensorfold_llama/models"
LFM2_MODELS = REPO / "plugins/tensorfold_lfm2/tensorfold_lfm2/models"
DEST = {
    "tiny-llama": LLAMA_MODELS / "tiny-llama",
    "tiny-llama-drafter": LLAMA_MODELS / "tiny-llama-drafter",
    "tiny-lfm2": LFM2_MODELS / "tiny-lfm2",
    "tiny-lfm2-moe": LFM2_MODELS / "tiny-lfm2-moe",
}
# 4-bit copy -> its bf16 source
QUANTIZED = {
    "tiny-llama-drafter-4bit": "tiny-llama-drafter",
    "tiny-lfm2-moe-4bit": "tiny-lfm2-moe",
}
DEST.update({q: DEST[src].parent / q for q, src in QUANTIZED.items()})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DRAFTER_ONLY = {"tiny-llama-drafter", "tiny-llama-drafter-4bit"}  # marked in config.json: served alone, refused


def load_trained(name: str, run: Path) -> torch.nn.Module:
    """The device's bf16 shards loaded into this machine's transformers class (tied head re-tied)."""
    model = train.make_model(name)
    state = {}
    for f in sorted(glob.glob(str(run / f"{name}.*.safetensors"))):
        state.update(load_file(f))
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) != {"lm_head.weight"}:
        raise SystemExit(f"{name}: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    return model


def write_generation_config(out: Path) -> None:
    ids = {s: i for i, s in enumerate(SPECIALS)}
    # Chat turns end with <|im_end|>, plain text with <|endoftext|>: stop on either.
    GenerationConfig(bos_token_id=train.BOS, eos_token_id=[ids[EOS], ids[IM_END]],
                     pad_token_id=train.PAD).save_pretrained(out)


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for f in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / f, out / f)


def patch_config(out: Path) -> None:
    cfg = json.loads((out / "config.json").read_text())
    if cfg["model_type"] == "lfm2" and "block_dim" not in cfg:
        # transformers 5.x drops block_dim when saving Lfm2 configs; mlx-lm requires it.
        cfg["block_dim"] = cfg["hidden_size"]
    if out.name in DRAFTER_ONLY:
        cfg["tensorfold_role"] = "drafter"  # tensorfold_core.specs.DRAFTER_ROLE_KEY: the checkpoint says it drafts
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def export_bf16(name: str, run: Path, tokenizer_dir: Path) -> Path:
    out = DEST[name]
    if out.exists():
        shutil.rmtree(out)
    model = load_trained(name, run).to(torch.bfloat16)
    for module in train.moe_blocks(model):
        # The router's bias is a selection offset; keep it fp32 as LFM2-MoE checkpoints and mlx-lm do.
        module.expert_bias.data = module.expert_bias.data.float()
    model.save_pretrained(out)
    patch_config(out)
    write_generation_config(out)
    copy_tokenizer(tokenizer_dir, out)
    return out


def export_4bit(name: str, tokenizer_dir: Path) -> Path:
    src, out = DEST[QUANTIZED[name]], DEST[name]
    if out.exists():
        shutil.rmtree(out)
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path", str(out),
                    "-q", "--q-bits", "4", "--q-group-size", "64"], check=True)
    cfg = json.loads((out / "config.json").read_text())
    if "quantization" not in cfg:
        raise SystemExit(f"{out}: mlx_lm.convert wrote no quantization block")
    # mlx-lm re-saves the tokenizer through transformers; ship the same bytes as every other dir instead.
    for extra in ("chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt"):
        (out / extra).unlink(missing_ok=True)
    copy_tokenizer(tokenizer_dir, out)
    shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
    patch_config(out)
    return out


def make_readable(out: Path) -> None:
    # safetensors writes 0600 files; package data must be readable by whoever installs it.
    for f in out.iterdir():
        f.chmod(0o644)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", type=Path, default=Path(".zoo/run"))
    ap.add_argument("--tokenizer", type=Path, default=Path(".zoo/tokenizer"))
    ap.add_argument("--only", nargs="*", default=list(DEST))
    args = ap.parse_args()
    for name in args.only:
        out = export_4bit(name, args.tokenizer) if name in QUANTIZED else export_bf16(name, args.run, args.tokenizer)
        make_readable(out)
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        print(f"{name}: {out.relative_to(REPO)} weights {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
