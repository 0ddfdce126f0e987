"""[moe] deck section: defaults, bad values and the cross-section checks name the key."""

from __future__ import annotations

import pytest

from hpcpipe.config import ConfigError, TopologyConfig, parse_section
from hpcpipe.moe import MoEConfig, check_moe


def parse(table: dict) -> MoEConfig:
    return parse_section(MoEConfig, table, "deck.toml", "moe")


def test_defaults_are_dense():
    cfg = parse({})
    assert cfg.experts == 0 and not cfg.enabled and not cfg.is_moe_block(1)
    check_moe(cfg, ep=4, layers=1, kind="mlp", source="deck.toml")  # nothing to check


def test_every_selects_blocks():
    cfg = parse({"experts": 4, "every": 2})
    assert [b for b in range(6) if cfg.is_moe_block(b)] == [1, 3, 5]
    assert all(parse({"experts": 4, "every": 1}).is_moe_block(b) for b in range(3))


@pytest.mark.parametrize("factor", [0, -0.5])
def test_capacity_factor_must_be_positive_in_drop_mode(factor):
    with pytest.raises(ConfigError) as err:
        parse({"experts": 4, "capacity_factor": factor})
    assert err.value.key == "moe.capacity_factor" and "deck.toml" in str(err.value)
    assert "must be > 0 when dropless = false" in str(err.value)
    assert parse({"experts": 4, "capacity_factor": factor, "dropless": True}).dropless


@pytest.mark.parametrize(
    "table,key",
    [
        ({"experts": 4, "top_k": 3}, "moe.top_k"),
        ({"experts": 1, "top_k": 2}, "moe.top_k"),
        ({"experts": -1}, "moe.experts"),
        ({"experts": 4, "every": 0}, "moe.every"),
        ({"experts": 4, "hierarchical": 1}, "moe.hierarchical"),
        ({"experts": 4, "expert": 2}, "moe.expert"),
    ],
)
def test_bad_values_name_the_key(table, key):
    with pytest.raises(ConfigError) as err:
        parse(table)
    assert err.value.key == key


def test_cross_section_checks():
    cfg = parse({"experts": 6, "every": 2})
    check_moe(cfg, ep=3, layers=2, kind="gpt", source="deck.toml")
    with pytest.raises(ConfigError, match=r"divisible by topology\.ep = 4") as err:
        check_moe(cfg, ep=4, layers=2, kind="gpt", source="deck.toml")
    assert err.value.key == "moe.experts"
    with pytest.raises(ConfigError, match=r"model\.kind = 'gpt'"):
        check_moe(cfg, ep=1, layers=2, kind="mlp", source="deck.toml")
    with pytest.raises(ConfigError, match="no block would be MoE") as err:
        check_moe(cfg, ep=1, layers=1, kind="gpt", source="deck.toml")
    assert err.value.key == "moe.every"


def test_ep_must_divide_dp():
    with pytest.raises(ConfigError) as err:
        parse_section(TopologyConfig, {"dp": 2, "ep": 4}, "deck.toml", "topology")
    assert err.value.key == "topology.ep" and "must divide dp = 2" in str(err.value)
