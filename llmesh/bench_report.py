"""Report of ``llmesh bench``: llmesh/reference ratios, JSON, a PNG plot and a text table."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RATIO_FIGURES: tuple[tuple[str, ...], ...] = (
    ("output_tokens_per_s",),
    ("requests_per_s",),
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("itl_ms", "p50"),
    ("itl_ms", "p99"),
    ("tpot_ms", "p50"),
    ("tpot_ms", "p99"),
    ("latency_ms", "p50"),
    ("latency_ms", "p99"),
    ("errors",),
    ("cpu_s_per_1k_tokens", "total"),
    ("serving_cpu_us_per_token", "total"),
)
"""Figures compared per concurrency level (path into a level summary)."""


def _get(summary: Mapping[str, Any], path: Sequence[str]) -> float:
    value: Any = summary
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return math.nan
        value = value[key]
    return float(value) if isinstance(value, int | float) else math.nan


def ratio(a: float, b: float) -> float | None:
    """a / b; None when undefined (NaN, or b == 0 unless both are 0, which gives 1.0)."""
    if math.isnan(a) or math.isnan(b):
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return round(a / b, 4)


def ratios(
    llmesh: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """llmesh / reference for every figure of every concurrency level both systems ran."""
    by_c = {int(s["concurrency"]): s for s in reference}
    out = []
    for mine in llmesh:
        c = int(mine["concurrency"])
        ref = by_c.get(c)
        if ref is None:
            continue
        row: dict[str, Any] = {"concurrency": c}
        for path in RATIO_FIGURES:
            row[".".join(path)] = ratio(_get(mine, path), _get(ref, path))
        # Added time to first token (ms), the figure the goal is stated in.
        row["ttft_p50_added_ms"] = _delta(_get(mine, ("ttft_ms", "p50")), _get(ref, ("ttft_ms", "p50")))
        out.append(row)
    return out


def _delta(a: float, b: float) -> float | None:
    return None if math.isnan(a) or math.isnan(b) else round(a - b, 3)


def _clean(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(report: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(dict(report)), indent=2, allow_nan=False) + "\n")
    return path


def _series(levels: Sequence[Mapping[str, Any]], path: Sequence[str]) -> tuple[list[int], list[float]]:
    xs = [int(s["concurrency"]) for s in levels]
    ys = [_get(s, path) for s in levels]
    return xs, ys


def plot(report: Mapping[str, Any], path: Path) -> Path | None:
    """Throughput, TTFT, ITL and CPU cost against concurrency, one line per system.

    Returns None (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    systems: dict[str, Any] = report.get("systems", {})
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=80)
    panels: list[tuple[Any, str, str, list[tuple[tuple[str, ...], str, str]]]] = [
        (axes[0][0], "Output throughput", "tokens/s", [(("output_tokens_per_s",), "-", "")]),
        (axes[0][1], "Time to first token", "ms (log)", [(("ttft_ms", "p50"), "-", " p50"),
                                                         (("ttft_ms", "p99"), "--", " p99")]),
        (axes[1][0], "Inter-token latency", "ms", [(("itl_ms", "p50"), "-", " p50"),
                                                   (("itl_ms", "p99"), "--", " p99")]),
        (axes[1][1], "CPU per 1k output tokens (all processes)", "CPU s",
         [(("cpu_s_per_1k_tokens", "total"), "-", "")]),
    ]
    colors = {"llmesh": "tab:blue", "reference": "tab:orange"}
    all_c: set[int] = set()
    for ax, title, unit, lines in panels:
        for name, system in systems.items():
            levels = system.get("levels", [])
            label = system.get("label", name)
            for fig_path, style, suffix in lines:
                xs, ys = _series(levels, fig_path)
                all_c.update(xs)
                if xs and not all(math.isnan(y) for y in ys):
                    ax.plot(xs, ys, style, marker="o", color=colors.get(name), label=f"{label}{suffix}")
        if title == "Output throughput":
            _mark_errors(ax, systems)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.set_xlabel("concurrent streams")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0][1].set_yscale("log")
    for ax, *_ in panels:
        if all_c:
            ax.set_xticks(sorted(all_c))
            ax.set_xticklabels([str(c) for c in sorted(all_c)])
    meta = report.get("meta", {})
    fig.suptitle(f"llmesh vs vllm serve - {meta.get('model', '')} ({meta.get('machine', '')})", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _mark_errors(ax: Any, systems: Mapping[str, Any]) -> None:
    """Label the throughput points of levels that had failed requests (their tokens are not counted)."""
    for system in systems.values():
        for s in system.get("levels", []):
            if s.get("errors"):
                point = (s["concurrency"], s["output_tokens_per_s"])
                label = f"{s['errors']}/{s['requests']} requests failed"
                ax.annotate(label, point, textcoords="offset points", xytext=(-110, -4), fontsize=8,
                            color="tab:red")


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _interval(bounds: Sequence[float] | None) -> str:
    """``lo to hi ms``, or "n/a" (too few pairs, or a report from before the interval)."""
    if not bounds:
        return "n/a"
    lo, hi = bounds
    return f"{_fmt(float(lo), 2)} to {_fmt(float(hi), 2)} ms"


def level_table(report: Mapping[str, Any]) -> str:
    """Markdown table: one row per system and concurrency, then the ratios."""
    rows = ["| system | streams | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | errors | CPU s/1k tok |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, system in report.get("systems", {}).items():
        for s in system.get("levels", []):
            rows.append(
                f"| {system.get('label', name)} | {s['concurrency']} | {_fmt(s['output_tokens_per_s'])} "
                f"| {_fmt(s['ttft_ms']['p50'])} | {_fmt(s['ttft_ms']['p99'])} | {_fmt(s['itl_ms']['p50'])} "
                f"| {_fmt(s['itl_ms']['p99'])} | {s['errors']} "
                f"| {_fmt(s['cpu_s_per_1k_tokens'].get('total'), 2)} |"
            )
    ratio_rows = report.get("ratios", [])
    if ratio_rows:
        rows += ["", "| llmesh / reference | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | CPU/1k tok "
                 "| serving CPU/tok | added TTFT p50 (ms) |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in ratio_rows:
            rows.append(
                f"| {r['concurrency']} streams | {_fmt(r['output_tokens_per_s'], 3)} "
                f"| {_fmt(r['ttft_ms.p50'], 3)} | {_fmt(r['ttft_ms.p99'], 3)} | {_fmt(r['itl_ms.p50'], 3)} "
                f"| {_fmt(r['itl_ms.p99'], 3)} | {_fmt(r['cpu_s_per_1k_tokens.total'], 3)} "
                f"| {_fmt(r.get('serving_cpu_us_per_token.total'), 3)} | {_fmt(r['ttft_p50_added_ms'], 1)} |"
            )
    return "\n".join(rows)


def cpu_table(report: Mapping[str, Any]) -> str:
    """Markdown table of CPU seconds per 1k output tokens per tier."""
    rows = []
    for name, system in report.get("systems", {}).items():
        for s in system.get("levels", []):
            per = s.get("cpu_s_per_1k_tokens", {})
            cells = ", ".join(f"{tier} {_fmt(v, 3)}" for tier, v in per.items())
            rows.append(f"- {system.get('label', name)}, {s['concurrency']} streams: {cells}")
            serving = s.get("serving_cpu_us_per_token")
            if serving:
                # The engine core processes left out: what the serving code itself costs.
                cells = ", ".join(f"{tier} {_fmt(v, 1)}" for tier, v in serving.items())
                rows.append(f"  - without engine processes, CPU us per output token: {cells}")
    return "\n".join(rows)


def text_summary(report: Mapping[str, Any]) -> str:
    """What ``llmesh bench`` prints at the end."""
    parts = [level_table(report)] if report.get("systems") else []
    cpu = cpu_table(report)
    if cpu:
        parts += ["", "CPU seconds per 1k output tokens:", cpu]
    overhead = report.get("overhead")
    if overhead:
        parts += ["", "Per-request overhead with a fake-engine mesh (sequential requests, each down "
                  "every path in turn, p50):"]
        for path, figs in overhead.get("paths", {}).items():
            parts.append(f"- {path}: TTFT {_fmt(figs['ttft_ms']['p50'], 2)} ms, "
                         f"total {_fmt(figs['latency_ms']['p50'], 2)} ms, errors {figs['errors']}")
        for key, value in overhead.get("added_ms", {}).items():
            parts.append(f"- added {key}: {_fmt(value, 2)} ms")
        for key, value in overhead.get("added_paired_ms", {}).items():
            parts.append(f"- added {key}, paired (median of per-request differences): {_fmt(value, 2)} ms")
    paired = report.get("paired_ttft")
    if paired:
        added = paired["added_ttft_ms"]
        parts += ["", f"Added TTFT at one stream, paired ({paired['pairs']} prompts, each sent to llmesh and "
                  "to the reference in turn, both up at once, "
                  f"{paired['output_tokens_per_request']} tokens each): P50 {_fmt(added['p50'], 2)} ms "
                  f"(P25 {_fmt(added['p25'], 2)}, P75 {_fmt(added['p75'], 2)}; 95 % interval of the "
                  f"median {_interval(paired.get('p50_interval_ms'))}); TTFT P50 llmesh "
                  f"{_fmt(paired['llmesh']['ttft_ms']['p50'], 2)} ms, reference "
                  f"{_fmt(paired['reference']['ttft_ms']['p50'], 2)} ms; errors "
                  f"{paired['llmesh']['errors']} and {paired['reference']['errors']}"]
    blocks = report.get("paired_throughput")
    if blocks:
        mine, ref = blocks["llmesh"], blocks["reference"]
        pairs = ", ".join(_fmt(r, 3) for r in blocks["pair_ratios"])
        parts += ["", f"Throughput at {blocks['concurrency']} streams, paired ({blocks['blocks_per_system']} "
                  f"blocks of {blocks['requests_per_block']} requests per system, both up, alternating "
                  f"llmesh/reference): llmesh {_fmt(mine['output_tokens_per_s'])} tok/s, reference "
                  f"{_fmt(ref['output_tokens_per_s'])} tok/s, ratio "
                  f"{_fmt(blocks['output_tokens_per_s_ratio'], 3)} (pairs {pairs}); serving CPU per output "
                  f"token llmesh {_fmt(mine.get('serving_cpu_us_per_token', {}).get('total'), 1)} us, "
                  f"reference {_fmt(ref.get('serving_cpu_us_per_token', {}).get('total'), 1)} us, ratio "
                  f"{_fmt(blocks['serving_cpu_ratio'], 3)}; errors {mine['errors']} and {ref['errors']}"]
    capacity = report.get("capacity")
    if capacity:
        parts += ["", f"Capacity, {capacity['engine']} engine, worker transport "
                  f"{capacity.get('worker_transport', 'calls')}, {capacity['streams']} streams x "
                  f"{capacity['tokens_per_request']} tokens over {capacity.get('protocol', 'grpc')}: "
                  f"{_fmt(capacity['output_tokens_per_s'])} tok/s "
                  f"to the client, {capacity['errors']} errors", "",
                  "| tier | CPU us per output token |", "| --- | ---: |"]
        parts += [f"| {tier} | {_fmt(us, 1)} |" for tier, us in capacity["cpu_us_per_token"].items()]
        idle = capacity.get("idle_cpu_ms_per_s")
        if idle:
            tiers = ", ".join(f"{tier} {_fmt(ms, 1)}" for tier, ms in idle.items() if tier != "total")
            parts += ["", f"Idle mesh before the load: {_fmt(idle['total'], 1)} ms of CPU per second "
                      f"({tiers}), {_fmt(capacity.get('idle_us_per_token'), 1)} us per output token "
                      "at this run's rate"]
    batching = report.get("batching")
    if batching:
        parts += ["", f"Batching window on ({batching.get('on_ms')} ms) vs off, "
                  f"{batching.get('engine')} engine:"]
        for row in batching.get("comparison", []):
            parts.append(
                f"- {row['concurrency']} streams: tok/s on {_fmt(row['on_tok_s'])} "
                f"off {_fmt(row['off_tok_s'])}; TTFT p50 on {_fmt(row['on_ttft_p50_ms'], 2)} "
                f"off {_fmt(row['off_ttft_p50_ms'], 2)} ms; "
                f"CPU s/1k tok on {_fmt(row['on_cpu_s_per_1k'], 3)} "
                f"off {_fmt(row['off_cpu_s_per_1k'], 3)}")
    return "\n".join(parts)
