"""An environment served by the real `openreward` SDK Server whose `list_tasks` is
refused (NotImplementedError -> HTTP 400 "not supported"), so clients must read tasks
one index at a time through `num_tasks` + `task`. For `driver prepare-tasks` tests.

Usage: python index_only_env.py HOST PORT
"""
import sys

from openreward.environments import JSONObject, Server, TextBlock

from answer_env import AnswerEnv


class IndexOnlyEnv(AnswerEnv):
    SIZES = {"train": 9, "test": 4}

    @classmethod
    def list_tasks(cls, split: str):
        raise NotImplementedError("this environment only serves tasks by index")

    @classmethod
    async def num_tasks(cls, split: str) -> int:
        return cls.SIZES[split]

    @classmethod
    async def get_task(cls, split: str, index: int) -> JSONObject:
        if not 0 <= index < cls.SIZES[split]:
            raise IndexError(index)
        return {"split": split, "n": index, "question": f"what is {index} + 1?"}

    def get_prompt(self):
        return [TextBlock(text=self.task_spec["question"])]

    def expected_answer(self) -> str:
        return str(self.task_spec["n"] + 1)


if __name__ == "__main__":
    Server([IndexOnlyEnv]).run(host=sys.argv[1], port=int(sys.argv[2]))
