"""Quadrature sets: normalisation (full set sums to 1), unit directions, symmetry, moments."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.sweep.quadrature import (
    LEVEL_SYMMETRIC_ORDERS,
    OCTANTS,
    level_symmetric,
    make_quadrature,
    product,
)

SETS = [level_symmetric(n) for n in LEVEL_SYMMETRIC_ORDERS] + [
    product(2, 1),
    product(4, 3),
    product(8, 4),
    product(12, 7),
]


@pytest.mark.parametrize("quad", SETS, ids=str)
def test_weights_and_directions(quad):
    assert quad.weights.sum() == pytest.approx(0.125, abs=1e-15)
    assert (quad.weights > 0).all()
    assert (quad.mu > 0).all() and (quad.eta > 0).all() and (quad.xi > 0).all()
    norm = quad.mu**2 + quad.eta**2 + quad.xi**2
    np.testing.assert_allclose(norm, 1.0, atol=1e-14)
    dirs, w = quad.all_directions()
    assert dirs.shape == (quad.total, 3)
    assert w.sum() == pytest.approx(1.0, abs=1e-14)
    # odd moments vanish by octant symmetry; second moments are 1/3 (exact up to table digits)
    np.testing.assert_allclose(w @ dirs, 0.0, atol=1e-15)
    np.testing.assert_allclose(w @ dirs**2, 1.0 / 3.0, atol=2e-7)


@pytest.mark.parametrize("order,count", [(2, 1), (4, 3), (6, 6), (8, 10)])
def test_level_symmetric_counts_and_rotation_invariance(order, count):
    quad = level_symmetric(order)
    assert quad.per_octant == count == order * (order + 2) // 8
    # level-symmetric: the same set of cosines on every axis
    for a, b in ((quad.mu, quad.eta), (quad.mu, quad.xi)):
        np.testing.assert_allclose(np.sort(a), np.sort(b), atol=1e-15)


def test_product_integrates_polynomials_in_xi():
    quad = product(6, 5)
    dirs, w = quad.all_directions()
    xi = dirs[:, 2]
    for k in (2, 4, 6, 8, 10):  # exact: Gauss-Legendre with 6 points is exact to degree 11
        assert w @ xi**k == pytest.approx(1.0 / (k + 1), rel=1e-13)
    assert quad.per_octant == 3 * 5


def test_octant_signs_cover_all_eight_once():
    assert sorted(OCTANTS) == sorted(
        (sx, sy, sz) for sx in (1, -1) for sy in (1, -1) for sz in (1, -1)
    )
    quad = level_symmetric(4)
    assert (np.sign(quad.directions(5)) == OCTANTS[5]).all()


@pytest.mark.parametrize(
    "kind,order,match",
    [
        ("lebedev", 4, "unknown set 'lebedev'"),
        ("level-symmetric", 10, "level-symmetric sets exist for orders 2, 4, 6, 8"),
        ("product", 5, "even number of polar points"),
    ],
)
def test_bad_quadrature_is_a_clear_error(kind, order, match):
    with pytest.raises(ValueError, match=match):
        make_quadrature(kind, order)
