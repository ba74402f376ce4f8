"""Runs episodes against an ORS server with the official `openreward` SDK client and
prints what it saw as JSON. Usage: python sdk_client_episode.py BASE_URL"""
import asyncio
import json
import sys

from openreward.api.environments.client import AsyncEnvironmentsAPI


def texts(blocks):
    return [b.text for b in blocks if getattr(b, "type", "") == "text"]


async def main(base_url: str) -> dict:
    api = AsyncEnvironmentsAPI(base_url=base_url, api_key=None)
    out: dict = {}
    try:
        digits = api.get("digits")  # no variant: bare paths, redirected by the server
        out["digits_splits"] = await digits.list_splits()
        tasks = await digits.list_tasks("test")
        out["digits_num_tasks"] = len(tasks)
        out["digits_env_name"] = tasks[0].environment_name
        async with digits.session(task=tasks[0]) as s:
            out["digits_prompt"] = texts(await s.get_prompt())
            out["digits_tools"] = [t.name for t in await s.list_tools()]
            term = await s.terminal_tool()
            out["digits_terminal"] = [term.name, term.arg]
            target = tasks[0].task_spec["target"]
            res = await s.call_terminal_tool(f" {target} ")
            out["digits_result"] = [res.reward, res.finished, texts(res.blocks)]

        counter = api.get("counter", variant="counter")
        out["counter_num_tasks"] = await counter.num_tasks("train")
        async with counter.session(split="train", index=0) as s:
            out["counter_prompt"] = texts(await s.get_prompt())
            out["counter_tools"] = [t.name for t in await s.list_tools()]
            steps = []
            r = await s.call_tool("add", {"amount": 0})
            steps.append([r.reward, r.finished, texts(r.blocks)])
            try:
                await s.call_tool("add", {"amount": "x"})
                steps.append("no error")
            except Exception as e:  # ToolCallError(reason="input_validation")
                steps.append([type(e).__name__, getattr(e, "reason", None)])
            r = await s.call_tool("submit", {})
            steps.append([r.reward, r.finished, texts(r.blocks)])
            out["counter_steps"] = steps
    finally:
        await api.aclose()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
