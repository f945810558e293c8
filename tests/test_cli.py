"""CLI smoke tests of ``demo``, ``bench`` and ``generate`` on a tiny random byte-level Llama.

One module-scoped ``demo`` run trains tiny FF and BTree heads into a temporary cache (a couple of
optimiser steps); the other tests reuse that cache and check the reports, the plot, the errors
and the atomic writes.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from circuits import files
from circuits_llm.app import demo as demo_module
from circuits_llm.app import report
from circuits_llm.app.cli import main
from circuits_llm.app.head_cache import head_dir
from circuits_llm.app.report import DecodeMode, DecoderRow, ReportError
from circuits_llm.app.verify_packing import Precision
from circuits_llm.decoding.metrics import DecodeSummary
from circuits_llm.runtime.devices import describe_device, resolve_device
from circuits_llm.text.byte_level import decode, evaluation_prompts
from circuits_llm.text.models import load_byte_model, model_fingerprint

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_RUN = ["--window", "4", "--rank", "4", "--train-steps", "2", "--prompts", "2",
            "--prompt-bytes", "24", "--new-tokens", "12", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=256, eos_token_id=257,
                         pad_token_id=258)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def demo_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("demo")
    out, cache = root / "out", root / "cache"
    code = main(["demo", "--model", str(tiny_model), "--out", str(out), "--cache-dir", str(cache),
                 *TINY_RUN, "--device", "auto"])
    assert code == 0
    return {"out": out, "cache": cache, "model": tiny_model}


def _args(run: dict, out: Path | None = None) -> list[str]:
    return ["--model", str(run["model"]), "--out", str(out or run["out"]),
            "--cache-dir", str(run["cache"]), *TINY_RUN]


def test_demo_writes_a_valid_report(demo_run: dict) -> None:
    result = report.load_report(demo_run["out"] / "results.json")
    assert result["command"] == "demo"
    assert result["machine"]["device"] == describe_device(resolve_device("auto"))  # cpu here
    decoders = {(row["decoder"], row["mode"]) for row in result["rows"]}
    assert decoders == {(d, m.value) for d in ("autoregressive", "ff", "btree") for m in DecodeMode}
    assert result["greedy_identical"] == {"all": True, "prompts": 2, "mismatches": [],
                                          "decoders": ["autoregressive", "btree", "ff"]}
    assert {h: r["cached"] for h, r in result["heads"].items()} == {"ff": False, "btree": False}
    assert result["config"]["draft_confidence"] == 0.3 and result["config"]["draft_minimum"] == 0
    # the precision auto picks on this CPU; float32 with linear weights packed for the verify
    # blocks, or a row-invariant bfloat16 copy; the greedy check above ran on it
    assert result["config"]["packed_linear"] is True
    precision = Precision.AUTO.resolve(torch.device("cpu"))
    assert result["config"]["precision"] == precision.value
    assert result["machine"]["linear_layers"].startswith(  # what, why
        "model: row-invariant bfloat16: float64 attention" if precision is Precision.BFLOAT16
        else "linear layers: weights ")
    assert result["config"]["token_input"] == ["ff", "btree"]  # both heads read the token
    assert result["heads"]["ff"]["training_config"]["token_input"] is True
    assert result["heads"]["btree"]["training_config"]["token_input"] is True
    for row in result["rows"]:
        assert row["prompts"] == 2 and row["new_tokens"] == 24
        if row["decoder"] == "autoregressive":
            assert row["speedup_vs_ar"] == pytest.approx(1.0) and row["acceptance_by_position"] == []
        else:
            # window 4: three drafted tokens, of which the demo's confident(0.3) rule verifies
            # the first and any the head is confident in
            assert 1 <= len(row["acceptance_by_position"]) <= 3
    assert result["sample"]["decoder"] == "btree"
    assert result["sample"]["prompt"] == decode(evaluation_prompts(2, 24)[0])
    assert (demo_run["out"] / "table.txt").read_text().startswith("mode")


def test_demo_plot_is_a_png(demo_run: dict) -> None:
    from matplotlib import image
    path = demo_run["out"] / "tradeoff.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(path)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert not list(demo_run["out"].glob(".*tmp*"))  # no temporary files left behind


def test_second_demo_reuses_cached_heads(demo_run: dict, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached head was trained again")

    monkeypatch.setattr("circuits_llm.training.train_head", no_training)
    assert main(["demo", *_args(demo_run, tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "IDENTICAL" in printed and "----- continuation -----" in printed
    assert "lat/round" in printed and "per-position acceptance" in printed
    result = report.load_report(tmp_path / "results.json")
    assert {h: r["cached"] for h, r in result["heads"].items()} == {"ff": True, "btree": True}


def test_bench_uses_more_prompts(demo_run: dict, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(demo_run, tmp_path)
    args[args.index("--prompts") + 1] = "3"
    assert main(["bench", *args, "--device", "cpu"]) == 0
    assert "----- continuation -----" not in capsys.readouterr().out
    result = report.load_report(tmp_path / "results.json")
    assert result["command"] == "bench" and result["machine"]["device"] == "cpu"
    assert all(row["prompts"] == 3 for row in result["rows"])
    assert (tmp_path / "tradeoff.png").read_bytes()[:8] == PNG_SIGNATURE


def _generate(run: dict, head: str, *extra: str) -> int:
    return main(["generate", "--model", str(run["model"]), "--cache-dir", str(run["cache"]),
                 "--prompt", "def main(", "--head", head, "--max-new-tokens", "10",
                 "--threads", "1", *extra])


def test_generate_greedy_matches_across_heads(demo_run: dict,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    texts = {}
    for head in ("ar", "ff", "btree"):
        assert _generate(demo_run, head) == 0
        captured = capsys.readouterr()
        texts[head] = captured.out
        assert "10 tokens in" in captured.err and "tokens/round" in captured.err
    assert texts["ar"] == texts["ff"] == texts["btree"]
    assert _generate(demo_run, "btree", "--lookup", "0.3,0.6") == 0  # the copy component: exact
    captured = capsys.readouterr()
    assert captured.out == texts["ar"] and "lookup 0.3/0.6" in captured.err
    assert _generate(demo_run, "ar", "--lookup", "0.5") == 2
    assert "--lookup mixes a copy" in capsys.readouterr().err
    run_dir = next((demo_run["cache"]).glob("*/btree-*"))
    assert _generate(demo_run, str(run_dir), "--temperature", "1", "--top-k", "20",
                     "--seed", "3") == 0
    assert "speculative" in capsys.readouterr().err


def test_generate_on_cpu_and_auto_devices(demo_run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = {}
    for device in ("cpu", "auto"):
        assert _generate(demo_run, "btree", "--device", device, "--temperature", "1",
                         "--seed", "5") == 0
        captured = capsys.readouterr()
        outputs[device] = captured.out
        assert f" on {resolve_device(device)}]" in captured.err
    if not torch.cuda.is_available():  # auto is the CPU here: the same seeded sample
        assert outputs["cpu"] == outputs["auto"]


@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--model", "{missing}"], "no such directory"),
    (["demo", "--model", "{empty}"], "has no config.json"),
    (["generate", "--model", "{missing}", "--prompt", "x"], "no such directory"),
    (["generate", "--model", "{model}", "--prompt", "x", "--head", "nonsense"],
     "expected a head kind (ff, cp, hmm, btree"),
    (["generate", "--model", "{model}", "--prompt", "x", "--head", "ar", "--temperature", "-1"],
     "temperature must be"),
    (["generate", "--model", "{model}", "--prompt", "x", "--head", "ff", "--cache-dir",
      "{empty}"], "no trained ff head"),
    (["demo", "--model", "{model}", "--window", "1"], "--window must be >= 2"),
    # issue 44: the draft blocks by name, on a model none ships for
    (["generate", "--model", "{model}", "--prompt", "x", "--head", "block"],
     "no shipped block draft block for this model"),
    (["generate", "--model", "{model}", "--prompt", "x", "--head", "btree-block"],
     "--on-block BLOCK_RUN"),
    (["demo", "--model", "{model}", "--blocks", "block,ff"], "--blocks names draft blocks"),
])
def test_clear_errors(argv: list[str], message: str, tiny_model: Path, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    values = {"missing": str(tmp_path / "nope"), "empty": str(tmp_path / "empty"),
              "model": str(tiny_model)}
    argv = [a.format(**values) for a in argv] + ["--out", str(tmp_path / "out")] * (argv[0] == "demo")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_missing_embedded_model_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("circuits_llm.embedded.EMBEDDED_MODEL_DIR", tmp_path / "absent")
    assert main(["generate", "--prompt", "x", "--head", "ar"]) == 2
    assert "circuits-llm pretrain" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo", "--prompts", "0"], ["bench", "--train-seconds", "-3"],
                                  ["generate"], ["demo", "--variant", "huge"]])
def test_bad_arguments_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2


def test_failed_run_writes_no_results(demo_run: dict, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_plot(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(report, "write_tradeoff_plot", broken_plot)
    with pytest.raises(OSError, match="disk full"):
        main(["demo", *_args(demo_run, tmp_path / "out")])
    assert not (tmp_path / "out" / "results.json").exists()


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "results.json"
    report.write_json({"old": 1}, path)

    def failing_replace(src: object, dst: object) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(files.os, "replace", failing_replace)  # the one atomic writer
    with pytest.raises(OSError, match="rename failed"):
        report.write_json({"new": 2}, path)
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def _row(decoder: str, mode: DecodeMode, throughput: float, accepted: float) -> DecoderRow:
    summary = DecodeSummary(new_tokens=64, rounds=16, backbone_calls=17, drafted=48, accepted=24,
                            acceptance_rate=0.5, tokens_per_round=accepted, tokens_per_call=3.8,
                            acceptance_by_position=(0.75, 0.5, 0.25), conditional_acceptance_by_position=(),
                            mean_latency_s=accepted / throughput, throughput=throughput)
    return DecoderRow.from_summary(decoder, mode, 4, summary)


def test_speedups_table_and_schema() -> None:
    rows = report.with_speedups([_row("autoregressive", DecodeMode.GREEDY, 100.0, 1.0),
                                 _row("ff", DecodeMode.GREEDY, 200.0, 3.0),
                                 _row("btree", DecodeMode.GREEDY, 300.0, 4.0),
                                 _row("btree", DecodeMode.SAMPLING, 250.0, 4.0)])
    by_name = {(r.decoder, r.mode): r for r in rows}
    assert by_name["btree", DecodeMode.GREEDY].speedup_vs_ar == pytest.approx(3.0)
    assert by_name["btree", DecodeMode.GREEDY].speedup_vs_ff == pytest.approx(1.5)
    assert by_name["btree", DecodeMode.SAMPLING].speedup_vs_ar is None
    table = report.format_table(rows)
    assert "   3.00   1.50" in table and "   75   50   25" in table
    record = rows[2].to_json()
    assert DecoderRow.from_json(json.loads(json.dumps(record))) == rows[2]
    with pytest.raises(ReportError, match="acceptance rates"):
        report.check_row({**record, "acceptance_by_position": [1.5]})
    with pytest.raises(ReportError, match="mode must be"):
        report.check_row({**record, "mode": "beam"})
    with pytest.raises(ReportError, match="missing keys"):
        report.check_row({k: v for k, v in record.items() if k != "throughput"})
    assert report.iso_levels([150.0, 900.0]) == [100.0, 200.0, 500.0, 1000.0]


def test_report_schema_rejects_wrong_kind(demo_run: dict, tmp_path: Path) -> None:
    result = json.loads((demo_run["out"] / "results.json").read_text())
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**result, "kind": "something else"}))
    with pytest.raises(ReportError, match="expected kind"):
        report.load_report(path)
    path.write_text("{not json")
    with pytest.raises(ReportError, match="cannot read"):
        report.load_report(path)


def test_head_cache_key_depends_on_model_and_config(tiny_model: Path) -> None:
    pytest.importorskip("circuits_llm.training")
    loaded = load_byte_model(tiny_model)
    config = demo_module.ComparisonConfig.demo(quick=True)
    ff, btree = (demo_module.training_config(config, a) for a in ("ff", "btree"))
    cache = Path("/cache")
    assert head_dir(cache, loaded.fingerprint, ff) != \
        head_dir(cache, loaded.fingerprint, btree)
    wider = demo_module.training_config(demo_module.ComparisonConfig.demo(), "btree")
    assert head_dir(cache, loaded.fingerprint, btree) != \
        head_dir(cache, loaded.fingerprint, wider)
    with torch.no_grad():
        loaded.model.model.norm.weight.add_(1.0)
    assert model_fingerprint(loaded.model) != loaded.fingerprint


def test_training_budget_split() -> None:
    config = demo_module.ComparisonConfig.demo()
    shares = {a: demo_module.head_seconds(config, a) for a in config.heads}
    assert shares["btree"] == pytest.approx(4 * shares["ff"])
    assert sum(shares.values()) == pytest.approx(config.train_seconds)
    quick = demo_module.ComparisonConfig.demo(quick=True)
    assert quick.window == 8 and quick.train_seconds < config.train_seconds


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_corrupt_model_weights_are_one_line_in_every_command(
        command: str, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``generate`` and ``demo`` load models through the same loader as ``train-head``."""
    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_model.iterdir():
        data = item.read_bytes()
        (model / item.name).write_bytes(data[: len(data) // 2] if item.suffix == ".safetensors"
                                        else data)
    argv = {"generate": ["generate", "--model", str(model), "--prompt", "x"],
            "demo": ["demo", "--model", str(model), "--out", str(tmp_path / "out")]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"model.safetensors in {model} is corrupt or truncated" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- subword models
@pytest.fixture(scope="module")
def subword_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from test_tokens import save_model_dir, tiny_subword_model, tiny_tokenizer
    tokenizer = tiny_tokenizer()
    model = tiny_subword_model(len(tokenizer), seed=4)
    root = tmp_path_factory.mktemp("subword-cli")
    return {"dir": save_model_dir(root / "model", model, tokenizer), "model": model,
            "tokenizer": tokenizer, "cache": root / "cache"}


def _generate_text(run: dict, *extra: str) -> tuple[int, str, str]:
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["generate", "--model", str(run["dir"]), "--cache-dir", str(run["cache"]),
                     "--head", "ar", "--max-new-tokens", "20", "--threads", "1", *extra])
    return code, out.getvalue(), err.getvalue()


def _reference(run: dict, ids: list[int], **options: object) -> list[int]:
    prompt = torch.tensor([ids])
    out = run["model"].generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=0,
                                **options)
    return out[0, prompt.shape[1]:].tolist()


def test_generate_reads_and_writes_text_with_the_models_tokenizer(subword_run: dict) -> None:
    tokenizer = subword_run["tokenizer"]
    code, out, err = _generate_text(subword_run, "--prompt", "def decode(self, s):",
                                    "--stop", "xyzzy")
    expected = _reference(subword_run, tokenizer("def decode(self, s):").input_ids)
    assert code == 0 and out == tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert f"{len(expected)} tokens in" in err
    code, out, _ = _generate_text(subword_run, "--prompt", "hi", "--chat", "--system", "be brief")
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert code == 0 and out == tokenizer.decode(_reference(subword_run, list(chat)),
                                                 skip_special_tokens=True) + "\n"


def test_generate_stops_like_generate(subword_run: dict, tmp_path: Path) -> None:
    tokenizer = subword_run["tokenizer"]
    ids = tokenizer("class A:").input_ids
    free = _reference(subword_run, ids, eos_token_id=None)
    pieces = [tokenizer.decode([t]) for t in free]
    stop = next(a[-1:] + b[:1] for a, b in itertools.pairwise(pieces[2:])
                if a and b and (a[-1:] + b[:1]).isascii() and (a[-1:] + b[:1]).strip())
    expected = _reference(subword_run, ids, stop_strings=[stop], tokenizer=tokenizer)
    code, out, err = _generate_text(subword_run, "--prompt", "class A:", "--stop",
                                    stop.replace("\n", "\\n"))
    assert code == 0 and out == tokenizer.decode(expected) + "\n"
    assert f"] {len(expected)} tokens in" in err and len(expected) < len(free)
    several = tmp_path / "several-eos"  # the same model, whose generation_config has two EOS ids
    shutil.copytree(subword_run["dir"], several)
    config = json.loads((several / "generation_config.json").read_text())
    eos = [free[6], free[3]]
    (several / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    first = next(i + 1 for i, t in enumerate(free) if t in eos)
    code, out, err = _generate_text({**subword_run, "dir": several}, "--prompt", "class A:")
    assert code == 0 and f"] {first} tokens in" in err
    assert out == tokenizer.decode(free[:first], skip_special_tokens=True) + "\n"


def test_text_errors_are_one_line(subword_run: dict, tiny_model: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from test_tokens import save_model_dir, tiny_subword_model
    bare = save_model_dir(tmp_path / "bare", tiny_subword_model(300), None)
    cases = [(["generate", "--model", str(bare), "--prompt", "x", "--head", "ar"],
              f"the model directory {bare} has no tokenizer"),
             (["generate", "--model", str(tiny_model), "--prompt", "x", "--head", "ar", "--chat"],
              "--chat needs a chat template, and the byte tokenizer has none"),
             (["generate", "--model", "no-such-org/no-such-model", "--prompt", "x"],
              "not in the local Hugging Face cache"),
             (["train-head", "--model", str(bare), "--run-dir", str(tmp_path / "run")],
              "has no tokenizer")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_head_trained_for_another_model_is_one_line(demo_run: dict, subword_run: dict,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    head = next(demo_run["cache"].glob("*/btree-*"))  # trained for the byte model
    code, _, err = _generate_text(subword_run, "--prompt", "x", "--head", str(head))
    assert code == 2 and "trained for a model with another configuration" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_demo_drafting_options_parse_and_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from circuits_llm.app.cli import build_parser
    from circuits_llm.app.commands import comparison_config
    parser = build_parser()
    base = demo_module.ComparisonConfig.demo()
    assert base.token_input == ("ff", "btree") and base.draft_confidence == 0.3
    assert base.draft_minimum == 0
    assert comparison_config(parser.parse_args(["demo", "--draft-minimum", "2"]), base) \
        .draft_minimum == 2
    with pytest.raises(demo_module.DemoError, match="--draft-minimum 8 asks for more drafts"):
        comparison_config(parser.parse_args(["demo", "--draft-minimum", "8"]), base)
    with pytest.raises(demo_module.DemoError, match="give --draft-confidence TAU > 0 too"):
        comparison_config(parser.parse_args(["demo", "--draft-minimum", "1",
                                             "--draft-confidence", "0"]), base)
    args = parser.parse_args(["demo", "--token-input", "ff", "--draft-confidence", "0"])
    config = comparison_config(args, base)
    assert config.token_input == ("ff",) and not demo_module.training_config(config, "btree").token_input
    args = parser.parse_args(["demo", "--token-input", "ff,BTree", "--draft-confidence", "0"])
    config = comparison_config(args, base)
    assert config.token_input == ("ff", "btree") and config.draft_confidence is None
    assert demo_module.training_config(config, "btree").token_input
    args = parser.parse_args(["demo", "--token-input", "", "--draft-confidence", "0.5"])
    config = comparison_config(args, base)
    assert config.token_input == () and config.draft_confidence == 0.5
    assert not demo_module.training_config(config, "ff").token_input
    with pytest.raises(demo_module.DemoError, match="--token-input names cp"):
        comparison_config(parser.parse_args(["demo", "--token-input", "cp"]), base)
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--draft-confidence", "1.5"])
    assert "expected a number in [0, 1)" in capsys.readouterr().err
    assert comparison_config(parser.parse_args(["demo", "--lookup", "0.1,0.5"]), base).lookup \
        == (0.1, 0.5)
    assert comparison_config(parser.parse_args(["demo", "--lookup", "none"]), base).lookup is None
    assert comparison_config(parser.parse_args(["demo", "--compile-rounds"]), base).compile_rounds
    assert base.packed_linear
    assert not comparison_config(parser.parse_args(["demo", "--plain-linear"]), base).packed_linear
    for bad in ("0.5,x", "1.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["demo", "--lookup", bad])
        assert "expected weights in [0, 1]" in capsys.readouterr().err


def test_generate_under_a_regex_walks_the_constraint(demo_run: dict,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--regex`` with a head and ``--constraint-walk W`` mixes the constraint's walk into its
    drafts (greedy output still AR's; off by default), and the option is refused without a
    constraint or with ``--head ar``."""
    regex = ("--regex", "(self|x|y)(, ?(self|x|y))*\\):")
    assert _generate(demo_run, "ar", *regex) == 0
    reference = capsys.readouterr().out
    assert _generate(demo_run, "btree", *regex, "--constraint-walk", "0.5") == 0
    captured = capsys.readouterr()
    assert captured.out == reference and "constraint 0.5" in captured.err
    assert _generate(demo_run, "btree", *regex) == 0
    captured = capsys.readouterr()
    assert captured.out == reference and "lookup" not in captured.err
    for head, extra in (("ar", regex), ("btree", ())):
        assert _generate(demo_run, head, *extra, "--constraint-walk", "0.5") == 2
        assert "--constraint-walk mixes the constraint's walk" in capsys.readouterr().err


def test_generate_with_a_json_schema_stays_inside_its_bounds(subword_run: dict, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    """``--json-schema FILE`` on the command line: integer bounds hold (outlines-core alone would
    allow any integer), and a keyword the regex cannot enforce is one error naming it."""
    schema = tmp_path / "small.json"
    schema.write_text(json.dumps({"type": "integer", "minimum": 3, "maximum": 12}))
    for prompt in ("x", "class A:", "def f(a):"):
        code, out, err = _generate_text(subword_run, "--prompt", prompt, "--json-schema", str(schema))
        assert code == 0 and 3 <= int(out) <= 12, (out, err)
    refused = tmp_path / "price.json"
    refused.write_text(json.dumps({"type": "object", "properties": {"price": {"type": "number",
                                                                              "multipleOf": 0.01}}}))
    code, out, err = _generate_text(subword_run, "--prompt", "x", "--json-schema", str(refused))
    assert code == 2 and out == "" and "Traceback" not in err
    assert "#/properties/price/multipleOf is not enforced" in err and "remove it" in err


# ---------------------------------------------------------------------------- --prompts-file
def _lines(path: Path, *lines: object) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return path


def _generate_file(run: dict, path: Path, *extra: str) -> int:
    return main(["generate", "--model", str(run["model"]), "--cache-dir", str(run["cache"]),
                 "--prompts-file", str(path), "--head", "btree", "--max-new-tokens", "10",
                 "--threads", "1", *extra])


def test_generate_a_prompts_file_in_batches(demo_run: dict, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """One JSON line per request, in order: each the text ``--prompt`` gives it alone (greedy,
    and sampled: request ``i`` draws with seed ``--seed + i`` whatever its batch), with its own
    ``max_new_tokens`` and ``id``; ``--output`` gets the same lines."""
    prompts = ["def main(", "import os\n", "x = [", "class A:"]
    alone = {}
    for seed, temperature in ((0, "0"), (5, "1")):
        for index, prompt in enumerate(prompts):
            assert main(["generate", "--model", str(demo_run["model"]), "--cache-dir",
                         str(demo_run["cache"]), "--prompt", prompt, "--head", "btree",
                         "--max-new-tokens", "10", "--threads", "1", "--temperature", temperature,
                         "--seed", str(seed + index)]) == 0
            alone[temperature, index] = capsys.readouterr().out[:-1]  # print's newline
    requests = _lines(tmp_path / "requests.jsonl", {"prompt": prompts[0], "id": "a"},
                      {"prompt": prompts[1], "max_new_tokens": 4}, "",
                      {"prompt": prompts[2], "id": 7}, {"prompt": prompts[3]})
    for temperature in ("0", "1"):
        outputs = []
        for batch in ("3", "4"):
            assert _generate_file(demo_run, requests, "--batch-size", batch, "--temperature",
                                  temperature, "--seed", "5" if temperature == "1" else "0") == 0
            captured = capsys.readouterr()
            assert f"4 requests in batches of {batch}" in captured.err
            outputs.append(captured.out)
        assert outputs[0] == outputs[1]  # a request's output does not depend on its batch
        records = [json.loads(line) for line in outputs[0].splitlines()]
        assert [r["index"] for r in records] == [0, 1, 2, 3]
        assert [r.get("id") for r in records] == ["a", None, 7, None]
        assert [r["new_tokens"] for r in records] == [10, 4, 10, 10]
        for index in (0, 2, 3):
            assert records[index]["text"] == alone[temperature, index]
    out = tmp_path / "answers" / "out.jsonl"
    assert _generate_file(demo_run, requests, "--output", str(out)) == 0
    assert capsys.readouterr().out == ""
    written = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(written) == 4 and written[0] == alone["0", 0]
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]


@pytest.mark.parametrize(("lines", "extra", "message"), [
    (["not json"], (), "requests.jsonl line 1: not JSON"),
    ([{"prompt": "x"}, {"prompt": "x", "temperature": 1}], (),
     "line 2: unknown field(s) temperature"),
    ([{"id": 3}], (), "line 1: a request needs a \"prompt\""),
    ([{"prompt": "x", "max_new_tokens": -1}], (), "\"max_new_tokens\" must be >= 0"),
    ([{"prompt": "x", "max_new_tokens": True}], (), "\"max_new_tokens\" must be int"),
    ([{"prompt": "x", "stop": 3}], (), "\"stop\" must be str or list"),
    ([""], (), "holds no request"),
    ([{"prompt": "x"}], ("--regex", "a+"), "take no --regex"),
    ([{"prompt": "x"}], ("--compile",), "take no --compile"),
])
def test_prompts_file_errors_are_one_line(lines: list[object], extra: tuple[str, ...],
                                          message: str, demo_run: dict, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert _generate_file(demo_run, _lines(tmp_path / "requests.jsonl", *lines), *extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert _generate(demo_run, "ar", "--output", str(tmp_path / "o.jsonl")) == 2
    assert "--output writes the JSON lines of --prompts-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --prompt and --prompts-file exclude each other
        _generate(demo_run, "ar", "--prompts-file", str(tmp_path / "requests.jsonl"))


def test_bench_decodes_in_batches(demo_run: dict, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --batch-size 2``: 3 prompts in batches of 2 and 1, greedy outputs still AR's."""
    args = _args(demo_run, tmp_path)
    args[args.index("--prompts") + 1] = "3"
    assert main(["bench", *args, "--batch-size", "2"]) == 0
    result = report.load_report(tmp_path / "results.json")
    assert result["config"]["batch_size"] == 2 and result["greedy_identical"]["all"]
    assert all(row["prompts"] == 3 and row["throughput"] > 0 for row in result["rows"])
    assert main(["bench", *args, "--batch-size", "2", "--compile"]) == 2
    assert "need the dynamic KV cache" in capsys.readouterr().err
