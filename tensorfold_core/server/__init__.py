"""The OpenAI-compatible HTTP server over a host: FastAPI app, uvicorn runner, SSE, error mapping."""

from .app import create_app
from .run import Server, serve, start_in_thread

__all__ = ["Server", "create_app", "serve", "start_in_thread"]
