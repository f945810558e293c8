"""``circuits-llm ship`` (circuits_llm.app.shipping: ``add_ship_command``, ``ship_run``): writing a
finished ``train-head`` run into the shipped heads from the ``circuits-llm`` command line.

The subcommand replaces ``python -m circuits_llm.app.head_cache ship``, which made runpy warn (the
package imports ``head_cache`` before ``-m`` runs it); that spelling still forwards to the same
function. A tiny FF run (the model and config of ``test_head_cache``, two steps) is shipped for
real; the forwarding of every option is checked on a stand-in for ``ship_run``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_corpus import write_corpus
from test_head_cache import tiny_config
from test_tokens import save_model_dir, tiny_subword_model, tiny_tokenizer

from circuits_llm.app import head_cache as hc
from circuits_llm.app import shipping
from circuits_llm.app.cli import build_parser
from circuits_llm.app.cli import main as cli_main
from circuits_llm.heads.shipped import SHIPPED_DIR, read_shipped_head
from circuits_llm.text.corpus import CACHE_ENV
from circuits_llm.text.models import load_model
from circuits_llm.training import train_head

# the tiny head is far above 5% of a 28k-parameter model, by design
pytestmark = pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished FF ``train-head`` run on the tiny subword model of ``test_head_cache``."""
    root = tmp_path_factory.mktemp("ship-command")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(root / "corpus-cache"))
        model_dir = save_model_dir(root / "model", tiny_subword_model(300, seed=5), tiny_tokenizer())
        train_head(load_model(model_dir).model, tiny_config("ff"), root / "run", progress=False,
                   corpus_root=write_corpus(root / "corpus"))
    return root / "run"


def one_error_line(err: str) -> str:
    """The single stderr line of a failed ``ship`` (fails on more lines or a traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("circuits-llm ship: error: "), lines[0]
    return lines[0]


# ---------------------------------------------------------------------------- parse and dispatch
def test_ship_parses_every_option() -> None:
    args = build_parser().parse_args(["ship", "runs/b", "--name", "n", "--model", "smollm2",
                                      "--circuit-head", "runs/h", "--head-record", "h.json",
                                      "--root", "out"])
    assert (args.command, args.run_dir, args.name, args.model) == \
        ("ship", Path("runs/b"), "n", "smollm2")
    assert (args.circuit_head, args.head_record, args.root) == \
        (Path("runs/h"), Path("h.json"), Path("out"))
    args = build_parser().parse_args(["ship", "runs/a", "--name", "n", "--model", "m"])
    assert (args.circuit_head, args.head_record, args.root) == (None, None, SHIPPED_DIR)


@pytest.mark.parametrize("missing", ["--name", "--model"])
def test_ship_requires_a_name_and_a_model(missing: str, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    argv = ["ship", "runs/a", "--name", "n", "--model", "m"]
    del argv[argv.index(missing):argv.index(missing) + 2]
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2 and missing in capsys.readouterr().err


@pytest.mark.parametrize("entry", ["circuits-llm", "head_cache"])
def test_ship_forwards_every_option_to_ship_run(entry: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``circuits-llm ship`` and its former spelling (``head_cache.main``) call the same
    ``ship_run`` with the same arguments."""
    calls: list[tuple[Any, ...]] = []

    def ship_run(run_dir: Path, out: Path, model_name: str, *, circuit_head: Path | None,
                 head_record: Path | None, draft_steps: int | None) -> SimpleNamespace:
        calls.append((run_dir, out, model_name, circuit_head, head_record, draft_steps))
        return SimpleNamespace(directory=out, kind="btree-block", size_bytes=2_500_000,
                               manifest={"parameters": 1234})

    monkeypatch.setattr(shipping, "ship_run", ship_run)
    main = cli_main if entry == "circuits-llm" else hc.main
    assert main(["ship", str(tmp_path / "run"), "--name", "smollm2-x", "--model", "smollm2",
                 "--circuit-head", str(tmp_path / "head"), "--head-record",
                 str(tmp_path / "h.json"), "--root", str(tmp_path / "root"),
                 "--draft-steps", "5"]) == 0
    assert calls == [(tmp_path / "run", tmp_path / "root" / "smollm2-x", "smollm2",
                      tmp_path / "head", tmp_path / "h.json", 5)]
    out = capsys.readouterr().out
    assert "btree-block, 2.5 MB, 1,234 parameters" in out


# ---------------------------------------------------------------------------- a real run
def test_ship_writes_the_run_as_the_former_command_did(run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ship", str(run), "--name", "tiny-ff", "--model", "tiny",
                     "--root", str(tmp_path / "new")]) == 0
    assert "tiny-ff" in capsys.readouterr().out
    shipped = read_shipped_head(tmp_path / "new" / "tiny-ff")
    shipped.verify()
    assert (shipped.kind, shipped.model_name) == ("ff", "tiny")
    assert [s.name for s in hc.shipped_heads(tmp_path / "new")] == ["tiny-ff"]
    assert hc.main(["ship", str(run), "--name", "tiny-ff", "--model", "tiny",
                    "--root", str(tmp_path / "old")]) == 0
    former = read_shipped_head(tmp_path / "old" / "tiny-ff")
    assert former.manifest["files"] == shipped.manifest["files"]  # the same bytes


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".hidden", "-x", "tiny ff"])
def test_a_bad_name_is_one_error_and_writes_nothing(name: str, run: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    assert cli_main(["ship", str(run), f"--name={name}", "--model", "tiny",
                     "--root", str(root)]) == 2
    assert "--name must be a directory name" in one_error_line(capsys.readouterr().err)
    assert not root.exists() and not (tmp_path / "escape").exists()


def test_a_missing_run_dir_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ship", str(tmp_path / "no-run"), "--name", "x", "--model", "tiny",
                     "--root", str(tmp_path / "root")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no-run" in line and "training.json" in line and "does not exist" in line
    assert not (tmp_path / "root").exists()


def test_a_circuit_head_for_a_head_run_is_one_error(run: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ship", str(run), "--name", "x", "--model", "tiny", "--circuit-head",
                     str(run), "--root", str(tmp_path / "root")]) == 2
    assert "go with a draft-block run" in one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------- no runpy warning
def _help(module: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "always::RuntimeWarning", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, "ship", "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_ship_help_runs_without_runpys_warning() -> None:
    """``python -m circuits_llm ship --help`` prints the options and no RuntimeWarning; the
    former ``-m circuits_llm.app.head_cache`` still works, with runpy's warning (which shows
    that the check would see one)."""
    done = _help("circuits_llm")
    assert done.returncode == 0, done.stderr
    assert "--circuit-head" in done.stdout and "--name" in done.stdout
    assert "RuntimeWarning" not in done.stderr and "sys.modules" not in done.stderr, done.stderr
    former = _help("circuits_llm.app.head_cache")
    assert former.returncode == 0, former.stderr
    assert "--circuit-head" in former.stdout
    assert "RuntimeWarning" in former.stderr and "found in sys.modules" in former.stderr
