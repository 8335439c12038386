"""The `pagedbatch` command: every engine setting is one knob under one name (a flag of `serve`,
`worker` and `run-batch`, a PAGEDBATCH_ variable, an EngineArgs field) with EngineArgs's default;
and `serve` refuses to open the service to the network without API keys unless told that it is
on purpose."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from pagedbatch.cli import build_parser, check_exposure, engine_kwargs, main, settings_from_args
from pagedbatch.engine import EngineArgs
from pagedbatch.settings import ENGINE_SETTINGS, KERNEL_VARIABLES, Settings, unknown_variables

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ENGINE_ARGS = dataclasses.fields(EngineArgs)
# The settings of issue 14's deployment, as flags and as variables.
FLAGS = ["--max-num-seqs", "4", "--max-model-len", "512", "--kv-cache-memory-gib", "0.1"]
FLAGS += ["--dtype", "float32", "--no-prefix-caching", "--scheduling-policy", "fcfs"]
VARIABLES = {"MAX_NUM_SEQS": "4", "MAX_MODEL_LEN": "512", "KV_CACHE_MEMORY_GIB": "0.1"}
VARIABLES |= {"DTYPE": "float32", "ENABLE_PREFIX_CACHING": "false", "SCHEDULING_POLICY": "fcfs"}
GIVEN = {"max_num_seqs": 4, "max_model_len": 512, "kv_cache_memory_gib": 0.1}
GIVEN |= {"dtype": "float32", "enable_prefix_caching": False, "scheduling_policy": "fcfs"}


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("PAGEDBATCH_"):
            monkeypatch.delenv(name)


def flags_of(command: str) -> set[str]:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    return {flag for action in commands.choices[command]._actions for flag in action.option_strings}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_every_engine_arg_is_a_flag_of_serve_worker_and_run_batch_and_a_setting():
    assert tuple(arg.name for arg in ENGINE_ARGS) == ENGINE_SETTINGS
    for command in ("serve", "worker", "run-batch"):
        assert {flag(arg.name) for arg in ENGINE_ARGS} <= flags_of(command), command
    assert set(ENGINE_SETTINGS) <= set(Settings.model_fields)


def test_the_defaults_are_engine_args_own_but_where_a_service_has_its_own():
    settings = Settings().engine_args()
    assert settings.pop("model") is None  # the service then serves its default model
    assert settings.pop("stats_log_interval_seconds") == 5.0  # offline: 0, never
    offline = dataclasses.asdict(EngineArgs(model="m"))
    assert offline.pop("stats_log_interval_seconds") == 0.0
    assert settings == {name: value for name, value in offline.items() if name != "model"}


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_engine_flags_and_variables_set_the_services_engine(command, monkeypatch):
    from_flags = settings_from_args(build_parser().parse_args([command, *FLAGS]))
    for name, value in VARIABLES.items():
        monkeypatch.setenv(f"PAGEDBATCH_{name}", value)
    from_variables = settings_from_args(build_parser().parse_args([command]))
    for settings in (from_flags, from_variables):
        assert {name: settings.engine_args()[name] for name in GIVEN} == GIVEN
    # A flag wins over its variable; the other variables still count.
    args = build_parser().parse_args([command, "--max-num-seqs", "8", "--enable-prefix-caching"])
    settings = settings_from_args(args)
    assert (settings.max_num_seqs, settings.enable_prefix_caching) == (8, True)
    assert settings.max_model_len == 512


def test_run_batch_takes_the_same_flags_and_passes_only_those_given():
    args = build_parser().parse_args(["run-batch", "-i", "in", "-o", "out", "--model", "m", *FLAGS])
    assert engine_kwargs(args) == GIVEN
    args = build_parser().parse_args(["run-batch", "-i", "in", "-o", "out", "--model", "m"])
    assert engine_kwargs(args) == {}  # EngineArgs's defaults, an offline run's
    args = build_parser().parse_args(
        ["run-batch", "-i", "in", "-o", "out", "--model", "m", "--enable-prefix-caching", "no"]
    )
    assert engine_kwargs(args) == {"enable_prefix_caching": False}


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--kv-cache-memory-gib", "0"], "kv_cache_memory_gib"),
        (["--max-model-len", "many"], "max_model_len"),
        (["--low-priority-token-budget", "-1"], "low_priority_token_budget"),
        (["--realtime-target-itl-ms", "inf"], "realtime_target_itl_ms"),
        (["--kv-cache-memory-gib", "nan"], "kv_cache_memory_gib"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "run-batch"])
def test_a_bad_engine_setting_is_refused_naming_it_before_anything_starts(
    command, given, named, tmp_path, capsys
):
    data_dir = tmp_path / "data"
    extra = ["--data-dir", str(data_dir)] if command == "serve" else []
    if command == "run-batch":
        extra = ["-i", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--model", "m"]
    try:
        code = main([command, *extra, *given])
    except SystemExit as e:  # argparse's own check of the type
        code = e.code
    assert code == 2
    assert named in capsys.readouterr().err.replace("-", "_")
    assert not data_dir.exists() and not (tmp_path / "out").exists()


def test_a_choice_out_of_the_engine_args_is_refused_by_every_command(capsys):
    for command in (["serve"], ["run-batch", "-i", "in", "-o", "out", "--model", "m"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--dtype", "float8"])
        assert "invalid choice: 'float8'" in capsys.readouterr().err


def test_the_configuration_doc_lists_every_engine_setting_with_its_flag_and_default():
    rows = {
        match[1]: match[0]
        for match in re.findall(r"^(\| `PAGEDBATCH_(\w+)`.*)$", CONFIGURATION.read_text(), re.M)
    }
    for arg in ENGINE_ARGS:
        row = rows.get(arg.name.upper())
        assert row is not None, f"docs/configuration.md: no row for PAGEDBATCH_{arg.name.upper()}"
        assert f"`{flag(arg.name)}`" in row
        default = Settings.model_fields[arg.name].default  # a service's
        if default is not None:
            shown = f"{default:g}" if isinstance(default, float) else str(default).lower()
            assert f"| {shown} |" in row, row


def test_the_configuration_doc_lists_every_service_setting():
    rows = [line for line in CONFIGURATION.read_text().splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`PAGEDBATCH_(\w+)`", row)}
    missing = sorted(
        f"PAGEDBATCH_{name.upper()}" for name in Settings.model_fields if name.upper() not in named
    )
    assert not missing, f"docs/configuration.md has no row for {missing}"


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        ({"host": "0.0.0.0"}, True),
        ({"host": "::"}, True),
        ({"host": "api.example.com"}, True),  # a name may resolve to anything
        ({"host": "0.0.0.0", "api_keys": ["k1"]}, False),
        ({"host": "0.0.0.0", "allow_unauthenticated": True}, False),
        ({"host": "127.0.0.1"}, False),
        ({"host": "localhost"}, False),
        ({"host": "::1"}, False),
    ],
)
def test_only_loopback_is_served_without_keys_unless_allowed(settings, refused):
    if refused:
        with pytest.raises(ValueError, match="ALLOW_UNAUTHENTICATED"):
            check_exposure(Settings(**settings))
    else:
        check_exposure(Settings(**settings))


def test_serve_refuses_before_starting_anything(tmp_path: Path, capsys):
    data_dir = tmp_path / "data"
    assert main(["serve", "--host", "0.0.0.0", "--data-dir", str(data_dir)]) == 2
    assert "refusing to serve on 0.0.0.0" in capsys.readouterr().err
    assert not data_dir.exists()  # no database, no model: nothing was started


def test_a_yes_or_no_setting_is_a_flag():
    args = build_parser().parse_args(["serve", "--allow-unauthenticated"])
    assert settings_from_args(args).allow_unauthenticated is True
    args = build_parser().parse_args(["serve", "--allow-unauthenticated", "false"])
    assert settings_from_args(args).allow_unauthenticated is False


def test_a_variable_that_names_no_setting_is_told_not_silently_ignored():
    environ = {
        "PAGEDBATCH_MAX_NUM_SEQS": "4",
        "PAGEDBATCH_BATCH_TOKENS_UNDER_REALTIME": "256",  # the knob's name before a release
        "pagedbatch_max_num_seqz": "4",
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        "PAGEDBATCH_BATCH_TOKENS_UNDER_REALTIME",
        "pagedbatch_max_num_seqz",
    ]


def test_the_kernels_switches_are_known_variables_and_documented():
    """The kernels read their own switches from the environment: each is one the service knows
    (not warned of as ignored) and that docs/configuration.md describes."""
    from pagedbatch.kernels import native, ops, quant_linear

    read = {
        ops.SETTING,
        native.SETTING,
        quant_linear.ACTIVATIONS_SETTING,
        quant_linear.GEMM_SETTING,
    }
    assert read == set(KERNEL_VARIABLES)
    assert unknown_variables(dict.fromkeys(read, "auto")) == []
    documented = CONFIGURATION.read_text()
    assert all(f"`{name}" in documented for name in read)


@pytest.mark.parametrize("command", ["serve", "worker", "run-batch", "db", "make-model"])
def test_every_command_explains_itself(command, capsys):
    """`--help` prints every flag with its doc; a `%` in a doc ("90% of free memory") once
    broke argparse's formatting of the whole page."""
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert "usage: pagedbatch" in capsys.readouterr().out
