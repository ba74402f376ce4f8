"""ORS load benchmark server: a counter environment on the real `openreward` SDK Server,
wrapped in an outermost ASGI middleware that times every request server side.

Usage: python ors_load_env.py HOST PORT

Per request the middleware records (path, server_ms) under the request's session id
(`X-Session-ID`; for `/create_session`, the sid its SSE answer carries). server_ms runs
from the moment the request enters the ASGI app to the moment its last non-empty body
chunk is handed to uvicorn, so everything the server does for the request is on the
server's side of the ledger. `POST /bench_timings` returns all records and clears them.
"""
import json
import re
import sys
import time

from pydantic import BaseModel

from openreward.environments import (Environment, JSONObject, Server, TextBlock,
                                     ToolOutput, tool)
from openreward.environments.environment import terminal

NUM_TASKS = 64
SID_IN_SSE = re.compile(rb"event: task_id\r?\ndata: ([0-9a-fA-F-]{8,64})")


class AddParams(BaseModel):
    amount: int


class AnswerParams(BaseModel):
    answer: str


class OrsLoadEnv(Environment):
    """Counter: reach `target` from `start` with `add`, then `answer` the value (reward 1)."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.value = int(task_spec["start"])
        self.target = int(task_spec["target"])

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        if split != "train":
            raise ValueError(f"unknown split {split!r}")
        return [{"start": i, "target": i + 2} for i in range(NUM_TASKS)]

    def get_prompt(self):
        return [TextBlock(text=f"Counter is {self.value}. Reach {self.target}, then answer.")]

    @tool
    async def add(self, params: AddParams) -> ToolOutput:
        """Add an integer to the counter."""
        self.value += params.amount
        return ToolOutput(blocks=[TextBlock(text=f"value is now {self.value}")],
                          reward=0.0, finished=False, metadata={"value": self.value})

    @terminal
    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Final answer: the counter value."""
        ok = params.answer.strip() == str(self.value) and self.value == self.target
        return ToolOutput(blocks=[TextBlock(text="correct" if ok else "wrong")],
                          reward=1.0 if ok else 0.0, finished=True)


class TimingMiddleware:
    """Outermost ASGI middleware: per-session server-side handling time of each request."""

    def __init__(self, app):
        self.app = app
        self.records: dict[str, list] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path == "/bench_timings":
            body = json.dumps(self.records).encode()
            self.records = {}
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        start = time.perf_counter()
        sid = dict(scope.get("headers", [])).get(b"x-session-id", b"").decode()
        last = [start]
        found = [sid]

        async def timed_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                last[0] = time.perf_counter()
                if not found[0]:
                    m = SID_IN_SSE.search(message["body"])
                    if m:
                        found[0] = m.group(1).decode()
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.records.setdefault(found[0], []).append(
                [path, (last[0] - start) * 1000.0])


if __name__ == "__main__":
    server = Server([OrsLoadEnv])
    server.app = TimingMiddleware(server.app)
    server.run(host=sys.argv[1], port=int(sys.argv[2]))
