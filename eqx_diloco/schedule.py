"""When fragments sync and when their results are merged. Pure functions of the step.

Step t counts completed inner steps (t = 1 after the first step). With H the sync period,
P fragments and tau overlap steps, fragment p syncs at t = (p + 1) * H / P + k * H for
k >= 0, and its result is merged at t + tau. So exactly one fragment leaves every H / P
steps and each fragment still syncs once per H steps. With P = 1 this is plain DiLoCo:
one sync of everything every H steps.
"""


def synced_fragment(step: int, sync_period: int, num_fragments: int) -> int | None:
    """The fragment whose sync starts after inner step `step`, or None."""
    interval = sync_period // num_fragments
    if step < interval or step % interval:
        return None
    return (step // interval - 1) % num_fragments


def applied_fragment(step: int, sync_period: int, num_fragments: int, overlap_steps: int) -> int | None:
    """The fragment whose synced result is merged into the replicas after step `step`, or None."""
    return synced_fragment(step - overlap_steps, sync_period, num_fragments)


def router_synced(step: int, router_sync_period: int) -> bool:
    """Whether the MoE router parameters take their own outer step after `step` (0 = never)."""
    return router_sync_period > 0 and step > 0 and step % router_sync_period == 0


def sync_steps(fragment: int, sync_period: int, num_fragments: int, until: int) -> list[int]:
    """All steps <= `until` at which `fragment` syncs (the closed form, for tests and docs)."""
    interval = sync_period // num_fragments
    return list(range((fragment + 1) * interval, until + 1, sync_period))
