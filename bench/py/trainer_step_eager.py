"""Baseline for bench trainer_step: the same GRPO step in PyTorch eager.

transformers' Qwen3ForCausalLM built from a config with random init, bf16 weights and
compute (SDPA attention, transformers' default; no torch.compile), fp32 master weights
updated by torch.optim.AdamW (fused=True) and copied back to the
bf16 weights after each step, as Manta's trainer does. The batch is SAMPLES rows of SEQ
tokens (no padding); the last 3/4 of each row is the response. Log-probs of response
tokens come from the final hidden states in chunks of 1024 rows (fp32 log-softmax; the
entropy is computed as a metric without autograd), the loss is the clipped policy loss
against rollout log-probs (eps_clip 0.2, eps_clip_high 0.28), per-sample token mean,
mean over samples; grad-norm clip 1.0. Prints one JSON object.

RECOMPUTE: gradient checkpointing of the first N decoder layers (transformers' per-layer
`gradient_checkpointing` flag; Megatron's block method): none, all, N, or auto (the 4b
default; 0.6b defaults to none): the fewest checkpointed layers with which a step fits
in memory, found by trying steps (a CUDA out-of-memory error is caught and the probe
moves on), as the Manta side does for itself.

usage: python trainer_step_eager.py 0.6b|4b [SAMPLES] [SEQ] [ITERS] [RECOMPUTE]
"""
import gc
import json
import math
import sys
import time
import warnings

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8),
}
CHUNK = 1024
EPS_LOW, EPS_HIGH = 0.2, 0.28


def main():
    shape = sys.argv[1] if len(sys.argv) > 1 else "0.6b"
    rest = [int(a) for a in sys.argv[2:5]]
    samples, seq, iters = (rest + [8, 2048, 5][len(rest):])[:3]
    recompute_arg = sys.argv[5] if len(sys.argv) > 5 else ("auto" if shape == "4b" else "none")
    cfg = Qwen3Config(
        vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, max_position_embeddings=40960, use_cache=False,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.train()
    with warnings.catch_warnings():  # renamed activation_checkpointing_* after 5.17
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.model.layers

    def checkpoint_first(n):
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < n
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params]
    # fused=True: PyTorch's single-kernel AdamW; the default foreach path would also need
    # an extra fp32 copy of the second moments, which a 4B model cannot spare on 80 GB.
    opt = torch.optim.AdamW(masters, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    torch.cuda.synchronize()
    init_s = time.perf_counter() - t0

    resp = seq - seq // 4
    prompt = seq - resp
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(cfg.vocab_size, (samples, seq), device="cuda", generator=g)
    targets = ids[:, prompt:].reshape(-1)
    old_logp = -math.log(cfg.vocab_size) + 0.2 * torch.randn(samples * resp, device="cuda", generator=g)
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(samples)], device="cuda")
    adv_tok = adv.repeat_interleave(resp)
    lm_head = model.lm_head.weight

    def step():
        for p in params:
            p.grad = None
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        sel = hidden[:, prompt - 1:seq - 1, :].reshape(-1, cfg.hidden_size)
        logps, ents = [], []
        for s in range(0, sel.shape[0], CHUNK):
            logits = (sel[s:s + CHUNK] @ lm_head.t()).float()
            all_lp = logits.log_softmax(-1)
            logps.append(all_lp.gather(-1, targets[s:s + CHUNK, None]).squeeze(-1))
            with torch.no_grad():
                ents.append(-(all_lp.exp() * all_lp).sum(-1))
        logp = torch.cat(logps)
        entropy = torch.cat(ents)
        ratio = torch.exp(logp - old_logp)
        pg = torch.maximum(-adv_tok * ratio, -adv_tok * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
        loss = (pg.view(samples, resp).mean(1)).sum() / samples
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                m.grad = None
                p.copy_(m)
        clipfrac = ((ratio - 1).abs() > EPS_LOW).float().mean()
        return loss.item(), grad_norm.item(), clipfrac.item(), entropy.mean().item()

    def fits(n):
        checkpoint_first(n)
        try:
            step()
            torch.cuda.synchronize()
            ok = True
        except torch.cuda.OutOfMemoryError:
            ok = False
        for p in params + masters:
            p.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        probes.append((n, ok))
        print(f"eager recompute probe: first {n} of {len(layers)} layers: {'fits' if ok else 'out of memory'}", file=sys.stderr)
        return ok

    probes = []
    t_probe = time.perf_counter()
    if recompute_arg == "auto":
        if not fits(len(layers)):
            sys.exit("the step does not fit in memory even with every layer checkpointed")
        lo, hi = 0, len(layers)
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        n_ckpt = hi
    else:
        n_ckpt = {"none": 0, "all": len(layers)}.get(recompute_arg)
        n_ckpt = int(recompute_arg) if n_ckpt is None else n_ckpt
    probe_s = time.perf_counter() - t_probe
    # A count that fitted one probe can still run out of memory in the timed steps (the
    # caching allocator's fragmentation differs): then one more layer is checkpointed
    # and the warm-up and timing start again.
    oom_retries = 0
    while True:
        checkpoint_first(n_ckpt)
        try:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            last = None
            for _ in range(iters):
                t = time.perf_counter()
                last = step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            break
        except torch.cuda.OutOfMemoryError:
            if n_ckpt >= len(layers):
                raise
            for p in params + masters:
                p.grad = None
            gc.collect()
            torch.cuda.empty_cache()
            oom_retries += 1
            n_ckpt += 1
            print(f"eager: out of memory in the timed steps, checkpointing {n_ckpt} layers", file=sys.stderr)
    median = sorted(times)[len(times) // 2]
    print(json.dumps({
        "impl": "transformers Qwen3ForCausalLM, PyTorch eager (sdpa), bf16 + fp32 masters, torch.optim.AdamW(fused)",
        "attn_implementation": model.config._attn_implementation,
        "shape": shape, "samples": samples, "seq": seq, "iters": iters,
        "response_tokens": samples * resp, "gradient_checkpointing": n_ckpt > 0,
        "recompute": "checkpoint the first N layers" if n_ckpt else "none",
        "recompute_num_layers": n_ckpt, "num_layers": len(layers),
        "recompute_choice": recompute_arg, "recompute_probes": probes, "probe_s": probe_s,
        "timed_oom_retries": oom_retries,
        "init_s": init_s, "median_s": median, "times_s": times,
        "tokens_per_s": samples * seq / median,
        "loss": last[0], "grad_norm": last[1], "pg_clipfrac": last[2],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
    }))


if __name__ == "__main__":
    main()
