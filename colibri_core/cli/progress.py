"""Progress bars on stderr for long work: loading, the prompt's prefill, converting.

They show on a terminal, or anywhere when ``--progress`` asks (they go to stderr, so
``--json`` output on stdout stays one clean object). Each bar counts in its own unit:
bytes in binary units (KiB, MiB, GiB: the units of the statistics, ``units.format_bytes``),
experts as experts, tokens as tokens.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text


def stderr_console(force: bool = False) -> Console:
    """The console bars draw on: stderr, drawn as on a terminal when ``force``."""
    return Console(stderr=True, highlight=False, force_terminal=True if force else None)


def wanted(console: Console, *, asked: bool, quiet: bool) -> bool:
    """Bars show when asked (``--progress``), else on a terminal unless quiet."""
    return asked or (console.is_terminal and not quiet)


class AmountColumn(ProgressColumn):
    """``done/total UNIT``: bytes (the task's ``unit`` field, the default) in binary units,
    anything else counted as is (``8/91 experts``, ``128/360 tokens``)."""

    def __init__(self):
        super().__init__()
        self._bytes = DownloadColumn(binary_units=True)

    def render(self, task) -> Text:
        unit = task.fields.get("unit", "bytes")
        if unit == "bytes":
            return self._bytes.render(task)
        total = "?" if task.total is None else f"{int(task.total)}"
        return Text(f"{int(task.completed)}/{total} {unit}", style="progress.download")


def bar(console: Console, *, enabled: bool, label: str = "{task.description}", transient: bool = True) -> Progress:
    """A progress display whose tasks carry a ``unit`` field ("bytes" by default)."""
    return Progress(TextColumn(label), BarColumn(), AmountColumn(), TimeRemainingColumn(), console=console,
                    disable=not enabled, transient=transient)


class PrefillBar:
    """``prefill 128/360 tokens``: started by the first report, gone once the prompt is
    through (before any generated text is printed)."""

    def __init__(self, console: Console, enabled: bool):
        self.enabled = enabled
        self._progress = bar(console, enabled=enabled)
        self._task = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task("prefill", total=total, unit="tokens")
        self._progress.update(self._task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._task is not None:
            self._progress.stop()
            self._task = None
            self.enabled = False
