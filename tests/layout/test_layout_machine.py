"""[machine]: bad keys are bad input, calibration files set what they measure."""

from __future__ import annotations

import json

import pytest
from conftest import INPUTS, ROOT

from hpcpipe.config import ConfigError, load_config
from hpcpipe.layout.machine import MachineConfig, machine_model

RESULTS = ROOT / "benchmarks" / "results"
DECK = INPUTS / "layout_moe_gpt32.toml"


def test_defaults_resolve_to_si_units():
    m = machine_model(MachineConfig(), 0, "deck")
    assert m.ranks_per_node == 8
    assert m.flops == 200e12
    assert m.memory_bytes == pytest.approx(80 * 0.9 * 2**30)
    assert m.intra.latency == pytest.approx(3e-6) and m.intra.bandwidth == 150e9
    assert m.inter.alltoall_bandwidth == m.inter.bandwidth == 25e9


def test_topology_ranks_per_node_is_the_fallback():
    assert machine_model(MachineConfig(), 4, "deck").ranks_per_node == 4
    assert machine_model(MachineConfig(ranks_per_node=2), 4, "deck").ranks_per_node == 2


@pytest.mark.parametrize(
    "override, key",
    [
        ("machine.memory_gib=0", "machine.memory_gib"),
        ("machine.compute_tflops=-1", "machine.compute_tflops"),
        ("machine.inter_bandwidth_gbs=0", "machine.inter_bandwidth_gbs"),
        ("machine.alltoall_intra_gbs=0", "machine.alltoall_intra_gbs"),
        ("machine.memory_reserve=0.95", "machine.memory_reserve"),
        ("machine.bandwidth=3", "machine.bandwidth"),
        ("machine.ranks_per_node='eight'", "machine.ranks_per_node"),
    ],
)
def test_bad_machine_keys_are_named(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(DECK, [override])
    assert info.value.key == key


def test_calibration_from_shipped_bench_results():
    """The repository's own p2p and all-to-all results, as a user's would be."""
    cfg = MachineConfig(
        calibration_intra=(str(RESULTS / "p2p_latency.json"), str(RESULTS / "moe_alltoall.json"))
    )
    m = machine_model(cfg, 0, "deck")
    p2p = json.loads((RESULTS / "p2p_latency.json").read_text())["rows"]
    rows = sorted(p2p, key=lambda r: r["bytes"])
    assert m.intra.latency == pytest.approx(rows[0]["mailbox_us"] * 1e-6)
    slope = (rows[-1]["bytes"] - rows[-2]["bytes"]) / (
        (rows[-1]["mailbox_us"] - rows[-2]["mailbox_us"]) * 1e-6
    )
    assert m.intra.bandwidth == pytest.approx(slope)
    a2a = max(json.loads((RESULTS / "moe_alltoall.json").read_text())["rows"],
              key=lambda r: r["bytes"])  # fmt: skip
    ranks = json.loads((RESULTS / "moe_alltoall.json").read_text())["machine"]["ranks"]
    egress = (ranks - 1) * a2a["bytes"]  # `bytes` goes to each peer
    assert m.intra.alltoall_bandwidth == pytest.approx(egress / (a2a["flat_us"] * 1e-6))
    assert m.inter == machine_model(MachineConfig(), 0, "deck").inter  # untouched


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "cannot be read"),
        ("{not json", "is not JSON"),
        ('{"benchmark": "sweep", "rows": [{}]}', "not a --json result of `hpcpipe bench p2p`"),
        ('{"benchmark": "p2p", "rows": [{"bytes": 1, "mailbox_us": 2}]}', "two or more growing"),
        ('{"benchmark": "p2p", "rows": [{"bytes": 1}]}', "rows lack the column 'raw_us'"),
        ('{"benchmark": "alltoall", "rows": [{"size": 1}]}', "rows lack"),
        ('{"benchmark": "alltoall", "rows": [{"bytes": 8, "flat_us": 0}]}', "finite"),
        (
            '{"benchmark": "p2p", "rows": [{"bytes": 1, "mailbox_us": "nan"}, '
            '{"bytes": 2, "mailbox_us": 3}, {"bytes": 4, "mailbox_us": 5}]}',
            "finite",
        ),
        ('{"benchmark": "sweep", "rows": [{}]}', "(benchmark = 'sweep')"),
    ],
)
def test_bad_calibration_files_name_the_key_and_the_file(tmp_path, content, says):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        machine_model(MachineConfig(calibration_inter=(str(path),)), 0, "deck")
    assert info.value.key == "machine.calibration_inter"
    assert str(path) in str(info.value) and says in str(info.value)


def test_compute_rate_from_a_pipeline_benchmark(monkeypatch):
    """compute_tflops from `bench pipeline`: 3 x FLOPs of a step / (ranks x F+B+W seconds)."""
    from hpcpipe.model.models import build_model

    monkeypatch.chdir(ROOT)  # the result names its deck relative to where it ran

    path = RESULTS / "pipeline_step.json"
    data = json.loads(path.read_text())
    ranks = data["machine"]["ranks"]
    deck = load_config(data["params"]["deck"], data["params"]["overrides"])
    per_token = sum(u.flops_per_token() for u in build_model(deck.model))
    tokens = deck.data.global_batch * deck.model.seq_len
    rates = sorted(
        3 * per_token * tokens / (ranks * s["compute_s"])
        for row in data["rows"]
        for s in row["per_step"]
    )
    m = machine_model(MachineConfig(calibration_compute=(str(path),)), 0, "deck")
    assert m.flops == pytest.approx(rates[len(rates) // 2])
    assert m.intra == machine_model(MachineConfig(), 0, "deck").intra  # links untouched


def test_compute_calibration_needs_a_pipeline_result():
    with pytest.raises(ConfigError) as info:
        machine_model(
            MachineConfig(calibration_compute=(str(RESULTS / "p2p_latency.json"),)), 0, "deck"
        )
    assert info.value.key == "machine.calibration_compute"
    assert "bench pipeline" in str(info.value)
