"""Divisors of a world size, found from its prime factors.

Every parallel degree of a valid layout divides the world size, so the fix search only ever
needs the divisors of W: a few dozen even for W = 2^40, where listing 1..W would not finish.
Factorising uses trial division by small primes, then Miller-Rabin and Pollard's rho for
what is left, so a 40-bit prime is as quick as a power of two.
"""

from __future__ import annotations

import math
import random
from collections import Counter

_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
_TRIAL_LIMIT = 1000


def is_prime(n: int) -> bool:
    """Miller-Rabin with the bases that make it exact below 3.3e24, and very likely above."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_rho(n: int, rng: random.Random) -> int:
    """A non-trivial factor of the composite odd `n` (Brent's variant)."""
    while True:
        y, c, m = rng.randrange(1, n), rng.randrange(1, n), 128
        g = r = q = 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += m
            r *= 2
        if g == n:
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g


def factorize(n: int) -> Counter:
    """Prime -> exponent for an integer n >= 1."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"only integers >= 1 have prime factors here, got {n!r}")
    factors: Counter = Counter()
    for p in range(2, _TRIAL_LIMIT):
        if p * p > n:
            break
        while n % p == 0:
            factors[p] += 1
            n //= p
    rng = random.Random(n)  # seeded: the same n always takes the same path
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if is_prime(m):
            factors[m] += 1
            continue
        d = _pollard_rho(m, rng)
        stack += [d, m // d]
    return factors


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending."""
    out = [1]
    for prime, power in factorize(n).items():
        out = [d * prime**k for d in out for k in range(power + 1)]
    return sorted(out)
