"""Angular quadrature sets for discrete ordinates.

Convention (one for the whole package): the weights of the full set sum to 1, so the scalar flux
is `phi = sum_n w_n psi_n` and an isotropic source enters the transport equation without a 4*pi.
The angular flux `psi` is therefore 4*pi times the per-steradian flux; the scalar flux, currents
and reaction rates are the physical ones. Each octant holds the same directions reflected, so a
set stores only its first-octant cosines and weights (summing to 1/8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "LEVEL_SYMMETRIC_ORDERS",
    "OCTANTS",
    "QUADRATURES",
    "Quadrature",
    "level_symmetric",
    "make_quadrature",
    "product",
]

OCTANTS: tuple[tuple[int, int, int], ...] = tuple(
    (1 - 2 * (o & 1), 1 - 2 * ((o >> 1) & 1), 1 - 2 * ((o >> 2) & 1)) for o in range(8)
)
"""Direction signs (sx, sy, sz) of octant o: bit 0 flips x, bit 1 flips y, bit 2 flips z."""

QUADRATURES = ("level-symmetric", "product")

# Level-symmetric LQn sets (Lewis & Miller, Table 4-1): the smallest cosine mu_1, and one weight
# per class of points (i, j, k), where a class is the sorted index triple. The cosines follow from
# mu_i^2 = mu_1^2 + (i - 1) * 2 (1 - 3 mu_1^2) / (N - 2), which keeps every point on the sphere.
_LQN: dict[int, tuple[float, dict[tuple[int, int, int], float]]] = {
    2: (0.5773502691896258, {(1, 1, 1): 1.0}),
    4: (0.3500212, {(1, 1, 2): 1.0 / 3.0}),
    6: (0.2666355, {(1, 1, 3): 0.1761263, (1, 2, 2): 0.1572071}),
    8: (0.2182179, {(1, 1, 4): 0.1209877, (1, 2, 3): 0.0907407, (2, 2, 2): 0.0925926}),
}
LEVEL_SYMMETRIC_ORDERS: tuple[int, ...] = tuple(_LQN)


@dataclass(frozen=True, eq=False)
class Quadrature:
    """First-octant direction cosines (all > 0) and weights; octant o flips signs by OCTANTS[o]."""

    name: str
    mu: np.ndarray
    eta: np.ndarray
    xi: np.ndarray
    weights: np.ndarray

    @property
    def per_octant(self) -> int:
        return int(self.mu.size)

    @property
    def total(self) -> int:
        return 8 * self.per_octant

    def directions(self, octant: int) -> np.ndarray:
        """Signed (n, 3) unit vectors of one octant, in the order the sweep uses."""
        sx, sy, sz = OCTANTS[octant]
        return np.stack([sx * self.mu, sy * self.eta, sz * self.xi], axis=1)

    def all_directions(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (8n, 3) direction and its weight: for moment checks and plots."""
        dirs = np.concatenate([self.directions(o) for o in range(8)])
        return dirs, np.tile(self.weights, 8)

    def __str__(self) -> str:
        return f"{self.name} ({self.per_octant} directions per octant, {self.total} in all)"


def level_symmetric(order: int) -> Quadrature:
    """The LQn set S_order (2, 4, 6, 8): N(N+2)/8 directions per octant, rotation invariant."""
    if order not in _LQN:
        allowed = ", ".join(str(n) for n in _LQN)
        raise ValueError(f"order: level-symmetric sets exist for orders {allowed}, not {order}")
    mu1, classes = _LQN[order]
    if order == 2:
        levels = np.array([mu1])
    else:
        step = 2.0 * (1.0 - 3.0 * mu1 * mu1) / (order - 2)
        levels = np.sqrt(mu1 * mu1 + step * np.arange(order // 2))
    points, weights = [], []
    top = order // 2 + 2  # i + j + k for every point of the octant
    for i in range(1, top - 1):
        for j in range(1, top - i):
            k = top - i - j
            points.append((levels[i - 1], levels[j - 1], levels[k - 1]))
            weights.append(classes[tuple(sorted((i, j, k)))])
    pts = np.array(points)
    pts /= np.linalg.norm(pts, axis=1, keepdims=True)  # remove the tables' 7-digit round-off
    w = np.array(weights)
    w *= 0.125 / w.sum()
    return Quadrature(f"S{order}", pts[:, 0].copy(), pts[:, 1].copy(), pts[:, 2].copy(), w)


def product(polar: int, azimuthal: int) -> Quadrature:
    """Gauss-Legendre in xi (polar, about z) x Chebyshev (equal-weight) azimuths.

    `polar` Gauss points on [-1, 1] (even), so polar/2 per hemisphere; `azimuthal` angles per
    quadrant at (m + 1/2) * (pi/2) / azimuthal. Exact for polynomials in xi to degree 2*polar-1.
    """
    if polar < 2 or polar % 2:
        raise ValueError(
            f"order: a product set needs an even number of polar points >= 2, not {polar}"
        )
    if azimuthal < 1:
        raise ValueError(f"azimuthal: must be >= 1, not {azimuthal}")
    nodes, gl_w = np.polynomial.legendre.leggauss(polar)
    keep = nodes > 0
    xi_l, w_l = nodes[keep], gl_w[keep] / 2.0  # the positive half sums to 1/2
    phi = (np.arange(azimuthal) + 0.5) * (np.pi / 2) / azimuthal
    xi = np.repeat(xi_l, azimuthal)
    sin = np.sqrt(1.0 - xi * xi)
    ang = np.tile(phi, xi_l.size)
    w = np.repeat(w_l, azimuthal) / (4.0 * azimuthal)
    return Quadrature(f"GLC{polar}x{azimuthal}", sin * np.cos(ang), sin * np.sin(ang), xi, w)


def make_quadrature(kind: str, order: int, azimuthal: int = 0) -> Quadrature:
    """Build a set by deck name; `azimuthal = 0` means order/2 azimuths per quadrant."""
    if kind == "level-symmetric":
        return level_symmetric(order)
    if kind == "product":
        return product(order, azimuthal or max(1, order // 2))
    raise ValueError(f"quadrature: unknown set {kind!r}; known: {', '.join(QUADRATURES)}")
