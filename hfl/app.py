"""Flower's entry points for ``flwr run`` and every deployment host (``pyproject.toml``,
``[tool.flwr.app.components]``), light to import.

Flower starts a new ClientApp process for every message a SuperNode receives, and it imports
this module first. A node host's bridge only relays the message to its node server
(``hfl.deploy.bridge``), so its path imports neither torch nor the engine (about 4 s a message
on 2 cores); everything else loads ``hfl.runtime.apps``.
"""

from __future__ import annotations

from typing import Any

from flwr.client import Client, ClientApp
from flwr.common import Context
from flwr.server import ServerApp


def _config(context: Context) -> dict:
    from hfl.runtime.apps import _context_config

    return _context_config(context)


def _client_fn(context: Context) -> Client:
    if context.node_config.get("role") is not None:  # a deployment's bridge or device
        from hfl.deploy.wiring import deployed_client

        return deployed_client(context, lambda: _config(context))
    from hfl.runtime.apps import _flwr_client_fn

    return _flwr_client_fn(context)


class _ServerApp(ServerApp):
    """``hfl.runtime.apps.server_app``, imported when a run starts."""

    def __call__(self, grid: Any, context: Context) -> None:
        from hfl.runtime.apps import server_app

        server_app(grid, context)


client_app = ClientApp(client_fn=_client_fn)
server_app = _ServerApp()
