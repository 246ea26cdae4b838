"""The exit policy: what happens to a job after each outcome.

    outcome ──► actions (DEFAULT_ACTIONS) ──► complete / retry / fail
       exit(N) ──► the exit_codes map; unmapped codes fail
    retry, once the attempt number is past ``retries`` ──► fail
    retry ──► backoff_s(base, attempt): base, 2 x base, 4 x base... capped at MAX_BACKOFF_S

The defaults are the outcome table of docs/design.md (and of the README). A worker builds
its policy from ``exit_codes`` alone (``SandboxWorker(exit_codes=...)``, ``--exit-code``);
every other outcome keeps its default action. ``lease_lost``, ``cancelled`` and
``interrupted`` never reach the policy: a worker that lost its lease does not ack, a
cancelled job is already final, and an interrupted job is requeued without charge
(acks.py).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sandboxq.models import Action, Outcome

DEFAULT_ACTIONS: dict[Outcome, Action] = {
    Outcome.OK: Action.COMPLETE,
    Outcome.ERROR: Action.RETRY,
    Outcome.SOFT_TIMEOUT: Action.RETRY,
    Outcome.HARD_TIMEOUT: Action.RETRY,
    Outcome.EXIT: Action.FAIL,  # unless the exit code is mapped
    Outcome.CRASHED: Action.RETRY,
    Outcome.MEMORY_LIMIT: Action.FAIL,
    Outcome.CPU_LIMIT: Action.FAIL,
}

#: Longest wait between two attempts, whatever the backoff and attempt number.
MAX_BACKOFF_S = 3600.0


class ExitPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    actions: dict[Outcome, Action] = Field(default_factory=lambda: dict(DEFAULT_ACTIONS))
    exit_codes: dict[int, Action] = Field(default_factory=dict)

    def decide(self, outcome: Outcome, exitcode: int | None, attempt: int, retries: int) -> Action:
        """The action for ``attempt`` (1-based) of a job allowed ``retries`` retries."""
        if outcome is Outcome.EXIT:
            action = (
                self.exit_codes.get(exitcode, Action.FAIL) if exitcode is not None else Action.FAIL
            )
        else:
            action = self.actions.get(outcome, Action.FAIL)
        if action is Action.RETRY and attempt > retries:
            return Action.FAIL
        return action


def backoff_s(base_s: float, attempt: int) -> float:
    """Exponential backoff before attempt ``attempt + 1``: base, 2 x base, 4 x base... capped."""
    if base_s <= 0:
        return 0.0
    return float(min(MAX_BACKOFF_S, base_s * 2 ** min(attempt - 1, 30)))
