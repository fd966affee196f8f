"""Three bar charts with interquartile error bars, drawn from a results dict (the JSON)."""
from __future__ import annotations

import os

SPREAD_NOTE = "bars: median; error bars: 25th–75th percentile across rounds"


def _err(summaries, scale=1.0, offset=0.0):
    """Median heights and asymmetric (lower, upper) error bars from summarize() dicts."""
    med, lo, hi = [], [], []
    for s in summaries:
        if not s or s.get("median") is None:
            med.append(0.0), lo.append(0.0), hi.append(0.0)
            continue
        m = (s["median"] - offset) * scale
        med.append(m)
        lo.append(max(0.0, m - (s["p25"] - offset) * scale))
        hi.append(max(0.0, (s["p75"] - offset) * scale - m))
    return med, [lo, hi]


def _logging(res, ax, plt):
    regimes = list(res["regimes"])
    variants = [v for v in res["variants"] if v != res["baseline"]]
    width = 0.8 / max(1, len(variants))
    cmap = plt.get_cmap("tab10")
    for j, v in enumerate(variants):
        sums = [res["regimes"][r]["variants"].get(v, {}).get("slowdown") for r in regimes]
        med, err = _err(sums, 100.0, 1.0)
        xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(regimes))]
        ax.bar(xs, med, width, yerr=err, capsize=2, color=cmap(j % 10),
               label=res["variants"][v])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(1, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(regimes)))
    ax.set_xticklabels([f"{r}\n{res['regimes'][r]['label']}" for r in regimes], fontsize=8)
    ax.set_ylabel("slowdown vs metrics computed, not logged (%)")
    ax.set_title("Logging in a training step (dashed: the 1% target)")
    ax.legend(fontsize=7, ncol=2)


def _percall(res, ax, plt):
    ks = res["ks"]
    methods = [m for m in res["methods"]
               if any("us" in res["results"][str(k)].get(m, {}) for k in ks)]
    width = 0.8 / max(1, len(methods))
    cmap = plt.get_cmap("tab10")
    for j, m in enumerate(methods):
        sums = [res["results"][str(k)].get(m, {}).get("us") for k in ks]
        med, err = _err(sums)
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(ks))]
        ax.bar(xs, med, width, yerr=err, capsize=2, color=cmap(j % 10), label=res["methods"][m])
    ax.set_yscale("log")
    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([f"K = {k}" for k in ks])
    ax.set_ylabel("µs per logging call (log scale)")
    ax.set_title("Cost of one logging call with K scalars")
    ax.legend(fontsize=7)


def _pitfalls(results, axes):
    ax = axes[0]
    t = results.get("timing", {})
    w = t.get("workloads", {}).get("matmul 8192² bf16")
    if w:
        names = [m for m in t["methods"] if m in w]
        med, err = _err([w[m]["ms"] for m in names])
        ax.bar(range(len(names)), med, yerr=err, capsize=3, color="tab:blue")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([t["methods"][m].replace(" (reference)", "\n(reference)")
                            for m in names], fontsize=7, rotation=15)
        ax.set_ylabel("measured ms")
        ax.set_title("8192² bf16 matmul, timed 4 ways", fontsize=9)
    else:
        ax.text(0.5, 0.5, "timing: skipped (needs CUDA)", ha="center", va="center")
        ax.set_axis_off()

    ax = axes[1]
    d = results.get("dataloader", {})
    if "tuned" in d:
        keys = ["workers0", "tuned"]
        med, err = _err([d[k]["images_per_s"] for k in keys])
        ax.bar(range(2), med, yerr=err, capsize=3, color=["tab:red", "tab:green"])
        ax.set_xticks(range(2))
        ax.set_xticklabels([d["labels"][k].replace(", ", ",\n") for k in keys], fontsize=7)
        ax.set_ylabel("images/s")
        ax.set_title("DataLoader", fontsize=9)
    else:
        ax.set_axis_off()

    ax = axes[2]
    lch = results.get("launch", {})
    lat = lch.get("latency_us", {})
    if lat:
        keys = [k for k in ("eager", "graph", "compiled") if k in lat]
        med, err = _err([lat[k] for k in keys])
        ax.bar(range(len(keys)), med, yerr=err, capsize=3, color="tab:purple")
        ax.set_xticks(range(len(keys)))
        names = {"eager": "eager", "graph": "CUDA graph", "compiled": "compile\n(reduce-overhead)"}
        ax.set_xticklabels([names[k] for k in keys], fontsize=7)
        ax.set_ylabel("µs per forward (latency)")
        ax.set_title("Batch-1 MLP inference", fontsize=9)
    else:
        ax.set_axis_off()


def make_plots(results: dict, prefix: str) -> list[str]:
    """Write up to three PNGs next to the results; returns their paths."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        print(f"  note: matplotlib unavailable ({exc}); no plots", flush=True)
        return []
    paths = []
    title = f"{results['env'].get('gpu')}, torch {results['env'].get('torch')} — {SPREAD_NOTE}"

    def save(fig, name):
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        path = f"{prefix}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    sec = results.get("sections", {})
    if sec.get("logging", {}).get("regimes"):
        fig, ax = plt.subplots(figsize=(11, 5))
        _logging(sec["logging"], ax, plt)
        save(fig, "logging")
    if sec.get("per_call", {}).get("results"):
        fig, ax = plt.subplots(figsize=(11, 5))
        _percall(sec["per_call"], ax, plt)
        save(fig, "per-call")
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    _pitfalls(sec, axes)
    save(fig, "pitfalls")
    return [os.path.basename(p) for p in paths]
