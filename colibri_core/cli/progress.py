"""Progress on stderr for long work: loading, the prompt's prefill, converting.

It shows on a terminal, or anywhere when ``--progress`` asks (it goes to stderr, so
``--json`` output on stdout stays one clean object). On a terminal it is a bar redrawn in
place; elsewhere (a log file, a pipe, CI) it is plain lines, one every PLAIN_INTERVAL_S
seconds at most per task and one when the task is done, with no escape codes: a bar
redrawn into a file is tens of kB of erase codes on one line. Each counts in its own
unit: bytes in binary units (KiB, MiB, GiB: the units of the statistics,
``units.format_bytes``), experts as experts, tokens as tokens.
"""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, TaskID, TextColumn, TimeRemainingColumn
from rich.text import Text

PLAIN_INTERVAL_S = 5.0


def stderr_console() -> Console:
    """The console progress draws on: stderr."""
    return Console(stderr=True, highlight=False)


def wanted(console: Console, *, asked: bool, quiet: bool) -> bool:
    """Bars show when asked (``--progress``), else on a terminal unless quiet."""
    return asked or (console.is_terminal and not quiet)


@contextmanager
def token_bar(console: Console, description: str, total: int, *, quiet: bool, asked: bool = False):
    """``advance(n)`` for a bar of ``total`` tokens (plain lines off a terminal); a no-op
    when progress is not wanted."""
    if not wanted(console, asked=asked, quiet=quiet):
        yield lambda n: None
        return
    with bar(console, enabled=True) as shown:
        task = shown.add_task(description, total=total, unit="tokens")
        yield lambda n: shown.advance(task, n)


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
    """A progress display whose tasks carry a ``unit`` field ("bytes" by default): a bar on
    a terminal, plain lines elsewhere."""
    if enabled and not console.is_terminal:
        return PlainProgress(console, label=label)
    return Progress(TextColumn(label), BarColumn(), AmountColumn(), TimeRemainingColumn(), console=console,
                    disable=not enabled, transient=transient)


class PlainProgress(Progress):
    """Progress as plain lines (``converting 12.0/48.0 MiB (25%, 0:00:09 left)``): a line at
    a task's first report, then at most one every ``interval`` seconds, one when it is
    done, and one with where it stopped if it ends (or is removed) short of done. Rich keeps
    the tasks (so the amounts and time left are computed as the bar's are); its live
    display stays off."""

    def __init__(self, console: Console, *, label: str = "{task.description}", interval: float = PLAIN_INTERVAL_S,
                 get_time=None):
        self._label, self._amount, self._left = TextColumn(label), AmountColumn(), TimeRemainingColumn()
        self._interval = interval
        self._shown: dict[TaskID, tuple[float, str]] = {}  # per task: when its last line was written, and the line
        super().__init__(console=console, disable=True, get_time=get_time)

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._report(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._report(task_id)

    def remove_task(self, task_id: TaskID) -> None:
        self._report(task_id, final=True)
        self._shown.pop(task_id, None)
        super().remove_task(task_id)

    def stop(self) -> None:
        for task_id in list(self._shown):
            self._report(task_id, final=True)
        super().stop()

    def line(self, task_id: TaskID) -> str:
        task = self._tasks[task_id]
        text = f"{self._label.render(task).plain} {self._amount.render(task).plain}"
        if task.total:
            text += f" ({min(task.completed / task.total, 1):.0%}"
            text += ")" if task.finished else f", {self._left.render(task).plain} left)"
        return text

    def _report(self, task_id: TaskID, *, final: bool = False) -> None:
        task = self._tasks.get(task_id)
        if task is None:
            return
        now, shown = self.get_time(), self._shown.get(task_id)
        line = self.line(task_id)
        if shown is not None and shown[1] == line:
            return
        if shown is None:
            due = not final  # a task that never reported has nothing to end on
        else:
            due = final or task.finished or now - shown[0] >= self._interval
        if not due:
            return
        self._shown[task_id] = (now, line)
        self.console.file.write(line + "\n")
        self.console.file.flush()


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
