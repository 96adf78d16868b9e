"""The output items of a streamed response whose output is read as it comes (infer.server.responses):
the thinking (--reasoning-parser) as a `reasoning` item, text as a `message`, each tool call as a
`function_call` item, each opened by its first piece and closed when the next opens or the output ends:

    response.output_item.added     {type: reasoning}   response.reasoning_text.delta ...  .done
    response.output_item.added     {type: message}     response.output_text.delta ...     .done
    response.output_item.added     {type: function_call, call_id, name, arguments: ""}
                                   response.function_call_arguments.delta ...              .done
    response.output_item.done      each, with the item whole
"""

from __future__ import annotations

from infer.engine.llm_engine import StepOutput
from infer.server import tools
from infer.server.protocol import new_id


class StreamedItems:
    """The output items of one streamed response, from its output as it comes (`feed`, then `close`),
    as the events that tell them; `items`, `text` (the message's), `calls` and `num_reasoning` (output
    tokens of the thinking) are what the whole response then holds. `run` is the response's maker
    (infer.server.responses._Response), `events` its event writer."""

    def __init__(self, run, events):
        self.run, self.events = run, events
        if run.forced:
            self.parser = tools.call_parser(run.body)
        else:
            self.parser = tools.auto_parser(run.state.args.tool_call_parser, run.body)
        self.reasoning = run.reasoning_reader()
        self.num_reasoning = 0  # output tokens of the thinking
        self.thinking: list[str] = []
        self.items: list[dict] = []  # closed items
        self.open: dict | None = None  # the item being streamed
        self.texts: list[str] = []
        self.logprobs: list[dict] = []
        self.text = ""  # the message's text, once closed
        self.calls: list[dict] = []  # [{"id", "function": {"name", "arguments"}}]

    def feed(self, out: StepOutput) -> list[str]:
        answer, events = out.text, []
        if self.reasoning is not None:
            if not self.reasoning.in_content:
                self.num_reasoning += len(out.token_ids)
            thought, answer = self.reasoning.feed_output(out.text, out.finished)
            if thought:
                events += self._thought(thought)
        if self.parser is None:
            pieces = [answer] if answer else []
        else:
            pieces = self.parser.feed(answer)
            if out.finished and not self.run.forced:
                pieces += self.parser.finish()
        entries = self.run.token_logprobs(out)
        for piece in pieces:
            if isinstance(piece, str):
                events += self._text(piece, entries)
                entries = []
            elif piece.name is not None:
                events += self._close("completed") + self._open_call(piece.name, piece.arguments)
            else:
                events += self._arguments(piece.arguments)
        return events

    def _where(self, content_index: int | None = None) -> dict:
        """The open item's place, as its events name it (a part's, with content_index)."""
        where = {"item_id": self.open["id"], "output_index": len(self.items)}
        return where if content_index is None else {**where, "content_index": content_index}

    def _thought(self, text: str) -> list[str]:
        events = []
        if self.open is None:
            self.open = reasoning_item(new_id("rs"), "", "in_progress")
            self.open["content"] = []
            index = len(self.items)
            events.append(self.events("response.output_item.added", output_index=index, item=dict(self.open)))
        elif self.open["type"] != "reasoning":
            return []
        self.thinking.append(text)
        return [*events, self.events("response.reasoning_text.delta", **self._where(0), delta=text)]

    def _text(self, text: str, logprobs: list[dict]) -> list[str]:
        events = []
        if self.open is not None and self.open["type"] == "reasoning":
            events += self._close("completed")
        if self.open is None:
            self.open = self.run.message("in_progress", [])
            events.append(
                self.events("response.output_item.added", output_index=len(self.items), item=self.open)
            )
            part = self.run.text_part("", [])
            events.append(
                self.events("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        elif self.open["type"] != "message":
            return []  # text after the calls: no item takes it
        self.texts.append(text)
        self.logprobs += logprobs
        delta = {"delta": text, "logprobs": logprobs}
        return [*events, self.events("response.output_text.delta", **self._where(), content_index=0, **delta)]

    def _open_call(self, name: str, arguments: str) -> list[str]:
        call_id = tools.call_id() if self.run.forced else self.parser.call_id()
        self.open = call_item(new_id("fc"), call_id, name, "", "in_progress")
        events = [
            self.events("response.output_item.added", output_index=len(self.items), item=dict(self.open))
        ]
        return events + self._arguments(arguments)

    def _arguments(self, arguments: str) -> list[str]:
        if not arguments or self.open is None or self.open["type"] != "function_call":
            return []
        self.open["arguments"] += arguments
        return [self.events("response.function_call_arguments.delta", **self._where(), delta=arguments)]

    def _close(self, status: str) -> list[str]:
        item, events = self.open, []
        if item is None:
            return []
        where = self._where()
        if item["type"] == "reasoning":
            thought = "".join(self.thinking)
            done = reasoning_item(item["id"], thought, status)
            events.append(self.events("response.reasoning_text.done", **self._where(0), text=thought))
        elif item["type"] == "message":
            self.text = "".join(self.texts)
            logprobs = self.logprobs if self.run.include_logprobs else None
            done = self.run.message(status, [self.run.text_part(self.text, logprobs)])
            part = done["content"][0]
            events.append(
                self.events(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self.text,
                    logprobs=self.logprobs,
                )
            )
            events.append(self.events("response.content_part.done", **where, content_index=0, part=part))
        else:
            done = {**item, "status": status}
            events.append(
                self.events("response.function_call_arguments.done", **where, arguments=item["arguments"])
            )
            function = {"name": item["name"], "arguments": item["arguments"]}
            self.calls.append({"id": item["call_id"], "function": function})
        events.append(self.events("response.output_item.done", output_index=where["output_index"], item=done))
        self.items.append(done)
        self.open = None
        return events

    def close(self, reason: str | None) -> list[str]:
        """The output ended: the open item closes (an empty message if nothing at all was written)."""
        events = [] if self.open is not None or self.items else self._text("", [])
        return events + self._close("incomplete" if reason == "length" else "completed")


def plain_call(call: dict) -> dict:
    """A call as the stored reply's tool_calls hold it."""
    return {"id": call["id"], "function": dict(call["function"])}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
