"""Test environments for Manta's episode loop, written against the real `openreward` SDK.

Each class is served by one SDK `Server` (see `serve_episode_envs.py`) under
`/{lowercase class name}/…`. They exercise one ORS behaviour each; the Rust side is
`actors/rollout/tests/ors_sdk_episodes.rs`.
"""
import asyncio

from pydantic import BaseModel

from openreward.environments import (Environment, ImageBlock, JSONObject, TextBlock,
                                     ToolOutput, tool)


def text(s: str) -> list:
    return [TextBlock(text=s)]


class AnswerParams(BaseModel):
    answer: str


class SingleStep(Environment):
    """One question; the `answer` tool grades it and ends the episode."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.question = str(task_spec["question"])
        self.expected = str(task_spec["answer"])

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"question": "What is 6 times 7?", "answer": "42"}]

    def get_prompt(self):
        return text(self.question)

    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Submit the final answer."""
        ok = params.answer.strip() == self.expected
        return ToolOutput(blocks=text("correct" if ok else f"wrong: {params.answer}"),
                          reward=1.0 if ok else 0.0, finished=True)


class StepParams(BaseModel):
    amount: int


class NoteParams(BaseModel):
    text: str


class MultiStep(Environment):
    """Each successful `step` pays the next reward of `task_spec["rewards"]`; `note` pays
    nothing (reward null); `finish` pays `task_spec["final"]` and ends the episode."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.rewards = [float(r) for r in task_spec["rewards"]]
        self.final = float(task_spec["final"])
        self.steps = 0
        self.total = 0

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"rewards": [0.5, -0.25, 1.0], "final": 2.0}]

    def get_prompt(self):
        return text(f"Take {len(self.rewards)} steps, then finish.")

    @tool
    async def step(self, params: StepParams) -> ToolOutput:
        """Move by an integer amount."""
        reward = self.rewards[self.steps] if self.steps < len(self.rewards) else 0.0
        self.steps += 1
        self.total += params.amount
        return ToolOutput(blocks=text(f"step {self.steps}: total {self.total}"),
                          reward=reward, finished=False)

    @tool
    async def note(self, params: NoteParams) -> ToolOutput:
        """Write a note (no reward)."""
        return ToolOutput(blocks=text(f"noted {params.text!r}"), reward=None, finished=False)

    @tool
    async def finish(self) -> ToolOutput:
        """End the episode."""
        return ToolOutput(blocks=text(f"finished after {self.steps} steps"),
                          reward=self.final, finished=True)


class Faulty(Environment):
    """`explode` raises inside the tool (the SDK answers with an SSE `error` event)."""

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"id": 0}]

    def get_prompt(self):
        return text("Call explode.")

    @tool
    async def explode(self) -> ToolOutput:
        """Raises."""
        raise RuntimeError("faulty env: deliberate tool failure")

    @tool
    async def calm(self) -> ToolOutput:
        """Works (pays 0.3)."""
        return ToolOutput(blocks=text("calm"), reward=0.3, finished=False)


def big_text() -> str:
    """4 MiB+ of deterministic text with non-ASCII characters and leading spaces, so the
    SDK's 2 KB SSE chunks split it everywhere. Rebuilt identically by the Rust test."""
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    lines = []
    size = 0
    i = 0
    while size < 4 * 1024 * 1024:
        r = i % 26
        line = f" row {i:06d} é日本 {alphabet[r:]}{alphabet[:r]} {{\"k\": [{i}]}}\n"
        lines.append(line)
        size += len(line.encode("utf-8"))
        i += 1
    return "".join(lines)


class Bulk(Environment):
    """`big` returns 4 MiB of text; `slow` outlasts the SSE ping interval; `done` ends."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.sleep = float(task_spec.get("sleep", 11.5))

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"sleep": 11.5}]

    def get_prompt(self):
        return text("Fetch the big text, then finish.")

    @tool
    async def big(self) -> ToolOutput:
        """Returns a very long text."""
        return ToolOutput(blocks=text(big_text()), reward=None, finished=False)

    @tool
    async def slow(self) -> ToolOutput:
        """Takes longer than the 10 s SSE ping interval."""
        await asyncio.sleep(self.sleep)
        return ToolOutput(blocks=text(f"waited {self.sleep} s"), reward=0.75, finished=True)

    @tool
    async def done(self) -> ToolOutput:
        """End the episode."""
        return ToolOutput(blocks=text("bye"), reward=1.0, finished=True)


class IndexOnly(Environment):
    """Refuses `/tasks` (list_tasks raises NotImplementedError → 400 "not supported");
    tasks are reachable only through `num_tasks` + `get_task`."""

    @classmethod
    def list_splits(cls):
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str):
        raise NotImplementedError("too many tasks to list")

    @classmethod
    async def num_tasks(cls, split: str) -> int:
        return 7 if split == "train" else 2

    @classmethod
    async def get_task(cls, split: str, index: int) -> JSONObject:
        if index < 0 or index >= await cls.num_tasks(split):
            raise IndexError(index)
        return {"split": split, "index": index, "square": index * index}

    def get_prompt(self):
        return text(f"What is {self.task_spec['index']} squared?")

    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Submit the final answer."""
        ok = params.answer.strip() == str(self.task_spec["square"])
        return ToolOutput(blocks=text("ok" if ok else "no"), reward=1.0 if ok else 0.0,
                          finished=True)


class Vision(Environment):
    """The prompt mixes text and image blocks; the episode keeps only the text."""

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"id": 0}]

    def get_prompt(self):
        # A 1×1 transparent PNG.
        png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8"
               "AAAAASUVORK5CYII=")
        return [TextBlock(text="Look at the picture."),
                ImageBlock(data=png, mimeType="image/png"),
                TextBlock(text="What colour is it?")]

    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Submit the final answer."""
        ok = params.answer.strip().lower() == "transparent"
        return ToolOutput(blocks=text("ok" if ok else "no"), reward=1.0 if ok else 0.0,
                          finished=True)


class Secretive(Environment):
    """Reads the session's secrets (from the `X-Secrets` header). The prompt echoes the
    secret names and `shared_token`; `check` pays 1.0 only when secret `env_token` equals
    the task's `expect`."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.secrets = dict(secrets)

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"expect": "per-env-456"}]

    def get_prompt(self):
        names = ",".join(sorted(self.secrets))
        shared = self.secrets.get("shared_token", "<none>")
        return text(f"Check your credentials. secrets=[{names}] shared_token={shared}")

    @tool
    async def check(self) -> ToolOutput:
        """Compares the secret with the task's expectation."""
        ok = self.secrets.get("env_token") == self.task_spec["expect"]
        return ToolOutput(blocks=text(f"match={ok}"), reward=1.0 if ok else 0.0,
                          finished=True)


ALL = [SingleStep, MultiStep, Faulty, Bulk, IndexOnly, Vision, Secretive]
