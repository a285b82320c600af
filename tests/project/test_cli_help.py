"""The `mtpjax` command's help: every option explained with its default, the model families from
the registry, `--version`, each benchmark described, and no runpy warning on `python -m`."""

import argparse
import os
import subprocess
import sys

import pytest

import mtpjax
from mtpjax import cli
from mtpjax.config import SUPPORTED_MODEL_TYPES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv) + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _parsers():
    """{subcommand: its ArgumentParser}, built the way main() builds them."""
    found = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                found.update(action.choices)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = grab
    try:
        with pytest.raises(SystemExit):
            cli.main(["generate"])
    finally:
        argparse.ArgumentParser.parse_args = real
    return found


def test_every_option_has_help_and_says_its_default():
    parsers = _parsers()
    assert {"generate", "convert", "bench", "finetune", "acceptance"} <= set(parsers)
    for name in ("generate", "convert", "bench"):
        p = parsers[name]
        fmt = p._get_formatter()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"mtpjax {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{where} has no help"
            text = fmt._get_help_string(action) % {"default": action.default}
            if action.option_strings and action.default not in (None, False):
                assert "default" in text.lower(), f"{where}: help does not give its default"


def test_families_listed_from_the_registry(capsys):
    out = _help(capsys)
    for family in SUPPORTED_MODEL_TYPES:
        assert family in out
    convert = _help(capsys, "convert")
    assert "deepseek_v3" in convert and "kimi_k2" in convert
    assert "deepseek_v3" in _help(capsys, "generate")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"mtpjax {mtpjax.__version__} (jax ")


def test_bench_help_lists_and_describes_every_bench(capsys):
    out = _help(capsys, "bench")
    for name in cli.BENCHES:
        assert f"\n  {name} " in out, name
    assert "Host-overhead benchmark" in out


def test_bench_sub_help_describes_the_bench(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "engine", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("mtpjax bench engine: Host-overhead benchmark")
    assert "usage: mtpjax bench engine [-h]" in out


def test_every_bench_has_a_docstring():
    for name, module in cli.BENCHES.items():
        assert cli.module_doc(module).strip(), name


def test_finetune_help_through_the_cli(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["finetune", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mtpjax finetune")
    assert "--seconds" in out and "default" in out


@pytest.mark.parametrize("argv", [["-m", "mtpjax", "--version"],
                                  ["-m", "mtpjax", "finetune", "--help"],
                                  ["-m", "mtpjax.demo", "--help"]])
def test_no_runpy_warning(argv):
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" not in r.stderr and "found in sys.modules" not in r.stderr, r.stderr


@pytest.mark.parametrize("module", ["mtpjax.train.finetune", "mtpjax.speculative.acceptance_eval"])
def test_script_modules_run_without_runpy_warning(module):
    """Both are scripts and library modules: `import mtpjax` must not load them, or runpy warns
    that the module was in sys.modules before it ran as __main__."""
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", module, "--help"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RuntimeWarning" not in out.stderr
