"""DTRALLOC_CONF: parsing, validation messages, `python -m dtralloc config`.

What a user notices: a setting takes effect with the documented unit and
suffixes; a typo or a bad value is a ConfigError (a ValueError) that names the
key and says what the key accepts, from every entry point (Pool(conf=...),
describe_config, the CLI); a bad environment variable never breaks `import
dtralloc`.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import GiB, KiB, MiB

import dtralloc

OPTION_NAMES = [
    "budget",
    "max_split_size_mb",
    "segment_fit",
    "small_in_large",
    "spare_evicted",
    "long_lived",
    "unmap_pages",
    "split_oversize",
    "arena",
    "async_segments",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "history_entries",
    "policy",
    "recompute_penalty",
    "small_tensor_cutoff",
    "eviction_sample_threshold",
    "eviction_seed",
]


def run_cli(*args, env_conf=None, timeout=120):
    env = dict(os.environ)
    env.pop("DTRALLOC_CONF", None)
    if env_conf is not None:
        env["DTRALLOC_CONF"] = env_conf
    return subprocess.run(
        [sys.executable, "-m", "dtralloc", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


# --------------------------------------------------------------------------
# the option table


def test_every_option_is_described_with_default_accepts_and_doc():
    options = dtralloc.describe_config("")
    assert [o["name"] for o in options] == OPTION_NAMES
    for o in options:
        assert o["value"] == o["default"], o
        assert o["accepts"].strip() and o["doc"].strip(), o
    defaults = {o["name"]: o["default"] for o in options}
    assert defaults["budget"] == "none"
    assert defaults["max_split_size_mb"] == "auto"  # none unless policy dtralloc + budget
    assert defaults["max_non_split_rounding_mb"] == "20 MiB"  # torch's default
    assert defaults["roundup_power2_divisions"] == "0"
    assert defaults["garbage_collection_threshold"] == "0"
    assert defaults["history_entries"] == "0"  # off by default, as in torch


def test_effective_config_reads_the_environment_when_conf_is_none(monkeypatch):
    monkeypatch.setenv("DTRALLOC_CONF", "budget:6G,max_split_size_mb:256")
    eff = dtralloc.effective_config()
    assert eff["budget"] == "6 GiB"
    assert eff["max_split_size_mb"] == "256 MiB"
    monkeypatch.setenv("DTRALLOC_CONF", "bogus_key:1")
    with pytest.raises(dtralloc.ConfigError, match="bogus_key"):
        dtralloc.effective_config()


def test_pool_ignores_the_environment(monkeypatch):
    # The env var configures the process-wide allocator, not pools built by hand.
    monkeypatch.setenv("DTRALLOC_CONF", "budget:1M")
    pool = dtralloc.Pool("virtual", capacity="1G")
    assert pool.budget_bytes == GiB


# --------------------------------------------------------------------------
# sizes and units


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6G", 6 * GiB),
        ("6g", 6 * GiB),
        ("6GB", 6 * GiB),
        ("512M", 512 * MiB),
        ("64K", 64 * KiB),
        ("1.5G", 3 * GiB // 2),
        ("1073741824B", GiB),
        ("1T", 1 << 40),
        (" 2G ", 2 * GiB),
    ],
)
def test_budget_takes_sizes_with_suffixes(text, expected):
    pool = dtralloc.Pool("virtual", capacity="1T", conf=f"budget:{text}")
    assert pool.budget_bytes == expected
    assert pool.stats()["budget_bytes"] == expected


@pytest.mark.parametrize(
    "fraction, share", [("0.5", 0.5), ("0.25", 0.25), (".75", 0.75), ("50%", 0.5), ("12.5%", 0.125), ("100%", 1.0)]
)
def test_budget_takes_a_fraction_of_device_memory(fraction, share):
    pool = dtralloc.Pool("virtual", capacity="8G", conf=f"budget:{fraction}")
    assert pool.budget_bytes == int(share * 8 * GiB)


@pytest.mark.parametrize("bare", ["1", "2", "1.0", "1.5", "512", "1073741824"])
def test_budget_bare_number_that_is_not_a_fraction_is_an_error_naming_both_forms(bare):
    """budget:1 once meant the whole device and budget:2 two bytes: neither is
    what a user who writes them can be sure of, so both are errors."""
    with pytest.raises(dtralloc.ConfigError) as info:
        dtralloc.Pool("virtual", capacity="8G", conf=f"budget:{bare}")
    message = str(info.value)
    assert f"bad value '{bare}' for key 'budget'" in message
    assert "0.5 or 50%" in message  # the fraction form
    assert "6G" in message and "512M" in message  # the size form


def test_budget_none_is_the_whole_device():
    pool = dtralloc.Pool("virtual", capacity="3G", conf="budget:none")
    assert pool.budget_bytes == 3 * GiB


@pytest.mark.parametrize(
    "text, expected",
    [("256", 256 * MiB), ("256M", 256 * MiB), ("1G", 1024 * MiB), ("100.5", int(100.5 * MiB))],
)
def test_mb_keys_take_megabytes_or_suffixed_sizes(text, expected):
    pool = dtralloc.Pool("virtual", capacity="1G", conf=f"max_split_size_mb:{text}")
    assert pool.stats()["max_split_size"] == expected


def test_max_split_size_none_reports_torch_sentinel():
    # torch reports "no limit" as a huge/negative sentinel; dtralloc uses -1.
    assert dtralloc.Pool("virtual", capacity="1G").stats()["max_split_size"] == -1


@pytest.mark.parametrize(
    "conf, expected",
    [
        ("policy:dtralloc,budget:512M", 32 * MiB),  # auto: dtralloc under a budget
        ("policy:dtralloc", -1),                     # no budget: nothing to defragment for
        ("policy:msps,budget:512M", -1),             # other policies: torch's default
        ("policy:dtralloc,budget:512M,max_split_size_mb:none", -1),
        ("policy:dtralloc,budget:512M,max_split_size_mb:64", 64 * MiB),
        ("policy:dtralloc,budget:512M,max_split_size_mb:AUTO", 32 * MiB),
    ],
)
def test_max_split_size_auto(conf, expected):
    assert dtralloc.Pool("virtual", capacity="1G", conf=conf).stats()["max_split_size"] == expected


def test_max_split_size_auto_is_reported_as_asked():
    # The configuration shows what was asked for; the pool's stats what it runs with.
    assert dtralloc.effective_config("policy:dtralloc,budget:512M")["max_split_size_mb"] == "auto"


@pytest.mark.parametrize(
    "conf, segment, shown",
    [
        ("", 20 * MiB, "auto"),                             # torch's 20 MiB segment
        ("policy:dtralloc,budget:512M", 18 * MiB, "auto"),  # two 9 MiB copies, no tail
        ("policy:dtralloc", 20 * MiB, "auto"),              # no budget: off
        ("policy:msps,budget:512M", 20 * MiB, "auto"),      # other policies: off
        ("policy:dtralloc,budget:512M,segment_fit:off", 20 * MiB, "off"),
        ("segment_fit:on", 18 * MiB, "on"),
        ("segment_fit:AUTO,policy:dtralloc,budget:512M", 18 * MiB, "auto"),
    ],
)
def test_segment_fit(conf, segment, shown):
    pool = dtralloc.Pool("virtual", capacity="1G", conf=conf)
    pool.malloc(9 * MiB)
    assert pool.stats()["reserved_bytes.all.current"] == segment
    assert dtralloc.effective_config(conf)["segment_fit"] == shown  # as asked, not resolved


def test_segment_fit_strands_no_tail_under_a_budget():
    # Four 9 MiB tensors in 36 MiB: two 18 MiB segments hold them exactly.
    # torch's sizing takes a 20 MiB segment, then only own-size (10 MiB)
    # ones fit under the budget, and the fourth finds no room.
    fit = dtralloc.Pool("virtual", capacity="1G", conf="budget:36M,segment_fit:on")
    held = [fit.malloc(9 * MiB) for _ in range(4)]
    assert fit.stats()["reserved_bytes.all.current"] == 36 * MiB
    for h in held:
        fit.free(h)
    torch_sizes = dtralloc.Pool("virtual", capacity="1G", conf="budget:36M,segment_fit:off")
    for _ in range(3):
        torch_sizes.malloc(9 * MiB)
    assert torch_sizes.stats()["reserved_bytes.all.current"] == 30 * MiB
    with pytest.raises(dtralloc.OutOfMemoryError):
        torch_sizes.malloc(9 * MiB)


def test_conf_as_dict_equals_conf_as_text():
    as_dict = dtralloc.effective_config({"budget": "6G", "roundup_power2_divisions": 4})
    as_text = dtralloc.effective_config("budget:6G,roundup_power2_divisions:4")
    assert as_dict == as_text
    assert as_dict["roundup_power2_divisions"] == "4"


def test_conf_of_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="conf"):
        dtralloc.Pool("virtual", capacity="1G", conf=42)


def test_history_entries_takes_k_suffix():
    assert dtralloc.effective_config("history_entries:4K")["history_entries"] == "4096"


# --------------------------------------------------------------------------
# errors


def _check_config_error(excinfo, key):
    err = excinfo.value
    assert isinstance(err, ValueError)
    assert isinstance(err, dtralloc.ConfigError)
    assert key in str(err), str(err)


@pytest.mark.parametrize("entry", ["describe", "pool", "pool_dict"])
def test_unknown_key_names_the_key_and_lists_the_known_ones(entry):
    with pytest.raises(dtralloc.ConfigError) as excinfo:
        if entry == "describe":
            dtralloc.describe_config("budget:1G,max_spilt_size_mb:256")
        elif entry == "pool":
            dtralloc.Pool("virtual", capacity="1G", conf="budget:1G,max_spilt_size_mb:256")
        else:
            dtralloc.Pool("virtual", capacity="1G", conf={"max_spilt_size_mb": 256})
    _check_config_error(excinfo, "max_spilt_size_mb")
    for name in OPTION_NAMES:
        assert name in str(excinfo.value)


@pytest.mark.parametrize(
    "key",
    ["expandable_segments", "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register"],
)
def test_torch_only_keys_get_a_specific_message(key):
    with pytest.raises(dtralloc.ConfigError) as excinfo:
        dtralloc.Pool("virtual", capacity="1G", conf=f"{key}:True")
    _check_config_error(excinfo, key)
    msg = str(excinfo.value)
    assert "PYTORCH_CUDA_ALLOC_CONF" in msg
    assert "unknown key" not in msg


MALFORMED = [
    ("budget", "6Q"),
    ("budget", "lots"),
    ("budget", "0"),
    ("budget", "0%"),
    ("budget", "101%"),
    ("budget", "-5%"),
    ("budget", "%"),
    ("budget", "5%G"),
    ("budget", "-1G"),
    ("budget", "inf"),
    ("budget", "99999999999T"),
    ("max_split_size_mb", "abc"),
    ("max_split_size_mb", "-5"),
    ("max_split_size_mb", "10"),  # must exceed the 20 MB large segment, as in torch
    ("max_split_size_mb", "20"),
    ("segment_fit", "yes"),
    ("segment_fit", "1"),
    ("max_non_split_rounding_mb", "x"),
    ("roundup_power2_divisions", "3"),
    ("roundup_power2_divisions", "128"),
    ("roundup_power2_divisions", "-2"),
    ("roundup_power2_divisions", "2.5"),
    ("roundup_power2_divisions", "four"),
    ("garbage_collection_threshold", "1"),
    ("garbage_collection_threshold", "1.5"),
    ("garbage_collection_threshold", "-0.1"),
    ("garbage_collection_threshold", "nan"),
    ("garbage_collection_threshold", "high"),
    ("history_entries", "-1"),
    ("history_entries", "many"),
]


@pytest.mark.parametrize("key, value", MALFORMED)
def test_malformed_value_is_a_config_error_naming_the_key(key, value):
    with pytest.raises(dtralloc.ConfigError) as excinfo:
        dtralloc.Pool("virtual", capacity="1G", conf=f"{key}:{value}")
    _check_config_error(excinfo, key)
    assert value in str(excinfo.value)  # the message echoes what was written


def test_bad_value_message_says_what_the_key_accepts():
    """The message must state what the key accepts, as the option table does:
    a user who writes budget:50 must learn that budget:0.5 and 50% work."""
    accepts = {o["name"]: o["accepts"] for o in dtralloc.describe_config("")}
    bad = {
        "budget": "50",
        "max_split_size_mb": "big",
        "max_non_split_rounding_mb": "big",
        "roundup_power2_divisions": "3",
        "garbage_collection_threshold": "high",
        "history_entries": "many",
    }
    missing = {}
    for key, value in bad.items():
        with pytest.raises(dtralloc.ConfigError) as excinfo:
            dtralloc.describe_config(f"{key}:{value}")
        if accepts[key] not in str(excinfo.value):
            missing[key] = str(excinfo.value)
    assert not missing, f"messages that do not state what the key accepts: {missing}"


def test_history_entries_rejects_a_fraction():
    # "a non-negative integer": 1.5 entries is a typo, not 2 entries.
    with pytest.raises(dtralloc.ConfigError, match="history_entries"):
        dtralloc.describe_config("history_entries:1.5")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("budget", "budget"),                      # no colon
        ("budget:", "budget"),                     # empty value
        ("budget:1G,budget:2G", "budget"),         # given twice
    ],
)
def test_structural_errors_name_the_item(text, fragment):
    with pytest.raises(dtralloc.ConfigError, match=fragment):
        dtralloc.Pool("virtual", capacity="1G", conf=text)


def test_empty_items_and_whitespace_are_ignored():
    eff = dtralloc.effective_config(" budget : 2G , ,max_split_size_mb: 64 ,")
    assert eff["budget"] == "2 GiB"
    assert eff["max_split_size_mb"] == "64 MiB"


# --------------------------------------------------------------------------
# the settings take effect


def test_roundup_power2_divisions_changes_the_block_size():
    plain = dtralloc.Pool("virtual", capacity="1G")
    four = dtralloc.Pool("virtual", capacity="1G", conf="roundup_power2_divisions:4")
    size = 5 * MiB + 1
    a, b = plain.malloc(size), four.malloc(size)
    assert plain.stats()["allocated_bytes.all.current"] == 5 * MiB + 512
    assert four.stats()["allocated_bytes.all.current"] == 6 * MiB  # 4 steps between 4 and 8 MiB
    plain.free(a)
    four.free(b)


def test_history_entries_bounds_the_trace():
    pool = dtralloc.Pool("virtual", capacity="1G", conf="history_entries:3")
    for _ in range(5):
        pool.free(pool.malloc(1000))
    assert len(pool.snapshot()["device_traces"][0]) == 3


# --------------------------------------------------------------------------
# the command line and import


def test_cli_config_prints_the_table():
    proc = run_cli("config")
    assert proc.returncode == 0, proc.stderr
    for name in OPTION_NAMES:
        assert name in proc.stdout
    assert "DTRALLOC_CONF is not set" in proc.stdout
    assert "accepts:" in proc.stdout


def test_cli_config_shows_effective_values_and_defaults():
    proc = run_cli("config", "--conf", "budget:6G,max_split_size_mb:256")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    budget = next(line for line in lines if line.startswith("budget"))
    assert "6 GiB" in budget and "default none" in budget
    split = next(line for line in lines if line.startswith("max_split_size_mb"))
    assert "256 MiB" in split


def test_cli_config_reads_the_environment():
    proc = run_cli("config", env_conf="roundup_power2_divisions:8")
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("roundup_power2_divisions"))
    assert "8" in line and "default 0" in line


@pytest.mark.parametrize(
    "args, env_conf, key",
    [
        (("config", "--conf", "budget:6Q"), None, "budget"),
        (("config", "--conf", "max_spilt_size_mb:256"), None, "max_spilt_size_mb"),
        (("config",), "garbage", "garbage"),
    ],
)
def test_cli_bad_conf_exits_2_with_the_message(args, env_conf, key):
    proc = run_cli(*args, env_conf=env_conf)
    assert proc.returncode == 2
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "DTRALLOC_CONF" in proc.stderr


@pytest.mark.parametrize("env_conf", ["garbage", "budget:6Q", "expandable_segments:True", ":::,,,"])
def test_import_never_fails_on_a_bad_environment(env_conf):
    env = dict(os.environ, DTRALLOC_CONF=env_conf)
    proc = subprocess.run(
        [sys.executable, "-c", "import dtralloc; p = dtralloc.Pool('host', capacity='64M'); "
         "p.free(p.malloc(100)); print('ok')"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_history_entries_is_bounded_because_the_ring_is_allocated_up_front():
    assert dtralloc.effective_config("history_entries:16M")["history_entries"] == str(1 << 24)
    with pytest.raises(dtralloc.ConfigError, match="history_entries must be at most"):
        dtralloc.Pool("virtual", capacity="1G", conf="history_entries:1T")
