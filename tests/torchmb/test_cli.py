import torch

from torchmb.__main__ import main


def test_demo_trains_every_model_past_chance(capsys) -> None:
    main(["demo", "--models", "4", "--steps", "60", "--samples", "32", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "4 models x 60 steps" in out
    accuracies = [float(a) for a in out.split("validation accuracy per model:")[1].split("\n")[0].split()]
    assert len(accuracies) == 4
    assert min(accuracies) > 0.5, "four classes: chance is 0.25; every model must have learned"
    assert torch.cuda.is_available() or "on cpu" in out
