"""The processor of examples/quickstart.py: plain Python, nothing sandboxq-specific."""

from __future__ import annotations


def count_primes(below: int) -> int:
    """How many primes are smaller than ``below`` (a sieve: CPU work, no I/O)."""
    if below < 3:
        return 0
    sieve = bytearray([1]) * below
    sieve[0] = sieve[1] = 0
    for n in range(2, int(below**0.5) + 1):
        if sieve[n]:
            sieve[n * n :: n] = bytes(len(range(n * n, below, n)))
    return sum(sieve)
