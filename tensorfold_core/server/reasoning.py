"""Thinking models: where the chat template marks reasoning with <think>...</think>, a reply's reasoning split off."""

from __future__ import annotations

import json

from .reply import partial_tail

OPEN, CLOSE = "<think>", "</think>"


def marks_reasoning(chat_template: str | None) -> bool:
    """Whether replies of this template may hold reasoning: the template writes its closing tag (Qwen3, DeepSeek-R1
    and their kin write `</think>` into past turns or into the generation prompt)."""
    return bool(chat_template) and CLOSE in chat_template


def after_reasoning(grammar: str, inside: bool) -> str:
    """`grammar` (Lark text or llguidance's JSON) holding only what follows the reply's reasoning: the block the
    prompt left open (`inside`), or else one the reply may open first, as ReasoningSplitter reads replies."""
    parts = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    head = "start: think blank @answer" if inside else f'start: "{OPEN}" think blank @answer | @answer'
    # the reasoning is free text up to its closing tag; a few blanks may follow it (Qwen writes two)
    close = CLOSE.replace("/", "\\/")
    reasoning = f"think[lazy]: /(.|\\n)*{close}/\nblank: /[ \\t\\n]{{0,4}}/"
    return json.dumps({"grammars": [{"lark_grammar": f"{head}\n{reasoning}"}, {**parts[0], "name": "answer"},
                                    *parts[1:]]})


def reply_opening(generation_prompt: str) -> str:
    """Where the reply begins, by what the generation prompt wrote: "reasoning" inside a block it left open
    (DeepSeek-R1's), "content" after one it closed (Qwen3's with thinking off), else "start": the reply may open
    one itself (Qwen3's with thinking on)."""
    opened, closed = generation_prompt.rfind(OPEN), generation_prompt.rfind(CLOSE)
    if opened > closed:
        return "reasoning"
    return "content" if closed >= 0 else "start"


class ReasoningSplitter:
    """Splits one reply's text, as it arrives, into reasoning and content. Reasoning is what lies inside the block:
    the one the prompt left open, or one the reply opens first thing (after blanks); a reply that opens none is
    all content. Blanks right after the closing tag are dropped; a block left open makes the whole reply
    reasoning."""

    def __init__(self, inside: bool):
        self.state = "reasoning" if inside else "start"  # start -> reasoning -> closed -> content
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `text` makes known; `final`: the reply is over, nothing is held."""
        self.pending += text
        reasoning = ""
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(OPEN):
                self.pending, self.state = head[len(OPEN):], "reasoning"
            elif OPEN.startswith(head) and not final:  # may still open a block
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.pending.find(CLOSE)
            if end < 0:
                keep = 0 if final else partial_tail(self.pending, CLOSE)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending, self.state = self.pending[:end], self.pending[end + len(CLOSE):], "closed"
        if self.state == "closed":
            self.pending = self.pending.lstrip()
            if not self.pending:
                return reasoning, ""
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content
