"""`make demo`: sandboxed children that hang, crash and exit, handled while good jobs complete."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from sandboxq import AttemptFailed, Pool  # noqa: E402


def main() -> None:
    kinds = ["ok", "hang", "slow", "crash", "ok", "exit", "raise", "ok"]
    print(f"running {len(kinds)} jobs on 2 sandboxed children (hard timeout 1 s)\n")
    started = time.monotonic()
    with Pool("demo_jobs:misbehave", size=2, soft_timeout_s=0.5, hard_timeout_s=1.0) as pool:
        futures = [(kind, pool.submit(kind)) for kind in kinds]
        for kind, future in futures:
            try:
                print(f"  {kind:6} -> ok: {future.result()}")
            except AttemptFailed as err:
                print(f"  {kind:6} -> {err}")
    print(f"\nall done in {time.monotonic() - started:.2f} s; no child left running")


if __name__ == "__main__":
    main()
