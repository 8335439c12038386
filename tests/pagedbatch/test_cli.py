"""`pagedbatch serve` refuses to open the service to the network without API keys unless told
that it is on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedbatch.cli import build_parser, check_exposure, main, settings_from_args
from pagedbatch.settings import Settings


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("API_KEYS", "ALLOW_UNAUTHENTICATED", "HOST"):
        monkeypatch.delenv(f"PAGEDBATCH_{name}", raising=False)


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
