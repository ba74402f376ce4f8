"""What the driver tests' `openreward` SDK environments share: splits of a given size and
one `answer` tool that ends the episode with reward 1.0 when the answer is the task's.
A subclass sets SIZES and says how tasks are listed, prompted and answered."""
from pydantic import BaseModel

from openreward.environments import (Environment, JSONObject, TextBlock, ToolOutput,
                                     tool)


class AnswerParams(BaseModel):
    answer: str


class AnswerEnv(Environment):
    SIZES: dict[str, int] = {}

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.task_spec = task_spec

    @classmethod
    def list_splits(cls):
        return list(cls.SIZES)

    def expected_answer(self) -> str:
        raise NotImplementedError

    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Final answer."""
        ok = params.answer.strip() == self.expected_answer()
        return ToolOutput(blocks=[TextBlock(text="ok" if ok else "no")],
                          reward=1.0 if ok else 0.0, finished=True)
