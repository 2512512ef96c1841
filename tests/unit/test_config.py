"""Run-config loading: precedence, types, and one-line errors that name the problem."""

import pytest

from dsclip.config import ConfigError, build_arg_parser, make_run_config, parse_run_config


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_recipe_then_flags(tmp_path):
    recipe = write(tmp_path, "model: tiny\nbatch_size: 8\nlr: 0.001\nepochs: 3\n")
    cfg = parse_run_config(["--config", recipe, "--batch-size", "16", "--name", "x"])
    assert cfg.model.model == "tiny"
    assert cfg.train.batch_size == 16  # flag beats recipe
    assert cfg.optim.lr == pytest.approx(1e-3)  # recipe beats default
    assert cfg.train.epochs == 3
    assert cfg.optim.wd == pytest.approx(0.2)  # default


def test_sectioned_recipe_is_flattened(tmp_path):
    recipe = write(tmp_path, "train:\n  batch_size: 4\noptim:\n  lr: 0.5\n")
    cfg = parse_run_config(["--config", recipe, "--name", "x"])
    assert cfg.train.batch_size == 4 and cfg.optim.lr == 0.5


def test_bool_flags_and_optional_values(tmp_path):
    cfg = parse_run_config(
        [
            "--grad-checkpointing",
            "--local-loss",
            "--gather-with-grad",
            "--name",
            "x",
            "--grad-clip-norm",
            "1.0",
            "--force-patch-dropout",
            "0.5",
        ]
    )
    assert cfg.model.grad_checkpointing and cfg.loss.local_loss
    assert cfg.optim.grad_clip_norm == 1.0 and cfg.model.force_patch_dropout == 0.5
    assert cfg.loss_name == "infonce_local"
    assert parse_run_config(["--siglip", "--name", "x"]).loss_name == "siglip"
    assert parse_run_config(["--tiled-loss", "--name", "x"]).loss_name == "infonce_tiled"


def test_local_rank_from_launcher_is_accepted():
    cfg = parse_run_config(["--local_rank=1", "--name", "x"])
    assert cfg.log.name == "x"


def test_unknown_recipe_key_names_it(tmp_path):
    recipe = write(tmp_path, "batch_sise: 8\n")
    with pytest.raises(ConfigError, match="unknown setting 'batch_sise'.*did you mean 'batch_size'"):
        parse_run_config(["--config", recipe])


def test_unknown_flag_names_it():
    with pytest.raises(ConfigError, match="unknown flag --batch-sise.*--batch-size"):
        parse_run_config(["--batch-sise", "3"])


def test_missing_recipe_lists_builtins():
    with pytest.raises(ConfigError, match="recipe not found: nope.yaml.*demo"):
        parse_run_config(["--config", "nope.yaml"])


def test_builtin_recipe_by_name():
    cfg = parse_run_config(["--config", "tiny", "--name", "x"])
    assert cfg.model.model == "tiny"


def test_invalid_yaml(tmp_path):
    recipe = write(tmp_path, "a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_run_config(["--config", recipe])


def test_bad_types_and_values():
    with pytest.raises(ConfigError, match="'batch_size': cannot read 'abc' as int"):
        make_run_config({"batch_size": "abc"})
    with pytest.raises(ConfigError, match="'accum_freq' must be >= 1"):
        make_run_config({"accum_freq": 0})
    with pytest.raises(ConfigError, match="--local-loss without --gather-with-grad"):
        make_run_config({"local_loss": True})
    with pytest.raises(ConfigError, match="lr_scheduler' must be one of"):
        make_run_config({"lr_scheduler": "linear"})
    with pytest.raises(ConfigError, match="needs --epochs-cooldown"):
        make_run_config({"lr_scheduler": "const-cooldown"})


def test_delete_previous_checkpoint_means_keep_one():
    assert make_run_config({"delete_previous_checkpoint": True, "name": "x"}).checkpoint.keep_last == 1


def test_every_field_has_help():
    text = build_arg_parser().format_help()
    for flag in (
        "--model",
        "--batch-size",
        "--epochs",
        "--lr",
        "--wd",
        "--warmup",
        "--lr-scheduler",
        "--grad-clip-norm",
        "--precision",
        "--grad-checkpointing",
        "--force-patch-dropout",
        "--local-loss",
        "--gather-with-grad",
        "--seed",
        "--logs",
        "--name",
        "--resume",
        "--save-frequency",
        "--log-every-n-steps",
        "--report-to",
        "--train-data",
        "--train-num-samples",
        "--workers",
        "--deepspeed-config",
        "--accum-freq",
    ):
        assert flag in text, flag


@pytest.mark.parametrize("recipe", ["demo", "tiny", "ViT-B-32", "ViT-L-14", "ViT-H-14", "ViT-bigG-14"])
def test_builtin_recipes_parse_and_resolve_with_their_deepspeed_config(recipe):
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.model import get_model_config

    cfg = parse_run_config(["--config", recipe, "--name", "x"])
    get_model_config(cfg.model.model)  # the architecture exists
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=8, device_type="cuda"
    )
    assert ds["train_batch_size"] == cfg.train.batch_size * cfg.train.accum_freq * 8
