"""Manta's Weights & Biases sidecar: logs the driver's per-step metrics with `wandb`.

The driver (crates/telemetry/src/wandb.rs) embeds this file and starts it as
    python -c <this file> PROJECT RUN_NAME
then writes JSON lines on stdin: first {"config": {...}}, then one
{"step": N, "<metric>": value, ...} per step. End of input finishes the run.
Exit status 3: `wandb` cannot be imported; 4: wandb.init failed.
"""

import json
import signal
import sys


def main() -> int:
    # Ctrl-C reaches the whole process group; the driver finishes its step and closes
    # stdin, which is when this run must end (not earlier, losing the last steps).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    project, name = sys.argv[1], sys.argv[2]
    try:
        import wandb
    except ImportError as e:
        print(
            f"manta-wandb: cannot import wandb with {sys.executable}: {e} "
            "(pip install wandb, or set MANTA_PYTHON to a Python that has it)",
            file=sys.stderr,
        )
        return 3
    first = sys.stdin.readline()
    config = json.loads(first).get("config", {}) if first.strip() else {}
    try:
        run = wandb.init(project=project, name=name, config=config)
    except Exception as e:  # wandb raises several types (auth, network, usage)
        print(f"manta-wandb: wandb.init(project={project!r}) failed: {e}", file=sys.stderr)
        return 4
    for line in sys.stdin:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            print(f"manta-wandb: skipping a malformed line ({e}): {line[:200]!r}", file=sys.stderr)
            continue
        step = row.pop("step", None)
        if not isinstance(step, int):
            print(f"manta-wandb: skipping a line without an integer step: {line[:200]!r}", file=sys.stderr)
            continue
        run.log({k: v for k, v in row.items() if v is not None}, step=step)
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
