"""Matching the kills with the run's island_lost / island_rejoined events, and every
acceptance check."""

from __future__ import annotations

from typing import Any

from benchmarks import _common as common
from benchmarks._elastic.launcher import finish_summary
from benchmarks._elastic.observe import count_events
from benchmarks._elastic.settings import LOSS_TOLERANCE, H, Mode


def analyse(attack: dict[str, Any], reference: dict[str, Any] | None, mode: Mode) -> dict[str, Any]:
    """Match the kills with the events and decide every acceptance check."""
    done = finish_summary(attack["run_dir"], mode.steps)
    records = done["records"]
    lost_events, rejoin_events = count_events(records, "island_lost"), count_events(records, "island_rejoined")
    finished = attack["exit_code"] == 0 and attack["failure"] is None and done["final_eval_loss"] is not None
    kills = attack["kills"]
    for k, kill in enumerate(kills):
        lost = lost_events[k] if k < len(lost_events) else None
        back = rejoin_events[k] if k < len(rejoin_events) else None
        kill["lost_event"] = lost
        kill["rejoin_event"] = back
        kill["lost_steps"] = lost["lost_steps"] if lost else None
        kill["resume_step"] = lost["resume_step"] if lost else None
        kill["stalled_lost_s"] = lost["stalled_s"] if lost else None
        kill["stalled_rejoin_s"] = back["stalled_s"] if back else None
        kill["stalled_s"] = (lost["stalled_s"] + back["stalled_s"]) if lost and back else None
        # The others trained on with 2 replicas after the loss, and with 3 after the rejoin.
        at = records.index(lost) if lost else None
        until = records.index(back) if back else None
        kill["continued_with_2"] = bool(lost and any(r.get("live_replicas") == 2 and "loss" in r
                                                     for r in records[at:until]))
        kill["continued_with_3"] = bool(back and any(r.get("live_replicas") == 3 and "loss" in r
                                                     for r in records[until:]))
        kill["island_matches"] = bool(lost and back and lost["island"] == back["island"] == kill["island"])
        kill["lost_steps_within_h"] = kill["lost_steps"] is not None and 0 <= kill["lost_steps"] <= H
        # The last kill counts only if the run also finished; an earlier one, once the run went on to the next.
        kill["survived"] = bool(kill["island_matches"] and kill["continued_with_2"] and kill["continued_with_3"]
                                and (finished or k < len(kills) - 1))
    survived = sum(1 for kill in kills if kill["survived"])
    lost_steps = [kill["lost_steps"] for kill in kills if kill["lost_steps"] is not None]
    stall = lambda key: common.mean_sd([kill[key] for kill in kills if kill[key] is not None])
    elastic_loss = done["final_eval_loss"]
    ref_loss = reference["final_eval_loss"] if reference else None
    rel = (elastic_loss - ref_loss) / ref_loss if elastic_loss is not None and ref_loss else None
    checks = {
        f"{mode.kills} kills tried": len(kills) == mode.kills,
        "every kill survived": len(kills) > 0 and survived == len(kills),
        "run finished (exit 0, final evaluation)": finished,
        f"lost steps <= H = {H}": bool(lost_steps) and len(lost_steps) == len(kills) and max(lost_steps) <= H,
        "no unexpected losses": len(lost_events) == len(kills),
        "metrics.jsonl has a line for every step, once": done["all_steps_logged"] and not done["repeated_steps"],
    }
    if mode.reference:  # the smoke run is far too short to compare losses
        checks["final eval loss within 2% of the uninterrupted run"] = rel is not None and abs(rel) <= LOSS_TOLERANCE
    return {
        "kills_tried": len(kills),
        "kills_survived": survived,
        "kills_planned": mode.kills,
        "run_finished": finished,
        "all_steps_logged": done["all_steps_logged"],
        "missing_steps": done["missing_steps"],
        "repeated_steps": done["repeated_steps"],
        "unexpected_losses": max(0, len(lost_events) - len(kills)),
        "moments": {
            "sync_in_flight": sum(kill["sync_in_flight"] for kill in kills),
            "checkpoint_write": sum(kill["checkpoint_write"] for kill in kills),
            "snapshot_write": sum(kill["snapshot_write"] for kill in kills),
            "inner_only": sum(not (kill["sync_in_flight"] or kill["checkpoint_write"] or kill["snapshot_write"])
                              for kill in kills),
        },
        "lost_steps": {"values": lost_steps, "max": max(lost_steps, default=None), "bound": H,
                       "bound_name": "H = --diloco.sync-period", "within_bound": checks[f"lost steps <= H = {H}"]},
        "stalled_s": {"at_loss": stall("stalled_lost_s"), "at_rejoin": stall("stalled_rejoin_s"),
                      "per_kill": stall("stalled_s")},
        "kill_to_training_s": stall("kill_to_training_s"),
        "kill_to_rejoined_s": stall("kill_to_rejoined_s"),
        "eval": {"elastic": elastic_loss, "uninterrupted": ref_loss, "relative_difference": rel,
                 "tolerance": LOSS_TOLERANCE},
        "checks": checks,
        "passed": all(checks.values()),
    }
