"""A fake LLM: a scripted OpenAI-compatible chat endpoint on loopback.

No model that proposes sensible configs can run here, so the LLM agent's tests talk
to a real aiohttp server that answers chat completions with canned text, in order
(the last one again once they run out), and records what it was asked.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


class FakeLlm:
    def __init__(self, *answers: str) -> None:
        assert answers, "a fake LLM needs at least one answer"
        self.answers = list(answers)
        self.requests: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        text = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return web.json_response({"choices": [{"message": {"role": "assistant",
                                                           "content": text}}]})

    async def start(self) -> tuple[web.AppRunner, str]:
        """Serve on a free loopback port: the runner (to clean up) and the base URL."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner, f"http://127.0.0.1:{port}"
