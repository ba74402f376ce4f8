"""An environment served by the real `openreward` SDK Server whose `list_tasks` is
refused (NotImplementedError -> HTTP 400 "not supported"), so clients must read tasks
one index at a time through `num_tasks` + `task`. For `driver prepare-tasks` tests.

Usage: python index_only_env.py HOST PORT
"""
import sys

from pydantic import BaseModel

from openreward.environments import (Environment, JSONObject, Server, TextBlock,
                                     ToolOutput, tool)

SIZES = {"train": 9, "test": 4}


class AnswerParams(BaseModel):
    answer: str


class IndexOnlyEnv(Environment):
    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.task_spec = task_spec

    @classmethod
    def list_splits(cls):
        return list(SIZES)

    @classmethod
    def list_tasks(cls, split: str):
        raise NotImplementedError("this environment only serves tasks by index")

    @classmethod
    async def num_tasks(cls, split: str) -> int:
        return SIZES[split]

    @classmethod
    async def get_task(cls, split: str, index: int) -> JSONObject:
        if not 0 <= index < SIZES[split]:
            raise IndexError(index)
        return {"split": split, "n": index, "question": f"what is {index} + 1?"}

    def get_prompt(self):
        return [TextBlock(text=self.task_spec["question"])]

    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Final answer."""
        ok = params.answer.strip() == str(self.task_spec["n"] + 1)
        return ToolOutput(blocks=[TextBlock(text="ok" if ok else "no")],
                          reward=1.0 if ok else 0.0, finished=True)


if __name__ == "__main__":
    Server([IndexOnlyEnv]).run(host=sys.argv[1], port=int(sys.argv[2]))
