"""The vLLM connector's load planning and its start-up check, as pure functions (no vLLM, no
I/O; unit-tested alone).

When `get_num_new_matched_tokens` has told the scheduler that a hit's tokens are external, vLLM
counts them as computed and never computes them itself: either the connector writes those
blocks, or it reports them through `get_block_ids_with_load_errors` and vLLM recomputes from the
first one reported. There is no third way: a planned load that is silently dropped leaves vLLM
running on blocks nobody wrote.

Reported blocks are recomputed only under `kv_load_failure_policy="recompute"`; under vLLM's
default, "fail", the request fails instead (an empty answer). So the connector sets the policy
to "recompute" when it is built (vLLM 0.32 builds the scheduler's connector before it reads the
policy) and checks, once the scheduler has read it, that it took: `policy_refusal`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["POLICY_SETTING", "RECOMPUTE", "LoadPlan", "plan_load", "policy_refusal"]

POLICY_SETTING = "kv_transfer_config.kv_load_failure_policy"
RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to do with one request's hit in this step.

    - `blocks`: destination blocks of chunks `first_chunk`, `first_chunk + 1`, ... (load them);
    - `error_blocks`: blocks to report as load errors (vLLM recomputes from the first of them);
    - `mismatch`: the request's block list did not cover the hit (counted and logged);
    - `unreportable`: a mismatch with no block to report (the connector knows none of the
      request's blocks): vLLM cannot be told; the caller logs it as an error."""

    blocks: tuple[int, ...] = ()
    error_blocks: tuple[int, ...] = ()
    mismatch: bool = False

    @property
    def unreportable(self) -> bool:
        return self.mismatch and not self.error_blocks


def plan_load(block_ids: Sequence[int], first_chunk: int, hit_chunks: int) -> LoadPlan:
    """Plan the load of chunks `first_chunk..hit_chunks` into a request's blocks `block_ids`
    (block i holds chunk i; one chunk = one block).

    Covered (the list has a block for every chunk of the hit): load them. Not covered (the
    connector's view of the request's blocks is shorter than what vLLM was told is external):
    load nothing and report every block of the hit's range the list does have, so vLLM
    recomputes from `first_chunk` on; when the list has none there, report its last block (vLLM
    then recomputes from that block: more than needed, never less)."""
    if first_chunk < 0 or hit_chunks < 0:
        raise ValueError(f"chunk indexes must be >= 0, got first {first_chunk}, hit {hit_chunks}")
    wanted = hit_chunks - first_chunk
    if wanted <= 0:
        return LoadPlan()
    covered = tuple(block_ids[first_chunk:hit_chunks])
    if len(covered) == wanted:
        return LoadPlan(blocks=covered)
    return LoadPlan(error_blocks=covered or tuple(block_ids[-1:]), mismatch=True)


def policy_refusal(configured: str | None, scheduler_recomputes: bool | None) -> str | None:
    """Why the connector must refuse to start, or None when a block it reports as a load error
    is recomputed. `configured`: the policy as the user set it (before the connector set it to
    "recompute"); `scheduler_recomputes`: what the scheduler decided from the policy (vLLM
    0.32: `Scheduler.recompute_kv_load_failures`), None when it cannot be seen (another vLLM)."""
    if scheduler_recomputes is True:
        return None
    if scheduler_recomputes is None and configured == RECOMPUTE:
        return None  # cannot check, but the user asked for it
    if scheduler_recomputes is False:
        why = f"this vLLM read {POLICY_SETTING}={configured!r} before the connector could set it"
    else:
        why = f"cannot see whether this vLLM recomputes a failed load ({POLICY_SETTING}={configured!r})"
    return (
        f"{why}, so a cache block that fails to load would fail its request: set"
        f" {POLICY_SETTING}={RECOMPUTE!r}"
    )
