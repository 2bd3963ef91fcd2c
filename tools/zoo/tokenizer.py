"""Train the zoo's shared byte-level BPE tokenizer (8,192 ids) and encode the corpus splits into uint16 arrays."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import load_manifest, read_split  # noqa: E402

VOCAB_SIZE = 8192
# Order fixes the ids 0..5; the trainer places specials first.
SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
EOS, BOS, PAD, IM_START, IM_END, MASK = SPECIALS
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_LENGTH = 2048


def train(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # GPT-2's split regex keeps runs of indentation spaces together, which code is full of.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"trained vocab is {tok.get_vocab_size()}, wanted {VOCAB_SIZE}")
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def special_ids() -> dict[str, int]:
    return {s: i for i, s in enumerate(SPECIALS)}


def tokenizer_config() -> dict:
    """tokenizer_config.json written by hand so old and new transformers read the same fields."""
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, s in enumerate(SPECIALS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "mask_token": MASK,
            "additional_special_tokens": [IM_START, IM_END]}


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_tokens_map(), indent=2) + "\n")


def encode_split(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Each file becomes bos + tokens + eos, concatenated in manifest order."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(SPECIALS.index(BOS))
        ids.extend(enc.ids)
        ids.append(SPECIALS.index(EOS))
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--manifest", type=Path, default=Path(".zoo/corpus.json"))
    ap.add_argument("--tokenizer-out", type=Path, default=Path(".zoo/tokenizer"))
    ap.add_argument("--data-out", type=Path, default=Path(".zoo/data"))
    args = ap.parse_args()
    manifest = load_manifest(args.manifest)
    train_texts = read_split(manifest, "train")
    tok = train(train_texts)
    write_tokenizer(tok, args.tokenizer_out)
    args.data_out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in ("train", "heldout"):
        arr = encode_split(tok, train_texts if split == "train" else read_split(manifest, split))
        np.save(args.data_out / f"{split}.npy", arr)
        counts[split] = int(arr.size)
    nbytes = manifest["byte_counts"]
    stats = {
        "python": manifest["python"],
        "file_counts": manifest["file_counts"],
        "byte_counts": nbytes,
        "token_counts": counts,
        "bytes_per_token": {s: round(nbytes[s] / counts[s], 3) for s in counts},
        "vocab_size": tok.get_vocab_size(),
        "special_ids": special_ids(),
    }
    (args.data_out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
