"""`cadenza bench model`: cadenza's model vs transformers' DeepseekV3ForCausalLM, same weights.

Figures on the `tiny` MoE preset (goals from issue 2):
- training: forward + next-token cross-entropy + backward, tokens/s, each library's own
  training path (cadenza `model.loss`, fused head + CE; transformers `model(ids,
  labels=ids).loss`), goal >= 2x; baselines: transformers defaults (sdpa attention,
  grouped_mm experts) and its reference eager experts (a Python loop over experts);
- decoding: greedy tokens/s with the KV cache vs transformers `generate`, goal >= 1.5x.

Runs of the compared implementations are interleaved and each figure is a median. Both wall
time and this process's CPU time are reported: on a shared machine (other jobs on the same
cores) wall time mostly measures the neighbours, CPU time the work done.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadenza bench model", description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="training batch size")
    p.add_argument("--seq", type=int, default=128, help="training sequence length")
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32, help="prompt length for decoding")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--preset", default="tiny")
    return p.parse_args(argv)


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each fn, runs interleaved (after one warm-up each)."""
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return {
        k: {"wall_s": statistics.median(wall[k]), "cpu_s": statistics.median(cpu[k])} for k in fns
    }


def _report(title: str, tokens: int, times: dict, ours: str, goal: float) -> dict:
    out: dict = {"tokens": tokens}
    print(title)
    for name, t in times.items():
        out[name] = {
            "tokens_per_s_wall": tokens / t["wall_s"],
            "tokens_per_s_cpu": tokens / t["cpu_s"],
            **t,
        }
        line = f"  {name:<28} {tokens / t['wall_s']:9.0f} tok/s wall  {tokens / t['cpu_s']:9.0f} tok/s cpu"
        if name != ours:
            sw = t["wall_s"] / times[ours]["wall_s"]
            sc = t["cpu_s"] / times[ours]["cpu_s"]
            out[name]["cadenza_speedup_wall"], out[name]["cadenza_speedup_cpu"] = sw, sc
            line += f"   cadenza is {sw:.2f}x (wall) {sc:.2f}x (cpu) (goal {goal}x)"
        print(line)
    return out


def run(argv: list[str]) -> dict:
    a = _args(argv)
    from transformers import DeepseekV3ForCausalLM

    from cadenza.config.model import MODEL_PRESETS
    from cadenza.model import CausalLM, generate, save_pretrained

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = MODEL_PRESETS[a.preset]()
    ours = CausalLM(cfg)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(ours, d)
        hf = DeepseekV3ForCausalLM.from_pretrained(d)
        hf_eager = DeepseekV3ForCausalLM.from_pretrained(d, experts_implementation="eager")
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))

    def train(model, loss_fn):
        def step():
            model.zero_grad(set_to_none=True)
            loss_fn().backward()

        return step

    for m in (ours, hf, hf_eager):
        m.train()
    train_times = _interleaved(
        {
            "cadenza": train(ours, lambda: ours.loss(ids)),
            "transformers (default)": train(hf, lambda: hf(ids, labels=ids).loss),
            "transformers (eager experts)": train(hf_eager, lambda: hf_eager(ids, labels=ids).loss),
        },
        a.repeats,
    )
    train_res = _report(
        f"forward+backward, {a.batch}x{a.seq} tokens, {a.threads} threads:",
        a.batch * a.seq,
        train_times,
        "cadenza",
        2.0,
    )

    for m in (ours, hf):
        m.eval()
    prompts = torch.randint(0, cfg.vocab_size, (a.decode_batch, a.prompt))
    n = a.new_tokens

    def hf_generate():
        with torch.no_grad():
            out = hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.shape[1] == a.prompt + n

    def ours_generate():
        gens = generate(ours, prompts.tolist(), max_new_tokens=n, temperature=0.0)
        assert all(len(g.tokens) == n for g in gens)

    decode_times = _interleaved(
        {"cadenza": ours_generate, "transformers generate": hf_generate}, max(a.repeats - 2, 1)
    )
    decode_res = _report(
        f"greedy decoding, {a.decode_batch} prompts x {n} new tokens after {a.prompt}:",
        a.decode_batch * n,
        decode_times,
        "cadenza",
        1.5,
    )
    return {"preset": a.preset, "threads": a.threads, "train": train_res, "decode": decode_res}
