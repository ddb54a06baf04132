"""What a client sees of a reply while it streams: text up to a stop string, with text
that could begin a stop string or a tool-call marker held back until the next token
decides, and everything from a tool-call marker on kept for parsing at the end."""

from __future__ import annotations

from colibri_serve.toolcalls import ParsedReply, ToolCallFormat, held_back


class ReplyStream:
    def __init__(self, stops: list[str] | None = None, tool_format: ToolCallFormat | None = None,
                 tools: list[dict] | None = None):
        self.stops = [s for s in (stops or []) if s]
        self.tool_format = tool_format
        self.tools = tools
        self.markers = tool_format.markers if tool_format is not None else ()
        self.text = ""  # the reply so far, cut at a stop string
        self.emitted = 0  # characters of text the client has seen
        self.tools_at: int | None = None  # where the tool-call section starts
        self.stopped: str | None = None  # the stop string that ended the reply

    def feed(self, delta: str) -> str:
        """Add the engine's next text; returns the content the client may see now.
        After it sets ``stopped``, the generation should be cancelled."""
        if self.stopped is not None or not delta:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=1) + 1)
        self.text += delta
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, stop = min(hits)
            self.text, self.stopped = self.text[:at], stop
        if self.tools_at is None:
            found = [i for m in self.markers if (i := self.text.find(m, max(0, self.emitted - len(m)))) >= 0]
            if found:
                self.tools_at = min(found)
        if self.tools_at is not None:
            limit = self.tools_at
        elif self.stopped is not None:
            limit = len(self.text)
        else:
            hold = max([held_back(self.text, s) for s in self.stops] + [held_back(self.text, m) for m in self.markers] + [0])
            limit = len(self.text) - hold
        return self._emit(limit)

    def _emit(self, limit: int) -> str:
        if limit <= self.emitted:
            return ""
        out = self.text[self.emitted : limit]
        self.emitted = limit
        return out

    def finish(self) -> tuple[str, ParsedReply]:
        """At the end of the generation: the content not yet shown and the whole reply
        split into content and tool calls (a section that cannot be read stays content)."""
        if self.tool_format is not None and self.tools_at is not None:
            parsed = self.tool_format.parse(self.text, self.tools)
            if parsed.tool_calls:
                tail = self._emit(len(parsed.content)) if len(parsed.content) > self.emitted else ""
                return tail, parsed
        return self._emit(len(self.text)), ParsedReply(self.text, [])
