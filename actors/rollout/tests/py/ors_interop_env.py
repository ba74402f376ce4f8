"""A tiny environment served by the real `openreward` SDK Server, for interop tests.

Usage: python ors_interop_env.py HOST PORT
"""
import json
import sys

from pydantic import BaseModel

from openreward.environments import (Environment, JSONObject, Server, TextBlock,
                                     ToolOutput, tool)
from openreward.environments.environment import terminal


class AddParams(BaseModel):
    amount: int


class AnswerParams(BaseModel):
    answer: str


class InteropEnv(Environment):
    """Counter with per-step rewards, a big-output tool, a failing tool and a terminal answer."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.value = int(task_spec["start"])
        self.target = int(task_spec["target"])
        self.secrets = dict(secrets)

    @classmethod
    def list_splits(cls):
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str):
        if split not in ("train", "test"):
            raise ValueError(split)
        return [{"start": i, "target": i + 2} for i in range(5)]

    def get_prompt(self):
        return [TextBlock(text=f"start {self.value} target {self.target}"),
                TextBlock(text="secrets " + json.dumps(self.secrets, sort_keys=True))]

    @tool
    async def add(self, params: AddParams) -> ToolOutput:
        """Add an integer to the counter."""
        before = abs(self.value - self.target)
        self.value += params.amount
        closer = abs(self.value - self.target) < before
        return ToolOutput(blocks=[TextBlock(text=f"value is now {self.value}")],
                          reward=0.1 if closer else 0.0, finished=False,
                          metadata={"value": self.value})

    @tool
    async def big(self) -> ToolOutput:
        """Return a long text (exercises SSE chunking)."""
        text = "".join(f"line {i}: " + "x" * 50 + "\n" for i in range(300))
        return ToolOutput(blocks=[TextBlock(text=text)], finished=False)

    @tool
    async def boom(self) -> ToolOutput:
        """Raise an exception."""
        raise RuntimeError("interop tool exploded")

    @terminal
    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Final answer: the counter value."""
        ok = params.answer.strip() == str(self.value) and self.value == self.target
        return ToolOutput(blocks=[TextBlock(text="correct" if ok else "wrong")],
                          reward=1.0 if ok else 0.0, finished=True)


if __name__ == "__main__":
    Server([InteropEnv]).run(host=sys.argv[1], port=int(sys.argv[2]))
