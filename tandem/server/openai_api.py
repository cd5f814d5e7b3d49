"""OpenAI-compatible endpoints (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) and session-scoped chat
with exact token histories. Being built (issue 26): no routes yet."""

from __future__ import annotations

from fastapi import FastAPI

from tandem.engine.engine import Engine


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Add the OpenAI-compatible routes to `app`, serving `engine` (its tokenizer: `engine.tokenizer`)."""
