"""Independent PyTorch transcription of slime's GRPO loss (slime/utils/ppo_utils.py,
slime/backends/megatron_utils/loss.py, group reward normalization in slime/ray/rollout.py)
and Megatron's LR schedule, to check Manta's trainer against.

  make  OUT --config CONFIG.json --seed S [--set KEY=JSON ...] [--noise X]
        tiny HF Qwen3 or Qwen3-MoE (transformers, by the config's model_type) + debug
        rollout files; rollout log-probs are transformers' plus N(0, X) noise (0.3)
  check OUT --run RUN_DIR --ckpt CKPT_DIR --flags FLAGS.json
        replays the debug files with the same flags and compares per-step metrics
        (metrics.jsonl: every train/* metric either side makes, bar the ONE_SIDED ones)
        and the final weights (every tensor either side has); exits 1 on a mismatch.

Mixture-of-experts models with `moe_aux_loss_coeff` > 0 add Megatron's switch
load-balancing loss (`--moe-router-load-balancing-type aux_loss`), transcribed from its
definition: per sparse layer of a micro-batch of N tokens, E experts, top-k,
coeff * E / (N^2 k) * sum_e (sum over tokens of softmax(router logits)_e) * (tokens routed
to e), computed here from transformers' own router logits (`output_router_logits`), not
transformers' load_balancing_loss_func (which pools all layers into one term).
"""
import argparse, json, math, os, sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

torch.set_default_dtype(torch.float32)


def load_model(path):
    m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    m.train()  # no dropout in Qwen3 anyway
    return m


def is_moe(model):
    return model.config.model_type == "qwen3_moe"


def make(out, config, seed, steps=2, groups=2, n=3, overrides=(), noise_std=0.3):
    torch.manual_seed(seed)
    raw = {k: v for k, v in json.load(open(config)).items() if k not in ("architectures",)}
    for kv in overrides:
        key, _, value = kv.partition("=")
        raw[key] = json.loads(value)
    if raw.get("model_type") == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**raw)).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    # Routers start near zero (near-ties everywhere); give them choices.
                    p.normal_(0.0, 0.5)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**raw)).float().eval()
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        lines = []
        for gi in range(groups):
            for i in range(n):
                p = int(torch.randint(2, 5, (1,), generator=g))
                r = int(torch.randint(3, 7, (1,), generator=g))
                tokens = torch.randint(0, 256, (p + r,), generator=g).tolist()
                mask = [1] * r
                if r > 3:
                    mask[1] = 0  # an environment-added token inside the response
                with torch.no_grad():
                    logits = model(torch.tensor([tokens])).logits[0].float()
                lp = torch.log_softmax(logits, -1)
                rl = []
                for k in range(r):
                    true = lp[p + k - 1, tokens[p + k]].item()
                    noise = float(torch.randn(1, generator=g)) * noise_std
                    rl.append(true + noise if mask[k] else 0.0)
                reward = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0][(gi * n + i + step) % 6]
                lines.append(dict(group_index=gi, index=i, tokens=tokens, response_length=r, loss_mask=mask,
                                  rollout_log_probs=rl, reward=reward,
                                  status="truncated" if i == 2 else "completed"))
        with open(os.path.join(out, f"debug_{step}.jsonl"), "w") as f:
            for l in lines:
                f.write(json.dumps(l) + "\n")


def lr_at(step, f, total_steps):
    """Megatron OptimizerParamScheduler.get_lr with lr_warmup_init 0."""
    max_lr, min_lr, warm = f["lr"], f.get("min_lr", 0.0), f.get("lr_warmup_iters", 0)
    style = f.get("lr_decay_style", "constant")
    if warm > 0 and step <= warm:
        return max_lr * step / warm
    if style == "constant":
        return max_lr
    if step > total_steps:
        return min_lr
    ratio = (step - warm) / max(total_steps - warm, 1)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def kl_est(logp, base, kind, importance=None):
    x = logp - base
    if kind == "k1":
        kl = x
    elif kind == "k2":
        kl = x ** 2 / 2
    else:
        kl = torch.exp(-x) - 1 + x
    if importance is not None:
        kl = importance * kl
    if kind == "low_var_kl":
        kl = kl.clamp(-10, 10)
    return kl


def token_logp_entropy(model, s, temperature, router_logits=None):
    """Log-probs and entropies of the trained tokens; a mixture-of-experts model appends
    its sparse layers' router logits ([tokens, E] each) to `router_logits`."""
    tokens = torch.tensor([s["tokens"]])
    if is_moe(model):
        res = model(tokens, output_router_logits=True)
        if router_logits is not None:
            router_logits.append(res.router_logits)
    else:
        res = model(tokens)
    logits = res.logits[0].float() / temperature
    p = len(s["tokens"]) - s["response_length"]
    pos = torch.tensor([p + k - 1 for k, m in enumerate(s["loss_mask"]) if m])
    tgt = torch.tensor([s["tokens"][p + k] for k, m in enumerate(s["loss_mask"]) if m])
    allp = torch.log_softmax(logits[pos], -1)
    return allp.gather(-1, tgt[:, None])[:, 0], -(allp.exp() * allp).sum(-1)


def megatron_aux_loss(per_sample, top_k, coeff):
    """Megatron's switch load-balancing loss of one micro-batch whose samples' router
    logits are `per_sample` (per sample, a tuple over sparse layers of [tokens, E]),
    summed over the sparse layers."""
    total = 0.0
    for layer in zip(*per_sample):
        probs = torch.softmax(torch.cat(layer, 0).float(), -1)
        n, e = probs.shape
        chosen = torch.topk(probs, top_k, -1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=e).float()
        total = total + (probs.sum(0) * counts).sum() * (e / (n * n * top_k))
    return coeff * total


def advantages(samples, f):
    est = f.get("advantage_estimator", "grpo")
    groups = {}
    for s in samples:
        if s["status"] != "failed":
            groups.setdefault(s["group_index"], []).append(s)
    out = []
    for gi in sorted(groups):
        grp = sorted(groups[gi], key=lambda s: s["index"])
        r = torch.tensor([s["reward"] for s in grp], dtype=torch.float64)
        if est == "reinforce_plus_plus":
            a = r
        else:
            a = r - r.mean()
            if est in ("grpo", "gspo", "cispo") and not f.get("disable_grpo_std_normalization") and len(grp) > 1:
                a = a / (r.std() + 1e-6)
        out += list(zip(grp, a.tolist()))
    if f.get("normalize_advantages"):
        tok = torch.tensor([float(sum(s["loss_mask"])) for s, _ in out], dtype=torch.float64)
        a = torch.tensor([x for _, x in out], dtype=torch.float64)
        nt = tok.sum()
        mean = (a * tok).sum() / nt
        var = ((a * a * tok).sum() / nt - mean ** 2) * nt / (nt - 1)
        a = (a - mean) / torch.sqrt(var + 1e-8)
        out = [(s, x) for (s, _), x in zip(out, a.tolist())]
    return out


def train_step(model, ref, opt, batch, f, lr, pre=None):
    """One optimizer step of slime's policy_loss_function on the whole batch."""
    for gparam in opt.param_groups:
        gparam["lr"] = lr
    opt.zero_grad()
    T = f.get("temperature", 1.0)
    per = []
    router_logits = []
    for j, (s, a) in enumerate(batch):
        logp, ent = token_logp_entropy(model, s, T, router_logits)
        rollout = torch.tensor([v for v, m in zip(s["rollout_log_probs"], s["loss_mask"]) if m])
        with torch.no_grad():
            ref_lp = token_logp_entropy(ref, s, T)[0] if f.get("use_kl_loss") else None
        per.append((logp, ent, rollout, ref_lp, torch.full_like(logp, a), None if pre is None else pre[j]))
    n = len(per)
    ntok = sum(p[0].numel() for p in per)

    def reduce(xs):  # sum_of_sample_mean, or the global token mean
        if f.get("calculate_per_token_loss"):
            return sum(x.sum() for x in xs) / ntok
        return sum(x.mean() for x in xs) / n

    eps, eps_hi = f.get("eps_clip", 0.2), f.get("eps_clip_high", f.get("eps_clip", 0.2))
    c = f.get("eps_clip_c")
    pg, clipfrac, ppokl, ents, kls, tis, absd, opsm = [], [], [], [], [], [], [], []
    tis_clipfrac, tis_abs, ois = [], [], []
    for logp, ent, rollout, ref_lp, adv, before in per:
        # slime's batch["log_probs"]: the trainer's log-probs before this rollout's updates.
        train_lp = logp.detach() if before is None else before
        old = rollout if f.get("use_rollout_logprobs") else train_lp
        kl = old - logp
        if f.get("advantage_estimator") == "gspo":
            kl = kl.mean().expand_as(logp)
        ratio = torch.exp(-kl)
        if f.get("advantage_estimator") == "cispo":
            # MiniMax-M1: the clipped ratio is a constant weight on the log-prob.
            clipped = ratio.clamp(1 - eps, 1 + eps_hi)
            l = -clipped.detach() * adv * logp
            cf = (clipped != ratio).float()
        else:
            l1 = -ratio * adv
            l2 = -ratio.clamp(1 - eps, 1 + eps_hi) * adv
            l = torch.maximum(l1, l2)
            cf = (l2 > l1).float()
            if c is not None:
                l = torch.where(adv < 0, torch.minimum(-c * adv, l), l)
        if f.get("use_opsm"):
            seq_kl = (old - logp).mean().detach()
            drop = bool(adv[0] < 0) and seq_kl.item() > f.get("opsm_delta", 1e-4)
            opsm.append(1.0 if drop else 0.0)
            if drop:
                l = l * 0.0
        if f.get("use_tis"):
            # slime's vanilla_tis_function (truncate) / icepop_function (mask), and the
            # "ois" of policy_loss_function: the PPO ratio exp(-ppo_kl).
            w = torch.exp(train_lp - rollout)
            lo, hi = f.get("tis_clip_low", 0.0), f.get("tis_clip", 2.0)
            if f.get("tis_mode", "truncate") == "truncate":
                weight = w.clamp(lo, hi)
            else:
                weight = torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))
            l = l * weight
            tis.append(w)
            tis_clipfrac.append((weight != w).float())  # tokens whose weight is not the ratio
            tis_abs.append((w - 1).abs())
            ois.append(torch.exp(-kl.detach()))
        pg.append(l); clipfrac.append(cf); ppokl.append(kl); ents.append(ent)
        if f.get("use_kl_loss"):
            imp = torch.exp(logp - old) if f.get("use_unbiased_kl") else None
            kls.append(kl_est(logp, ref_lp, f.get("kl_loss_type", "k1"), imp))
        cmp = logp if f.get("use_rollout_logprobs") else old
        absd.append((cmp - rollout).abs())
    pg_loss = reduce(pg)
    ent_loss = reduce(ents)
    loss = pg_loss - f.get("entropy_coef", 0.0) * ent_loss
    m = {"train/pg_loss": pg_loss.item(), "train/pg_clipfrac": reduce(clipfrac).item(),
         "train/ppo_kl": reduce(ppokl).item(), "train/entropy_loss": ent_loss.item(),
         "train/train_rollout_logprob_abs_diff": reduce(absd).item()}
    if f.get("use_kl_loss"):
        kl_loss = reduce(kls)
        loss = loss + f.get("kl_loss_coef", 0.0) * kl_loss
        m["train/kl_loss"] = kl_loss.item()
    if f.get("use_tis"):
        m["train/tis"] = reduce(tis).item()
        m["train/tis_clipfrac"] = reduce(tis_clipfrac).item()
        m["train/tis_abs"] = reduce(tis_abs).item()
        m["train/ois"] = reduce(ois).item()
    if f.get("use_opsm"):
        m["train/opsm_clipfrac"] = sum(opsm)
    m["train/loss"] = loss.item()
    coeff = f.get("moe_aux_loss_coeff", 0.0)
    if coeff > 0 and router_logits:
        # Only in the gradient, not the logged loss (Megatron logs it apart); the whole
        # batch is one micro-batch (the default --max-tokens-per-gpu holds it).
        loss = loss + megatron_aux_loss(router_logits, model.config.num_experts_per_tok, coeff)
    loss.backward()
    params = [p for p in model.parameters()]
    m["train/grad_norm"] = torch.nn.utils.clip_grad_norm_(params, f.get("clip_grad", 1.0)).item()
    m["train/lr"] = lr
    m["train/tokens"] = float(ntok)  # trained tokens (loss mask 1) of this update
    opt.step()
    return m


# `train/*` metrics that legitimately exist on one side only, each with why. Every other
# metric either side produces must be produced, and matched, by the other.
ONE_SIDED = {
    "train/oom_skipped": "Manta's count of samples skipped after running out of memory; slime has no OOM recovery",
    "train/oom_splits": "Manta's count of micro-batches split after running out of memory; slime has no OOM recovery",
}

# Metrics summed over the updates of a rollout (the rest are averaged), as Manta logs them.
SUMMED = ("train/tokens",)


def check(out, run, ckpt, flags):
    f = json.load(open(flags))
    model = load_model(os.path.join(out, "model"))
    ref = load_model(os.path.join(out, "model")).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=f["lr"], betas=(f.get("adam_beta1", 0.9), f.get("adam_beta2", 0.999)),
                            eps=f.get("adam_eps", 1e-8), weight_decay=f.get("weight_decay", 0.0))
    steps = f["num_rollout"]
    k_steps = int(f.get("num_steps_per_rollout", 1))
    ours = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    bad = []
    opt_step = 0
    for step in range(steps):
        samples = [json.loads(l) for l in open(os.path.join(out, f"debug_{step}.jsonl"))]
        batch = advantages(samples, f)
        with torch.no_grad():
            pre = [token_logp_entropy(model, s, f.get("temperature", 1.0))[0] for s, _ in batch]
        # slime: global batch = the rollout's samples / num_steps_per_rollout, in order;
        # Manta logs the mean of each metric over the updates.
        n = len(batch)
        ms = []
        for k in range(k_steps):
            lo, hi = k * n // k_steps, (k + 1) * n // k_steps
            ms.append(train_step(model, ref, opt, batch[lo:hi], f, lr_at(opt_step, f, steps * k_steps), pre[lo:hi]))
            opt_step += 1
        m = {key: sum(x[key] for x in ms) / (1 if key in SUMMED else len(ms)) for key in ms[0]}
        m["train/lr"] = ms[-1]["train/lr"]
        got = ours[step]
        got = got.get("metrics", got)
        ours_train = {k for k in got if k.startswith("train/")}
        for k in sorted(ours_train | set(m)):
            if k in ONE_SIDED:
                if k in m:
                    bad.append(f"step {step + 1} {k}: allowed as one-sided, yet pytorch makes it too: compare it")
                continue
            if k not in m:
                bad.append(f"step {step + 1} {k}: manta logs it ({got[k]}), pytorch has no counterpart")
                continue
            if k not in got:
                bad.append(f"step {step + 1} {k}: pytorch makes it ({m[k]}), manta does not log it")
                continue
            g, v = got[k], m[k]
            if not math.isclose(g, v, rel_tol=1e-4, abs_tol=1e-5):
                bad.append(f"step {step + 1} {k}: manta {g} vs pytorch {v}")
            else:
                print(f"step {step + 1} {k}: {g:.6g} == {v:.6g}")
    final = load_file(os.path.join(ckpt, "model.safetensors"))
    # Both sides in the hub's layout, as transformers saves it (its in-memory one fuses
    # experts; a tied lm_head is not saved).
    model.save_pretrained(os.path.join(out, "pytorch_final"), safe_serialization=True)
    sd = load_file(os.path.join(out, "pytorch_final", "model.safetensors"))
    init = load_file(os.path.join(out, "model", "model.safetensors"))
    names = set(sd)
    for k in sorted(set(final) ^ names):
        side = "manta" if k in final else "pytorch"
        bad.append(f"weight {k}: only {side} has it")
    moved = 0.0
    for k, v in final.items():
        if k not in sd:
            continue
        ref_v = sd[k]
        d = (v.float() - ref_v).abs().max().item()
        moved = max(moved, (ref_v - init[k]).abs().max().item())
        if d > 2e-5:
            bad.append(f"weight {k}: max |manta - pytorch| = {d:.3g}")
    print(f"weights: {len(final)} tensors compared; largest change from init {moved:.3g}")
    if moved < 1e-3:
        bad.append(f"weights barely moved ({moved}); the comparison would prove nothing")
    if bad:
        print("\n".join(bad), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["make", "check"])
    ap.add_argument("out")
    ap.add_argument("--config")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--run")
    ap.add_argument("--ckpt")
    ap.add_argument("--flags")
    ap.add_argument("--set", action="append", default=[], help="KEY=JSON: a config.json override")
    ap.add_argument("--noise", type=float, default=0.3)
    a = ap.parse_args()
    if a.mode == "make":
        make(a.out, a.config, a.seed, steps=a.steps, overrides=a.set, noise_std=a.noise)
    else:
        check(a.out, a.run, a.ckpt, a.flags)
