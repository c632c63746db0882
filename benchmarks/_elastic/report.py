"""The markdown report of an elastic run."""

from __future__ import annotations

from typing import Any

from benchmarks import _common as common
from benchmarks._elastic.settings import DRAIN_S, H


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    ev = s["eval"]
    rel = None if ev["relative_difference"] is None else 100 * ev["relative_difference"]
    moments = s["moments"]
    plural = "" if s["kills_tried"] == 1 else "s"
    lines = [f"# Elastic islands: {s['kills_tried']} kill{plural} of 1 of 3 islands ({result['mode']})", ""]
    lines.append(f"Command: `{result['command']}`; attacked run: `{result['elastic']['command']}`.")
    lines.append("")
    lines.append(f"- **kills survived / tried: {s['kills_survived']} / {s['kills_tried']}** (planned "
                 f"{s['kills_planned']}; the run finished with exit {result['elastic']['exit_code']}; steps without a "
                 f"line in metrics.jsonl: {s['missing_steps'] or 'none'}, logged twice: {s['repeated_steps'] or 'none'})")
    lines.append(f"- kill moments: {moments['sync_in_flight']} with an overlapped sync in flight, "
                 f"{moments['checkpoint_write']} during an orbax checkpoint write, {moments['snapshot_write']} during "
                 f"an island snapshot write, {moments['inner_only']} during inner steps only")
    lines.append(f"- inner steps of work lost per kill: max {fmt(s['lost_steps']['max'], 'd')} (bound H = {H}: "
                 f"{'met' if s['lost_steps']['within_bound'] else 'NOT met'}); values {s['lost_steps']['values']}")
    lines.append(f"- seconds stalled per kill (loss + rejoin, from the events): "
                 f"{common.fmt_pm(s['stalled_s']['per_kill'], '.1f', ' s')} (at the loss "
                 f"{common.fmt_pm(s['stalled_s']['at_loss'], '.1f', ' s')}, at the rejoin "
                 f"{common.fmt_pm(s['stalled_s']['at_rejoin'], '.1f', ' s')}); from the kill until the survivors "
                 f"trained again {common.fmt_pm(s['kill_to_training_s'], '.1f', ' s')}, until all 3 trained again "
                 f"{common.fmt_pm(s['kill_to_rejoined_s'], '.1f', ' s')}")
    if ev["uninterrupted"] is not None:
        lines.append(f"- final eval loss: {fmt(ev['elastic'], '.4f')} attacked vs {ev['uninterrupted']:.4f} "
                     f"uninterrupted: {fmt(rel, '+.2f')}% (acceptance: within {100 * ev['tolerance']:g}%)")
    else:
        lines.append(f"- final eval loss: {fmt(ev['elastic'], '.4f')} attacked (no uninterrupted run to compare)")
    reference = result["reference"]
    lines.append(f"- wall time: attacked run {result['elastic']['wall_s']:.0f} s"
                 + (f", uninterrupted {reference['wall_s']:.0f} s ({reference['step_s']:.2f} s per step)"
                    if reference else " (no uninterrupted run in this mode)"))
    lines.append("")
    lines.append("| # | island | kind | step | sync in flight | checkpoint write | snapshot write | resume step | "
                 "lost steps | stalled at loss (s) | stalled at rejoin (s) | kill to training (s) | survived |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    yes = lambda b: "yes" if b else "no"
    for kill in result["kills"]:
        kind = kill["kind"] + (" (fell back to any)" if kill["fallback_to_any"] else "")
        flight = f"yes (fragment {kill['in_flight_fragment']})" if kill["sync_in_flight"] else "no"
        lines.append(f"| {kill['kill']} | {kill['island']} | {kind} | {kill['step']} | {flight} | "
                     f"{yes(kill['checkpoint_write'])} | {yes(kill['snapshot_write'])} | "
                     f"{fmt(kill.get('resume_step'), 'd')} | {fmt(kill.get('lost_steps'), 'd')} | "
                     f"{fmt(kill.get('stalled_lost_s'), '.1f')} | {fmt(kill.get('stalled_rejoin_s'), '.1f')} | "
                     f"{fmt(kill.get('kill_to_training_s'), '.1f')} | {yes(kill.get('survived'))} |")
    lines += ["", "| check | passed |", "|---|---|"]
    lines += [f"| {name} | {yes(ok)} |" for name, ok in s["checks"].items()]
    lines.append("")
    if result.get("failure"):
        lines += ["**Failure:** " + result["failure"].splitlines()[0], ""]
    m = result["machine"]
    lines.append(f"Stalls include the launcher's `--drain-s {DRAIN_S:g}`, process start-up, `jax.distributed` "
                 f"initialisation and loading compiled programs from the compilation cache. {m['cpu_count']} CPUs "
                 f"(load average at the end {m['load_average_at_end']}), {m['platform']}, Python {m['python']}, "
                 f"JAX {m['jax']}; code revision {result['revision'] or 'unknown'}.")
    return "\n".join(lines) + "\n"
