"""Prints what an offline W&B run recorded, as JSON: the run's project and name, its
config, and every history row ({"_step": N, metric: value}).

Reads the run's .wandb file: LevelDB-log framing (a 7-byte ":W&B" header, then 32 KiB
blocks of records with a 7-byte header: crc32c, length, type) around protobuf records
decoded with wandb's own schema (wandb.proto.wandb_internal_pb2.Record).

usage: read_wandb_offline.py RUN_DIR/run-ID.wandb
"""

import json
import sys

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(data: bytes):
    if data[:4] != b":W&B":
        raise SystemExit(f"{sys.argv[1]}: not a .wandb file (header {data[:7]!r})")
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        data = f.read()
    out = {"project": None, "name": None, "config": {}, "history": []}
    for record in records(data):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["project"] = record.run.project
            out["name"] = record.run.display_name
            for item in record.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
