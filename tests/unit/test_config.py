"""Tier URLs, tier options and callback arguments: good ones configure the tier, bad ones say what is wrong."""

from __future__ import annotations

import datetime as dt

import pytest

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends.base import DEFAULT_EVERY_N_TRAIN_STEPS, DEFAULT_KEEP_LAST, Backend
from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.backends.registry import parse_tier
from lightning_snapshot.errors import ConfigError, SnapshotError

# ---------------------------------------------------------------------------------------------------- parse_tier


def test_plain_path_with_options(tmp_path):
    tier = parse_tier(f"{tmp_path}/snaps?every=100&keep=3")
    assert isinstance(tier, LocalTier)
    assert tier.root == tmp_path / "snaps"
    assert tier.every_n_train_steps == 100
    assert tier.keep_last == 3
    assert tier.train_time_interval is None


def test_plain_path_without_options_gets_defaults(tmp_path):
    tier = parse_tier(str(tmp_path))
    assert isinstance(tier, LocalTier) and tier.root == tmp_path
    assert tier.every_n_train_steps == DEFAULT_EVERY_N_TRAIN_STEPS == 100
    assert tier.keep_last == DEFAULT_KEEP_LAST == 3
    assert tier.train_time_interval is None


def test_file_url_with_interval_in_minutes(tmp_path):
    tier = parse_tier(f"file://{tmp_path}/p?interval=10m")
    assert isinstance(tier, LocalTier)
    assert tier.root == tmp_path / "p"
    assert tier.train_time_interval == dt.timedelta(seconds=600)
    # an interval alone does not add a step schedule
    assert tier.every_n_train_steps is None


def test_file_url_localhost_and_percent_escapes(tmp_path):
    tier = parse_tier(f"file://localhost{tmp_path}/a%20b?every=5")
    assert tier.root == tmp_path / "a b"
    assert tier.every_n_train_steps == 5


@pytest.mark.parametrize(
    "value, seconds", [("600", 600), ("600s", 600), ("10m", 600), ("2h", 7200), ("1.5h", 5400), ("0.5", 0.5)]
)
def test_interval_units(tmp_path, value, seconds):
    tier = parse_tier(f"{tmp_path}?interval={value}")
    assert tier.train_time_interval.total_seconds() == pytest.approx(seconds)


def test_keep_all_keeps_every_snapshot(tmp_path):
    assert parse_tier(f"{tmp_path}?keep=all").keep_last is None


def test_every_and_interval_together(tmp_path):
    tier = parse_tier(f"{tmp_path}?every=50&interval=30s&keep=1")
    assert (tier.every_n_train_steps, tier.train_time_interval, tier.keep_last) == (50, dt.timedelta(seconds=30), 1)


def test_backend_passes_through_unchanged(tmp_path):
    tier = LocalTier(tmp_path)
    assert parse_tier(tier) is tier


def test_unknown_option_is_named_and_accepted_options_listed(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_tier(f"{tmp_path}?evry=3")
    msg = str(info.value)
    assert "evry" in msg
    for accepted in ("every", "interval", "keep"):
        assert accepted in msg


@pytest.mark.parametrize(
    "query, option",
    [
        ("every=0", "every"),
        ("every=-5", "every"),
        ("every=abc", "every"),
        ("every=1.5", "every"),
        ("every=", "every"),
        ("keep=0", "keep"),
        ("keep=-1", "keep"),
        ("keep=many", "keep"),
        ("keep=", "keep"),
        ("interval=-1", "interval"),
        ("interval=0", "interval"),
        ("interval=10d", "interval"),
        ("interval=abc", "interval"),
        ("interval=", "interval"),
    ],
)
def test_invalid_option_values_name_the_option(tmp_path, query, option):
    with pytest.raises(ConfigError) as info:
        parse_tier(f"{tmp_path}?{query}")
    assert option in str(info.value)


def test_option_given_twice(tmp_path):
    with pytest.raises(ConfigError, match="every.*twice"):
        parse_tier(f"{tmp_path}?every=3&every=4")


def test_malformed_query(tmp_path):
    with pytest.raises(ConfigError):
        parse_tier(f"{tmp_path}?every")


@pytest.mark.parametrize("url", ["ftp://host/x", "http://example.com/snaps", "hdfs:///x"])
def test_unknown_scheme(url):
    with pytest.raises(ConfigError, match="scheme"):
        parse_tier(url)


def test_ram_tier_url():
    t = parse_tier("ram://run-42?every=10&keep=2&erasure=4+2&idle=5m")
    assert (t.tier, t.name, t.every_n_train_steps, t.keep_last, t.erasure, t.idle_timeout) == (
        "ram",
        "run-42",
        10,
        2,
        (4, 2),
        300.0,
    )
    assert parse_tier("ram://?every=3").erasure is None


@pytest.mark.parametrize(
    "url,message",
    [
        ("ram://x?erasure=4-2", "write it as k\\+m"),
        ("ram://x?erasure=0+1", "erasure k must be an integer >= 1"),
        ("ram://x?erasure=200+100", "at most 256"),
        ("ram://x/path?every=1", "has a path"),
        ("ram://bad name?every=1", "RamTier name"),
        ("ram://x?idle=soon", "idle='soon'"),
        ("ram://x?size=3", "unknown tier URL option 'size'"),
    ],
)
def test_bad_ram_tier_urls_name_the_problem(url, message):
    with pytest.raises(ConfigError, match=message):
        parse_tier(url)


@pytest.mark.parametrize("url,hint", [("gs://b/p", "pip install gcsfs"), ("az://c/p", "pip install adlfs")])
def test_object_store_without_its_fsspec_package_names_the_pip_command(url, hint):
    pytest.importorskip("fsspec")
    try:
        __import__({"gs": "gcsfs", "az": "adlfs"}[url[:2]])
        pytest.skip("the package is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match=hint):
        parse_tier(url)


def test_object_store_url_with_options():
    tier = parse_tier("memory://bucket/run?every=1000&keep=5")
    assert type(tier).__name__ == "ObjectStoreTier"
    assert (tier.every_n_train_steps, tier.keep_last, tier.tier, tier.url) == (1000, 5, "memory", "memory://bucket/run")


def test_credentials_in_an_object_store_url_are_refused_and_redacted():
    with pytest.raises(ConfigError) as err:
        from lightning_snapshot.backends import ObjectStoreTier

        ObjectStoreTier("s3://AKIAXXXX:hunter2secret@bucket/p")
    assert "hunter2secret" not in str(err.value) and "storage_options" in str(err.value)


def test_file_url_with_a_remote_host_is_refused():
    with pytest.raises(ConfigError, match="otherhost"):
        parse_tier("file://otherhost/p")


@pytest.mark.parametrize("spec", ["", "   ", None, 42, ["/p"]])
def test_non_url_specs(spec):
    with pytest.raises(ConfigError):
        parse_tier(spec)


def test_config_errors_are_value_errors_and_snapshot_errors(tmp_path):
    with pytest.raises(ValueError):
        parse_tier(f"{tmp_path}?every=0")
    with pytest.raises(SnapshotError):
        parse_tier(f"{tmp_path}?every=0")


# ---------------------------------------------------------------------------------------------------- LocalTier


def test_local_tier_on_a_file_is_refused(tmp_path):
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        LocalTier(f)
    with pytest.raises(ConfigError):
        parse_tier(str(f))


def test_local_tier_does_not_need_the_directory_to_exist(tmp_path):
    tier = LocalTier(tmp_path / "later" / "made")
    assert tier.url == str(tmp_path / "later" / "made")
    assert tier.list("") == []


def test_local_tier_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert LocalTier("~/snaps").root == tmp_path / "snaps"


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"every_n_train_steps": 0}, "every_n_train_steps"),
        ({"every_n_train_steps": -1}, "every_n_train_steps"),
        ({"every_n_train_steps": True}, "every_n_train_steps"),
        ({"every_n_train_steps": 2.0}, "every_n_train_steps"),
        ({"every_n_train_steps": "10"}, "every_n_train_steps"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": False}, "keep_last"),
        ({"keep_last": 1.5}, "keep_last"),
        ({"train_time_interval": 0}, "train_time_interval"),
        ({"train_time_interval": -3}, "train_time_interval"),
        ({"train_time_interval": dt.timedelta(0)}, "train_time_interval"),
        ({"train_time_interval": True}, "train_time_interval"),
        ({"train_time_interval": "10m"}, "train_time_interval"),
    ],
)
def test_local_tier_option_validation(tmp_path, kwargs, option):
    with pytest.raises(ConfigError, match=option):
        LocalTier(tmp_path, **kwargs)


@pytest.mark.parametrize("path", ["", None, 3])
def test_local_tier_path_validation(path):
    with pytest.raises(ConfigError):
        LocalTier(path)


def test_local_tier_interval_as_number_or_timedelta(tmp_path):
    assert LocalTier(tmp_path, train_time_interval=90).train_time_interval == dt.timedelta(seconds=90)
    assert LocalTier(tmp_path, train_time_interval=dt.timedelta(minutes=2)).train_time_interval.total_seconds() == 120
    assert LocalTier(tmp_path, keep_last=None).keep_last is None


# ---------------------------------------------------------------------------------------------------- is_due


def test_step_schedule(tmp_path):
    tier = LocalTier(tmp_path, every_n_train_steps=100)
    due = [s for s in range(1, 501) if tier.is_due(s, None)]
    assert due == [100, 200, 300, 400, 500]
    # a step schedule ignores wall time
    assert not tier.is_due(150, 10**9)


def test_time_schedule_only(tmp_path):
    tier = LocalTier(tmp_path, train_time_interval=60)
    assert tier.every_n_train_steps is None
    assert not tier.is_due(100, 59.9)
    assert tier.is_due(7, 60.0)
    assert tier.is_due(7, 3600.0)
    assert not tier.is_due(7, None)
    assert not tier.is_due(0, 0.0)


def test_step_or_time_schedule(tmp_path):
    tier = LocalTier(tmp_path, every_n_train_steps=10, train_time_interval=dt.timedelta(seconds=30))
    assert tier.is_due(20, 0.0)  # step
    assert tier.is_due(21, 30.0)  # time
    assert not tier.is_due(21, 29.0)


def test_default_schedule_is_every_100_steps(tmp_path):
    tier = LocalTier(tmp_path)
    assert tier.is_due(100, None) and tier.is_due(300, 0.0)
    assert not tier.is_due(99, 10**6)


def test_schedule_from_url(tmp_path):
    tier = parse_tier(f"{tmp_path}?every=7&interval=1m")
    assert [s for s in range(1, 30) if tier.is_due(s, 1.0)] == [7, 14, 21, 28]
    assert tier.is_due(3, 60.0)


# ---------------------------------------------------------------------------------------------------- SnapshotCallback


def test_callback_accepts_urls_backends_and_lists(tmp_path):
    cb = SnapshotCallback([f"{tmp_path}/a?every=5", LocalTier(tmp_path / "b", keep_last=None)])
    assert [type(t) for t in cb.tiers] == [LocalTier, LocalTier]
    assert cb.tiers[0].every_n_train_steps == 5 and cb.tiers[1].keep_last is None
    one = SnapshotCallback(str(tmp_path))
    assert len(one.tiers) == 1 and isinstance(one.tiers[0], Backend)
    assert one.resume is True and one.on_error == "raise"


@pytest.mark.parametrize("tiers", [[], (), None, 5])
def test_callback_needs_at_least_one_tier(tiers):
    with pytest.raises(ConfigError, match="tiers"):
        SnapshotCallback(tiers=tiers)


def test_callback_rejects_bad_tier_urls(tmp_path):
    with pytest.raises(ConfigError, match="evry"):
        SnapshotCallback([str(tmp_path), f"{tmp_path}/b?evry=3"])


@pytest.mark.parametrize("on_error", ["ignore", "RAISE", None, ""])
def test_callback_on_error_values(tmp_path, on_error):
    with pytest.raises(ConfigError, match="on_error") as info:
        SnapshotCallback(str(tmp_path), on_error=on_error)
    assert "raise" in str(info.value) and "warn" in str(info.value)


def test_callback_on_error_warn_is_accepted(tmp_path):
    assert SnapshotCallback(str(tmp_path), on_error="warn").on_error == "warn"


@pytest.mark.parametrize("resume", [-1, -100, 1.5, None, [1]])
def test_callback_resume_values(tmp_path, resume):
    with pytest.raises(ConfigError, match="resume"):
        SnapshotCallback(str(tmp_path), resume=resume)


@pytest.mark.parametrize("resume", [True, False, 0, 1200, "/snaps/run-1/step-000000001200"])
def test_callback_resume_accepted(tmp_path, resume):
    assert SnapshotCallback(str(tmp_path), resume=resume).resume == resume


def test_an_option_set_after_construction_is_validated_and_used(tmp_path):
    cb = SnapshotCallback(LocalTier(tmp_path, every_n_train_steps=2))
    cb.resume, cb.on_error = False, "warn"
    assert (cb.config.resume, cb.config.on_error, cb._reporter.on_error) == (False, "warn", "warn")
    with pytest.raises(ConfigError, match="on_error must be one of 'raise', 'warn', got 'never'"):
        cb.on_error = "never"
    assert cb.on_error == "warn"  # (a refused value changes nothing)
    with pytest.raises(AttributeError, match="make a new SnapshotCallback"):
        cb.tiers = [LocalTier(tmp_path / "other")]


# ---------------------------------------------------------------------------------------------------- options declared once
def test_the_callback_signature_is_the_declared_options():
    """SnapshotConfig declares every option once (default and check); SnapshotCallback.__init__ spells them out for
    type checkers and LightningCLI: the same names, in the same order, with the same defaults."""
    import inspect

    from lightning_snapshot.config import REQUIRED, SnapshotConfig

    params = list(inspect.signature(SnapshotCallback.__init__).parameters.values())[1:]
    declared = SnapshotConfig.options()
    assert [p.name for p in params] == [f.name for f in declared]
    for p, f in zip(params, declared):
        default = f.metadata["default"]
        assert p.default == (inspect.Parameter.empty if default is REQUIRED else default), p.name
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if p.name == "tiers" else inspect.Parameter.KEYWORD_ONLY
        assert p.kind is kind, p.name
        assert f.name in SnapshotCallback.__dict__  # (its attribute, made from the declaration)


def test_every_declared_option_is_documented():
    """The callback's docstring (the API reference) and docs/configuration.md document every option."""
    import pathlib
    import re

    from lightning_snapshot.config import SnapshotConfig

    doc = SnapshotCallback.__doc__ or ""
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for f in SnapshotConfig.options():
        assert re.search(rf"^\s+{f.name}:", doc, re.M), f"SnapshotCallback's docstring does not document {f.name}"
        assert f"| `{f.name}` |" in page, f"docs/configuration.md does not document {f.name}"


def test_the_declared_defaults_are_valid_and_each_attribute_reads_its_option(tmp_path):
    from lightning_snapshot.config import SnapshotConfig

    tier = LocalTier(tmp_path)
    cb = SnapshotCallback(tier)
    assert cb.config == SnapshotConfig.create(tier) == cb.config.replace()
    for f in SnapshotConfig.options():
        value = getattr(cb.config, f.name)
        assert getattr(cb, f.name) == (list(value) if f.name == "tiers" else value)
    with pytest.raises(TypeError, match="evry"):
        SnapshotConfig.create(str(tmp_path), evry=3)
