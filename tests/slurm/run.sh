#!/bin/bash
# deploy/slurm/manta.sbatch under a real Slurm: installs slurmctld, slurmd and munge from
# the distribution's packages (needs root and apt), configures a one-host cluster on this
# machine, then
#   1. submits a job (driver + two workers on this host) that trains 5 steps of the tiny
#      model and checks its run directory;
#   2. submits a long job, scancels it after its first step, and checks that no driver
#      or worker process and no port of the job is left.
# Exit 0: passed; 1: failed; 77: SKIPPED (Slurm could not be installed or started here),
# said loudly. Uses target/debug's binaries (built first with cargo build).
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
bin=${MANTA_BIN:-$repo/target/debug}
work=$(mktemp -d /tmp/manta-slurm.XXXXXX)
pids=()
skip() {
    echo "=================================================================="
    echo "SKIPPED tests/slurm/run.sh: $*"
    echo "=================================================================="
    cleanup
    exit 77
}
fail() {
    echo "FAILED tests/slurm/run.sh: $*" >&2
    for f in "$work"/*.log "$work"/job*/*.log "$work"/job*/manta-job-*/*.log; do
        [[ -f "$f" ]] && { echo "--- $f"; tail -40 "$f"; }
    done >&2
    cleanup
    exit 1
}
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
    pids=()
}
trap cleanup EXIT

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    [[ $(id -u) == 0 ]] || skip "Slurm is not installed and this is not root"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        slurmctld slurmd slurm-client munge) >"$work/apt.log" 2>&1 \
        || skip "apt-get install slurmctld slurmd slurm-client munge failed (see $work/apt.log)"
fi
for f in "$bin/driver" "$bin/worker"; do
    [[ -x $f ]] || fail "$f missing: cargo build -p manta-driver --bins first"
done

# munge: a fresh key for this test only.
mkdir -p "$work/munge" && chmod 700 "$work/munge"
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$work/munge/munge.key"
munged --foreground --force --key-file="$work/munge/munge.key" \
    --socket="$work/munge/munge.socket" --pid-file="$work/munge/munged.pid" \
    --log-file="$work/munge.log" --seed-file="$work/munge/seed" 2>>"$work/munge.log" &
pids+=($!)
for _ in $(seq 1 50); do [[ -S $work/munge/munge.socket ]] && break; sleep 0.1; done
[[ -S $work/munge/munge.socket ]] || skip "munged did not start (see $work/munge.log)"

host=$(hostname -s)
cpus=$(nproc)
ctl_port=$((6900 + RANDOM % 400))
mkdir -p "$work/state" "$work/spool"
cat >"$work/slurm.conf" <<CONF
ClusterName=manta-ci
SlurmctldHost=$host
SlurmctldPort=$ctl_port
SlurmdPort=$((ctl_port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=20
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF=$work/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" >"$work/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >"$work/slurmd.out" 2>&1 &
pids+=($!)
up=
for _ in $(seq 1 100); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix)'; then up=1; break; fi
    sleep 0.3
done
[[ -n $up ]] || skip "the one-host Slurm cluster did not come up (see $work/slurmctld.log, $work/slurmd.log)"
echo "slurm up on $host ($cpus CPUs)"

# The run's cluster file, without [[nodes]]: the sbatch script adds one per worker.
cat >"$work/cluster-base.toml" <<CONF
[cluster]
mode = "remote"
train_config = "$repo/train_config.yaml"
heartbeat_interval_ms = 200
dead_after_ms = 3000

[rollout]
engines = 1
max_concurrent_episodes = 8

[train]
model = "$repo/assets/tiny-qwen3"
seed = 1
max_response_len = 8
context_len = 512
CONF
export MANTA_CLUSTER_TOKEN=slurm-ci-$RANDOM$RANDOM MANTA_BIN=$bin MANTA_CLUSTER_BASE=$work/cluster-base.toml
export RUST_LOG=info

# submit NAME PORT STEPS: a job of two workers on this host; prints its id.
submit() {
    local name=$1 port=$2 steps=$3
    mkdir -p "$work/$name"
    (cd "$work/$name" && MANTA_WORKER_PORT=$port sbatch --parsable -N1 --ntasks-per-node=2 \
        --cpus-per-task=1 --overcommit --output="$work/$name/job.log" \
        "$repo/deploy/slurm/manta.sbatch" -- --runs-dir "$work/$name/runs" --run-name r \
        --save "$work/$name/ckpt" --save-interval 0 --num-rollout "$steps" \
        --rollout-batch-size 2 --n-samples 2)
}
job_done() { [[ -z $(squeue -h -j "$1" 2>/dev/null) ]]; }
wait_job() {
    for _ in $(seq 1 "$2"); do job_done "$1" && return 0; sleep 1; done
    return 1
}

# 1. Five steps with two workers.
port1=$((7600 + RANDOM % 300))
job=$(submit train "$port1" 5) || fail "sbatch refused the job"
wait_job "$job" 600 || { scancel "$job"; fail "job $job still running after 10 minutes"; }
state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z]*' | head -1)
run="$work/train/runs/r"
steps=$(grep -c '"step"' "$run/metrics.jsonl" 2>/dev/null || echo 0)
[[ $steps == 5 ]] || fail "job $job ($state): $steps steps in $run/metrics.jsonl, expected 5"
grep -qE '"cluster/live_nodes":2(\.0)?[,}]' "$run/metrics.jsonl" || fail "the run did not train on two workers"
[[ $(cat "$work/train/ckpt/latest") == step_000005 ]] || fail "no step-5 checkpoint"
grep -q 'step     5/5' "$run/driver.log" || fail "driver.log lacks the step lines"
echo "job $job: 5 steps on two workers, checkpoint step_000005"

# 2. scancel mid-run: nothing of the job stays.
port2=$((port1 + 8))
job=$(submit cancel "$port2" 1000) || fail "sbatch refused the second job"
run="$work/cancel/runs/r"
for _ in $(seq 1 300); do
    grep -q '"step"' "$run/metrics.jsonl" 2>/dev/null && break
    job_done "$job" && fail "job $job ended before its first step"
    sleep 1
done
grep -q '"step"' "$run/metrics.jsonl" 2>/dev/null || fail "job $job made no step in 5 minutes"
status_port=$(sed 's/.*://' "$run/status_addr")
scancel "$job"
wait_job "$job" 120 || fail "job $job still listed 2 minutes after scancel"
sleep 1
left=$(pgrep -af "$bin/(driver|worker)" | grep -v pgrep || true)
[[ -z $left ]] || fail "processes left after scancel: $left"
for p in "$port2" $((port2 + 1)) "$status_port"; do
    if ss -ltn "( sport = :$p )" | grep -q LISTEN; then fail "port $p still open after scancel"; fi
done
echo "job $job: scancel after step 1 left no driver, worker or port"
cleanup
rm -rf "$work"
echo "PASSED tests/slurm/run.sh"
