"""Combines weight_sync_ipc (Manta) and weight_sync_ipc_torch (PyTorch) results into
weight_sync.json and prints a table. usage: weight_sync_report.py OUT_DIR"""

import datetime
import json
import os
import sys


def load(path):
    return json.load(open(path)) if os.path.exists(path) else None


def main() -> None:
    out = sys.argv[1]
    gpu = open(os.path.join(out, "gpu.txt")).read().strip()
    res = {"device": os.environ.get("MANTA_DEVICE_KIND", "device machine") + ": " + gpu,
           "date": datetime.date.today().isoformat(),
           "benchmark": "weight sync on one GPU: CUDA IPC between two processes (Manta shim vs "
                        "torch.multiprocessing), in-process engine update (pause to resume); "
                        "Qwen3 shapes, random bf16, median of REPS",
           "pending": "NCCL across GPUs (bandwidth_ratio_vs_torch) needs nvidia-h200-x2"}
    exact = []
    print(f"{'shape':<6}{'GB':>7}{'ipc ms':>9}{'GB/s':>8}{'torch ms':>10}{'1-proc ms':>11}{'pause ms':>10}{'exact':>7}")
    for shape, key in (("0.6b", "0_6b"), ("8b", "8b")):
        ipc = load(os.path.join(out, f"ipc_{key}.json"))
        eng = load(os.path.join(out, f"engine_{key}.json"))
        torch = load(os.path.join(out, f"torch_{key}.json"))
        if not ipc:
            continue
        res[f"ipc_ms_{key}"] = ipc["ipc_copy_ms"]
        res[f"ipc_gb_s_{key}"] = ipc["ipc_gb_s"]
        res[f"ipc_open_ms_{key}"] = ipc["open_ms"]
        res[f"in_process_copy_ms_{key}"] = ipc["in_process_copy_ms"]
        res[f"ipc_vs_in_process_{key}"] = ipc["ipc_vs_in_process"]
        exact.append(ipc["bit_exact"])
        if torch:
            res[f"torch_ipc_ms_{key}"] = torch["ipc_copy_ms"]
            res[f"ipc_speedup_vs_torch_{key}"] = torch["ipc_copy_ms"] / ipc["ipc_copy_ms"]
            res["baseline"] = torch["impl"]
            exact.append(torch["bit_exact"])
        if eng:
            res[f"pause_to_resume_ms_{key}"] = eng["pause_to_resume_ms"]
            exact.append(eng["bit_exact"])
        print(f"{shape:<6}{ipc['bytes'] / 1e9:>7.2f}{ipc['ipc_copy_ms']:>9.2f}{ipc['ipc_gb_s']:>8.0f}"
              f"{(torch or {}).get('ipc_copy_ms', float('nan')):>10.2f}{ipc['in_process_copy_ms']:>11.2f}"
              f"{(eng or {}).get('pause_to_resume_ms', float('nan')):>10.2f}{str(ipc['bit_exact']):>7}")
    res["bit_exact"] = bool(exact) and all(exact)
    json.dump(res, open(os.path.join(out, "weight_sync.json"), "w"), indent=2)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
