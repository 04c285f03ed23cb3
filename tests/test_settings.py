"""EAGLE3_OPS_* variables: parsed strictly, one message naming the variable, the value, the
accepted values and what happens instead (eagle3_ops/settings.py)."""
import logging

import pytest

from eagle3_ops import settings


@pytest.fixture(autouse=True)
def _fresh():
    settings._reported.clear()
    yield
    settings._reported.clear()


@pytest.mark.parametrize("raw,value", [("1", 1), ("8192", 8192), (" 4096 ", 4096), ("1048576", 1048576)])
def test_max_tokens_accepts_whole_numbers(raw, value):
    assert settings.get("EAGLE3_OPS_SGLANG_MAX_TOKENS", {"EAGLE3_OPS_SGLANG_MAX_TOKENS": raw}) == value


@pytest.mark.parametrize("raw", ["abc", "-5", "1e9", "0", "8192.0", "+8", "1048577", "8 192", "0x10"])
def test_max_tokens_rejects_with_one_clear_message(raw):
    with pytest.raises(settings.SettingError) as e:
        settings.get("EAGLE3_OPS_SGLANG_MAX_TOKENS", {"EAGLE3_OPS_SGLANG_MAX_TOKENS": raw})
    msg = str(e.value)
    assert msg.startswith(f"EAGLE3_OPS_SGLANG_MAX_TOKENS={raw!r} is not valid: expected a whole number of tokens "
                          f"from 1 to 1048576")
    assert "EAGLE3_OPS_SGLANG=0" in msg and "keep SGLang's stock capture" in msg
    assert "\n" not in msg


def test_unset_or_empty_is_the_default():
    for env in ({}, {"EAGLE3_OPS_SGLANG_MAX_TOKENS": ""}, {"EAGLE3_OPS_SGLANG_MAX_TOKENS": "  "}):
        assert settings.get("EAGLE3_OPS_SGLANG_MAX_TOKENS", env) is None
    assert settings.get("EAGLE3_OPS_SGLANG", {}) is True
    assert settings.get("EAGLE3_OPS_SGLANG_SHARD_FC", {}) is True
    assert settings.get("EAGLE3_OPS_DEBUG", {}) is False


@pytest.mark.parametrize("name", ["EAGLE3_OPS_SGLANG", "EAGLE3_OPS_SGLANG_SHARD_FC", "EAGLE3_OPS_VERIFY",
                                  "EAGLE3_OPS_DEBUG"])
def test_switches(name):
    for raw in ("1", "true", "ON", " on "):
        assert settings.get(name, {name: raw}) is True
    for raw in ("0", "false", "Off"):
        assert settings.get(name, {name: raw}) is False
    for raw in ("2", "yes", "no", "enabled"):  # one documented spelling set, nothing else
        with pytest.raises(settings.SettingError, match=f"{name}='{raw}' is not valid: expected 1/true/on or "
                                                        f"0/false/off"):
            settings.get(name, {name: raw})


def test_backend():
    assert settings.get("EAGLE3_OPS_BACKEND", {"EAGLE3_OPS_BACKEND": "auto"}) is None
    assert settings.get("EAGLE3_OPS_BACKEND", {"EAGLE3_OPS_BACKEND": "Triton"}) == "triton"
    with pytest.raises(ValueError, match="EAGLE3_OPS_BACKEND='cublas' is not valid"):
        settings.get("EAGLE3_OPS_BACKEND", {"EAGLE3_OPS_BACKEND": "cublas"})


def test_problems_name_bad_and_unknown_variables_once(caplog):
    env = {"EAGLE3_OPS_SGLANG_MAX_TOKENS": "abc", "EAGLE3_OPS_SGLANG_MAXTOKENS": "8192",
           "EAGLE3_OPS_DUMP_STATES": "/tmp/x.safetensors", "EAGLE3_OPS_BACKEND": "triton", "OTHER": "1"}
    log = logging.getLogger("eagle3_ops.test")
    with caplog.at_level(logging.ERROR, logger="eagle3_ops.test"):
        found = settings.report_problems(log, env)
        settings.report_problems(log, env)  # a second report of the same values logs nothing
        with pytest.raises(settings.SettingError) as e:
            settings.get("EAGLE3_OPS_SGLANG_MAX_TOKENS", env)
        settings.report_once(e.value, log)  # what a site does later: no second line either
    assert len(found) == 2
    assert found[0].startswith("EAGLE3_OPS_SGLANG_MAX_TOKENS='abc' is not valid")
    assert found[1].startswith("EAGLE3_OPS_SGLANG_MAXTOKENS is not a variable eagle3_ops reads (a typo?)")
    assert [r.getMessage() for r in caplog.records] == [f"eagle3_ops: {m}" for m in found]


def test_safe_default_on_bad_verify_and_debug(caplog):
    log = logging.getLogger("eagle3_ops.test")
    with caplog.at_level(logging.ERROR, logger="eagle3_ops.test"):
        assert settings.get_or_default("EAGLE3_OPS_VERIFY", log, {"EAGLE3_OPS_VERIFY": "nope"}) is True
        assert settings.get_or_default("EAGLE3_OPS_DEBUG", log, {"EAGLE3_OPS_DEBUG": "nope"}) is False
    assert len(caplog.records) == 2 and "backends are verified" in caplog.records[0].getMessage()


def test_unknown_setting_name_is_a_programming_error():
    with pytest.raises(KeyError, match="not an eagle3_ops setting"):
        settings.get("EAGLE3_OPS_NOPE")
