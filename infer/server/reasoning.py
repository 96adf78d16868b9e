"""Reasoning apart from the answer (--reasoning-parser, vLLM's names): thinking models write their
thoughts first, between `<think>` and `</think>`, then the answer.

    <think>The user wants the weather; I should call the tool.</think>\n\n<tool_call>...
    └──────────────────── reasoning_content ─────────────────┘└────── content ───────

The opening tag is optional (Qwen3's newer templates and DeepSeek-R1's put it in the prompt): the output
is reasoning from its first character until `</think>`; an output that never closes its thinking (cut
by max_tokens) is all reasoning. `qwen3` also ends the thinking at a `<tool_call>`, which then belongs
to the answer (vLLM's). With `chat_template_kwargs.enable_thinking` false the template told the model not
to think: the whole output is the answer.

Fed one delta at a time, as the output streams: a tail that may begin a tag is held until the next
characters tell, so the pieces do not depend on how the text was split.
"""

from __future__ import annotations

START, END, TOOL_CALL = "<think>", "</think>", "<tool_call>"
THINKING_END = END
_WHITESPACE = " \t\n\r"


class ReasoningParser:
    """Splits an output into (reasoning, content) as it is fed."""

    name = ""
    ends_at_tool_call = False

    def __init__(self, thinking: bool = True):
        self._state = "start" if thinking else "content"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """What `text` adds to the reasoning and to the content."""
        reasoning, content = [], []
        for char in text:
            self._char(char, reasoning, content)
        return "".join(reasoning), "".join(content)

    def feed_output(self, text: str, finished: bool) -> tuple[str, str]:
        """`feed` for one streamed output delta, with `finish` once the output has ended."""
        reasoning, content = self.feed(text)
        if finished:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: text held for a tag that did not come is what it was."""
        held, self._held = self._held, ""
        if self._state == "start":  # whitespace, or the beginning of <think>: reasoning
            return held, ""
        return (held, "") if self._state == "reasoning" else ("", held)

    @property
    def in_content(self) -> bool:
        return self._state == "content"

    def _char(self, char: str, reasoning: list[str], content: list[str]) -> None:
        if self._state == "content":
            content.append(char)
            return
        held = self._held + char
        if self._state == "start":
            if START.startswith(held.lstrip(_WHITESPACE)):
                self._held = held
                if held.lstrip(_WHITESPACE) == START:  # the opening tag (and whitespace before it) go
                    self._held, self._state = "", "reasoning"
                return
            self._held, self._state = "", "reasoning"
            for c in held:
                self._char(c, reasoning, content)
            return
        if held.endswith(END):
            reasoning.append(held[: -len(END)])
            self._held, self._state = "", "content"
            return
        if self.ends_at_tool_call and held.endswith(TOOL_CALL):
            reasoning.append(held[: -len(TOOL_CALL)])
            content.append(TOOL_CALL)
            self._held, self._state = "", "content"
            return
        tags = (END, TOOL_CALL) if self.ends_at_tool_call else (END,)
        keep = max(_overlap(held, tag) for tag in tags)
        reasoning.append(held[: len(held) - keep])
        self._held = held[len(held) - keep :]


def _overlap(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (shorter than the tag)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    ends_at_tool_call = True


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def thinking(chat_template_kwargs: dict | None) -> bool:
    """Whether the request lets the model think: `enable_thinking` (Qwen3, SmolLM3) or `thinking`
    (DeepSeek V3.1) in chat_template_kwargs, true unless set false."""
    kwargs = chat_template_kwargs or {}
    return kwargs.get("enable_thinking", True) is not False and kwargs.get("thinking", True) is not False


def split(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), None for an empty one: what its deltas accumulate to."""
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None
