"""ORS load baseline: the same scripted episodes as bench/src/bin/ors_load.rs, through the
official `openreward` Python SDK client (AsyncOpenReward, asyncio, a semaphore for the
concurrency limit). Prints one JSON object of the same shape as the Rust bench.

Usage: python ors_load_sdk_client.py BASE_URL VARIANT EPISODES CONCURRENCY
"""
import asyncio
import json
import sys
import time

from openreward import AsyncOpenReward


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


async def episode(env, task) -> tuple[str, list]:
    start, target = int(task.task_spec["start"]), int(task.task_spec["target"])
    calls = []
    session = env.session(task=task)
    t = time.perf_counter()
    await session.__aenter__()
    calls.append(["open", ms(t)])
    sid = session.sid
    try:
        t = time.perf_counter()
        tools = await session.list_tools()
        calls.append(["tools", ms(t)])
        # (terminal_tool() would fetch /task_tools again; the final reward checks `answer`.)
        if "add" not in [x.name for x in tools]:
            raise RuntimeError(f"{sid}: unexpected tools {tools}")

        t = time.perf_counter()
        prompt = await session.get_prompt()
        calls.append(["prompt", ms(t)])
        if not prompt or not getattr(prompt[0], "text", None):
            raise RuntimeError(f"{sid}: prompt without text: {prompt}")

        out = None
        for name, inp in [("add", {"amount": 1}), ("add", {"amount": target - start - 1}),
                          ("answer", {"answer": str(target)})]:
            t = time.perf_counter()
            out = await session.call_tool(name, inp)
            calls.append(["call", ms(t)])
        if (out.reward, out.finished) != (1.0, True):
            raise RuntimeError(f"{sid}: episode ended with reward {out.reward} "
                               f"finished {out.finished}, expected 1.0, True")
    finally:
        t = time.perf_counter()
        await session.__aexit__(None, None, None)
        calls.append(["close", ms(t)])
    return sid, calls


async def main(base_url: str, variant: str, episodes: int, concurrency: int) -> dict:
    client = AsyncOpenReward(api_key="", base_url=base_url)
    env = client.environments.get(variant, variant=variant, base_url=base_url)
    tasks = await env.list_tasks("train")  # setup, not timed
    if not tasks:
        raise SystemExit(f"split train of {base_url} has no tasks")
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int):
        async with gate:
            return await episode(env, tasks[i % len(tasks)])

    t0 = time.perf_counter()
    results = await asyncio.gather(*(gated(i) for i in range(episodes)), return_exceptions=True)
    wall = time.perf_counter() - t0
    await client.environments.aclose()
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    return {
        "client": "openreward Python SDK AsyncOpenReward (asyncio)",
        "episodes": episodes,
        "concurrency": concurrency,
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": wall,
        "episodes_per_s": len(done) / wall,
        "sessions": {sid: calls for sid, calls in done},
    }


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit("usage: ors_load_sdk_client.py BASE_URL VARIANT EPISODES CONCURRENCY")
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                      int(sys.argv[4])))))
