"""Tool calls read out of what a model writes on its own (tool_choice "auto"), one parser per model
family, under vLLM's names (--tool-call-parser NAME)."""

from __future__ import annotations

from infer.server.tool_parsers.base import Extracted, Piece, ToolParser, extract
from infer.server.tool_parsers.hermes import HermesToolParser
from infer.server.tool_parsers.llama3_json import Llama3JsonToolParser
from infer.server.tool_parsers.mistral import MistralToolParser
from infer.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def tool_parser_class(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "Extracted", "Piece", "ToolParser", "extract", "tool_parser_class"]
