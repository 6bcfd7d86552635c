"""HTTP serving: an OpenAI-compatible API over a runner's engine (``Server``), with
Prometheus metrics; ``python run.py serve`` starts it. No scheduling and no model math here."""

from server.app import Server
from server.http import Limits, configure_logging, serve_forever

__all__ = ["Limits", "Server", "configure_logging", "serve_forever"]
