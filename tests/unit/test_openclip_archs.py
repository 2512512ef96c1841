"""OpenCLIP architectures by name (issue 32): the shipped JSONs are OpenCLIP's, build the same tensors, and
any other name in OpenCLIP's registry resolves from it; towers dsclip lacks are one line naming them."""

from __future__ import annotations

import json

import pytest
import torch

from dsclip.cli import main
from dsclip.model import UnsupportedModelError, create_model, get_model_config, list_models
from dsclip.model.factory import CONFIG_DIR, openclip_config_path
from dsclip.model.openclip import _openclip_expected

open_clip = pytest.importorskip("open_clip")

SHIPPED = ["ViT-L-14-336", "ViT-L-14-336-quickgelu", "ViT-B-32-quickgelu", "ViT-B-16-quickgelu", "ViT-L-14-quickgelu",
           "ViT-H-14-quickgelu", "ViT-H-14-378-quickgelu", "ViT-B-16-plus-240", "ViT-B-32-256",
           # SigLIP: timm image tower (no class token, 'map' attention pool), bidirectional text, custom_text
           "ViT-B-16-SigLIP", "ViT-B-16-SigLIP-256", "ViT-B-16-SigLIP-384", "ViT-B-16-SigLIP-512",
           "ViT-L-16-SigLIP-256", "ViT-L-16-SigLIP-384", "ViT-SO400M-14-SigLIP", "ViT-SO400M-14-SigLIP-384",
           "ViT-B-16-SigLIP2", "ViT-SO400M-14-SigLIP2"]  # fmt: skip


def _openclip_shapes(name: str) -> dict[str, tuple]:
    with torch.device("meta"):  # no memory, no init: ViT-L-14-336 is 428M parameters
        model = open_clip.create_model(name, device="meta")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_are_openclips_and_build_its_tensors(name):
    assert name in list_models() and (CONFIG_DIR / f"{name}.json").is_file()
    assert json.loads((CONFIG_DIR / f"{name}.json").read_text()) == json.loads(openclip_config_path(name).read_text())
    ours = {k: tuple(v) for k, v in _openclip_expected(get_model_config(name)).items()}
    assert ours == _openclip_shapes(name)  # every OpenCLIP key, every shape: OpenAI's weights load by name


def test_quickgelu_configs_build_quickgelu():
    assert create_model("ViT-B-32-quickgelu", device="meta").config["quick_gelu"] is True
    assert create_model("ViT-B-32", device="meta").config["quick_gelu"] is False


@pytest.mark.parametrize("name", ["ViT-L-16-320", "ViT-L-16-SigLIP2-512", "ViT-gopt-16-SigLIP2-256"])
def test_a_name_only_in_openclips_registry_resolves_from_it(name):
    # not shipped: from open_clip/model_configs (SigLIP 2's patch-16 towers use timm's GELUTanh)
    assert name not in list_models()
    ours = {k: tuple(v) for k, v in _openclip_expected(get_model_config(name)).items()}
    assert ours == _openclip_shapes(name)


@pytest.mark.parametrize(
    "name, expect",
    [
        ("MobileCLIP-S1", "vision tower timm:fastvit_mci1 (a timm FastVit; dsclip builds timm VisionTransformer "
                          "towers, e.g. the SigLIP ViTs)"),
        ("ViT-SO400M-16-SigLIP-i18n-256", "text_cfg.proj_type='none'"),
        ("RN50", "a ResNet vision tower"),
        ("coca_ViT-B-32", "a multimodal text decoder (CoCa)"),
    ],
)  # fmt: skip
def test_towers_dsclip_lacks_are_one_line_naming_them(name, expect, tmp_path, capsys, monkeypatch):
    with pytest.raises(UnsupportedModelError, match="what dsclip's towers do not build") as e:
        get_model_config(name)
    assert expect in str(e.value) and "\n" not in str(e.value)
    monkeypatch.delenv("DSCLIP_DEBUG", raising=False)
    assert main(["train", "--config", "tiny", "--logs", str(tmp_path), "--model", name]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"dsclip train: error: --model {name}: OpenCLIP's architecture") and expect in line


def test_plan_takes_an_openclip_name(capsys):
    from dsclip.cli import plan as C

    assert C.main_plan(["--model", "ViT-L-14-336", "--gpus", "8", "--global-batch", "4096"]) == 0
    assert "ViT-L-14-336" in capsys.readouterr().out
