from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchmb.__main__ import main
from torchmb.cli.demo import DigitsCNN


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    args = ["demo", "--lr-values", "3", "--wd-values", "2", "--steps", "40", "--samples", "32"]
    main([*args, "--device", "cpu", "--out", str(out)])
    return out


def test_demo_writes_leaderboard_plot_and_results(demo_output: Path) -> None:
    out = demo_output
    with open(out / "leaderboard.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    assert [int(r["rank"]) for r in rows] == list(range(1, 7))
    accuracies = [float(r["val_accuracy"]) for r in rows]
    finite = [a for a in accuracies if a == a]
    assert finite == sorted(finite, reverse=True), "ranked by validation accuracy"
    assert max(finite) > 0.5, "ten classes: the best model must be far above chance after 40 steps"
    assert sorted({float(r["lr"]) for r in rows}) == pytest.approx([1e-3, 10**-1.5, 1.0])
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert results["best"] == {k: (int(v) if k in ("rank", "model") else float(v)) for k, v in rows[0].items()}


def test_best_checkpoint_loads_into_the_plain_model_and_without_torchmb(demo_output: Path) -> None:
    out = demo_output
    plain = DigitsCNN()
    plain.load_state_dict(torch.load(out / "best_state_dict.pt"))
    plain.eval()
    x = torch.rand(5, 1, 8, 8)
    expected = plain(x)
    torch.save(x, out / "probe.pt")
    script = (
        "import sys; sys.modules['torchmb'] = sys.modules['batch_layers'] = sys.modules['offload'] = None\n"
        "import torch\n"
        f"model = torch.export.load({str(out / 'best_model.pt2')!r}).module()\n"
        f"torch.save(model(torch.load({str(out / 'probe.pt')!r})), {str(out / 'answer.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=out)
    torch.testing.assert_close(torch.load(out / "answer.pt"), expected, atol=1e-5, rtol=0)


def test_every_flag_has_help_and_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from torchmb import __version__
    from torchmb.cli import bench as _bench
    from torchmb.cli import demo as _demo
    from torchmb.cli import kernels as _kernels

    for add in (_demo.add_arguments, _bench.add_arguments, _kernels.add_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        missing = [a.option_strings for a in parser._actions
                   if a.help in (None, "") and a.option_strings != ["-h", "--help"]]
        assert not missing, f"flags without help text: {missing}"
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"torchmb {__version__}"


def test_kernels_command_says_which_kernel_a_shape_takes_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    main(["kernels", "--batch", "16", "--in-channels", "6", "--out-channels", "16", "--kernel", "5", "5"])
    out = capsys.readouterr().out
    assert "one grouped convolution with weight (256, 6, 5, 5) and 16 groups" in out
    assert "forward: aten" in out and "not triton-grouped: needs at least 128 groups" in out
    main(["kernels", "--batch", "4", "--in-channels", "64", "--out-channels", "64", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "layout of a channels-last input: channels-last" in out and "needs a CUDA tensor" in out
    main(["kernels", "--batch", "64", "--in-channels", "512", "--out-channels", "512", "--size", "1", "1",
          "--padding", "1"])
    out = capsys.readouterr().out
    assert "1x1 images, padding 1" in out and "forward: matmul (H200" in out
    main(["kernels", "--batch", "64", "--in-channels", "64", "--out-channels", "64", "--size", "8", "8",
          "--padding", "1"])
    assert "not matmul: needs at most 16 pixel pairs" in capsys.readouterr().out
    main(["kernels", "--batch", "64", "--in-channels", "64", "--out-channels", "128", "--size", "8", "8",
          "--padding", "1", "--stride", "2"])
    assert "forward: patches-matmul (H200" in capsys.readouterr().out, "eager from 64 models on"
    main(["kernels", "--batch", "64", "--in-channels", "512", "--out-channels", "512"])
    assert "not matmul: needs the image's size and padding known" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"must be divisible by --groups \(4\)"):
        main(["kernels", "--batch", "2", "--in-channels", "6", "--out-channels", "8", "--groups", "4"])


def test_config_command_lists_every_switch(capsys: pytest.CaptureFixture[str]) -> None:
    import torchmb_config

    main(["config"])
    out = capsys.readouterr().out
    for switch in torchmb_config.SWITCHES.values():
        assert switch.name in out and switch.env in out
