"""Hardware profiles: the shipped ones load, and a bad file gets one clear error naming the key and the fix."""

from __future__ import annotations

import pytest

from torchrlhf.config import ConfigError
from torchrlhf.plan.hardware import SHIPPED, load_hardware, save_hardware


def test_every_shipped_profile_loads_and_says_where_its_figures_came_from():
    assert {"h100", "cpu_xeon_2core"} <= set(SHIPPED)
    for name in SHIPPED:
        hw = load_hardware(name)
        assert "measured" in hw.source and hw.peak_flops("float32") > 0


def test_a_saved_profile_reads_back_equal(tmp_path):
    hw = load_hardware("h100")
    assert load_hardware(str(save_hardware(hw, tmp_path / "hw.yaml"))) == hw


def _write(tmp_path, text: str):
    path = tmp_path / "hw.yaml"
    path.write_text(text)
    return str(path)


def test_a_missing_key_is_named(tmp_path):
    text = (SHIPPED["h100"].read_text()).replace("memory_bandwidth_gbps: 2900.0\n", "")
    with pytest.raises(ConfigError, match="memory_bandwidth_gbps"):
        load_hardware(_write(tmp_path, text))


def test_a_value_with_a_unit_is_refused_naming_the_key(tmp_path):
    text = SHIPPED["h100"].read_text().replace("memory_gib: 69.0", "memory_gib: 80 GB")
    with pytest.raises(ConfigError, match=r"memory_gib: '80 GB' carries a unit"):
        load_hardware(_write(tmp_path, text))


def test_an_efficiency_given_in_percent_is_refused(tmp_path):
    text = SHIPPED["h100"].read_text().replace("efficiency: 0.237", "efficiency: 23.7")
    with pytest.raises(ConfigError, match=r"train.efficiency is a fraction of the peak in \(0, 1\], got 23.7"):
        load_hardware(_write(tmp_path, text))


def test_an_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="h100.*--calibrate"):
        load_hardware("a100-nonexistent")


def test_a_negative_sampling_cost_is_refused(tmp_path):
    text = SHIPPED["h100"].read_text() + "sample_ns_per_logit: -1.0\n"
    with pytest.raises(ConfigError, match="sample_ns_per_logit must be >= 0 or null, got -1.0"):
        load_hardware(_write(tmp_path, text))


def test_an_fsdp_slowdown_below_one_is_refused(tmp_path):
    # a speed-up beside FSDP2's traffic is a mis-fit, not hardware; a profile without the key computes at 1
    with pytest.raises(ConfigError, match="fsdp_slowdown is a factor >= 1, got 0.9"):
        load_hardware(_write(tmp_path, SHIPPED["h100"].read_text() + "fsdp_slowdown: 0.9\n"))
    assert load_hardware("h100").fsdp_slowdown == 1.0
