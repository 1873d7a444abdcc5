"""The evaluation report: one call writes every artefact of a side-by-side run into one folder, all at once, so a
result can be re-plotted (report.json, outputs.jsonl), read in a terminal or on GitHub (report.md), sent
as one file (report.html, images inlined) and compared across runs (wandb).

Speedup is shown next to its mechanism (acceptance, tau, depth by load, FLOPs by bucket), and a greedy
run whose output differs from `ar`'s is reported loudly everywhere: that is a bug, not a trade-off.

Rows come from `runner.summarise`, plus transformers baselines (`hf_generate`, `hf_assisted`) that lack
the engine-only keys; those show "–" in tables and are left out of the plots that need them.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
import tempfile
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # no pyplot: no global state, Agg renders PNGs without a display

from specpolicy.errors import SpecPolicyError
from specpolicy.eval.interval import MIN_UNITS, ratio_interval
from specpolicy.runtime import OtherLoad

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger

log = logging.getLogger("specpolicy")

BUCKET_COLOURS = {"useful": "tab:green", "rejected": "tab:red", "padding": "tab:gray"}
META = {"date": "date", "hardware": "hardware", "device": "device", "dtype": "dtype", "target": "target",
        "draft": "draft", "temperature": "temperature", "top p": "top_p", "seed": "seed",
        "prompts loaded": "num_prompts", "max new tokens": "max_new_tokens", "overrides": "overrides"}
DASH = "–"
INTERVAL = "{0[0]:.2f}-{0[1]:.2f}x"  # a (low, high) speedup interval
VIOLATED = "LOSSLESSNESS VIOLATED"
EXACT_DTYPES = ("float32", "float64")  # where a k-token pass and a 1-token pass round alike enough to compare


# ---------------------------------------------------------------- entry point
def write_report(out_dir: str | Path, meta: dict, runs: list[dict], outputs: list[dict],
                 logger: Logger | None = None) -> Path:
    """Writes report.json, outputs.jsonl, report.md, report.html and PNG plots into out_dir; returns
    out_dir/report.md."""
    if not runs:
        raise SpecPolicyError("write_report got no runs: decode with at least one policy (eval.policies) first")
    if not (isinstance(runs, list) and all(isinstance(r, dict) for r in runs)):  # side_by_side's dict of runs
        raise SpecPolicyError("write_report takes report rows: pass summarise(side_by_side(...)), a list per batch "
                              "size joined into one")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check = lossless(meta, runs)
    with tempfile.TemporaryDirectory(dir=out, prefix=".report-") as staging:  # out may hold a user's other files
        new = Path(staging)
        write_json(new / "report.json", meta, runs, check)
        write_outputs(new / "outputs.jsonl", outputs)
        plots = {name: save_plot(plot(runs), new / f"{name}.png") for name, plot in PLOTS.items()}
        (new / "report.md").write_text(markdown(meta, runs, check, plots))
        (new / "report.html").write_text(html_page(meta, runs, check, plots))
        for path in list(new.iterdir()):  # renamed in at once: a run killed while plotting leaves the last report
            os.replace(path, out / path.name)
    plots = {name: out / path.name for name, path in plots.items()}
    if logger is not None:
        log_report(logger, runs, plots)
    log.info("report written to %s", out / "report.md")
    return out / "report.md"


# ---------------------------------------------------------------- data
def lossless(meta: dict, runs: list[dict]) -> dict:
    """Greedy fp32 decoding must reproduce `ar` token for token; with sampling, without `ar` or with `ar` alone
    there is nothing to check. In bf16/fp16 a k-token verify pass rounds differently from a 1-token one, so
    outputs may part ways without a bug: there the report gives each run's share of prompts with ar's output."""
    compared = list(dict.fromkeys(r["policy"] for r in runs if is_engine(r) and r["policy"] != "ar"))
    greedy, has_ar = meta.get("temperature") == 0, any(r["policy"] == "ar" for r in runs)
    checked = greedy and has_ar and bool(compared)
    exact = meta.get("dtype", "float32") in EXACT_DTYPES
    mismatches = [{"policy": r["policy"], "batch_size": r["batch_size"], "first_mismatch": r["first_mismatch"]}
                  for r in runs if checked and exact and r.get("first_mismatch") is not None]
    known = "temperature" in meta  # `write_report` called from Python without it: not known to be greedy
    skipped = (None if checked else "unknown" if not known else "sampled" if not greedy else "no ar" if not has_ar
               else "ar alone")
    return {"checked": checked, "skipped": skipped, "exact": exact, "compared": compared, "mismatches": mismatches}


def write_json(path: Path, meta: dict, runs: list[dict], check: dict) -> None:
    path.write_text(json.dumps({**meta, "runs": runs, "lossless": check}, indent=2))


def write_outputs(path: Path, outputs: list[dict]) -> None:
    path.write_text("".join(json.dumps(o) + "\n" for o in outputs))


def batch_sizes(runs: list[dict]) -> list[int]:
    return sorted({r["batch_size"] for r in runs})


def batch_heading(runs: list[dict], batch_size: int) -> str:
    """"Batch size 4 (3 batches, 12 prompts, other load 0.01 cores)": only full batches are decoded, so a batch size
    that does not divide the prompts decodes fewer of them than the header's "prompts loaded"."""
    here = [r for r in runs if r["batch_size"] == batch_size]
    batches = max(len({u[2] for u in r.get("units") or []}) for r in here)
    if not batches:  # rows made without the runner's timings
        return f"Batch size {batch_size}"
    plural = "es" if batches > 1 else ""
    loads = [r["other_load_cores"] for r in here if r.get("other_load_cores") is not None]  # reports before 2026-12-07
    load = f", other load {max(loads):.2f} cores" if loads else ""
    return f"Batch size {batch_size} ({batches} batch{plural}, {batches * batch_size} prompts{load})"


def is_engine(run: dict) -> bool:
    """Engine rows carry the FLOP accounting; transformers baselines do not."""
    return bool(run.get("flops"))


def drafts(run: dict) -> bool:
    return sum(run.get("drafted_at") or []) > 0


def flops_ratio(run: dict, bucket: str) -> float | None:
    f = run.get("flops")
    return f[bucket] / f["ar_equivalent"] if f and f.get("ar_equivalent") else None


def waste_share(run: dict) -> float | None:
    f = run.get("flops")
    return (f["rejected"] + f["padding"]) / f["total"] if f and f.get("total") else None


# header, value (None when the row does not have it), format
COLUMNS: list[tuple[str, Callable[[dict], float | str | None], str]] = [
    ("policy", lambda r: r["policy"], "{}"),
    ("tok/s", lambda r: r.get("tokens_per_s"), "{:.1f}"),
    ("speedup", lambda r: r.get("speedup"), "{:.2f}x"),
    ("95% interval", lambda r: r.get("speedup_interval"), INTERVAL),  # runner.summarise
    ("acceptance", lambda r: r.get("acceptance_rate") if drafts(r) else None, "{:.2f}"),  # undefined without drafts
    ("tau", lambda r: r.get("mean_accepted"), "{:.2f}"),
    ("mean depth", lambda r: r.get("mean_depth"), "{:.2f}"),
    ("FLOPs / plain", lambda r: flops_ratio(r, "total"), "{:.2f}x"),
    ("rejected+padding share", waste_share, "{:.0%}"),
    ("policy ms/step", lambda r: r.get("policy_ms_per_step"), "{:.2f}"),
    ("same as ar", lambda r: r.get("ar_match"), "{:.0%}"),
]


def table_rows(runs: list[dict], batch_size: int) -> list[list[str]]:
    """Formatted cells of one batch size's table, shared by the markdown and the HTML report."""
    return [[cell(value(r), spec) for _, value, spec in COLUMNS] for r in runs if r["batch_size"] == batch_size]


def cell(value: float | str | None, spec: str) -> str:
    return DASH if value is None else spec.format(value)


def best(runs: list[dict], batch_size: int) -> str:
    """Fastest engine policy; transformers baselines and upper bounds are context, not candidates."""
    rows = [r for r in runs if r["batch_size"] == batch_size and is_engine(r) and r.get("tokens_per_s")]
    candidates = [r for r in rows if not r.get("upper_bound")]  # an oracle is shown, but never the best policy
    if not candidates:
        return f"batch {batch_size}: no engine policy ran"
    top = max(candidates, key=lambda r: r["tokens_per_s"])
    speedup = lambda r: cell(r.get("speedup"), "{:.2f}x")  # noqa: E731
    bounds = "".join(f"; {r['policy']} (upper bound on acceptance, not on speed) {speedup(r)}"
                     for r in rows if r.get("upper_bound"))
    sure = interval_text(top.get("speedup_interval"), ", {}")
    if not sure and top.get("speedup") is not None and top["policy"] != "ar":  # "best" may then be the noise's pick
        sure = f", no interval: fewer than {MIN_UNITS} batches"
    line = f"batch {batch_size}: {top['policy']} ({top['tokens_per_s']:.1f} tok/s, {speedup(top)} vs ar{sure}){bounds}"
    return line + against_best_static(rows)


def against_best_static(rows: list[dict]) -> str:
    """Load-aware policies against the fastest static depth at this batch size: speed and wasted FLOPs."""
    static = [r for r in rows if r.get("kind") == "StaticPolicy"]
    if not static:
        return ""
    top = max(static, key=lambda r: r["tokens_per_s"])
    wasted = lambda r: r["flops"]["rejected"] + r["flops"]["padding"]  # noqa: E731
    sure = lambda r: interval_text(ratio_interval(r.get("units") or [], top.get("units") or []), " ({})")  # noqa: E731
    parts = [f"{r['policy']} vs best static ({top['policy']}): {r['tokens_per_s'] / top['tokens_per_s']:.2f}x tok/s"
             f"{sure(r)}, "
             f"{cell(wasted(r) / wasted(top) if wasted(top) else None, '{:.2f}x')} rejected+padding FLOPs"
             for r in rows if r.get("kind") == "GoodputPolicy"]
    return "".join(f"; {p}" for p in parts)


def lossless_lines(check: dict) -> list[str]:
    """One line per violation, so none hides in a paragraph; callers prefix VIOLATED when there are mismatches."""
    if not check["checked"]:
        return [{"sampled": "Lossless check skipped: outputs are sampled (temperature > 0: each run draws its own "
                            "tokens, so 'same as ar' counts coincidences, not errors).",
                 "no ar": "Lossless check skipped: no ar run to compare greedy outputs with (add `ar` to "
                          "eval.policies).",
                 "ar alone": "Lossless check: nothing to compare, ar is the only engine policy.",
                 "unknown": "Lossless check skipped: the report's meta gives no temperature, so whether the outputs "
                            "are greedy is not known (pass meta={'temperature': 0, ...})."}[check["skipped"]]]
    if not check["exact"]:
        return ["Reduced precision: a k-token verify pass rounds differently from a 1-token pass, so greedy outputs "
                "may differ from ar's without a bug; 'same as ar' is each run's share of prompts with ar's output."]
    if not check["mismatches"]:
        return [f"Lossless: every greedy output of {', '.join(check['compared'])} equals ar's."]
    return [f"greedy output of {m['policy']} at batch {m['batch_size']} differs from ar's, first at prompt "
            f"{m['first_mismatch']}" for m in check["mismatches"]]


def interval_text(interval: list[float] | tuple[float, float] | None, template: str) -> str:
    """`template` around "95% interval 0.97-1.03x", or nothing where there is no interval."""
    return template.format(f"95% interval {INTERVAL.format(interval)}") if interval else ""


def notes() -> list[str]:
    """What the columns mean where their headers cannot say it."""
    return [f"95% interval: a paired bootstrap over the batches every decoder ran in turn (their passes kept "
            f"together); '{DASH}' where a batch size had fewer than {MIN_UNITS} batches (more prompts give one; more "
            f"eval.repeats do not, as they decode the same batches again). A speedup whose interval holds 1.00x is a "
            f"tie with ar.",
            "FLOPs / plain: the run's FLOPs over what plain decoding spends on the same output, one token at a time "
            "without padding (ar itself reads above 1.00x: a prompt read in one pass scores keys its causal mask "
            "hides, and a batch pads ragged prompts). Useful FLOPs include the draft's reads of kept tokens: useful "
            "above 1.00x is what the draft costs.",
            f"Other load: the CPU cores other processes (and a VM's hypervisor) took while a batch size decoded; above "
            f"{OtherLoad.busy_share:.0%} of the machine's CPU cores, its speeds are a busy machine's."]


def title(meta: dict) -> str:
    return f"specpolicy evaluation: {meta.get('target', DASH)} + draft {meta.get('draft', DASH)}"


def meta_items(meta: dict) -> list[tuple[str, str]]:
    shown = lambda v: " ".join(map(str, v)) if isinstance(v, list) else str(v)  # noqa: E731 (overrides: as typed)
    return [(label, shown(meta.get(key, DASH))) for label, key in META.items()]


# ---------------------------------------------------------------- plots
def axes(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def log2_axis(ax: Axes, ticks: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def legend(ax: Axes, empty: str) -> None:
    """A legend, or on an empty plot the note `empty` (e.g. no policy drafted), so the file still explains itself."""
    if ax.get_legend_handles_labels()[0]:
        ax.figure.legend(loc="outside right upper")  # beside the axes: lines and bars stay visible
    else:
        ax.text(0.5, 0.5, f"no data: {empty}", transform=ax.transAxes, ha="center", color="gray")


def by_policy(runs: list[dict], keep: Callable[[dict], bool]) -> dict[str, list[dict]]:
    """Rows grouped by policy in first-seen order (ar first, as the runner runs it), sorted by batch size."""
    groups: dict[str, list[dict]] = {}
    for r in sorted((r for r in runs if keep(r)), key=lambda r: r["batch_size"]):
        groups.setdefault(r["policy"], []).append(r)
    order = list(dict.fromkeys(r["policy"] for r in runs))
    return {p: groups[p] for p in order if p in groups}


def plot_speedup(runs: list[dict]) -> Figure:
    fig, ax = axes("Speedup over ar (bars: 95% intervals; hollow: none)",
                   f"batch size (an interval needs {MIN_UNITS}+ timed batches)", "speedup (tok/s / ar tok/s)")
    ax.set_prop_cycle(color=colormaps["tab20"].colors)  # ~15 decoders: tab10 would give two of them one colour
    groups = by_policy(runs, lambda r: r.get("speedup") is not None and r["policy"] != "ar")
    for i, (policy, rows) in enumerate(groups.items()):
        y = [r["speedup"] for r in rows]
        low, high = zip(*(r.get("speedup_interval") or (s, s) for r, s in zip(rows, y)))
        nudge = 2 ** (0.01 * (i - (len(groups) - 1) / 2))  # side by side, so the intervals stay readable
        x = [r["batch_size"] * nudge for r in rows]
        line = ax.errorbar(x, y, yerr=[[s - lo for s, lo in zip(y, low)], [hi - s for s, hi in zip(y, high)]],
                           marker="o", markersize=4, capsize=2, elinewidth=1, label=policy)
        unsure = [(xi, yi) for xi, yi, r in zip(x, y, rows) if not r.get("speedup_interval")]
        if unsure:  # no interval is not a zero-width one
            ax.plot(*zip(*unsure), "o", markersize=6, color="white", markeredgecolor=line.lines[0].get_color(),
                    zorder=3)  # above the errorbar's own markers
    if groups:  # with nothing to compare, the reference line alone would pass for data
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="ar (plain decoding)")
    log2_axis(ax, batch_sizes(runs))
    legend(ax, "a speedup needs an ar run and another decoder")
    return fig


def plot_depth_vs_load(runs: list[dict]) -> Figure:
    """Mean drafted tokens per row-step at each batch size, for every policy that drafts somewhere: a load-aware
    policy's depth falls as the batch grows. (Within a run the load also falls as rows finish, but a row's last
    steps cap its depth at its tokens left, so those per-load means, `depth_by_load` in report.json, mostly show
    the end of the batch.)"""
    fig, ax = axes("Mean draft depth vs batch size", "batch size", "mean draft depth (tokens per row-step)")
    ax.set_prop_cycle(color=colormaps["tab20"].colors)
    groups = by_policy(runs, lambda r: r.get("mean_depth") is not None)
    for policy, rows in ((p, rows) for p, rows in groups.items() if any(map(drafts, rows))):
        ax.plot([r["batch_size"] for r in rows], [r["mean_depth"] for r in rows], marker="o", label=policy)
    ax.set_ylim(bottom=0)
    log2_axis(ax, batch_sizes(runs))
    legend(ax, "no policy drafted")
    return fig


def plot_flops(runs: list[dict]) -> Figure:
    """Stacked FLOP buckets over what plain decoding spends on the same tokens, one panel per batch size and one
    bar per policy: bars beyond 1 are the extra compute speculation trades for fewer sequential target passes.
    Horizontal bars, so ~15 policy names stay readable (rotated under vertical bars they ran together)."""
    engine = [r for r in runs if flops_ratio(r, "total") is not None]
    sizes, policies = batch_sizes(engine), list(by_policy(engine, lambda r: True))
    if not engine:
        fig, ax = axes("FLOPs by bucket", "FLOPs / plain decoding's", "policy")
        legend(ax, "no engine run")
        return fig
    fig = Figure(figsize=(max(8.0, 2.5 + 1.8 * len(sizes)), 1.5 + 0.3 * len(policies)), layout="constrained")
    panels = fig.subplots(1, len(sizes), sharex=True, sharey=True, squeeze=False)[0]
    y = range(len(policies))
    for ax, b in zip(panels, sizes):
        rows = {r["policy"]: r for r in engine if r["batch_size"] == b}
        left = [0.0] * len(policies)
        for bucket, colour in BUCKET_COLOURS.items():
            width = [flops_ratio(rows[p], bucket) if p in rows else 0.0 for p in policies]
            ax.barh(y, width, left=left, color=colour, label=bucket if ax is panels[0] else None)
            left = [lo + w for lo, w in zip(left, width)]
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1, label="plain decoding" if ax is panels[0] else None)
        ax.set_title(f"batch {b}")
        ax.grid(axis="x", alpha=0.3)
    panels[0].set_yticks(y, policies)
    panels[0].invert_yaxis()  # first policy (ar) on top, as in the tables
    fig.suptitle("FLOPs by bucket, relative to plain decoding")
    fig.supxlabel("FLOPs / plain decoding's (the same output, one token at a time, no padding)")
    legend(panels[0], "no engine run")
    return fig


def plot_acceptance(runs: list[dict]) -> Figure:
    """Position i's rate is P(x_i accepted | x_i drafted and x_1..x_{i-1} accepted), the per-token acceptance a
    depth policy trades on. Counts are summed over batch sizes before dividing: a ratio of totals."""
    fig, ax = axes("Acceptance by draft position, given earlier drafts kept", "draft position (all batch sizes)",
                   "accepted / reached at position")
    ax.set_prop_cycle(color=colormaps["tab20"].colors)
    for policy, rows in by_policy(runs, lambda r: drafts(r) and "reached_at" in r).items():
        reached = [sum(c) for c in zip_longest(*(r["reached_at"] for r in rows), fillvalue=0)]
        accepted = [sum(c) for c in zip_longest(*(r["accepted_at"] for r in rows), fillvalue=0)]
        points = [(i + 1, a / n) for i, (n, a) in enumerate(zip(reached, accepted)) if n]
        ax.plot(*zip(*points), marker="o", label=policy)
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    legend(ax, "no policy drafted")
    return fig


PLOTS: dict[str, Callable[[list[dict]], Figure]] = {
    "speedup_vs_batch": plot_speedup,
    "depth_vs_load": plot_depth_vs_load,
    "flops": plot_flops,
    "acceptance_by_position": plot_acceptance,
}


def save_plot(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    return path


# ---------------------------------------------------------------- documents
def markdown(meta: dict, runs: list[dict], check: dict, plots: dict[str, Path]) -> str:
    lines = [f"# {title(meta)}", ""]
    lines += [f"- **{label}**: {value}" for label, value in meta_items(meta)]
    loud = f"**{VIOLATED}**: " if check["mismatches"] else ""
    lines += [""] + [f"{loud}{line}  " for line in lossless_lines(check)] + [""] + [f"{n}  " for n in notes()]
    header = [h for h, _, _ in COLUMNS]
    for b in batch_sizes(runs):
        lines += ["", f"## {batch_heading(runs, b)}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in table_rows(runs, b)]
    lines += ["", "## Best policy per batch size", ""] + [f"- {best(runs, b)}" for b in batch_sizes(runs)]
    lines += ["", "## Plots", ""] + [f"![{name}]({path.name})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


CSS = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:.5rem 0 1.5rem}th,td{border:1px solid #ccc;padding:.25rem .6rem;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#f3f3f3}img{max-width:100%}
.violation{background:#fde2e2;border:2px solid #c00;color:#900;padding:.75rem;font-weight:bold}
.ok{background:#e6f4e6;padding:.5rem}"""


def html_page(meta: dict, runs: list[dict], check: dict, plots: dict[str, Path]) -> str:
    """The same content as report.md in one file with nothing external: images are base64 data URIs."""
    e = html.escape
    status, loud = ("violation", f"<strong>{VIOLATED}</strong>: ") if check["mismatches"] else ("ok", "")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title(meta))}</title>",
             f"<style>{CSS}</style></head><body><h1>{e(title(meta))}</h1><ul>"]
    parts += [f"<li><b>{e(label)}</b>: {e(value)}</li>" for label, value in meta_items(meta)]
    parts += ["</ul>"] + [f"<p class='{status}'>{loud}{e(line)}</p>" for line in lossless_lines(check)]
    parts += [f"<p>{e(n)}</p>" for n in notes()]
    header = "".join(f"<th>{e(h)}</th>" for h, _, _ in COLUMNS)
    for b in batch_sizes(runs):
        body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in table_rows(runs, b))
        parts.append(f"<h2>{e(batch_heading(runs, b))}</h2><table><tr>{header}</tr>{body}</table>")
    parts += ["<h2>Best policy per batch size</h2><ul>"] + [f"<li>{e(best(runs, b))}</li>" for b in batch_sizes(runs)]
    parts += ["</ul><h2>Plots</h2>"]
    for name, path in plots.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<p><img alt='{e(name)}' src='data:image/png;base64,{data}'></p>")
    return "\n".join(parts + ["</body></html>"])


# ---------------------------------------------------------------- wandb
def log_report(logger: Logger, runs: list[dict], plots: dict[str, Path]) -> None:
    """Raw numbers (not formatted strings), so runs can be compared and re-plotted in wandb; a logger without
    tables and images (CSVLogger, TensorBoard) gets the speedups (it stopped in an AttributeError after decoding)."""
    if hasattr(logger, "log_table"):  # WandbLogger (not imported at run time: lightning is slow to import)
        columns = ["batch_size"] + [h for h, _, _ in COLUMNS]
        raw = lambda v, spec: cell(v, spec) if isinstance(v, (list, tuple)) else v  # noqa: E731 (an interval: text)
        data = [[r["batch_size"]] + [raw(value(r), spec) for _, value, spec in COLUMNS] for r in runs]
        logger.log_table(key="eval/runs", columns=columns, data=data)
        for name, path in plots.items():
            logger.log_image(key=f"eval/{name}", images=[str(path)])
    logger.log_metrics({f"eval/speedup/{r['policy']}@{r['batch_size']}": r["speedup"]
                        for r in runs if r.get("speedup") is not None}
                       | {f"eval/other_load_cores@{r['batch_size']}": r["other_load_cores"]  # to filter busy runs
                          for r in runs if r.get("other_load_cores") is not None})
