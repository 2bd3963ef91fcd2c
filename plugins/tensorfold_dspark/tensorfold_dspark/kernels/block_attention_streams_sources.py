"""Kernel text of the DSpark block attention over every block of a hold in one launch, made from the one-block text."""

# The one-block bodies of block_attention_sources.py, row for row, but row r takes its block's slot, n, first packed
# key row kb and size B from rowmap [rows, 4]; its context keys and values come from the slot's lane buffer (slot s
# is the input pair k<s>, v<s>, [KV, C_s, D]; dims [rows, H, KV, C0, ..., C7]), its block's keys and values from the
# packed block_keys, block_values [keys, KV, D] (block key j at packed row kb + j). Only addresses change: the keys
# read and the order every sum runs in are the one-block body's, so a row's bits are the one-block call's.

from tensorfold_contract.kernel_text import select_chain
from tensorfold_core.row_kernels.attention_sources import STREAM_SLOTS

from .block_attention_sources import CUDA, METAL

ROWMAP = 4  # int32 columns of a row's map: slot, n, first packed block-key row, B


def _streams(body: str) -> str:
    """The one-block body with its sizes read per row and its key and value loads moved onto the packed layouts."""
    edits = [
        ("const int C = dims[3];\nconst int n = dims[4];\nconst int B = dims[5];\n", "", 1),
        ("const int kvh = head / (H / KV);\n",
         f"const int slot = rowmap[{ROWMAP} * row];\n"
         f"const int n = rowmap[{ROWMAP} * row + 1];\n"
         f"const int kb = rowmap[{ROWMAP} * row + 2];  // the packed row of the block's key 0\n"
         f"const int B = rowmap[{ROWMAP} * row + 3];\n"
         "const int C = dims[3 + slot];  // the lane's capacity: only the stride of its context keys\n"
         f"const auto kc = {select_chain('slot', 'k', STREAM_SLOTS)};\n"
         f"const auto vc = {select_chain('slot', 'v', STREAM_SLOTS)};\n"
         "const int kvh = head / (H / KV);\n", 1),
        # block key j of the kv head: packed row kb + j, a stride of KV * D between keys
        ("const size_t b0 = (size_t)kvh * B;", "const size_t b0 = ((size_t)kb * KV + kvh) * D;", 1),
        ("context_keys + (c0 + jk) * D : block_keys + (b0 + jk - n) * D;",
         "kc + (c0 + jk) * D : block_keys + b0 + (size_t)(jk - n) * KV * D;", 1),
        ("const auto vd = context_values + c0 * D + d;", "const auto vd = vc + c0 * D + d;", 1),
        ("const auto vd = block_values + b0 * D + d;", "const auto vd = block_values + b0 + d;", 1),
        ("vd[(size_t)(j - n) * D]", "vd[(size_t)(j - n) * KV * D]", 2),  # a whole chunk's loads, a short one's
    ]
    for old, new, count in edits:
        if body.count(old) != count:
            raise ValueError(f"the block attention body holds {old!r} {body.count(old)} times, expected {count}")
        body = body.replace(old, new)
    return "// Every block of a hold: row r's slot, n, block keys and B from rowmap (block_attention_streams)\n" + body


CUDA_STREAMS = _streams(CUDA)
METAL_STREAMS = _streams(METAL)
