"""The figures of `benchmarks.engine_push`: per push, its time against the floor and stock vLLM, its peak memory,
where its time goes; the targets, met or MISSED, and what stands between a missed one and its target."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks import common
from benchmarks.engine_shapes import BUCKETS
from benchmarks.engine_steps import FUSED_WRITE, PLUGIN, READS, VLLM

TARGET_WHOLE_X = 1.3  # whole-file push / floor
TARGET_TENSOR_X = 2.0  # one-tensor buckets / floor
TARGET_VS_STOCK = 1.0  # plugin / stock, same calls, where stock completes
TARGET_OWN = 0.05  # the plugin's own steps, share of the push
TARGET_SHAPE, TARGET_LAYOUT = "dflash-2k", "gpu"
ROLES_ARMS = (("plugin", "session"), ("plugin", "plain"), ("stock", "plain"), ("stock", "layerwise"))

#: why a step costs what it does, and what would take it away (the closing note of a missed target)
WHY = {
    "vLLM: layerwise materialize, copy back": (
        "vLLM's layerwise reload materializes each layer in fresh memory, loads the buffered tensors there and copies "
        "the result back into the layer's original storage (what captured graphs read): two more passes over the "
        "bytes than the floor, plus the page faults of the fresh memory. Closing it: load straight into the kept "
        "tensors where processing keeps the layout (unquantized on CUDA), which changes how vLLM's reload runs: a "
        "patch of vLLM's `_layerwise_process` or an upstream change, a decision for the planners"),
    READS: (
        "the reader gives each value a fresh tensor: vLLM holds a layer's tensors until the layer is complete, so one "
        "reused buffer cannot back them; fresh memory faults in page by page. Closing it: read into a reused buffer "
        "when every layer a bucket touches completes within its call (whole-file and per-layer buckets), a change to "
        "`lifecycle.vllm.reload.payload.feed`"),
    "vLLM: weight loaders": (
        "vLLM's weight loaders (name mapping, q/k/v and gate/up fused on load, one copy per tensor into the "
        "materialized layer): vLLM's own work, the same with stock vLLM"),
    "vLLM: processing": "vLLM's CPU repack into oneDNN (not in the floor): vLLM's own work on the CPU layout",
    "vLLM: fused rebuild (torch.cat)": "stock vLLM rebuilds the fused K/V buffer with `torch.cat` after every call",
    FUSED_WRITE: "the fused K/V buffer written once, in place: the floor does it too",
}


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _key(role: str, arm: str, bucket: str) -> str:
    return f"{role} {arm} {bucket}"


def _failure(probe: Mapping[str, Any]) -> str:
    run, check = probe["run"], probe["check"]
    if not run["ok"]:
        return f"the push raises: {run['error']}"
    gen = check["generate"]
    if not gen["ok"]:
        return f"the push returns; the next generate fails: {gen['error'][:160]}"
    if not check["fused_equals_checkpoint"]:
        return "the push returns; the fused K/V buffer does not hold the pushed checkpoint's rows"
    return f"the push returns; the draft is left unusable ({check.get('quarantine') or check.get('state')})"


def _breakdown(runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    steps: dict[str, float] = {}
    for r in runs:
        for step, s in r["steps"].items():
            steps[step] = steps.get(step, 0.0) + s * 1e3 / len(runs)
    total = sum(r["s"] for r in runs) * 1e3 / len(runs)
    out = {s: round(v, 3) for s, v in sorted(steps.items(), key=lambda kv: -kv[1])}
    out["rest (session plumbing)"] = round(total - sum(steps.values()), 3)
    out["total"] = round(total, 3)
    return out


def _arm(layout: Mapping[str, Any], role: str, arm: str, bucket: str) -> dict[str, Any] | None:
    k = _key(role, arm, bucket)
    probe = layout["probes"].get(k) or layout["layerwise_probes"].get(k)
    if k not in layout["samples"]:
        return None if probe is None else {"fails": _failure(probe), "check": probe["check"]}
    runs = layout["samples"][k]
    floor = [x["s"] for x in layout["samples"][_key(role, "floor", bucket)]]
    s = [x["s"] for x in runs]
    out: dict[str, Any] = {**common.summarize(s), "x_floor": common.paired_ratio(s, floor),
                           "peak_over_mib": _median([x["peak_over_mib"] or 0.0 for x in runs]),
                           "rss_mib": _median([x["rss_mib"] for x in runs]), "calls": runs[0]["calls"],
                           "check": probe["check"] if probe else None}
    if k in layout["steps"]:
        out["breakdown"] = _breakdown(layout["steps"][k])
        out["step_calls"] = layout["steps"][k][0]["step_calls"]
        own = sum(v for step, v in out["breakdown"].items() if step in PLUGIN)
        out["own_ms"] = round(own, 3)
        out["own_share"] = round(own / out["breakdown"]["total"], 4) if role == "plugin" else None
    return out


def summarize(results: Sequence[Mapping[str, Any]], repeats: int) -> dict[str, Any]:
    rows = []
    for res in results:
        shape = res["shape"]["name"]
        for layout_name, layout in res["layouts"].items():
            for bucket in BUCKETS:
                floor = layout["samples"][_key("plugin", "floor", bucket)]
                row: dict[str, Any] = {"shape": shape, "layout": layout_name, "bucket": bucket,
                                       "tensors": res["tensors"], "mb": round(res["bytes"] / 1e6, 1),
                                       "floor": common.summarize([x["s"] for x in floor]),
                                       "largest_bucket_mib": res["buckets"][bucket]["largest_mib"],
                                       "calls": res["buckets"][bucket]["calls"]}
                for role, arm in ROLES_ARMS:
                    row[f"{role}_{arm}"] = _arm(layout, role, arm, bucket)
                plugin, stock = row["plugin_plain"], row["stock_plain"]
                if plugin and stock and "fails" not in stock and "fails" not in plugin:
                    a = [x["s"] for x in layout["samples"][_key("plugin", "plain", bucket)]]
                    b = [x["s"] for x in layout["samples"][_key("stock", "plain", bucket)]]
                    row["plugin_vs_stock_plain"] = common.paired_ratio(a, b)
                rows.append(row)
    return {"rows": rows, "targets": targets(rows), "stock_layerwise": _stock_failures(results),
            "engines": [{"shape": r["shape"]["name"], "layout": ln, **{role: lay["started"][role] for role in
                                                                        lay["started"]}, "loadavg": lay["loadavg"]}
                        for r in results for ln, lay in r["layouts"].items()]}


def _stock_failures(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{"shape": r["shape"]["name"], "layout": ln, "bucket": k.split()[-1], "completes": p["check"]["ok"]
             and p["run"]["ok"], "what": _failure(p) if not (p["check"]["ok"] and p["run"]["ok"]) else "completes"}
            for r in results for ln, lay in r["layouts"].items() for k, p in lay["layerwise_probes"].items()]


def targets(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    mine = {r["bucket"]: r for r in rows if r["shape"] == TARGET_SHAPE and r["layout"] == TARGET_LAYOUT}
    out: list[dict[str, Any]] = []
    if not mine:
        return out

    def ratio_target(bucket: str, limit: float) -> None:
        arm = mine[bucket]["plugin_session"]
        ok = arm is not None and "fails" not in arm
        figure = arm["x_floor"]["median"] if ok else None
        what = "whole-file push" if bucket == "whole" else f"one-{bucket} buckets"
        out.append({"what": f"{what} (session) <= {limit}x the floor",
                    "figure": figure, "met": ok and figure <= limit, "bucket": bucket, "kind": "floor"})

    ratio_target("whole", TARGET_WHOLE_X)
    ratio_target("tensor", TARGET_TENSOR_X)
    for bucket, r in mine.items():
        stock, plugin = r["stock_plain"], r["plugin_plain"]
        if stock is None or "fails" in stock:
            continue
        ratio = r.get("plugin_vs_stock_plain", {}).get("median")
        less = plugin is not None and "fails" not in plugin and plugin["peak_over_mib"] < stock["peak_over_mib"]
        out.append({"what": f"plain load_weights, {bucket} buckets: plugin no slower than stock, less peak memory",
                    "figure": ratio, "peak_mib": [plugin and plugin.get("peak_over_mib"), stock["peak_over_mib"]],
                    "met": ratio is not None and ratio <= TARGET_VS_STOCK and less, "bucket": bucket,
                    "kind": "stock"})
    for bucket, r in mine.items():
        arm = r["plugin_session"]
        share = arm.get("own_share") if arm else None
        out.append({"what": f"plugin's own steps < {TARGET_OWN:.0%} of the push (session, {bucket} buckets)",
                    "figure": share, "met": share is not None and share < TARGET_OWN, "bucket": bucket,
                    "kind": "own"})
    return out


def _ms_x(arm: Mapping[str, Any] | None) -> str:
    if arm is None:
        return "-"
    if "fails" in arm:
        return "FAILS"
    x = arm["x_floor"]
    return f"{arm['median_ms']:.1f} ({x['median']:.2f}x, {x['p25']:.2f}-{x['p75']:.2f})"


def _peak(arm: Mapping[str, Any] | None) -> str:
    return "-" if arm is None else ("FAILS" if "fails" in arm else f"{arm['peak_over_mib']:.0f}")


def print_report(report: Mapping[str, Any], info: Mapping[str, Any]) -> None:
    say, rows = common.say, report["rows"]
    say("\n1. push time, median ms (x floor: the median of the per-round ratios to the floor of the same round, "
        "IQR); FAILS: stock does not complete that push (2.); plugin/stock: the same plain calls, paired")
    say(common.table(
        ["draft", "layout", "buckets", "calls", "floor ms", "plugin session", "plugin plain", "stock plain",
         "stock layerwise", "plain: plugin/stock"],
        [[r["shape"], r["layout"], r["bucket"], r["calls"], f"{r['floor']['median_ms']:.1f}",
          _ms_x(r["plugin_session"]), _ms_x(r["plugin_plain"]), _ms_x(r["stock_plain"]),
          _ms_x(r["stock_layerwise"]),
          f"{r['plugin_vs_stock_plain']['median']:.2f}" if "plugin_vs_stock_plain" in r else "-"] for r in rows]))
    say("\n2. stock vLLM's layerwise reload (paths i-iii; what vLLM's own transfer engines run), each on a fresh "
        "engine, GPU layout:")
    for f in report["stock_layerwise"]:
        say(f"  {f['shape']}, {f['bucket']} buckets: {f['what']}")
    say("\n3. memory: peak RSS during the push over the process's RSS before it, MiB (median of the rounds); "
        "largest bucket: the bytes one call carries")
    say(common.table(
        ["draft", "layout", "buckets", "largest bucket MiB", "plugin session", "plugin plain", "stock plain",
         "steady RSS MiB (plugin / stock)"],
        [[r["shape"], r["layout"], r["bucket"], f"{r['largest_bucket_mib']:.1f}", _peak(r["plugin_session"]),
          _peak(r["plugin_plain"]), _peak(r["stock_plain"]),
          " / ".join(f"{a['rss_mib']:.0f}" for a in (r["plugin_session"], r["stock_plain"])
                     if a and "fails" not in a)] for r in rows]))
    _print_breakdowns(rows)
    say("\nTARGETS (dflash-2k, GPU layout):")
    for t in report["targets"]:
        fig = "-" if t["figure"] is None else (f"{100 * t['figure']:.1f}%" if t["kind"] == "own"
                                               else f"{t['figure']:.2f}x")
        extra = f", peak {t['peak_mib'][0]} vs {t['peak_mib'][1]} MiB" if t["kind"] == "stock" else ""
        say(f"  {'met' if t['met'] else 'MISSED'}: {t['what']}: {fig}{extra}")
    met = sum(t["met"] for t in report["targets"])
    say(f"TARGETS: {met} of {len(report['targets'])} met")
    for note in closing_notes(report):
        say("  " + note)
    say("\n" + common.end_line(info))
    say(common.noise_note(info))


def _print_breakdowns(rows: Sequence[Mapping[str, Any]]) -> None:
    groups: dict[tuple[str, str], list[tuple[str, Mapping[str, Any]]]] = {}
    for r in rows:
        for role, arm in (("plugin", "session"), ("stock", "plain")):
            a = r[f"{role}_{arm}"]
            if a and "breakdown" in a:
                groups.setdefault((r["shape"], r["layout"]), []).append((f"{role} {arm} {r['bucket']}", a))
    for (shape, layout), arms in groups.items():
        steps = [s for s in (*PLUGIN, READS, FUSED_WRITE, *VLLM) if any(s in a["breakdown"] for _, a in arms)]
        common.say(f"\n4. where the time goes: {shape}, {layout} layout, ms per push (mean of the timed-step "
                   "rounds); plugin's own = the first group")
        body = [[step, *(f"{a['breakdown'].get(step, 0.0):.2f}" for _, a in arms)]
                for step in [*steps, "rest (session plumbing)", "total"]]
        body.insert(len([s for s in steps if s in PLUGIN]),
                    ["= plugin's own", *(f"{a['own_ms']:.2f} ({100 * (a['own_share'] or 0):.1f}%)"
                                         if a.get("own_share") is not None else "-" for _, a in arms)])
        common.say(common.table(["step", *(name for name, _ in arms)], body))


def closing_notes(report: Mapping[str, Any]) -> list[str]:
    """For each missed target, the steps that separate it from its target, with what would close them."""
    rows = {(r["shape"], r["layout"], r["bucket"]): r for r in report["rows"]}
    notes = []
    for t in report["targets"]:
        if t["met"]:
            continue
        row = rows.get((TARGET_SHAPE, TARGET_LAYOUT, t["bucket"]))
        arm = row and row["plugin_plain" if t["kind"] == "stock" else "plugin_session"]
        if not arm or "breakdown" not in arm:
            continue
        b = arm["breakdown"]
        top = [(s, v) for s, v in b.items() if s not in ("total",) and (t["kind"] != "own" or s in PLUGIN)][:3]
        notes.append(f"why {t['what']}: " + "; ".join(f"{s} {v:.1f} ms ({100 * v / b['total']:.0f}%)"
                                                       for s, v in top))
        for s, _ in top[:2]:
            if s in WHY:
                notes.append(f"  {s}: {WHY[s]}")
    return notes
