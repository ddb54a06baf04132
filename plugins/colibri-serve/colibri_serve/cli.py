"""``colibri serve`` and ``colibri chat``."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import click

from colibri_core.cli.constrain import constraint_from_options, constraint_options
from colibri_core.cli.modelarg import model_option
from colibri_core.cli.run import (check_draft_options, draft_load_options, draft_options, placement_kwargs,
                                  placement_options)
from colibri_core.errors import UsageError
from colibri_serve.logs import LEVELS


def _stderr():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _check_model_dir(model_dir: str) -> Path:
    from colibri_core.io import smallfile

    path = Path(model_dir)
    if not smallfile.present(path / "config.json"):
        raise UsageError(f"--model: {path} is not a model directory (no config.json)")
    smallfile.check_regular(path / "config.json", "model config")  # a FIFO, device or link loop: said so here
    return path


def serve_options(f):
    """The options of ``serve``, which ``web`` shares."""
    for option in reversed([
        model_option(),
        click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told otherwise)."),
        click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True),
        click.option("--api-key", envvar="COLIBRI_API_KEY", default=None,
                     help="Require this key (Authorization: Bearer KEY or x-api-key). Default: env COLIBRI_API_KEY."),
        click.option("--slots", type=click.IntRange(1, 1024), default=4, show_default=True, help="Requests decoded together."),
        click.option("--max-queue", type=click.IntRange(0, 100000), default=64, show_default=True,
                     help="Requests that may wait for a slot; more get 429 with Retry-After."),
        click.option("--served-model-name", default=None,
                     help="The model's name in the APIs (default: the repo id, or the directory's name)."),
        click.option("--max-body", default="4M", show_default=True, help="Largest request body accepted (413 above it)."),
        click.option("--header-timeout", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
                     help="Seconds a connection may take to send a request's headers before it is closed."),
        click.option("--insecure-no-key", is_flag=True,
                     help="Serve a --host other than loopback without an API key (anyone who can reach the port uses the model)."),
        click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
                     help="Also answer requests whose Host header gives NAME (repeatable; * for any), e.g. behind a proxy."),
        click.option("--log-level", type=click.Choice(LEVELS, case_sensitive=False), envvar="COLIBRI_LOG_LEVEL", default="info",
                     show_default=True, help="The log's level: info shows the model loaded line and one line per request. "
                     "Default: env COLIBRI_LOG_LEVEL."),
        click.option("--kv-disk", default="0", show_default=True, metavar="SIZE",
                     help="Keep finished prompts' caches on disk, up to SIZE (e.g. 8G; least recently used out), in "
                          "colibri's cache dir: a returning conversation or a shared system prompt skips its prefill, "
                          "also after a restart. 0: off."),
        draft_options,
        placement_options,
    ]):
        f = option(f)
    return f


@click.command("serve")
@serve_options
def serve(model_dir, host, port, api_key, slots, max_queue, served_model_name, max_body, header_timeout, insecure_no_key,
          allowed_hosts, log_level, kv_disk, draft, draft_depth, mtp_int4, **placement):
    """Serve the model in --model over HTTP with the OpenAI API (/v1/chat/completions,
    /v1/completions, /v1/models) and the Anthropic API (/v1/messages), plus /health,
    /metrics, a web dashboard at / and a chat page at /chat. The APIs answer 503 until
    the model has loaded."""
    run_server(model_dir, host, port, api_key, slots, max_queue, served_model_name, max_body, header_timeout,
               insecure_no_key, allowed_hosts, log_level, kv_disk, draft, draft_depth, mtp_int4, **placement)


def open_chat_page(where: str, api_key: str | None) -> None:
    """``colibri web``: the chat page in the browser, the key in the URL's fragment (the
    page keeps it for its tab and takes it out of the address bar; a fragment is never
    sent to a server)."""
    import webbrowser
    from urllib.parse import quote

    url = f"http://{where}/chat" + (f"#key={quote(api_key, safe='')}" if api_key else "")
    _stderr().print(f"colibri web: the chat page is {url}")
    if not webbrowser.open(url):
        _stderr().print("colibri web: no browser could be started here: open the address above")


@click.command("web")
@serve_options
def web(**options):
    """colibri serve, and its chat page (/chat) opened in the browser: the same options
    as serve."""
    run_server(**options, on_listening=open_chat_page)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def run_server(model_dir, host, port, api_key, slots, max_queue, served_model_name, max_body, header_timeout,
               insecure_no_key, allowed_hosts, log_level, kv_disk, draft, draft_depth, mtp_int4, on_listening=None,
               **placement):
    """What ``serve`` does; ``on_listening(address, api_key)`` is called once the port is
    bound, while the model loads."""
    import uvicorn

    from colibri_core.engine.api import load, open_backend
    from colibri_core.units import parse_size
    from colibri_serve.app import create_app
    from colibri_serve import logs
    from colibri_serve.listen import HostNames, Server, address, bind, is_loopback, protocol
    from colibri_serve.service import Service

    if not is_loopback(host) and not api_key and not insecure_no_key:
        raise UsageError(f"--host {host} is not a loopback address: anyone who can reach it could use the model; "
                         "set --api-key (or COLIBRI_API_KEY), or pass --insecure-no-key to serve it without one")

    path = _check_model_dir(model_dir)
    check_draft_options(draft, draft_depth)
    extra = {"slots": slots}  # a tuned profile's slots, when --slots is not given
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta["colibri.profile_extra"] = extra
    options = placement_kwargs(**placement) | draft_load_options(draft, mtp_int4)
    slots = extra["slots"]
    open_backend(options["backend"], options["vram"])  # a bad --backend / --vram fails before the port is bound
    body_limit = parse_size(max_body)
    try:
        kv_disk_bytes = parse_size(kv_disk)
    except UsageError as exc:
        raise UsageError(f"--kv-disk: {exc}") from None
    console = _stderr()
    log_level = log_level.lower()
    logs.configure(log_level)
    if not is_loopback(host) and not api_key:
        console.print(f"[yellow]warning:[/] binding {host} without an API key (--insecure-no-key): anyone who can reach "
                      "this port can use the model")
    from colibri_core.io.hub_cache import hub_repo_id

    name = served_model_name or hub_repo_id(path) or path.resolve().name  # a hub snapshot's name is a commit hash
    service = Service(lambda: load(path, **options), model_name=name, slots=slots, max_queue=max_queue, draft=draft,
                      draft_depth=draft_depth, kv_disk=kv_disk_bytes)
    app = create_app(service, api_key=api_key, max_body=body_limit, hosts=HostNames(host, allowed_hosts))
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=logs.uvicorn_level(log_level), access_log=False,
                                   timeout_graceful_shutdown=5, http=protocol(header_timeout)), service)

    def failed(exc):
        server.should_exit = True

    sock = bind(host, port)  # before saying so: a port in use is one error line, not a log after it
    where = service.address = address(host, sock.getsockname()[1])
    console.print(f"colibri serve: loading {path} as {name!r}; listening on http://{where} (503 until loaded)")
    service.start_loading(on_failure=failed)
    if on_listening is not None:
        on_listening(where, api_key)
    # uvicorn shuts down on SIGTERM, then raises the signal again with the handler it found:
    # ours ends the process through the finally below (the model closed, the prefixes spilled
    # with --kv-disk), where the default handler would kill it on the spot
    main = threading.current_thread() is threading.main_thread()  # signals are the main thread's
    previous = signal.signal(signal.SIGTERM, _terminated) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        sock.close()
        service.wait_loaded(timeout=0)
        if service.status == "ready":
            service.close()
    if service.status == "failed":
        raise service.error
    if not server.started:
        raise UsageError(f"could not listen on {where}")


@click.command("chat")
@model_option()
@click.option("--system", default=None, help="System message.")
@click.option("--max-tokens", type=click.IntRange(1), default=512, show_default=True, help="Tokens per reply at most.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@draft_options
@constraint_options
@click.option("--session", "session_name", default=None, metavar="NAME",
              help="Keep this conversation and its cache on disk as NAME: /save and leaving the chat save it; the next "
                   "chat with --session NAME continues it without computing the conversation again.")
@click.option("--sessions-dir", default=None, metavar="DIR",
              help="Where --session keeps conversations (default: colibri's data dir, sessions/).")
@placement_options
def chat(model_dir, system, max_tokens, temperature, top_p, top_k, seed, draft, draft_depth, mtp_int4, json_schema, regex,
         grammar, session_name, sessions_dir, **placement):
    """Chat with the model in --model in the terminal, on its chat template. Each turn
    continues the cache of the conversation so far. Commands: /reset, /stats,
    /save [FILE], /exit."""
    from colibri_core.cli.run import load_with_progress
    from colibri_serve.chat import ChatSession, run_chat

    path = _check_model_dir(model_dir)
    check_draft_options(draft, draft_depth)
    constraint = constraint_from_options(json_schema, regex, grammar)
    store = saved = None
    if sessions_dir is not None and session_name is None:
        raise UsageError("--sessions-dir is where --session keeps conversations: add --session NAME")
    if session_name is not None:
        from colibri_serve.sessions import SessionStore

        if draft != "off":
            raise UsageError("--session cannot be combined with --draft: a verification can end with drafted positions "
                             "in the conversation's cache")
        store = SessionStore(sessions_dir, session_name)
        store.lock()
    try:
        if store is not None:
            saved = store.read()
            if saved is not None and system is not None and system != saved.system:
                raise UsageError(f"--system: session {session_name!r} has its own system message "
                                 f"({'none' if saved.system is None else repr(saved.system[:40])}); leave --system out "
                                 "or choose another --session name")
        model = load_with_progress(path, quiet=False, **placement_kwargs(**placement), **draft_load_options(draft, mtp_int4))
        with model:
            session = ChatSession(model, system=saved.system if saved is not None else system, max_tokens=max_tokens,
                                  temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, draft=draft,
                                  draft_depth=draft_depth, constraint=constraint, store=store)
            try:
                if saved is not None:
                    session.resume_saved(saved)
                    turns = sum(1 for m in saved.messages if m["role"] == "user")
                    warm = (f", {len(session.kept.fed)} positions warm" if session.kept is not None
                            else " (no saved cache: computed again)")
                    _stderr().print(f"(session {session_name!r} resumed: {turns} turns{warm})", markup=False)
                run_chat(session)
            finally:
                session.close()
    finally:
        if store is not None:
            store.close()
