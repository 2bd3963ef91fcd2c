"""A live dashboard at /dashboard: one static page that polls /dashboard/data, the host's own live figures."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from .served import ServedHost

PAGE = Path(__file__).parent / "static" / "dashboard.html"


def install(app: FastAPI, host: ServedHost) -> None:
    """The page and the JSON it reads (both behind the API key like every route but /health)."""

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/dashboard/data")
    def data() -> dict:
        """Streams decoding now, the engine's draft counters and guard verdicts, the ledger, queue and cache."""
        return {"streams": host.streams_report(), "metrics": host.metrics(), "health": host.health()}
