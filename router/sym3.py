"""Clipping the eigenvalues of a symmetric 3x3 matrix to [0, cap], in plain floats.

The latency profiles' RLS (:class:`router.profiles.BayesianRLS`) caps its covariance's
eigenvalues after every sample, up to five times per finished request on the proxy's
event loop. ``numpy.linalg.eigh`` on a 3x3 matrix and the products around it cost tens of
microseconds of call overhead each; this does the same in closed form:

- the eigenvalues by the trigonometric formula for symmetric 3x3 matrices (Smith 1961);
- nothing to do when they all lie in [0, cap] (the matrix is returned as given);
- else only the eigenvectors of the clipped eigenvalues are needed, each as the largest
  cross product of two rows of ``A - lambda I``, and the result is ``A`` less
  ``(lambda - cap) v v^T`` for each eigenvalue above the cap (two above: ``cap I`` plus
  ``(lambda_3 - cap) v_3 v_3^T``, from the one below).

NOTE: a vector's error grows as its eigenvalue nears another, but the correction it
carries is at most that gap (lambda just above the cap, the next at most the cap), so the
result stays within a few ulps of ``||A||`` of eigh's. What is left -- an eigenvalue below 0
(which the RLS's downdate may cause by rounding), a repeated eigenvalue that must be split
-- returns None, and the caller falls back to ``eigh``.
"""

from __future__ import annotations

import math

Mat3 = tuple[tuple[float, float, float], tuple[float, float, float], tuple[float, float, float]]
Vec3 = tuple[float, float, float]
_DEGENERATE = 1e-12  # a squared cross product below this x ||A - lambda I||^4: no direction


def eigvals(a: Mat3) -> tuple[float, float, float]:
    """The eigenvalues of symmetric ``a``, largest first."""
    (a00, a01, a02), (_, a11, a12), (_, _, a22) = a
    p1 = a01 * a01 + a02 * a02 + a12 * a12
    if p1 == 0.0:
        d = sorted((a00, a11, a22), reverse=True)
        return d[0], d[1], d[2]
    q = (a00 + a11 + a22) / 3.0
    b00, b11, b22 = a00 - q, a11 - q, a22 - q
    p = math.sqrt((b00 * b00 + b11 * b11 + b22 * b22 + 2.0 * p1) / 6.0)
    # det(A - qI) / p^3 / 2, in [-1, 1] but for rounding
    det = (b00 * (b11 * b22 - a12 * a12) - a01 * (a01 * b22 - a12 * a02)
           + a02 * (a01 * a12 - b11 * a02))
    phi = math.acos(min(max(det / (2.0 * p * p * p), -1.0), 1.0)) / 3.0
    hi = q + 2.0 * p * math.cos(phi)
    lo = q + 2.0 * p * math.cos(phi + 2.0 * math.pi / 3.0)
    return hi, 3.0 * q - hi - lo, lo


def eigvec(a: Mat3, lam: float) -> Vec3 | None:
    """A unit eigenvector of ``a`` for eigenvalue ``lam``; None if not one direction."""
    (a00, a01, a02), (_, a11, a12), (_, _, a22) = a
    # NOTE: rows r0 = (b00, a01, a02), r1 = (a01, b11, a12), r2 = (a02, a12, b22) of
    # A - lam I; the cross products r0 x r1, r0 x r2, r1 x r2 written out (this runs after
    # most RLS updates), the same operations in the same order as the plain loop
    # (tests/router/test_same_decisions.py)
    b00, b11, b22 = a00 - lam, a11 - lam, a22 - lam
    c0, c1, c2 = a01 * a12 - a02 * b11, a02 * a01 - b00 * a12, b00 * b11 - a01 * a01
    best_n = c0 * c0 + c1 * c1 + c2 * c2
    if not best_n > 0.0:
        c0 = c1 = c2 = best_n = 0.0
    d0, d1, d2 = a01 * b22 - a02 * a12, a02 * a02 - b00 * b22, b00 * a12 - a01 * a02
    n = d0 * d0 + d1 * d1 + d2 * d2
    if n > best_n:
        c0, c1, c2, best_n = d0, d1, d2, n
    d0, d1, d2 = b11 * b22 - a12 * a12, a12 * a02 - a01 * b22, a01 * a12 - b11 * a02
    n = d0 * d0 + d1 * d1 + d2 * d2
    if n > best_n:
        c0, c1, c2, best_n = d0, d1, d2, n
    scale = ((b00 * b00 + a01 * a01 + a02 * a02) + (a01 * a01 + b11 * b11 + a12 * a12)
             + (a02 * a02 + a12 * a12 + b22 * b22))
    if best_n <= _DEGENERATE * scale * scale or best_n == 0.0:
        return None
    s = 1.0 / math.sqrt(best_n)
    return c0 * s, c1 * s, c2 * s


def clip_eigenvalues(a: Mat3, cap: float) -> Mat3 | None:
    """``a`` with its eigenvalues clipped to [0, ``cap``] (``a`` itself when they are in
    it); None where the closed form does not apply (see the module docstring)."""
    hi, mid, lo = eigvals(a)
    if lo < 0.0:
        return None
    if hi <= cap:
        return a
    if lo >= cap:
        return ((cap, 0.0, 0.0), (0.0, cap, 0.0), (0.0, 0.0, cap))
    # one above the cap: take its excess off along its vector; two: cap everywhere but
    # along the lowest one's vector
    one = mid <= cap
    v = eigvec(a, hi if one else lo)
    if v is None:
        return None
    if one:
        e = hi - cap
        return _sym(a[0][0] - e * v[0] * v[0], a[0][1] - e * v[0] * v[1],
                    a[0][2] - e * v[0] * v[2], a[1][1] - e * v[1] * v[1],
                    a[1][2] - e * v[1] * v[2], a[2][2] - e * v[2] * v[2])
    e = lo - cap
    return _sym(cap + e * v[0] * v[0], e * v[0] * v[1], e * v[0] * v[2],
                cap + e * v[1] * v[1], e * v[1] * v[2], cap + e * v[2] * v[2])


def _sym(a00: float, a01: float, a02: float, a11: float, a12: float, a22: float) -> Mat3:
    return (a00, a01, a02), (a01, a11, a12), (a02, a12, a22)
