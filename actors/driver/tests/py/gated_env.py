"""An environment served by the real `openreward` SDK Server whose prompts can be held
back: every `get_prompt` appends its number (0, 1, ...) to LOG_FILE, then waits while
its number is at least the one written in BUDGET_FILE (no file: no limit; a file that
does not read as a number holds every prompt). A test lets the first N episodes through,
holds the next ones in flight for as long as it needs, then removes the file.

Usage: python gated_env.py HOST PORT LOG_FILE BUDGET_FILE
"""
import asyncio
import sys

from openreward.environments import Server, TextBlock

from answer_env import AnswerEnv

LOG, BUDGET = sys.argv[3], sys.argv[4]
served = 0


def budget():
    try:
        with open(BUDGET) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        return 0


class Gated(AnswerEnv):
    SIZES = {"train": 8}

    @classmethod
    def list_tasks(cls, split: str):
        return [{"n": i} for i in range(cls.SIZES[split])]

    async def get_prompt(self):
        global served
        number, served = served, served + 1
        with open(LOG, "a") as f:
            f.write(f"{number}\n")
        while (limit := budget()) is not None and number >= limit:
            await asyncio.sleep(0.05)
        return [TextBlock(text=f"what is {self.task_spec['n']} + 1?")]

    def expected_answer(self) -> str:
        return str(self.task_spec["n"] + 1)


if __name__ == "__main__":
    Server([Gated]).run(host=sys.argv[1], port=int(sys.argv[2]))
