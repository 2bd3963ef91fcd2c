"""The text a custom kernel is built from: the code as written, less its comments, indentation and blank lines."""

from __future__ import annotations

import re

from tensorfold_contract import gates
from tensorfold_contract.kernel_text import served_text
from tensorfold_contract.registry import discover


def test_comments_indentation_and_blank_lines_are_dropped_and_each_line_of_code_kept_on_its_own():
    text = "// why\nconst int a = 1;  // a comment\n\n#pragma unroll\n  for (int i = 0; i < 4; ++i) b += a;\n"
    assert served_text(text) == "const int a = 1;\n#pragma unroll\nfor (int i = 0; i < 4; ++i) b += a;\n"


def test_a_double_slash_inside_a_string_literal_stays_as_in_inline_asm():
    text = 'asm volatile("mov.b32 %0, %1; // not a comment \\" still quoted //" : "=r"(d) : "r"(s));  // gone\n'
    assert served_text(text) == 'asm volatile("mov.b32 %0, %1; // not a comment \\" still quoted //" : "=r"(d) : "r"(s));\n'


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
