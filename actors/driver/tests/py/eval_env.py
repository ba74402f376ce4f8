"""An environment served by the real `openreward` SDK Server with a train and a test
split whose prompts say which split they are from (TRAINTASK / EVALTASK), and which
logs every episode's task (one JSON line per prompt served) so a test can see which
tasks ran, and in what order. For the evaluation-during-training test.

Usage: python eval_env.py HOST PORT LOG_FILE
"""
import json
import sys

from openreward.environments import Server, TextBlock

from answer_env import AnswerEnv

LOG = sys.argv[3] if len(sys.argv) > 3 else None


class EvalEnv(AnswerEnv):
    SIZES = {"train": 6, "test": 3}

    @classmethod
    def list_tasks(cls, split: str):
        # Test ids start at 100, so the two splits never share one.
        first = 0 if split == "train" else 100
        return [{"split": split, "id": first + i} for i in range(cls.SIZES[split])]

    def get_prompt(self):
        if LOG:
            with open(LOG, "a") as f:
                f.write(json.dumps({"split": self.task_spec["split"],
                                    "id": self.task_spec["id"]}) + "\n")
        tag = "TRAINTASK" if self.task_spec["split"] == "train" else "EVALTASK"
        return [TextBlock(text=f"{tag} {self.task_spec['id']}: answer with the number.")]

    def expected_answer(self) -> str:
        return str(self.task_spec["id"])


if __name__ == "__main__":
    Server([EvalEnv]).run(host=sys.argv[1], port=int(sys.argv[2]))
