"""OpenCLIP's cheap options with OpenCLIP's meaning (issue 15 items 3 and 6): --skip-scheduler,
--momentum, --precision amp/pure_*, --save-most-recent, --log-local/--debug, --copy-codebase,
--force-context-length, --report-to wandb (offline), one-line errors for bad values."""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import struct
import time

import pytest
import torch

from dsclip import compat
from dsclip.checkpoint import ds_checkpoint as dc
from dsclip.config import ConfigError, make_run_config, parse_run_config
from dsclip.data.loader import TokenizingCollate
from dsclip.data.tokenizer import TRUNCATED, SentencePieceTokenizer, train_sentencepiece
from dsclip.data.tools import main_tokenizer
from dsclip.engine.ds_config import resolve_ds_config
from dsclip.engine.optim import lr_multiplier
from dsclip.train import runlog, wandb_sink
from dsclip.train.goodput import summarize
from dsclip.train.gradcache import StepResult
from dsclip.train.metrics import MetricsLogger, data_counters
from tests.unit.test_checkpoint import FakeEngine


def cfg(**kw):
    kw.setdefault("name", "t")
    return make_run_config(kw)


def resolve(raw, device="cpu", **kw):
    c = cfg(**kw)
    return resolve_ds_config(raw, c.train, c.optim, world_size=2, device_type=device)


def test_skip_scheduler_keeps_lr_constant_without_warmup():
    scheduled = lr_multiplier(cfg(warmup=10).optim, total_steps=100, steps_per_epoch=10)
    assert scheduled(0) == pytest.approx(0.1)  # the warm-up --skip-scheduler removes
    for name in ("cosine", "const-cooldown"):
        o = cfg(warmup=10, lr_scheduler=name, epochs_cooldown=2, skip_scheduler=True).optim
        f = lr_multiplier(o, total_steps=100, steps_per_epoch=10)
        assert [f(s) for s in (0, 5, 50, 99, 100)] == [1.0] * 5


def test_momentum_goes_to_an_optimizer_that_takes_it_and_is_refused_otherwise():
    ds = resolve({"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}, momentum=0.9)
    assert ds["optimizer"]["params"] == {"lr": 5e-4, "weight_decay": 0.2, "momentum": 0.9}  # no betas/eps for SGD
    with pytest.raises(ConfigError, match=r"--momentum: dsclip's default optimizer is AdamW.*--beta1"):
        resolve({}, momentum=0.9)
    with pytest.raises(ConfigError, match=r"--momentum: the optimizer of .* \(Lamb\) takes no momentum"):
        resolve({"optimizer": {"type": "Lamb"}}, momentum=0.9)
    with pytest.raises(ConfigError, match="'momentum' is 0.5 but the run config gives 0.9"):
        resolve({"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}}, momentum=0.9)


def test_amp_means_deepspeed_mixed_precision_and_pure_is_refused_with_the_equivalent():
    assert resolve({}, precision="amp_bf16")["bf16"]["enabled"] is True
    assert resolve({}, precision="amp_bfloat16")["bf16"]["enabled"] is True
    assert resolve({}, precision="amp", device="cuda")["fp16"]["enabled"] is True
    for pure, alt in (("pure_bf16", "bf16"), ("pure_fp16", "fp16")):
        with pytest.raises(ConfigError, match=f"--precision {pure} .*no DeepSpeed equivalent.*--precision {alt} "):
            cfg(precision=pure)


def test_force_context_length_is_context_length():
    assert parse_run_config(["--name", "t", "--force-context-length", "32"]).model.context_length == 32
    assert parse_run_config(["--name", "t", "--force-quick-gelu"]).model.force_quick_gelu


def test_save_most_recent_saves_every_epoch_and_keeps_only_the_newest_extra(tmp_path):
    engine = FakeEngine()
    ck = dc.Checkpointer(tmp_path, every_n_steps=0, every_n_epochs=2, keep_last=0, rank=0, most_recent=True)
    ckpts = tmp_path / "checkpoints"
    saved = []
    for step in range(1, 21):  # 5 steps per epoch, 4 epochs
        epoch, epoch_end = (step - 1) // 5, step % 5 == 0
        saved.append(ck.maybe_save(engine, step, {"step": step}, epoch_end=epoch_end, epoch=epoch))
        if step == 5:
            assert dc.complete_tags(ckpts) == ["step_000000005"]  # epoch 1 is not due by --save-frequency 2
        if step == 15:
            # epoch 2's save is kept (--save-frequency); epoch 1's extra one gave way to epoch 3's
            assert dc.complete_tags(ckpts) == ["step_000000010", "step_000000015"]
    assert [s for s, ok in enumerate(saved, 1) if ok] == [5, 10, 15, 20]
    assert dc.complete_tags(ckpts) == ["step_000000010", "step_000000020"]
    assert (ckpts / "latest").read_text() == "step_000000020"
    plain = dc.Checkpointer(tmp_path / "p", every_n_steps=0, every_n_epochs=2, keep_last=0, rank=0)
    assert not plain.due(5, epoch_end=True, epoch=0)


@pytest.fixture
def clean_dsclip_logger():
    yield
    for name in ("dsclip", "dsclip.console"):
        lg = logging.getLogger(name)
        for h in [h for h in lg.handlers if getattr(h, "_dsclip_run_log", False)]:
            lg.removeHandler(h)
            h.close()
        lg.setLevel(logging.NOTSET)


def _metrics(run_dir, **kw):
    return MetricsLogger(
        run_dir,
        rank=0,
        world_size=1,
        every_n_steps=1,
        report_to=kw.pop("report_to", ""),
        samples_per_step=4,
        total_steps=10,
        device=torch.device("cpu"),
        **kw,
    )


def test_run_log_files_and_debug_level(tmp_path, clean_dsclip_logger):
    log = cfg().log
    assert runlog.log_file(tmp_path, 1, log_local=False) is None  # only rank 0 without --log-local
    runlog.setup(log, tmp_path, rank=0)
    logging.getLogger("dsclip.data").info("skipped 3 samples")
    logging.getLogger("dsclip.data").debug("hidden without --debug")
    m = _metrics(tmp_path)
    m.write_line("step 1/10 | loss 1.0")
    m.close()
    text = (tmp_path / "out.log").read_text()
    assert "rank 0 | INFO | dsclip.data | skipped 3 samples" in text and "step 1/10 | loss 1.0" in text
    assert "hidden" not in text

    local = cfg(log_local=True, debug=True).log
    runlog.setup(local, tmp_path / "r", rank=1)
    logging.getLogger("dsclip.data").debug("only with --debug")
    text = (tmp_path / "r" / "out-1.log").read_text()
    assert "rank 1 | DEBUG | dsclip.data | only with --debug" in text
    assert "skipped" not in text  # a new run's file does not get the previous run's records


def test_copy_codebase(tmp_path):
    dst = runlog.copy_codebase(tmp_path, resuming=False)
    assert (dst / "compat.py").read_text() == open(compat.__file__).read()
    assert not list(dst.rglob("*.pyc"))
    with pytest.raises(ConfigError, match="--copy-codebase needs a new run"):
        runlog.copy_codebase(tmp_path, resuming=False)
    assert runlog.copy_codebase(tmp_path, resuming=True) == dst  # a requeued run keeps its first copy


def test_report_to_errors_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"--report-to 'mlflow' is not supported \(supported: tensorboard, wandb"):
        cfg(report_to="tensorboard,mlflow")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="--report-to wandb needs the wandb package: pip install wandb"):
        cfg(report_to="tensorboard,wandb")


def wandb_records(run_dir, steps: set[int] = frozenset(), timeout: float = 60.0):
    """:func:`read_wandb_records`, waiting (up to ``timeout`` s) until the history holds ``steps``: wandb's
    writer is a separate process (wandb-core) that may still be writing when ``finish()`` returns."""
    deadline = time.monotonic() + timeout
    while True:
        ids, rows = read_wandb_records(run_dir)
        if steps <= {r.get("_step") for r in rows} or time.monotonic() > deadline:
            return ids, rows
        time.sleep(0.5)


def read_wandb_records(run_dir):
    """(run ids, history rows) of the offline runs under RUN/wandb (one run-ID.wandb file per start, in
    offline-run-TIME-ID folders): the .wandb files are a LevelDB-style
    log of protobuf records (32 KiB blocks, 7-byte record headers after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    ids, rows = [], []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        ids.append(path.rsplit("-", 1)[1].removesuffix(".wandb"))  # run-ID.wandb
        data, i, buf = open(path, "rb").read(), 7, b""
        assert data[:4] == b":W&B"
        while i + 7 <= len(data):
            left = 32768 - i % 32768
            if left < 7:  # block trailer padding
                i += left
                continue
            _, n, kind = struct.unpack("<IHB", data[i : i + 7])
            if kind == 0 and n == 0:
                i += left
                continue
            buf, i = buf + data[i + 7 : i + 7 + n], i + 7 + n
            if kind in (1, 4):  # FULL or LAST fragment
                r = pb.Record()
                r.ParseFromString(buf)
                buf = b""
                if r.WhichOneof("record_type") == "history":
                    rows.append({"/".join(it.nested_key) or it.key: json.loads(it.value_json) for it in r.history.item})
    return ids, rows


def test_wandb_gets_the_tensorboard_scalars_and_keeps_its_run_id_across_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in the dev extra")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    run_cfg = cfg(logs=str(tmp_path), name="w", report_to="all", wandb_notes="n")
    run_dir = run_cfg.run_dir
    run_dir.mkdir()
    result = StepResult(loss=1.5, logit_scale=14.0, logit_bias=None, grad_norm=2.0, applied=True)

    m = _metrics(run_dir, report_to="all", wandb=wandb_sink.for_run(run_cfg, rank=0))
    assert wandb_sink.for_run(run_cfg, rank=1) is None  # only rank 0 logs
    m.step(1, result, data_wait_s=0.0, lr=1e-3, epoch=0, extra={"bad_samples": 2})
    m.log_eval(1, {"top1": 0.25, "name": "x"}, prefix="zeroshot")
    seconds = {"step": 3.0, "startup": 1.0}
    m.log_goodput(1, summarize([{"wall_s": 4.0, "seconds": seconds, "overlap_s": {"background_write": 2.0}}]))
    m.close()
    first_id = (run_dir / wandb_sink.ID_FILE).read_text().strip()

    run_cfg.checkpoint.resume = "latest"  # a resumed run continues the same wandb run
    time.sleep(1.1)  # wandb names its local run folder by the second: keep the two runs' files apart
    m = _metrics(run_dir, wandb=wandb_sink.for_run(run_cfg, rank=0))
    m.step(2, result, data_wait_s=0.0, lr=1e-3, epoch=0)
    m.close()

    ids, rows = wandb_records(run_dir, steps={1, 2})
    assert ids == [first_id, first_id]
    by_step = {r["_step"]: r for r in rows}
    assert by_step[1]["train/loss"] == 1.5 and by_step[1]["train/lr"] == 1e-3
    assert by_step[1]["train/bad_samples"] == 2 and by_step[1]["zeroshot/top1"] == 0.25
    assert by_step[2]["train/grad_norm"] == 2.0
    # the run's goodput at its end (issue 65): steps' share, each kind's, the overlapping writes' seconds
    assert by_step[1]["goodput/goodput"] == 0.75 and by_step[1]["goodput/startup_share"] == 0.25
    assert by_step[1]["goodput/background_write_s"] == 2.0
    # the same names as TensorBoard's
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    wandb_keys = {k for r in rows for k in r if not k.startswith("_")}
    assert set(tb.Tags()["scalars"]) == wandb_keys

    fresh = cfg(logs=str(tmp_path), name="w", report_to="wandb")  # not resuming: a new wandb run
    m = _metrics(run_dir, wandb=wandb_sink.for_run(fresh, rank=0))
    m.close()
    assert (run_dir / wandb_sink.ID_FILE).read_text().strip() != first_id


# --- caption length accounting (issue 15 item 5) ---


@pytest.fixture(scope="module")
def digit_tok(tmp_path_factory):
    """The new user's case: a 64-piece tokenizer trained on short digit captions."""
    words = "zero one two three four five six seven eight nine".split()
    texts = [f"a photo of the digit {words[i % 10]} written by hand number {i}" for i in range(300)]
    path = train_sentencepiece(texts, tmp_path_factory.mktemp("dtok") / "spm", vocab_size=64)
    return texts, path


def test_tokenize_counting_counts_exactly_the_captions_cut(digit_tok):
    texts, path = digit_tok
    tok = SentencePieceTokenizer(path, context_length=16)
    lengths = [len(tok.encode(t)) for t in texts[:20]]
    tokens, cut = tok.tokenize_counting(texts[:20])
    assert cut == sum(n > 15 for n in lengths) > 0  # pieces + EOS over 16
    assert torch.equal(tokens, tok(texts[:20]))
    exact = max(lengths)  # a context that holds the longest caption and its EOS cuts nothing
    assert tok.tokenize_counting(texts[:20], context_length=exact + 1)[1] == 0
    assert tok.tokenize_counting(texts[:20], context_length=exact)[1] == lengths.count(exact)
    _, _, stats = TokenizingCollate(tok)([(torch.zeros(3, 2, 2), t, {}) for t in texts[:20]])
    assert stats.get(TRUNCATED, 0) == cut


def test_tokenizer_train_prints_the_length_distribution_and_the_share_cut(digit_tok, tmp_path, capsys):
    texts, _ = digit_tok
    src = tmp_path / "caps.txt"
    src.write_text("\n".join(texts) + "\n")
    out = tmp_path / "t" / "spm"
    argv = ["train", "--input", str(src), "--out", str(out), "--vocab-size", "64", "--context-length", "16"]
    assert main_tokenizer(argv) == 0
    printed = capsys.readouterr().out
    tok = SentencePieceTokenizer(f"{out}.model", 16)
    lengths = sorted(len(tok.encode(t)) + 1 for t in texts)
    cut = sum(n > 16 for n in lengths)
    assert f"over {len(texts)} captions: min {lengths[0]}," in printed and f"max {lengths[-1]};" in printed
    assert f"cut at context length 16: {cut} ({100 * cut / len(texts):.1f}%)" in printed
    assert cut > 0  # the case this exists for


def test_trainer_warns_once_when_more_than_one_percent_are_cut(tmp_path, capsys):
    assert data_counters({"corrupt_image": 2, TRUNCATED: 5}) == {
        "bad_samples": 2, "truncated_captions": 5, "cpu_decoded_images": 0,
    }  # fmt: skip
    result = StepResult(loss=1.0, logit_scale=1.0, logit_bias=None, grad_norm=None, applied=True)
    m = MetricsLogger(
        tmp_path,
        rank=0,
        world_size=2,
        every_n_steps=100,
        report_to="",
        samples_per_step=400,  # 200 captions per rank and step
        total_steps=100,
        device=torch.device("cpu"),
        context_length=16,
    )
    m.step(1, result, data_wait_s=0, lr=1, epoch=0, extra={"truncated_captions": 2})  # 1.0%: no warning
    assert "warning" not in capsys.readouterr().out
    m.step(2, result, data_wait_s=0, lr=1, epoch=0, extra={"truncated_captions": 5})  # 5 of 400
    out = capsys.readouterr().out
    assert "warning: 1.2% of captions (5 of 400 on rank 0 so far) are longer than the context length 16" in out
    m.step(3, result, data_wait_s=0, lr=1, epoch=0, extra={"truncated_captions": 600})
    assert "warning" not in capsys.readouterr().out  # once
    m.close()
