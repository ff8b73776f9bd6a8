"""`.ci/uv_pip.py`: the Makefile's uv installs see what this machine's pip is told (find-links,
indexes, constraints, CA bundle); without that, uv would take torch's CUDA build from PyPI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "uv_pip.py"


@pytest.fixture(scope="module")
def uv_pip():
    spec = importlib.util.spec_from_file_location("uv_pip", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/old.pem'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/srv/other'
install.no-compile='1'
"""


def test_settings_become_uv_options_environment_over_files(uv_pip):
    settings = uv_pip.parse_pip_config(LISTING)
    assert settings["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS over pip.conf, as pip reads them
    assert settings["cert"] == "/etc/ssl/certs/ca-certificates.crt"
    options, environment = uv_pip.uv_install_options(settings)
    assert options == [
        "--index-strategy", "unsafe-best-match",
        "--find-links", "/opt/wheels",
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--constraint", "/etc/xdg/pip/constraints.txt",
    ]
    assert environment == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


def test_no_pip_configuration_leaves_uv_its_defaults(uv_pip):
    assert uv_pip.uv_install_options(uv_pip.parse_pip_config("")) == (["--index-strategy", "unsafe-best-match"], {})


def test_a_pip_variable_reaches_uv(uv_pip, monkeypatch, tmp_path):
    """Through the live `pip config list`: a PIP_* variable set now is what uv is given."""
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    options, _ = uv_pip.uv_install_options(uv_pip.pip_settings())
    assert options[options.index("--find-links") + 1] == str(tmp_path)


def test_a_wrong_command_is_refused(uv_pip, capsys):
    assert uv_pip.main(["uv", "freeze"]) == 2
    assert "install|uninstall" in capsys.readouterr().err
