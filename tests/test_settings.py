"""EAGLE3_OPS_* variables: parsed strictly, one message naming the variable, the value, the
accepted values and what happens instead (eagle3_ops/settings.py)."""
import logging
import os

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


# ---- every variable, by its kind: a setting added later is covered by construction -----------------------
ALL = {**settings.SETTINGS, **settings.BUILD_SETTINGS}


def bad_values(s: settings.Setting):
    """Values a hostile (or careless) user sets, generated from the setting's kind."""
    # superscript two, fullwidth one, Arabic-Indic one, "ok" with the Kelvin sign (which lower() makes "ok")
    odd = ["\u00b2", "\uff11", "\u0661", "x", "-1", "1 0", "on!", "o\u212a"]
    if s.kind == "switch":
        return odd + ["2", "yes", "no", "enabled", "tru", "0x1", "1.0"]
    if s.kind == "count":
        lo, hi = s.limits
        return odd + [str(lo - 1), str(hi + 1), "1" * 30, "1" + "\u00b2", "+1", "1e3", "1.0", "0x10", "1_000",
                      "12abc", str(hi) + "0", "\u00b9\u2070"]
    if s.kind == "choice":
        return odd + [w + "x" for w in s.words] + ["\uff41uto", "all,auto", "none"] + [
            w.replace("k", "\u212a") for w in s.words if "k" in w]
    raise AssertionError(f"{s.name}: no generator for kind {s.kind!r}; add one to bad_values")


def test_every_setting_has_a_known_kind_and_the_dump_variables_are_settings():
    from eagle3_ops.doctor.states import DUMP_VARIABLES

    assert all(s.kind in settings.KINDS for s in ALL.values())
    assert set(DUMP_VARIABLES) <= set(settings.SETTINGS)
    assert not set(settings.OTHER_KNOWN) & set(ALL)


@pytest.mark.parametrize("name", [n for n, s in ALL.items() if s.kind != "output-file"])
def test_every_bad_value_is_one_line_naming_the_variable(name, caplog):
    s = ALL[name]
    log = logging.getLogger("eagle3_ops.test")
    for raw in bad_values(s):
        env = {name: raw}
        with pytest.raises(settings.SettingError) as e:
            settings.get(name, env)
        msg = str(e.value)
        assert msg == f"{name}={raw!r} is not valid: expected {s.accepted}; {s.on_error}", msg
        assert "\n" not in msg
        if name in settings.SETTINGS:  # what the plugin (and the CLI) report at start: that one line, once
            caplog.clear()
            settings._reported.clear()
            with caplog.at_level(logging.ERROR, logger="eagle3_ops.test"):
                assert settings.report_problems(log, env) == [msg]
                settings.report_problems(log, env)
            assert [r.getMessage() for r in caplog.records] == [f"eagle3_ops: {msg}"]


@pytest.mark.parametrize("name", list(ALL))
def test_every_good_value_of_the_kind_is_accepted(name, tmp_path):
    s = ALL[name]
    if s.kind == "switch":
        cases = [(w, w in settings.ON_WORDS) for w in settings.ON_WORDS + settings.OFF_WORDS]
        cases += [(f" {w.upper()} ", v) for w, v in cases]
    elif s.kind == "count":
        lo, hi = s.limits
        cases = [(str(lo), lo), (f" {hi} ", hi), (str((lo + hi) // 2), (lo + hi) // 2)]
    elif s.kind == "choice":
        cases = [(w, s.parse(w)) for w in s.words] + [(w.upper(), s.parse(w)) for w in s.words]
    else:
        new = str(tmp_path / "new.safetensors")
        cases = [(new, new), (f" {new} ", new)]
    for raw, want in cases:
        assert settings.get(name, {name: raw}) == want, raw
    for unset in ({}, {name: ""}, {name: "   "}):
        assert settings.get(name, unset) == s.default


# ---- output-file settings (EAGLE3_OPS_DUMP_STATES): checked for what they are used for ----------------------
def _unwritable_folder(tmp_path):
    if os.geteuid() == 0:  # root writes through any mode bits; sysfs refuses new files even to root
        return "/sys"
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return str(d)


def bad_paths(tmp_path):
    """(path, what the message says) for every way a path cannot take the file."""
    tmp_path.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "link_to_dir").symlink_to(tmp_path / "a_dir")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "file").write_text("x")
    return [(str(tmp_path / "a_dir"), "is a directory, not a regular file (it is never replaced); give a file path"),
            (str(tmp_path / "link_to_dir"), "is a directory"),
            ("/dev/full", "/dev/full is a character device, not a regular file"),
            ("/dev/null", "is a character device"),
            (str(fifo), "is a FIFO, not a regular file"),
            (str(tmp_path / "missing" / "s.safetensors"), "does not exist"),
            (str(tmp_path / "file" / "s.safetensors"), "is not a folder"),
            (str(tmp_path / "loop"), "cannot inspect"),
            (os.path.join(_unwritable_folder(tmp_path), "s.safetensors"), "cannot create a file in")]


def test_every_unusable_output_path_is_one_line(tmp_path):
    for name in [n for n, s in ALL.items() if s.kind == "output-file"]:
        s = ALL[name]
        for raw, needle in bad_paths(tmp_path / name):
            with pytest.raises(settings.SettingError) as e:
                settings.get(name, {name: raw})
            msg = str(e.value)
            assert msg.startswith(f"{name}={raw!r} is not usable: ") and msg.endswith(f"; {s.on_error}"), msg
            assert needle in msg and "\n" not in msg, (needle, msg)
            assert settings.problems({name: raw}) == [msg]


@pytest.fixture
def _dump_dir(tmp_path):
    (tmp_path / "dump_dir").mkdir()
    return tmp_path / "dump_dir"


def test_a_symlink_is_followed_and_an_existing_file_accepted(_dump_dir):
    target = _dump_dir / "real.safetensors"
    link = _dump_dir / "link.safetensors"
    link.symlink_to(target)  # dangling: the file is created where it points
    assert settings.output_file_problem(link) is None
    target.write_text("old")  # a regular file: replaced when the dump is written
    assert settings.output_file_problem(link) is None and settings.output_file_problem(target) is None
    assert settings.output_file_problem(_dump_dir / "new" / "deeper" / "s.safetensors", create_folders=True) is None
    assert "does not exist" in settings.output_file_problem(_dump_dir / "new" / "s.safetensors")
    assert sorted(os.listdir(_dump_dir)) == ["link.safetensors", "real.safetensors"]  # the probe left nothing
