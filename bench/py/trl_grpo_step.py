"""Whole GRPO steps of TRL's GRPOTrainer, the peer of Manta's colocated loop (bench/run_trl_step.sh).

usage: trl_grpo_step.py --model-dir DIR [--prompts 32] [--samples 8] [--max-completion-len 64]
                        [--steps 4] [--micro-batch 64] [--gradient-checkpointing true|false]
                        [--dtype bf16|fp32-master|fp32] [--out FILE]

DIR is a model directory in Hugging Face layout without weights (bench/py/e2e_model.py
writes the Qwen3-0.6B or 8B shape; assets/tiny-qwen3 is a CPU-sized one): the model is built
from its config.json with random weights (AutoModelForCausalLM.from_config), the
tokenizer and chat template come from the directory. One optimizer step = one generation
of PROMPTS x SAMPLES completions with transformers' generate (use_vllm off, TRL's
default), the reward, and PROMPTS x SAMPLES / MICRO_BATCH micro-batches of forward and
backward, then AdamW: Manta's step (--num-steps-per-rollout 1) in TRL's terms
(generation_batch_size = per_device_train_batch_size x gradient_accumulation_steps, so no
extra old-log-prob pass; beta 0, so no reference model).

The task mirrors Manta's built-in single-turn `digits` environment as train_config.yaml
runs it: the same system and user prompts through the model dir's chat template with
enable_thinking false, and the same reward rule (per character of the trimmed answer: 1
for the target digit, 0.5 for another digit, 0 otherwise). The dataset is made here
(datasets.Dataset.from_dict); nothing is read from the Hub (HF_HUB_OFFLINE=1 and friends
are set before any import, report_to none). With the random 0.6B model nearly every reward
is 0, so advantages are 0; TRL still runs every forward, backward and optimizer step.

Each optimizer step's wall time is taken between successive on_step_end callbacks (the
first from on_train_begin), after torch.cuda.synchronize(), so it holds everything TRL does
in a step: prompt fetch, generation, reward, training micro-batches, optimizer step and
logging. The first step (CUDA and allocator warm-up) is left out of the median. The time
spent in TRL's _generate_and_score_completions (generation, decode, reward, advantages) is
reported as rollout_s; train_s is the rest. Prints one JSON object on stdout (the training
logs go to stderr) and writes it to --out when given.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
               ("HF_HUB_DISABLE_TELEMETRY", "1"), ("TOKENIZERS_PARALLELISM", "false"),
               ("WANDB_DISABLED", "true")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402


def digits_reward(answer: str, target: int) -> float:
    """Manta's `digits` rule: mean per character of the trimmed answer of 1.0 (the target
    digit), 0.5 (another ASCII digit) or 0.0; an empty answer scores 0.0."""
    answer = answer.strip()
    if not answer:
        return 0.0
    want = str(target)
    return sum(1.0 if c == want else 0.5 if c in "0123456789" else 0.0 for c in answer) / len(answer)


def completion_text(completion) -> str:
    # Conversational prompts give completions as a list of messages.
    if isinstance(completion, list):
        return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))
    return completion


def reward_digits(completions, target, **kwargs):
    return [digits_reward(completion_text(c), int(t)) for c, t in zip(completions, target)]


# The system prompt of Manta's single-turn runs (train_config.yaml: "Follow the
# instruction.{tools}"; `digits` lists no tools besides its terminal answer, so {tools} is
# empty), rendered like Manta's (thinking: false opens the assistant turn with an empty
# think block).
SYSTEM = "Follow the instruction."


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="config.json + tokenizer files, no weights needed")
    p.add_argument("--prompts", type=int, default=32, help="prompts (GRPO groups) per step")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--max-completion-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps; the first is warm-up")
    p.add_argument("--micro-batch", type=int, default=64,
                   help="completions per forward/backward (per_device_train_batch_size); must divide prompts x samples")
    p.add_argument("--gradient-checkpointing", default="true", choices=["true", "false"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32-master", "fp32"],
                   help="bf16: bf16 weights and optimizer state (bf16 autocast); fp32-master: fp32 weights "
                        "with bf16 autocast (Manta's recipe); fp32: no bf16 at all (CPU tests)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="also write the JSON object here")
    a = p.parse_args()
    total = a.prompts * a.samples
    if a.samples < 2:
        p.error("--samples must be at least 2 (GRPO)")
    if a.steps < 2:
        p.error("--steps must be at least 2: the first step is warm-up")
    if a.micro_batch < 1 or total % a.micro_batch:
        p.error(f"--micro-batch {a.micro_batch} must divide prompts x samples = {total}")
    if not os.path.isfile(os.path.join(a.model_dir, "config.json")):
        p.error(f"{a.model_dir}/config.json not found (make one with bench/py/e2e_model.py)")
    return a


def main():
    a = parse_args()
    import datasets
    import transformers
    import trl
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    param_dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32

    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(a.model_dir)
    with dev:  # random init straight on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
    n_params = sum(p.numel() for p in model.parameters())
    tok = AutoTokenizer.from_pretrained(a.model_dir, padding_side="left", truncation_side="left")
    if tok.chat_template is None:
        sys.exit(f"{a.model_dir}: the tokenizer has no chat template")
    print(f"[trl] model {n_params / 1e6:.1f} M parameters ({a.dtype}) on {device_name} "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    # One row per prompt of every step (and a step to spare); TRL repeats each SAMPLES times.
    rows = a.prompts * (a.steps + 1)
    targets = [(i * 7) % 10 for i in range(rows)]
    data = datasets.Dataset.from_dict({
        "prompt": [[{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Reply with the digit {t}."}] for t in targets],
        "target": targets,
    })

    total = a.prompts * a.samples
    out_dir = tempfile.mkdtemp(prefix="trl_grpo_step.")
    args = GRPOConfig(
        output_dir=out_dir,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        seed=a.seed,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=total // a.micro_batch,  # one optimizer step per generation
        num_generations=a.samples,
        max_completion_length=a.max_completion_len,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        use_vllm=False,
        gradient_checkpointing=a.gradient_checkpointing == "true",
        bf16=a.dtype != "fp32",
        use_cpu=not cuda,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        log_completions=False,
        chat_template_kwargs={"enable_thinking": False},
    )

    class TimedGRPOTrainer(GRPOTrainer):
        """Adds up, per optimizer step, the time of TRL's rollout phase."""
        bench_rollout_s = 0.0
        bench_generate_s = 0.0

        def _generate_and_score_completions(self, *args, **kwargs):
            sync()
            t = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            sync()
            self.bench_rollout_s += time.perf_counter() - t
            return out

        def _generate_single_turn(self, *args, **kwargs):
            sync()
            t = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            sync()
            self.bench_generate_s += time.perf_counter() - t
            return out

    steps = []

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.last = None

        def on_train_begin(self, args, state, control, **kw):
            sync()
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            now = time.perf_counter()
            tr = self.trainer
            steps.append({"step": state.global_step, "step_s": now - self.last,
                          "rollout_s": tr.bench_rollout_s, "generate_s": tr.bench_generate_s})
            tr.bench_rollout_s = tr.bench_generate_s = 0.0
            print(f"[trl] step {state.global_step}: {now - self.last:.3f} s", file=sys.stderr)
            self.last = now

    timer = StepTimer()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward_digits, args=args, train_dataset=data,
                               processing_class=tok, callbacks=[timer])
    timer.trainer = trainer
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_train = time.perf_counter()
    # Trainer's printer callback writes logs to stdout; stdout is kept for the result.
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    train_wall = time.perf_counter() - t_train

    # Per-step token counts from TRL's own logs (num_tokens is cumulative prompt + completion).
    logs = [h for h in trainer.state.log_history if "num_tokens" in h]
    tokens, prev = [], 0.0
    for h in logs:
        tokens.append(h["num_tokens"] - prev)
        prev = h["num_tokens"]
    comp_len = [h.get("completions/mean_length") for h in logs]
    for s, tk, cl in zip(steps, tokens, comp_len):
        s["tokens"] = tk
        s["completion_mean_len"] = cl
        s["prompt_mean_len"] = tk / total - cl if cl is not None else None
    timed = steps[1:]
    med = lambda key: statistics.median(s[key] for s in timed)
    step_s = med("step_s")
    res = {
        "impl": "trl GRPOTrainer",
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": device_name,
        "generation_mode": "transformers generate",
        "model_dir": os.path.abspath(a.model_dir),
        "model_params": n_params,
        "dtype": a.dtype,
        "gradient_checkpointing": a.gradient_checkpointing == "true",
        "steps": len(steps),
        "timed_steps": len(timed),
        "prompts": a.prompts,
        "samples": a.samples,
        "max_completion_len": a.max_completion_len,
        "micro_batch": a.micro_batch,
        "gradient_accumulation_steps": total // a.micro_batch,
        "step_s": step_s,
        "rollout_s": med("rollout_s"),
        "generate_s": med("generate_s"),
        "train_s": statistics.median(s["step_s"] - s["rollout_s"] for s in timed),
        "first_step_s": steps[0]["step_s"],
        "tokens_per_step": statistics.median(s["tokens"] for s in timed) if tokens else None,
        "completion_mean_len": statistics.median(s["completion_mean_len"] for s in timed) if tokens else None,
        "prompt_mean_len": statistics.median(s["prompt_mean_len"] for s in timed) if tokens else None,
        "tokens_per_s": (statistics.median(s["tokens"] for s in timed) / step_s) if tokens else None,
        "reward_mean": statistics.mean(h["reward"] for h in logs if "reward" in h) if logs else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "train_wall_s": train_wall,
        "per_step": steps,
    }
    text = json.dumps(res, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
