"""``colibri chat``: a terminal conversation on the model's chat template.

Each turn renders the whole conversation and submits it to the core's scheduler, which
continues the previous turn's cache (kept between turns): only the new message is
computed. Where the rendered conversation departs from what the cache holds (a template
that rewrites earlier turns), the cache goes back to the common part where it can, else
the turn starts anew on the scheduler's prefix cache; with --draft (whose verifications
can leave drafted positions in a cache) turns always do the latter. The reply streams to
the terminal as it is decoded. Commands: /reset, /stats, /save [FILE], /exit.

``--session NAME`` keeps the conversation and its cache on disk (colibri_serve.sessions):
/save and leaving the chat save it, the next ``colibri chat --session NAME`` continues it
warm, with the replies an uninterrupted chat would give.

On a terminal the input line is edited with prompt_toolkit: arrows, Up/Down through the
messages of earlier chats (kept in colibri's state dir), Alt+Enter (or Esc then Enter)
for a new line within a message. Otherwise (a pipe, a file) each line read is a message,
as a script expects.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from colibri_core.errors import UsageError

HELP = ("commands: /reset (new conversation), /stats (speed, cache and expert hit rates), /save FILE (the conversation "
        "as JSON; with --session, /save alone saves the session), /exit")
EDITING_HELP = "Up/Down recall earlier messages; Alt+Enter (or Esc, Enter) starts a new line, Enter sends"
HISTORY_NAME = "chat-history"


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_tok_s: float
    finish_reason: str


class ChatSession:
    def __init__(self, model, *, system: str | None = None, max_tokens: int = 512, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, draft: str | None = None,
                 draft_depth: int = 4, constraint=None, store=None):
        from colibri_core.engine.sampling import SamplingParams
        from colibri_serve.service import new_scheduler

        if model.tokenizer is None or model.tokenizer.chat_template is None:
            raise UsageError(f"{model.model_dir}: colibri chat needs a tokenizer with a chat template")
        self.model = model
        self.system = system
        self.max_tokens = max_tokens
        self.draft, self.draft_depth = draft, draft_depth  # speculative decoding (colibri_core.engine.speculative)
        # what every reply must fit (a ConstraintSpec, docs/structured.md), compiled once
        self.constraint = model.constraint(constraint)
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        # the previous turn's cache, continued by the next (KeptSequence); not with drafts
        self.keep = draft is None or draft == "off"
        self.kept = None
        self.store = store  # a SessionStore (colibri_serve.sessions) with --session
        self.scheduler = new_scheduler(model, slots=1, max_queue=1)
        self.scheduler.start()
        self.turns: list[Turn] = []
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.kept = None

    def resume(self, messages: list[dict], kept) -> None:
        """Continue a saved conversation: its messages and its cache (a KeptSequence or None)."""
        self.messages, self.kept = list(messages), kept

    def save_session(self) -> int:
        """Write the session (``--session``): the conversation and its cache. Bytes written."""
        return self.scheduler.call(lambda: self.store.save(self.model, self.system, self.messages, self.kept,
                                                           self.sampling))

    def resume_saved(self, saved) -> None:
        """Continue the session's saved conversation (colibri_serve.sessions.SavedConversation)."""
        self.resume(saved.messages, self.scheduler.call(lambda: self.store.bind(saved, self.model)))

    def _start(self, ids: list[int]):
        """The kept cache, made to hold a prefix of ``ids`` (KeptSequence.start), or None to
        start anew."""
        kept, self.kept = self.kept, None  # the request owns it now
        return self.scheduler.call(lambda: kept.start(ids)) if kept is not None else None

    def ask(self, text: str, on_text=lambda piece: None) -> str:
        """Add the user's message, stream the reply through ``on_text``, keep it in the
        conversation and return it. Ctrl-C stops the reply where it is."""
        from colibri_core.engine.scheduler import Request

        model = self.model
        messages = self.messages + [{"role": "user", "content": text}]
        ids = model.tokenizer.encode(model.chat_prompt(messages), add_special_tokens=False)
        if len(ids) >= model.lm.max_context:
            raise UsageError(f"the conversation has {len(ids)} tokens; the context holds {model.lm.max_context}: /reset to start again")
        started = time.perf_counter()
        start = self._start(ids) if self.keep else None
        handle = self.scheduler.submit(Request(prompt_ids=ids, max_tokens=min(self.max_tokens, model.lm.max_context - len(ids)),
                                               sampling=self.sampling, stop_ids=frozenset(model.eos_ids),
                                               draft=self.draft, draft_depth=self.draft_depth,
                                               constraint=self.constraint, start_cache=start, keep_cache=self.keep))
        pieces: list[str] = []
        first = last = None
        try:
            for event in handle:
                now = time.perf_counter()
                if first is None and event.token_id >= 0:
                    first = now
                last = now
                if event.text:
                    pieces.append(event.text)
                    on_text(event.text)
        except KeyboardInterrupt:
            handle.cancel()
        reply = "".join(pieces)
        usage = handle.usage
        n = usage.get("completion_tokens", len(handle.token_ids))
        decode_s = (last - first) if first is not None and last is not None else 0.0
        self.turns.append(Turn(usage.get("prompt_tokens", len(ids)), usage.get("cached_tokens", 0), n,
                               (first - started) if first is not None else 0.0,
                               (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0, handle.finish_reason or "cancelled"))
        handle.wait()
        self.kept = handle.kept
        self.messages = messages + [{"role": "assistant", "content": reply}]
        return reply

    def stats(self) -> dict:
        """The last turn's numbers and the engine's since the start."""
        engine = self.scheduler.stats()
        hits = sum(engine.get(k, 0) for k in ("hits_device", "hits_pinned", "hits_lru"))
        lookups = hits + engine.get("hits_prefetched", 0) + engine.get("misses", 0)
        last = self.turns[-1] if self.turns else None
        return {"turns": len(self.turns), "last": last.__dict__ if last else None,
                "expert_hit_rate": hits / lookups if lookups else None, "expert_lookups": lookups,
                "bytes_read": sum((engine.get("bytes_by_drive") or {}).values()),
                "prefix_hits_tokens": engine.get("prefix_hits_tokens", 0)}

    def save(self, path: str) -> Path:
        """Write the conversation as JSON, atomically."""
        target = Path(path).expanduser()
        data = {"model": str(self.model.model_dir), "messages": self.messages}
        fd, tmp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".", prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=2)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    def close(self) -> None:
        self.scheduler.stop()


def _stats_table(stats: dict):
    from rich.table import Table

    from colibri_core.units import format_bytes

    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    last = stats["last"]
    table.add_row("turns", str(stats["turns"]))
    if last:
        table.add_row("last prompt", f"{last['prompt_tokens']} tokens, {last['cached_tokens']} reused from the previous turn")
        table.add_row("last reply", f"{last['completion_tokens']} tokens, first after {last['ttft_s']:.2f} s, "
                                    f"{last['decode_tok_s']:.2f} tok/s ({last['finish_reason']})")
    if stats["expert_hit_rate"] is not None:
        table.add_row("expert hit rate", f"{stats['expert_hit_rate']:.1%} of {stats['expert_lookups']} lookups")
    table.add_row("read from disk", format_bytes(stats["bytes_read"]))
    return table


def history_path() -> Path:
    """The file of earlier chats' messages: colibri's state dir, shared by every model."""
    import platformdirs

    return Path(platformdirs.user_state_dir("colibri")) / HISTORY_NAME


def terminal_reader(input=None, output=None, history_file: Path | None = None):
    """``read(prompt) -> str`` editing the line with prompt_toolkit: history in
    ``history_file`` (in memory when it cannot be written), Enter sends, Alt+Enter or Esc
    Enter inserts a newline. Ctrl-D raises EOFError and Ctrl-C KeyboardInterrupt, as
    ``input`` does."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    history = InMemoryHistory()
    if history_file is not None:
        try:
            history_file.parent.mkdir(parents=True, exist_ok=True)
            history_file.touch()
            history = FileHistory(str(history_file))
        except OSError:  # a read-only home: editing still works, recall only within this chat
            pass
    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    session = PromptSession(history=history, key_bindings=keys, multiline=False, input=input, output=output,
                            enable_history_search=False)
    return lambda prompt: session.prompt(prompt)


def default_reader():
    """prompt_toolkit's editing on a terminal; plain lines from a pipe or a file."""
    import sys

    if sys.stdin.isatty() and sys.stdout.isatty():
        return terminal_reader(history_file=history_path()), True
    return input, False


def run_chat(session: ChatSession, console=None, read=None) -> None:
    """The conversation loop; with a session (``--session``), leaving it saves the session."""
    console = console or _console()
    try:
        _loop(session, console, read)
    finally:
        if session.store is not None:
            _save_session(session, console)


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _save_session(session: ChatSession, console) -> None:
    from colibri_core.units import format_bytes

    size = session.save_session()
    warm = f", {len(session.kept.fed)} positions warm" if session.kept is not None else ""
    console.print(f"(session {session.store.name!r} saved: {len(session.messages)} messages{warm}, "
                  f"{format_bytes(size)} in {session.store.dir})", markup=False, soft_wrap=True)


def _loop(session: ChatSession, console, read) -> None:
    from rich.console import Console

    from colibri_core.io.hub_cache import hub_repo_id

    err = Console(stderr=True, highlight=False)
    editing = False
    if read is None:
        read, editing = default_reader()
    name = hub_repo_id(session.model.model_dir) or session.model.model_dir.name  # a snapshot's name is a hash
    err.print(f"colibri chat with {name}. {HELP}" + (f"\n{EDITING_HELP}" if editing else ""))
    while True:
        try:
            line = read("you> ")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, arg = text.partition(" ")
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                session.reset()
                console.print("(new conversation)")
            elif command == "/stats":
                console.print(_stats_table(session.stats()))
            elif command == "/save" and not arg.strip() and session.store is not None:
                _save_session(session, console)
            elif command == "/save":
                if not arg.strip():
                    console.print("usage: /save FILE")
                else:
                    try:
                        console.print(f"saved {session.save(arg.strip())}")
                    except OSError as exc:
                        console.print(f"cannot save: {exc}")
            else:
                console.print(HELP)
            continue
        console.print("model> ", end="")
        try:
            session.ask(text, on_text=lambda piece: console.print(piece, end="", markup=False, highlight=False))
        except UsageError as exc:
            console.print(f"error: {exc}", markup=False)
            continue
        console.print()
