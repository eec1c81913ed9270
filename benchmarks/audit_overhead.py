"""Audit overhead: events per second to a JSON-lines file, and the cost per reload with logging on vs off.

    python -m benchmarks.audit_overhead [--quick] [--repeats N] [--json PATH] [--threads T]

Part 1, per event: one lifecycle audit event (a `transition` with the usual fields, through
`BackboneLifecycle.audit_event`, so including the in-memory `recent_events` ring) under each audit setting:
  off           `configure_audit(console=False)`: processed, then dropped (no file, no terminal)
  JSON file     `configure_audit(json_path=..., console=False)`: one JSON line per event
  console       `configure_audit(console=True)` rendered to /dev/null (readable lines, no colours)
  debug, filtered   a debug-level event (as the loader's per-bucket event) at the default info level
Part 2, per reload: a DFlash draft (8 layers) reloaded from a safetensors file (begin_reload, load_safetensors one
bucket per layer, finalize_loading, refresh_derived_buffers) with audit off / JSON file / console, interleaved
round by round. The difference per reload is compared with events per reload x the per-event difference.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

if __package__ in (None, ""):  # run as a file: python benchmarks/audit_overhead.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common
from benchmarks.common import Arm
from benchmarks.stored import Summary, iqr, num
from lifecycle import events as audit_events
from lifecycle.events import configure_audit
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.testing import random_checkpoint
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft

NAME = "audit_overhead"
MEASURED = ("lifecycle", ":(exclude)lifecycle/vllm", ":(exclude)lifecycle/audit", "models",
            "benchmarks/audit_overhead.py")


def reload_config(quick: bool) -> DFlashConfig:
    if quick:
        return DFlashConfig(num_hidden_layers=2)
    return DFlashConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=64)


class Settings:
    """The audit configurations compared, each applied by `use(name)`."""

    names = ("off", "JSON file", "console")

    def __init__(self, tmp: Path) -> None:
        self.log = tmp / "audit.jsonl"
        self._devnull: TextIO = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def use(self, name: str) -> None:
        configure_audit(console=False)
        if name == "JSON file":
            self.log.unlink(missing_ok=True)
            configure_audit(json_path=self.log, console=False)
        elif name == "console":
            configure_audit(console=True, stream=self._devnull)

    def close(self) -> None:
        configure_audit(console=False)
        self._devnull.close()


def per_event(settings: Settings, quick: bool) -> list[dict[str, Any]]:
    model = DFlashQwen3Draft(DFlashConfig(num_hidden_layers=2), name="events")
    lc = model.lifecycle
    fields = {"trigger": "weights_loaded", "src": "PARTIALLY_LOADED", "dst": "PARTIALLY_LOADED",
              "layers_ready": 3, "layers_total": 9, "duration_ms": 0.021, "tensors": 8}
    number = 300 if quick else 5000
    rows = []
    for name in Settings.names:
        settings.use(name)
        cost = common.per_call_us(lambda: lc.audit_event("transition", **fields), number=number)
        rows.append({"setting": name, **cost, "events_per_s": round(1e6 / cost["median_us"])})
        if name == "JSON file":
            configure_audit(console=False)
            lines = len(audit_events.read_events(settings.log))
            rows[-1]["lines_written"] = lines  # every event became one JSON line
    settings.use("off")
    cost = common.per_call_us(lambda: lc.audit_event("loader_bucket", level="debug", **fields), number=number)
    rows.append({"setting": "debug, filtered (at info level)", **cost, "events_per_s": round(1e6 / cost["median_us"])})
    return rows


def per_reload(settings: Settings, tmp: Path, quick: bool, repeats: int) -> dict[str, Any]:
    cfg = reload_config(quick)
    model = DFlashQwen3Draft(cfg, name="audit-bench")
    weights = random_checkpoint(model, 0)
    path = write_checkpoint(weights, tmp / "draft.safetensors")
    settings.use("off")
    load_safetensors(model, path)
    model.finalize_loading()
    model.refresh_derived_buffers()

    def reload() -> None:
        model.begin_reload()
        load_safetensors(model, path, bucket_by="layer")
        model.finalize_loading()
        model.refresh_derived_buffers()

    arms = [Arm(name, reload, lambda name=name: settings.use(name)) for name in Settings.names]
    cpu: dict[str, list[float]] = {}
    samples = common.interleaved(arms, repeats, cpu=cpu)
    settings.use("JSON file")
    reload()
    configure_audit(console=False)
    events = audit_events.read_events(settings.log)
    settings.use("off")
    return {"tensors": len(weights), "mb": round(common.checkpoint_bytes(weights) / 1e6, 1),
            "layers": cfg.num_hidden_layers, "events_per_reload": len(events),
            "event_kinds": sorted({e["event"] for e in events}), "samples": samples, "cpu": cpu}


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser(NAME, __doc__.splitlines()[0], repeats=15).parse_args(argv)
    repeats = common.setup_run(args, default_repeats=15)
    info = common.machine_info()
    repeats = common.enough_rounds(repeats, info, explicit=args.repeats is not None)
    common.say(f"audit overhead ({'quick' if args.quick else 'full'} run, {repeats} interleaved repeats per arm)")
    common.say(common.machine_line(info))
    with common.scratch("bench-audit-") as d:
        settings = Settings(Path(d))
        try:
            events = per_event(settings, args.quick)
            reload = per_reload(settings, Path(d), args.quick, repeats)
        finally:
            settings.close()
    common.finish(info)

    off_us = next(r["median_us"] for r in events if r["setting"] == "off")
    common.say("\nper event (lifecycle audit_event, median of 5 batches)")
    common.say(common.table(
        ["setting", "median us", "min us", "events/s", "vs off"],
        [[r["setting"], r["median_us"], r["min_us"], r["events_per_s"], f"{r['median_us'] - off_us:+.1f} us"]
         for r in events]))

    samples, cpu = reload.pop("samples"), reload.pop("cpu")
    base = common.summarize(samples["off"])
    rows = []
    for name in Settings.names:
        s = common.summarize(samples[name])
        paired = common.paired_ratio(samples[name], samples["off"])
        ev_us = next(r["median_us"] for r in events if r["setting"] == name)
        rows.append({"setting": name, **s, "ratio_to_off": paired,
                     "ratio_to_off_cpu": common.paired_ratio(cpu[name], cpu["off"]),
                     "delta_ms": round(s["median_ms"] - base["median_ms"], 3),
                     "predicted_delta_ms": round(reload["events_per_reload"] * (ev_us - off_us) / 1e3, 3)})
    common.say(f"\nper reload: DFlash {reload['layers']} layers, {reload['tensors']} tensors, {reload['mb']} MB; "
               f"{reload['events_per_reload']} audit events per reload ({', '.join(reload['event_kinds'])})")
    common.say(common.table(
        ["audit", "median ms", "min-max", "x off (IQR)", "CPU time: x off", "delta ms", "events x per-event delta"],
        [[r["setting"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.3g}-{r['max_ms']:.3g}",
          iqr(r["ratio_to_off"], three), iqr(r["ratio_to_off_cpu"], three), f"{r['delta_ms']:+.2f}",
          f"{r['predicted_delta_ms']:+.2f}"] for r in rows]))
    common.say("\n" + common.end_line(info))
    common.say(common.noise_note(info))
    reloads = {**reload, "rows": rows}
    common.store(args, NAME, {"repeats": repeats, "per_event": events, "per_reload": reloads}, info,
                 summary(events, reloads), MEASURED)
    return 0


def three(v: float) -> str:
    return f"{v:.3f}"


def summary(events: list[dict[str, Any]], reload: dict[str, Any]) -> Summary:
    out = Summary()
    out.table(["per event", "median µs", "min µs", "events/s"],
              [(e["setting"], e["median_us"], e["min_us"], e["events_per_s"]) for e in events])
    out.table(["audit", "median ms (min-max)", "x off (IQR)", "CPU time: x off (IQR)", "+ms"],
              [(r["setting"], common.ms(r), iqr(r["ratio_to_off"], three), iqr(r["ratio_to_off_cpu"], three),
                r["delta_ms"]) for r in reload["rows"]],
              title=f"Per reload ({reload['layers']} layers, {reload['tensors']} tensors, {num(reload['mb'])} MB, "
                    f"{reload['events_per_reload']} events):")
    return out


if __name__ == "__main__":
    sys.exit(main())
