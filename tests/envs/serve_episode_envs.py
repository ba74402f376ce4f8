"""Serves every environment of `episode_envs.py` from one `openreward` SDK Server.

Usage: python serve_episode_envs.py HOST PORT

The process exits when its stdin closes, so a test binary that dies without cleaning
up does not leave the server behind.
"""
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from openreward.environments import Server  # noqa: E402

from episode_envs import ALL  # noqa: E402


def exit_when_stdin_closes() -> None:
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)


if __name__ == "__main__":
    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    Server(ALL).run(host=sys.argv[1], port=int(sys.argv[2]))
