"""colibri-serve: ``colibri serve`` (the OpenAI and Anthropic APIs over HTTP) and
``colibri chat`` (a terminal chat), registered through the commands hook.

Imports only click and colibri_core at import time: FastAPI, uvicorn and the model load
when a command runs.
"""

from colibri_core import hookimpl

__version__ = "0.1.0"


@hookimpl
def colibri_register_commands(cli):
    from colibri_serve.cli import chat, serve, web

    cli.add_command(serve)
    cli.add_command(chat)
    cli.add_command(web)
