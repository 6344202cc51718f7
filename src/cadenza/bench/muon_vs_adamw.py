"""`cadenza bench muon-vs-adamw`: pretraining loss curves of Muon and AdamW at equal steps.

Two pretraining runs of the `tiny` model on the code corpus that differ only in
optim.optimizer: same initialization, data order, learning rate and schedule (Muon with
adjust_lr=match_rms_adamw, so its update RMS matches AdamW's and it shares AdamW's lr, as
in Moonshot's recipe; embeddings, lm_head, norms and router stay on AdamW in both).
AdamW is the baseline measured in the same run. Figures:

- final train loss (mean over the last 10% of steps) and validation loss, Muon / AdamW;
- steps Muon needs to reach AdamW's final (smoothed) train loss, as a fraction of the steps;
- seconds per step, Muon / AdamW (median over steps).

Writes a PNG of both smoothed curves (default bench/out/muon_vs_adamw.png).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from cadenza.config import load_config
from cadenza.log.metrics import read_jsonl
from cadenza.log.plot import line_plot_png
from cadenza.train.pretrain import METRICS_FILE, obtain_tokenizer, pretrain


def smooth(xs: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` values (shorter at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def steps_to_reach(curve: list[float], target: float) -> int | None:
    """First 1-based step at which `curve` is at or below `target`."""
    return next((i + 1 for i, v in enumerate(curve) if v <= target), None)


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="cadenza bench muon-vs-adamw", description=__doc__)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--config", default="tiny", help="preset or YAML file")
    ap.add_argument("--png", type=Path, default=Path("bench/out/muon_vs_adamw.png"))
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    args = ap.parse_args(argv)
    steps = args.steps
    base = [
        f"train.steps={steps}",
        f"train.log_every={max(1, steps // 5)}",
        f"train.eval_every={steps}",
        f"train.ckpt_every={steps}",
        "train.keep_checkpoints=1",
        "train.sample_tokens=0",
        *args.overrides,
    ]
    results: dict[str, dict] = {}
    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="cadenza-muon-vs-adamw-") as tmp:
        cfg0 = load_config(args.config, base)
        tok_path = cfg0.tokenizer.path
        if tok_path is None:
            obtain_tokenizer(cfg0, Path(tmp), print)
            tok_path = str(Path(tmp) / "tokenizer" / "tokenizer.json")
        for name in ("adamw", "muon"):
            out = Path(tmp) / name
            cfg = load_config(
                args.config,
                [*base, f"optim.optimizer={name}", f"train.out_dir={out}",
                 f"tokenizer.path={tok_path}"],
            )  # fmt: skip
            print(f"--- {name} ---", flush=True)
            t0 = time.perf_counter()
            result = pretrain(cfg, log=lambda m: None)
            wall = time.perf_counter() - t0
            records = read_jsonl(out / METRICS_FILE)
            losses = [r["loss"] for r in records]
            tail = losses[-max(1, steps // 10) :]
            curves[name] = losses
            results[name] = {
                "final_train_loss": sum(tail) / len(tail),
                "val_loss": result.val_loss,
                "s_per_step": statistics.median(r["step_time"] for r in records),
                "wall_s": wall,
            }
    window = max(1, steps // 15)
    smoothed = {k: smooth(v, window) for k, v in curves.items()}
    reach = steps_to_reach(smoothed["muon"], smoothed["adamw"][-1])
    a, m = results["adamw"], results["muon"]
    summary = {
        "steps": steps,
        "adamw": a,
        "muon": m,
        "final_train_loss_ratio": m["final_train_loss"] / a["final_train_loss"],
        "val_loss_ratio": m["val_loss"] / a["val_loss"],
        "muon_steps_to_adamw_final_loss": reach,
        "step_fraction_to_match": (reach / steps) if reach else None,
        "step_time_ratio": m["s_per_step"] / a["s_per_step"],
        "png": str(args.png),
    }
    line_plot_png(
        args.png,
        {"adamw": smoothed["adamw"], "muon": smoothed["muon"]},
        title=f"train loss (moving avg {window}) vs step",
    )
    print(f"\nMuon vs AdamW (baseline), {steps} steps, same data, init, lr and schedule")
    print(f"{'':24}{'adamw':>10}{'muon':>10}{'muon/adamw':>12}")
    for key, label in (("final_train_loss", "final train loss"), ("val_loss", "val loss"),
                       ("s_per_step", "s/step (median)")):  # fmt: skip
        print(f"{label:24}{a[key]:>10.4f}{m[key]:>10.4f}{m[key] / a[key]:>12.3f}")
    if reach:
        print(
            f"Muon reaches AdamW's final smoothed loss {smoothed['adamw'][-1]:.4f} at step "
            f"{reach} of {steps} ({reach / steps:.2f} of the steps)"
        )
    else:
        print(f"Muon does not reach AdamW's final smoothed loss {smoothed['adamw'][-1]:.4f}")
    print(f"plot: {args.png} (blue adamw, orange muon)")
    return summary
