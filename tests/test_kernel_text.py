"""The text a custom kernel is built from: the code as written, less its comments, indentation and blank lines."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tensorfold_contract import gates
from tensorfold_contract.kernel_text import narrowed, served_text
from tensorfold_contract.registry import discover
from tensorfold_core.row_kernels import attention_streams, stack
from tensorfold_core.row_kernels.attention_sources import CUDA_STREAMS, METAL_STREAMS


def test_comments_indentation_and_blank_lines_are_dropped_and_each_line_of_code_kept_on_its_own():
    text = "// why\nconst int a = 1;  // a comment\n\n#pragma unroll\n  for (int i = 0; i < 4; ++i) b += a;\n"
    assert served_text(text) == "const int a = 1;\n#pragma unroll\nfor (int i = 0; i < 4; ++i) b += a;\n"


def test_a_double_slash_inside_a_string_literal_stays_as_in_inline_asm():
    text = 'asm volatile("mov.b32 %0, %1; // not a comment \\" still quoted //" : "=r"(d) : "r"(s));  // gone\n'
    kept = 'asm volatile("mov.b32 %0, %1; // not a comment \\" still quoted //" : "=r"(d) : "r"(s));\n'
    assert served_text(text) == kept


def test_the_comments_knob_builds_the_text_as_written(monkeypatch):
    text = "// why\n  const int a = 1;\n"
    monkeypatch.setenv("TENSORFOLD_KERNEL_COMMENTS", "1")
    assert served_text(text) == text


def test_every_shipped_kernel_s_served_text_is_its_written_code_less_comments_and_whitespace():
    def code(text):  # no shipped source holds // inside a string literal (asserted below), so a regex is enough
        return re.sub(r"\s+", "", re.sub(r"//[^\n]*", "", text))

    checked = 0
    for reg in discover():
        for kind, impl in (reg.record.implementations.items() if reg.record else ()):
            if isinstance(impl, gates.Source):
                for text in (impl.header, impl.body):
                    assert not any('"' in line.split("//")[0] and "//" in line.split('"', 1)[1]
                                   for line in text.splitlines()), (reg.record.name, kind)
                    served = served_text(text)
                    assert code(served) == code(text) and "//" not in served, (reg.record.name, kind)
                checked += 1
    assert checked >= 40


def test_a_kernel_is_named_by_its_served_text_so_the_knob_never_serves_another_build(monkeypatch):
    record = next(r.record for r in discover() if r.record is not None and r.record.name == "llama rmsnorm")
    source = record.implementations["cuda"]
    stripped = gates._kernel_name("cuda", source)
    monkeypatch.setenv("TENSORFOLD_KERNEL_COMMENTS", "1")
    assert gates._kernel_name("cuda", source) != stripped


def test_a_select_chain_cut_to_fewer_inputs_keeps_its_entries_as_planted():
    body = "const auto kc = slot == 0 ? k1 : slot == 1 ? k0 : slot == 2 ? k2 : k3;\nx = kc[0];\n"
    assert narrowed(body, ("kc = ",), 2) == "const auto kc = slot == 0 ? k1 : k0;\nx = kc[0];\n"
    assert narrowed(body, ("kc = ",), 1) == "const auto kc = k1;\nx = kc[0];\n"
    assert narrowed(body, ("kc = ",), 4) == body
    with pytest.raises(ValueError, match="cannot keep 5"):
        narrowed(body, ("kc = ",), 5)


def test_a_launch_of_fewer_streams_names_fewer_cache_slots_unless_the_knob_keeps_all(monkeypatch):
    assert [attention_streams.slots_for(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [stack.slots_for(n) for n in (1, 8, 9, 16, 32)] == [8, 8, 16, 16, 32]
    monkeypatch.setenv("TENSORFOLD_NARROW_INPUTS", "0")
    assert attention_streams.slots_for(1) == 8 and stack.slots_for(16) == 32


def _lines_apart(a: str, b: str) -> list[tuple[str, str]]:
    a_lines, b_lines = a.splitlines(), b.splitlines()
    assert len(a_lines) == len(b_lines)
    return [(x, y) for x, y in zip(a_lines, b_lines) if x != y]


def test_the_narrowed_streams_attention_differs_from_the_full_text_in_its_two_cache_selects_alone():
    for text in (CUDA_STREAMS, METAL_STREAMS):
        for slots in (1, 2, 4):
            apart = _lines_apart(text, attention_streams.narrowed_text(text, slots))
            assert [x.split("=")[0] for x, _ in apart] == ["const auto kc ", "const auto vc "]
            assert all(f"{'kv'[i]}{slots}" not in y and f"{'kv'[i]}{slots - 1}" in y for i, (_, y) in enumerate(apart))


def test_each_contract_case_launches_its_narrowed_text_with_as_many_inputs_as_it_names():
    for name, module, dims_key in (("llama window attention streams", attention_streams, "streams"),
                                   ("llama stack kv", stack, "layers")):
        record = next(r.record for r in discover() if r.record is not None and r.record.name == name)
        for shape in (*record.shapes, *record.edges):
            if shape.rows == 0 or shape.heavy:
                continue
            case = gates.make_case(record, shape, min(shape.rows, 3), np.random.default_rng(0))
            served = record.implementations["cuda"].at(case)
            assert served.input_names == module.names(module.slots_for(shape.dims[dims_key])), (name, shape.label)
            assert len(served.inputs(case)) == len(served.input_names), (name, shape.label)
