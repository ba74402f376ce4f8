"""Two environments served by the real `openreward` SDK Server, whose task specs hold
non-ASCII text and floats that Python's json.dumps writes its own way (1e-05, 1e+16),
for checking `driver prepare-tasks` against the cookbook's rules.

Usage: python cookbook_envs.py HOST PORT
"""
import sys

from pydantic import BaseModel

from openreward.environments import (Environment, JSONObject, Server, TextBlock,
                                     ToolOutput, tool)

FLOATS = [1e-05, 1e16, 0.1, 2.5e-07, 123456789.125, -0.0, 1.0, 3e+20]
TEXTS = ["café", "naïve — ok", "日本語", "emoji 😀 here", "tab\there", "quote \" and \\", "plain"]


def specs(kind: str, split: str, count: int) -> list:
    out = []
    for i in range(count):
        out.append({
            "z_last": i,
            "kind": kind,
            "split": split,
            "text": TEXTS[i % len(TEXTS)] + f" #{i}",
            "value": FLOATS[i % len(FLOATS)],
            "nested": {"b": [i, FLOATS[(i + 3) % len(FLOATS)], None, True], "a": "ü"},
            "question": f"what is {i} + 1?",
        })
    return out


class AnswerParams(BaseModel):
    answer: str


class _Base(Environment):
    KIND = ""
    SIZES: dict = {}

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):
        super().__init__(task_spec)
        self.task_spec = task_spec

    @classmethod
    def list_splits(cls):
        return list(cls.SIZES)

    @classmethod
    def list_tasks(cls, split: str):
        return specs(cls.KIND, split, cls.SIZES[split])

    def get_prompt(self):
        return [TextBlock(text=self.task_spec["question"])]

    @tool
    async def answer(self, params: AnswerParams) -> ToolOutput:
        """Final answer."""
        ok = params.answer.strip() == str(self.task_spec["z_last"] + 1)
        return ToolOutput(blocks=[TextBlock(text="ok" if ok else "no")],
                          reward=1.0 if ok else 0.0, finished=True)


class Alpha(_Base):
    KIND = "alpha"
    SIZES = {"train": 23, "test": 7}


class Beta(_Base):
    KIND = "beta"
    SIZES = {"train": 11}


if __name__ == "__main__":
    Server([Alpha, Beta]).run(host=sys.argv[1], port=int(sys.argv[2]))
