"""Text in, text out from the shell: fine-tune a transformers Mamba-2 folder with its own
tokenizer, generate, evaluate, export, and load the export in transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from recurra_cli.main import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from text_fixtures import CORPUS, SAMPLE, hf_mamba_folder, make_bpe, make_world  # noqa: E402

runner = CliRunner()


def _mamba2_folder(tmp_path: Path) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    return hf_mamba_folder("mamba2", tmp_path / "mamba2-hf")[1]


def _data(tmp_path: Path) -> tuple[Path, Path]:
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"body": t}) for t in CORPUS))
    held = tmp_path / "held.txt"
    held.write_text("\n".join(CORPUS[:5]) + "\n")
    return train, held


def test_fine_tune_export_round_trip_with_transformers(tmp_path: Path) -> None:
    import torch
    import transformers

    import recurra_models as rm

    src = _mamba2_folder(tmp_path)
    train, held = _data(tmp_path)
    run = tmp_path / "run"
    args = ["train", "--model", str(src), "--data", str(train), "--text-field", "body"]
    args += ["--eval-data", str(held), "--steps", "3", "--batch-size", "2", "--seq-len", "16"]
    args += ["--lr", "1e-2", "--out", str(run), "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["model"] == "mamba2" and rec["last_step"] == 3 and rec["tokenizer"] == "HFTokenizer"
    assert rec["eval"] and rec["eval"][-1]["perplexity"] == pytest.approx(
        np.exp(rec["eval"][-1]["loss"])
    )
    assert abs(rec["losses"][0] - np.log(400)) < 1.0
    cached = list((run / "tokens").glob("tokens-*.uint16.bin"))
    assert len(cached) == 2  # train and eval data, each tokenized once
    assert (run / "tokenizer" / "tokenizer.json").is_file()

    # generate from the run, with the run's tokenizer: text, stopped at --max-tokens or EOS
    g = ["generate", "--model", str(run), "--prompt", "the quick", "--max-tokens", "8"]
    res = runner.invoke(app, [*g, "--temperature", "0", "--json"])
    assert res.exit_code == 0, res.output
    gen = json.loads(res.stdout)
    tok = rm.load_tokenizer(run / "tokenizer")
    ids = [t for t in gen["tokens"] if t != tok.eos_id]
    assert gen["text"] == tok.decode(ids) and 1 <= len(gen["tokens"]) <= 8

    # export: transformers loads the folder, the logits equal ours
    out = tmp_path / "export"
    res = runner.invoke(app, ["export", str(run), str(out), "--format", "hf"])
    assert res.exit_code == 0, res.output
    ours = rm.load_checkpoint(run / json.loads((run / "latest.json").read_text())["path"])["model"]
    tokens = tok.encode(SAMPLE)[None, :]
    ref = transformers.Mamba2ForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    mine = ours(tokens).numpy()
    assert np.max(np.abs(theirs - mine)) <= 1e-4 * np.max(np.abs(mine))
    # the weights moved away from the source folder's
    src_logits = rm.load_pretrained(src)(tokens).numpy()
    assert np.max(np.abs(src_logits - mine)) > 1e-3
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok(SAMPLE, add_special_tokens=False)["input_ids"] == tokens[0].tolist()
    # a second export refuses the non-empty folder unless --overwrite
    res = runner.invoke(app, ["export", str(run), str(out)])
    assert res.exit_code == 2 and "--overwrite" in res.output
    res = runner.invoke(app, ["export", str(run), str(out), "--overwrite"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["export", str(run), str(tmp_path / "x"), "--format", "rwkv"])
    assert res.exit_code == 2 and "format='rwkv' takes an RWKV" in " ".join(res.output.split())


def test_eval_equals_transformers_and_resume_reuses_the_tokens(tmp_path: Path) -> None:
    import torch
    import transformers

    src = _mamba2_folder(tmp_path)
    _, held = _data(tmp_path)
    res = runner.invoke(
        app, ["eval", "--model", str(src), "--data", str(held), "--seq-len", "20", "--json"]
    )
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    import recurra_models as rm

    data = rm.tokenize_files([held], rm.load_tokenizer(src))
    ref = transformers.Mamba2ForCausalLM.from_pretrained(str(src)).eval()
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, data.size, 20):
            w = torch.tensor(np.asarray(data[i : i + 20], dtype=np.int64))[None]
            if w.shape[1] >= 2:
                total += float(ref(w, labels=w).loss) * (w.shape[1] - 1)
                count += w.shape[1] - 1
    assert got["tokens"] == count
    assert abs(got["loss"] - total / count) <= 1e-4 * total / count
    res = runner.invoke(app, ["eval", "--model", str(src), "--data", str(tmp_path / "no.txt")])
    assert res.exit_code == 2 and "not found" in res.output


def test_rwkv_world_fine_tune_generate_export(tmp_path: Path) -> None:
    import recurra_models as rm

    model = rm.create("rwkv7", vocab_size=300, n_embd=32, n_layer=1, head_size=16, seed=1)
    src = tmp_path / "rwkv"
    world = rm.WorldTokenizer(make_world(tmp_path / "rwkv_vocab_v20230424.txt"))
    rm.save_pretrained(model, src, world)
    data = tmp_path / "d.txt"
    data.write_text("\n".join(CORPUS), encoding="utf-8")
    run = tmp_path / "run"
    res = runner.invoke(
        app,
        [
            "train",
            "--model",
            str(src / "model.pth"),
            "--data",
            str(data),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "8",
            "--out",
            str(run),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tokenizer"] == "WorldTokenizer"
    res = runner.invoke(
        app,
        ["generate", "--model", str(run), "--prompt", "日本", "--max-tokens", "5", "--seed", "0"],
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("日本") and "\ufffd" not in res.stdout[:2]
    res = runner.invoke(app, ["export", str(run), str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    back = rm.load_pretrained(tmp_path / "out")
    assert isinstance(back.tokenizer, rm.WorldTokenizer) and back.arch == "rwkv7"


def test_text_command_user_errors(tmp_path: Path) -> None:
    folder = make_bpe(tmp_path / "tok")
    data = tmp_path / "d.txt"
    data.write_text("hello world\n" * 20)
    cases = [
        (["train", "--model", str(tmp_path / "nope"), "--data", str(data)], "unknown --model"),
        (
            ["train", "--model", "mamba", "--data", str(data), "--tokenizer", str(tmp_path / "x")],
            "--tokenizer",
        ),
        (["generate", "--prompt", "a"], "one of --model"),
        (["export", str(tmp_path / "none"), str(tmp_path / "o")], "SOURCE"),
        (["export", str(tmp_path), str(tmp_path / "o"), "--format", "gguf"], "hf or rwkv"),
    ]
    for args, needle in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert needle in " ".join(res.output.split()), (args, res.output)
    # a preset trained with a real tokenizer takes its vocabulary
    res = runner.invoke(
        app,
        [
            "train",
            "--model",
            "mamba",
            "--data",
            str(data),
            "--tokenizer",
            str(folder),
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--seq-len",
            "4",
            "--config",
            "d_model=16",
            "--config",
            "n_layer=1",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config"]["vocab_size"] == 400
