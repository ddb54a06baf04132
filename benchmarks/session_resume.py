"""Time to first token of a chat turn after ``colibri chat --session NAME`` resumes a saved
conversation, against a cold start that computes the same history again, on the demo
model (colibri-trained's OLMoE-geometry model, with ``colibri demo``'s RAM budget so its
experts stream from disk).

    .venv/bin/python benchmarks/session_resume.py --history 2000 --rounds 3

A conversation is built turn by turn from the model's held-out text (Python, C, prose,
data) until its history holds ``--history`` tokens, and saved as a session. Then, each
round, in fresh processes (cold page cache is not forced: the model file stays cached, as
it does between a user's chats): ``cold`` loads the model and asks the next message with
the history's messages but no saved cache, so the whole history is prefilled; ``warm``
loads the model, resumes the session (reads and binds the state file) and asks the same
message. Reported: time to first token of that turn, the resume's own time (reading and
binding the state), and whether the warm reply equals the reply the uninterrupted chat
gave (it must) and the cold one (it need not: a cold prefill rounds otherwise). Medians
over rounds; JSON and Markdown to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.hostinfo import write_record  # noqa: E402
from benchmarks.trace_streaming import git_head, machine  # noqa: E402

NEXT = "Now write the same as a short Python function."


def _load(budget_quarter: bool = True):
    import colibri_core
    from colibri_core.cli.demo import DEFAULT_SPEC, quarter_budget, trained_demo_path

    path = trained_demo_path()
    ram = quarter_budget(path, None, DEFAULT_SPEC.cached_experts_per_layer) if budget_quarter else None
    return colibri_core.load(path, ram=ram, history=False)


def build(sessions: Path, history: int, max_tokens: int) -> dict:
    """The saved conversation, and the reply the uninterrupted chat gives to NEXT."""
    from colibri_core.cli.demo import trained_demo_path
    from colibri_serve.chat import ChatSession
    from colibri_serve.sessions import SessionStore

    heldout = trained_demo_path() / "heldout"
    texts = [(heldout / f"{name}.txt").read_text() for name in ("python", "c", "prose", "data")]
    store = SessionStore(sessions, "bench")
    store.lock()
    with _load() as model:
        session = ChatSession(model, max_tokens=max_tokens, store=store)
        try:
            turn = 0
            while session.kept is None or len(session.kept.fed) < history:
                text = texts[turn % len(texts)]
                start = (turn // len(texts)) * 600
                session.ask("Continue this:\n" + text[start : start + 600])
                turn += 1
            session.save_session()
            positions = len(session.kept.fed)
            reply = session.ask(NEXT)
        finally:
            session.close()
            store.close()
    return {"turns": turn, "positions": positions, "uninterrupted_reply": reply}


def measure(sessions: Path, mode: str, max_tokens: int) -> dict:
    """One fresh process's turn: ``cold`` (history computed again) or ``warm`` (resumed)."""
    from colibri_serve.chat import ChatSession
    from colibri_serve.sessions import SessionStore

    store = SessionStore(sessions, "bench")
    store.lock()
    saved = store.read()
    with _load() as model:
        session = ChatSession(model, max_tokens=max_tokens, store=store)
        try:
            began = time.perf_counter()
            if mode == "warm":
                session.resume_saved(saved)
            else:
                session.resume(saved.messages, None)
            resume_s = time.perf_counter() - began
            reply = session.ask(NEXT)
            turn = session.turns[-1]
        finally:
            session.close()
            store.close()
    return {"mode": mode, "ttft_s": turn.ttft_s, "resume_s": resume_s, "prompt_tokens": turn.prompt_tokens,
            "cached_tokens": turn.cached_tokens, "reply": reply}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=2000, help="Tokens of history to build (at least).")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48, help="Tokens per reply.")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(Path(args.child[1]), args.child[0], args.max_tokens)))
        return
    sessions = Path(tempfile.mkdtemp(prefix="colibri-session-bench-"))
    built = build(sessions, args.history, args.max_tokens)
    rows = []
    for r in range(args.rounds):
        for mode in ("cold", "warm") if r % 2 == 0 else ("warm", "cold"):
            out = subprocess.run([sys.executable, __file__, "--max-tokens", str(args.max_tokens), "--child", mode,
                                  str(sessions)], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONPATH": str(HERE.parent)})
            rows.append({"round": r, **json.loads(out.stdout.strip().splitlines()[-1])})
            print(rows[-1]["mode"], f"ttft {rows[-1]['ttft_s']:.3f} s", f"resume {rows[-1]['resume_s']:.3f} s", flush=True)
    med = {m: {k: statistics.median(row[k] for row in rows if row["mode"] == m) for k in ("ttft_s", "resume_s")}
           for m in ("cold", "warm")}
    warm_equal = all(row["reply"] == built["uninterrupted_reply"] for row in rows if row["mode"] == "warm")
    cold_equal = all(row["reply"] == built["uninterrupted_reply"] for row in rows if row["mode"] == "cold")
    ratio = med["warm"]["ttft_s"] / med["cold"]["ttft_s"]
    ratio_with_resume = (med["warm"]["ttft_s"] + med["warm"]["resume_s"]) / med["cold"]["ttft_s"]
    state_bytes = (sessions / "bench.state").stat().st_size
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "git": git_head(),
              "command": "benchmarks/session_resume.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "history_tokens": built["positions"], "turns": built["turns"], "state_bytes": state_bytes,
              "median": med, "ttft_ratio": ratio, "ttft_plus_resume_ratio": ratio_with_resume,
              "warm_reply_equals_uninterrupted": warm_equal, "cold_reply_equals_uninterrupted": cold_equal, "rows": rows}
    md = [f"# Session resume vs cold history, {report['date']}", "",
          f"`{report['command']}` on {report['machine']} (git {report['git']}); the demo model (colibri-trained OLMoE "
          f"geometry) with `colibri demo`'s RAM budget; {built['turns']} turns, {built['positions']} positions of history, "
          f"state file {state_bytes / 2**20:.1f} MiB; each measurement a fresh process, model file in the page cache.", "",
          "| | time to first token (median) | resume: read + bind state (median) |", "|---|---|---|",
          f"| cold (history prefilled) | {med['cold']['ttft_s']:.3f} s | - |",
          f"| warm (session resumed) | {med['warm']['ttft_s']:.3f} s | {med['warm']['resume_s']:.3f} s |", "",
          f"Warm / cold time to first token: **{ratio:.3f}** ({ratio_with_resume:.3f} counting the resume itself).",
          f"Warm reply equals the uninterrupted chat's: {warm_equal}; cold reply equals it: {cold_equal}.", ""]
    path = write_record(args.out, f"{report['date']}-session-resume", report, "\n".join(md))
    print("\n".join(md))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
